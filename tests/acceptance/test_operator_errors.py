"""Careless operators cannot break a project (issue 15, items 5-7), with real processes: a
second writer is refused, a bind failure is one line, SIGINT stops, a damaged state.db is
named as such."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.state.sqlite import SqliteStore
from coordinator.training import project as projects
from tests.procs import ENV, ROOT, first_url, free_port, poll, start_coordinator, tilehive

SMALL = {
    "model.layers": 1,
    "model.width": 32,
    "model.heads": 2,
    "model.context": 16,
    "training.batch_size": 4,
    "corpus.max_mb": 1,
}


@pytest.fixture
def project(tmp_path) -> Path:
    directory = tmp_path / "project"
    projects.create(directory, **{**SMALL, "training.steps": 500})
    return directory


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """The refusal: exit non-zero, nothing on stdout, one line on stderr, no traceback."""
    assert result.returncode != 0, result.stdout
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


# ---- item 5: one writer per project ------------------------------------------------------


def test_a_served_project_refuses_a_second_coordinator_and_a_local_run(project, tmp_path, reaper):
    first = reaper(start_coordinator(project, "127.0.0.1:0", tmp_path / "first.log"))
    url = first_url(first)
    for command in (
        ["coordinator", str(project), "--bind", f"127.0.0.1:{free_port()}"],
        ["train", str(project), "--local", "--steps", "1"],
    ):
        line = one_line_error(tilehive(*command))
        assert f"pid {first.pid}" in line and url in line and "tilehive coordinator" in line
    assert not (project / "checkpoints").exists() or not any((project / "checkpoints").iterdir())
    first.send_signal(signal.SIGINT)
    assert first.wait(60) == 130


def test_a_local_run_refuses_a_coordinator(project, tmp_path, reaper):
    with (tmp_path / "train.log").open("w") as out:
        training = reaper(
            subprocess.Popen(
                [sys.executable, "-m", "coordinator.cli", "train", str(project), "--local"],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env=ENV,
            )
        )
    lock = project / "project.lock"
    poll(lambda: lock.exists() and f'"pid": {training.pid}' in lock.read_text(), what="the lock")
    line = one_line_error(tilehive("coordinator", str(project), "--bind", "127.0.0.1:0"))
    assert f"pid {training.pid}" in line and "tilehive train --local" in line
    assert not (project / "state.db").exists()


def test_a_killed_coordinator_leaves_no_lock_behind(project, tmp_path, reaper):
    first = reaper(start_coordinator(project, "127.0.0.1:0", tmp_path / "first.log"))
    first_url(first)
    first.kill()
    first.wait(60)
    second = reaper(start_coordinator(project, "127.0.0.1:0", tmp_path / "second.log"))
    url = first_url(second)
    holder = json.loads((project / "project.lock").read_text())
    assert holder == {"pid": second.pid, "command": "coordinator", "url": url}
    second.send_signal(signal.SIGINT)
    assert second.wait(60) == 130


# ---- item 6: bind failures and SIGINT ----------------------------------------------------


@pytest.fixture
def busy_port():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


@pytest.mark.parametrize(
    ("bind", "reason"),
    [
        ("127.0.0.1:{busy}", "is in use"),
        ("nothing.invalid:8470", "no address for the name 'nothing.invalid'"),
        ("192.0.2.1:8470", "192.0.2.1 is not an address of this machine"),  # TEST-NET-1
        ("http://127.0.0.1:8470", "is a URL: give HOST:PORT"),
        ("127.0.0.1:99999", "port 99999 is out of range: give one from 0 to 65535"),
        ("127.0.0.1:http", "is not HOST:PORT"),
    ],
)
def test_a_bind_failure_is_one_line_and_touches_nothing(project, busy_port, bind, reason):
    before = sorted(path.name for path in project.iterdir())
    result = tilehive("coordinator", str(project), "--bind", bind.format(busy=busy_port))
    line = one_line_error(result)
    assert line.startswith("Error: ") and reason in line
    assert sorted(path.name for path in project.iterdir()) == before  # no state, no secret


def test_a_bind_from_the_environment_is_said_to_come_from_it(project):
    """Set in a shell profile or a unit file, the value was named as if typed."""
    result = tilehive("coordinator", str(project), env={"TILEHIVE_BIND": "127.0.0.1"})
    line = one_line_error(result)
    assert line.startswith("Error: --bind (from TILEHIVE_BIND) '127.0.0.1' is not HOST:PORT")


def test_an_ipv6_bind_announces_a_url_that_works(project, tmp_path, reaper):
    """The announced URL is what volunteers are given: an IPv6 address needs brackets."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    coordinator = reaper(start_coordinator(project, "[::1]:0", tmp_path / "c.log"))
    url = first_url(coordinator)
    assert url.startswith("http://[::1]:"), url
    done = tilehive("status", url, "--json")
    assert done.returncode == 0, done.stderr
    assert "gemms_active" in json.loads(done.stdout)
    coordinator.send_signal(signal.SIGINT)
    assert coordinator.wait(60) == 130


def test_sigint_stops_the_coordinator_even_when_asked_twice(project, tmp_path, reaper):
    for attempt in range(2):
        coordinator = reaper(start_coordinator(project, "127.0.0.1:0", tmp_path / "c.log"))
        first_url(coordinator)
        for _ in range(attempt + 1):
            coordinator.send_signal(signal.SIGINT)
        assert coordinator.wait(60) == 130
    assert "Traceback" not in (tmp_path / "c.log").read_text()


# ---- item 7: a damaged state.db ------------------------------------------------------------


async def a_real_state_db(path: Path) -> bytes:
    store = SqliteStore(path)
    await store.open()
    await store.close()
    return path.read_bytes()


async def damage(project: Path, how: str) -> None:
    state = project / "state.db"
    if how == "truncated":
        whole = await a_real_state_db(state)
        state.write_bytes(whole[: len(whole) // 2])
    elif how == "garbage":
        state.write_bytes(os.urandom(64 << 10))
    elif how == "empty after training":
        (project / "train.jsonl").write_text('{"step": 1, "loss": 5.5, "seconds": 0.1}\n')
        state.write_bytes(b"")


@pytest.mark.parametrize("how", ["truncated", "garbage", "empty after training"])
async def test_every_command_names_a_damaged_state_db_and_what_to_do(project, how):
    await damage(project, how)
    before = (project / "state.db").read_bytes()
    for command in (
        ["coordinator", str(project), "--bind", "127.0.0.1:0"],
        ["status", str(project)],
        ["logs", "tasks", str(project)],
        ["logs", "validation", str(project), "--follow"],
    ):
        line = one_line_error(tilehive(*command))
        assert f"{project / 'state.db'} is damaged" in line, command
        assert "restore it from a backup, or move it away" in line
    assert (project / "state.db").read_bytes() == before  # nothing was "repaired" away


def test_an_empty_state_db_of_a_project_that_never_trained_is_a_new_project(
    project, tmp_path, reaper
):
    (project / "state.db").write_bytes(b"")  # SQLite killed before its first write
    line = one_line_error(tilehive("logs", "tasks", str(project)))
    assert line.endswith(
        f"{project} is a project whose coordinator has not run yet: nothing to show before "
        f"`tilehive coordinator {project}`"
    )
    said = tilehive("status", str(project))
    assert said.returncode == 0 and ": step 0 of " in said.stdout, said.stderr
    assert "coordinator: not running" in said.stdout
    nothing = tmp_path / "nothing"
    nothing.mkdir()
    line = one_line_error(tilehive("status", str(nothing)))
    assert line.endswith(f"{nothing} is not a project (no project.toml, no state.db)")
    coordinator = reaper(start_coordinator(project, "127.0.0.1:0", tmp_path / "c.log"))
    first_url(coordinator)
    coordinator.send_signal(signal.SIGINT)
    assert coordinator.wait(60) == 130


def test_numbers_beyond_what_a_field_holds_are_one_line_not_an_overflow(project, tmp_path, reaper):
    coordinator = reaper(start_coordinator(project, "127.0.0.1:0", tmp_path / "c.log"))
    first_url(coordinator)
    coordinator.send_signal(signal.SIGINT)
    assert coordinator.wait(60) == 130
    huge = "99999999999999999999"
    for command, words in [
        (("logs", "tasks", str(project), "--step", huge), "is not in the range"),
        (("logs", "tasks", str(project), "--limit", huge), "is not in the range"),
        (("logs", "validation", str(project), "--step", huge), "is not in the range"),
        (("init", str(tmp_path / "new"), "--steps", "10000001"), "is not in the range"),
        (("init", str(tmp_path / "new"), "--seed", str(2**63)), "is not in the range"),
        (("volunteer", "start", "http://127.0.0.1:9", "--max-memory", huge), "not in the range"),
        (("volunteer", "start", "http://127.0.0.1:9", "--threads", huge), "not in the range"),
    ]:
        said = tilehive(*command)
        assert said.returncode == 2 and "Traceback" not in said.stderr, (command, said.stderr)
        assert words in said.stderr.splitlines()[-1], (command, said.stderr)
    # a host id beyond any is no host, by name or id
    said = tilehive("logs", "tasks", str(project), "--host", huge)
    assert "Traceback" not in said.stderr and f"no host named '{huge}'" in said.stderr
    # an id no host has is said as an unknown name is: it matched nothing, quietly
    for command in ("tasks", "validation"):
        said = tilehive("logs", command, str(project), "--host", "77")
        assert said.returncode == 1 and "no host 77 has registered" in said.stderr, said.stderr


def test_a_project_folder_that_takes_no_files_is_one_line(project):
    (project / "project.lock").mkdir()  # refused as a folder this user may not write is
    for command in (
        ("train", str(project), "--local"),
        ("coordinator", str(project), "--bind", "127.0.0.1:0"),
    ):
        line = one_line_error(tilehive(*command))
        assert f"cannot use {project / 'project.lock'}: Is a directory" in line, line


def test_status_and_logs_read_a_project_in_a_folder_they_cannot_write(project, tmp_path, reaper):
    """Another user's project, or one on read-only media: SQLite cannot make the file a
    reader of a WAL database needs beside it, and no coordinator runs there."""
    coordinator = reaper(start_coordinator(project, "127.0.0.1:0", tmp_path / "c.log"))
    first_url(coordinator)
    coordinator.send_signal(signal.SIGINT)
    assert coordinator.wait(60) == 130
    locked = lock_folder(project)
    try:
        for command in (("status", str(project)), ("logs", "tasks", str(project))):
            said = tilehive(*command)
            assert said.returncode == 0 and not said.stderr, (command, said.stderr)
    finally:
        locked()


def lock_folder(folder: Path):
    """Make `folder` take no new files, as for a user other than its owner; returns the
    undo. Root passes permission bits, so root makes it immutable (skips if it cannot)."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return lambda: folder.chmod(0o755)
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("cannot make a folder read-only here (root, and no chattr)")
    return lambda: subprocess.run(["chattr", "-i", str(folder)], check=True)
