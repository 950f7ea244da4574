"""What operators and volunteers see (issue 16): why work waits, the end of training, the
figures after a restart, paused, the logs' limits, names, init's checks, the demo."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import pty
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from coordinator.training import project as projects
from tests.factories import SMALL, operands, running
from tests.procs import (
    ENV,
    ROOT,
    committed,
    first_url,
    following,
    poll,
    start_coordinator,
    start_volunteer,
    tilehive,
    volunteer_status,
)
from tests.volunteers import wait_until
from volunteer.client import CoordinatorClient


def test_init_refuses_a_corpus_path_that_does_not_exist(tmp_path):
    result = tilehive("init", str(tmp_path / "p"), "--corpus", str(tmp_path / "no-such"))
    assert result.returncode == 2
    assert "--corpus" in result.stderr and "no such file or folder" in result.stderr
    assert not (tmp_path / "p" / "project.toml").exists()
    small = tmp_path / "small.txt"
    small.write_text("hello\n")
    result = tilehive("init", str(tmp_path / "q"), "--corpus", str(small))
    assert result.returncode == 1 and "too small" in result.stderr
    assert not (tmp_path / "q" / "project.toml").exists()


def test_init_takes_a_corpus_of_one_file_or_a_few(tmp_path):
    """Split by file, one file lands whole on one side: too few files are split inside
    each file instead, so a user's single text file trains."""
    text = b"".join(b"def f%d(x):\n    return x * %d\n\n" % (i, i) for i in range(4000))
    one = tmp_path / "one.py"
    one.write_bytes(text)
    few = tmp_path / "few"
    few.mkdir()
    (few / "a.txt").write_bytes(text[:60_000])
    (few / "b.txt").write_bytes(text[60_000:])
    for source in (one, few):
        project = tmp_path / f"p-{source.name}"
        made = tilehive("init", str(project), "--corpus", str(source), "--steps", "1")
        assert made.returncode == 0, made.stderr
        trained = tilehive("train", str(project), "--local")
        assert trained.returncode == 0, trained.stderr
        assert (project / "checkpoints" / "step-000001.npz").exists()
        # status reads the steps --local took: no coordinator has run, nothing else to show
        said = tilehive("status", str(project)).stdout
        assert "step 1 of 1, loss" in said and "training finished" in said, said
        said = tilehive("logs", "tasks", str(project)).stderr
        assert "has trained but holds no state.db" in said and "has not run yet" not in said
    tiny = tmp_path / "tiny.txt"
    tiny.write_bytes(text[:10_000])
    refused = tilehive("init", str(tmp_path / "t"), "--corpus", str(tiny))
    assert refused.returncode == 1
    assert "too small" in refused.stderr and "20480 bytes or more" in refused.stderr


def test_train_local_says_what_it_will_do_and_how_to_go_on_after_ctrl_c(tmp_path):
    project = tmp_path / "p"
    projects.create(project, **{**SMALL, "training.steps": 4, "training.checkpoint_every": 2})
    (project / "checkpoints").mkdir()
    (project / "checkpoints" / ".tmp-k1ll3d").write_bytes(b"half a checkpoint")
    said = tilehive("train", str(project), "--local", "--steps", "2").stdout
    assert not (project / "checkpoints" / ".tmp-k1ll3d").exists()  # a kill's leftover
    assert said.startswith("starting at step 1, training to step 2 of 4\n"), said
    said = tilehive("train", str(project), "--local", "--steps", "1").stdout
    assert said.startswith("nothing to do: step 2 of 4 is done already\n"), said
    said = tilehive("train", str(project), "--local", "--steps", "9").stdout
    assert said.startswith(
        "resuming after step 2, training to step 4 of 4 (--steps 9 is beyond the project's 4)"
    ), said
    long = tmp_path / "long"
    projects.create(long, **{**SMALL, "training.steps": 100_000, "training.checkpoint_every": 1})
    # Started with SIGINT ignored, as a script's background job is (and CI may be).
    with following("train", str(long), "--local", ignore_sigint=True) as run:
        assert run.stdout.readline().startswith("starting at step 1")
        assert run.stdout.readline().startswith("step 1/100000")
        run.send_signal(signal.SIGINT)
        # Read what it printed meanwhile: a step a line, fast enough to fill a pipe nobody
        # reads, and a process blocked writing to it never gets to stop.
        _, said = run.communicate(timeout=60)
        assert run.returncode == 130
    assert "stopped; run the same command again to resume from the last checkpoint" in said
    assert "Traceback" not in said and "Aborted" not in said


def test_init_refuses_a_folder_that_holds_another_projects_state(tmp_path):
    """Without this, a project made over another's checkpoints resumes from them: a new
    seed would go on from the old weights, and no longer be anyone's reference run."""
    project = tmp_path / "p"
    assert tilehive("init", str(project), "--steps", "1").returncode == 0
    assert tilehive("train", str(project), "--local").returncode == 0
    (project / "project.toml").unlink()
    again = tilehive("init", str(project), "--steps", "6", "--seed", "7")
    assert again.returncode == 1
    said = "holds a project's state without its project.toml (train.jsonl, checkpoints/)"
    assert said in again.stderr and "put its project.toml back" in again.stderr
    assert not (project / "project.toml").exists()
    # Nor do `coordinator` and `train` send the operator to `init`, which refuses it.
    for command in (["coordinator"], ["train", "--local"]):
        lost = tilehive(*command[:1], str(project), *command[1:])
        assert lost.returncode == 1 and "put its project.toml back" in lost.stderr, lost.stderr
        assert "create a project with" not in lost.stderr


def test_a_checkpoint_that_cannot_be_resumed_is_said_before_anything_else(tmp_path):
    """A finished project whose model settings changed said "nothing to do: all 2 steps
    are done already" and then the error; a cut-off checkpoint, "resuming after step 2"
    and then that it is damaged."""
    project = tmp_path / "p"
    assert tilehive("init", str(project), "--steps", "2").returncode == 0
    assert tilehive("train", str(project), "--local").returncode == 0
    settings = project / "project.toml"
    settings.write_text(settings.read_text().replace("width = 128 ", "width = 64 "))
    for command in (
        ["coordinator", str(project), "--bind", "127.0.0.1:0"],
        ["train", str(project), "--local"],
    ):
        said = tilehive(*command)
        assert said.returncode == 1 and "the model's settings changed" in said.stderr, said
        assert "nothing to do" not in said.stdout + said.stderr, said.stdout
    settings.write_text(settings.read_text().replace("width = 64 ", "width = 128 "))
    with (project / "checkpoints" / "step-000002.npz").open("r+b") as cut:
        cut.truncate(1000)
    said = tilehive("train", str(project), "--local")
    assert said.returncode == 1 and "is damaged" in said.stderr, said
    assert "resuming after" not in said.stdout, said.stdout


def test_a_project_in_a_folder_named_with_uri_characters_reads_back(tmp_path, reaper):
    """The files are opened through SQLite URIs, where '#', '?' and '%' mean something:
    status and logs read the project the path names, not another."""
    project = tmp_path / "runs #1?of%41" / "project"
    projects.create(project, **{**SMALL, "training.steps": 1})
    coordinator = reaper(start_coordinator(project, "127.0.0.1:0", tmp_path / "c.log"))
    first_url(coordinator)
    coordinator.send_signal(signal.SIGINT)
    assert coordinator.wait(60) == 130
    for command in (("status", str(project)), ("logs", "tasks", str(project))):
        said = tilehive(*command)
        assert said.returncode == 0 and not said.stderr, (command, said.stderr)


# ---- items 1 and 2: why work waits; the end of training --------------------------------


def status_of(target: str) -> dict:
    result = tilehive("status", target, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_one_volunteer_is_told_why_work_waits_and_a_finished_project_tells_them(tmp_path, reaper):
    project = tmp_path / "project"
    projects.create(project, **{**SMALL, "training.steps": 2, "work.tile": 16})
    log = tmp_path / "coordinator.log"
    coordinator = reaper(start_coordinator(project, "127.0.0.1:0", log))
    url = first_url(coordinator)
    before = status_of(url)["training"]
    assert before["step"] == 0 and before["steps"] == 2  # "of 2", not "of ?"
    first = reaper(start_volunteer(url, tmp_path / "v0"))
    poll(
        lambda: (status_of(url).get("waiting") or {}).get("reason") == "needs_hosts",
        what="the coordinator to say work waits for another host",
    )
    lines = tilehive("status", url).stdout
    assert "waiting:" in lines and "another volunteer" in lines and "quorum policy" in lines
    assert "waiting:" in tilehive("status", str(project)).stdout
    poll(
        lambda: "another volunteer" in volunteer_status(tmp_path / "v0").get("note", ""),
        what="the volunteer to say why it has no work",
    )
    second = reaper(start_volunteer(url, tmp_path / "v1"))
    assert coordinator.wait(300) == 0
    for volunteer, state_dir in ((first, tmp_path / "v0"), (second, tmp_path / "v1")):
        assert volunteer.wait(60) == 0
        assert volunteer_status(state_dir)["state"] == "finished"
        assert volunteer_status(state_dir)["note"] == "project finished"
        said = tilehive("volunteer", "status", "--state-dir", str(state_dir))
        assert "is finished" in said.stdout
    # The volunteer asked for is not told to start another one (3 times in 6 it was).
    assert "another volunteer" not in (tmp_path / "v1" / "out").read_text()
    text = log.read_text()
    # The wait ends once, said as it ends: work flows, or training is done first (the
    # second volunteer can finish two steps between two looks).
    ended = text.count("work flows again") + text.count("training is done: work no longer")
    assert text.count("WARNING work waits") == 1 and ended == 1, text
    assert "work waits: work waits" not in text
    assert "told 2 volunteer(s) that the project is finished" in text
    done = tilehive("status", str(project)).stdout
    assert "step 2 of 2" in done and "training finished" in done and "ETA: done" in done
    assert "hosts: 0 active, 2 idle" in done  # told the project is finished, they stopped


def test_a_volunteer_in_a_terminal_shows_why_it_waits_on_its_status_line(tmp_path, reaper):
    """The live line is cut to the terminal's width after the note, not before it, and a log
    line first clears it rather than starting in the middle of it."""
    project = tmp_path / "project"
    projects.create(project, **{**SMALL, "training.steps": 2, "work.tile": 16})
    coordinator = reaper(start_coordinator(project, "127.0.0.1:0", tmp_path / "c.log"))
    url = first_url(coordinator)
    controller, terminal = pty.openpty()  # 0 columns: the line's default width, 110
    command = ["volunteer", "start", url, "--state-dir", str(tmp_path / "v0"), "--threads", "1"]
    volunteer = reaper(
        subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli", *command],
            stdin=subprocess.DEVNULL,
            stdout=terminal,
            stderr=terminal,
            cwd=ROOT,
            env={k: v for k, v in ENV.items() if k not in ("COLUMNS", "LINES")},
        )
    )
    os.close(terminal)
    seen = b""
    deadline = time.monotonic() + 120
    while b"| work waits for another volunteer" not in seen:
        assert time.monotonic() < deadline and volunteer.poll() is None, seen[-2000:]
        with contextlib.suppress(OSError):
            seen += os.read(controller, 65536)
    os.close(controller)
    parts = seen.split(b"\r")  # each redraw, and each log line, starts after a carriage return
    redraws = [part for part in parts if b"GFLOPS" in part and b"INFO" not in part]
    assert any(b"| work waits for another volunteer" in line for line in redraws)
    assert all(len(line) <= 109 for line in redraws)
    logged = [part for part in parts if b" INFO " in part]
    assert logged and all(part.startswith(b"\x1b[K") for part in logged), logged


def test_status_from_the_running_coordinator_and_from_the_files_agree(tmp_path, reaper):
    """The coordinator that trained the steps (not one restarted, which reads train.jsonl)
    shows the last step's CPU too, as `status DIR` does."""
    project = tmp_path / "project"
    projects.create(project, **{**SMALL, "training.steps": 2, "work.policy": "freivalds"})
    log = tmp_path / "coordinator.log"
    coordinator = reaper(start_coordinator(project, "127.0.0.1:0", log, "--keep-serving"))
    url = first_url(coordinator)
    reaper(start_volunteer(url, tmp_path / "v0"))
    poll(lambda: status_of(url)["training"]["done"], timeout=300, what="training to finish")
    from_url = status_of(url)["training"]
    from_dir = json.loads(tilehive("status", str(project), "--json").stdout)["training"]
    for key in ("step", "loss", "val_loss", "seconds", "cpu_seconds", "done"):
        assert from_url.get(key) == from_dir.get(key), key
    assert from_url["cpu_seconds"] > 0
    said = tilehive("status", url).stdout
    assert re.search(r"last step: \d+\.\d{3} s, \d+\.\d{3} s of the training process.s CPU", said)


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGHUP], ids=["ctrl-c", "hangup"])
def test_a_volunteer_that_stops_is_not_waited_for(tmp_path, reaper, stop_signal):
    """Under quorum, the second of two volunteers stopping leaves the first with nobody to
    agree with: work waits for another volunteer, said at once, not once the stopped one has
    been silent for a minute."""
    project = tmp_path / "project"
    projects.create(project, **{**SMALL, "training.steps": 5000, "work.tile": 16})
    coordinator = reaper(start_coordinator(project, "127.0.0.1:0", tmp_path / "c.log"))
    url = first_url(coordinator)
    reaper(start_volunteer(url, tmp_path / "v0"))
    leaving = reaper(start_volunteer(url, tmp_path / "v1", "--name", "leaver"))
    poll(lambda: status_of(url)["training"]["step"] >= 1, what="a step done by both")
    leaving.send_signal(stop_signal)  # a hangup: its terminal was closed
    assert leaving.wait(60) == 0
    poll(
        lambda: (status_of(url).get("waiting") or {}).get("reason") == "needs_hosts",
        timeout=30,  # a host silent for CONNECTED_WITHIN (60 s) would count as gone only then
        what="the coordinator to say work waits for another volunteer",
    )
    assert status_of(url)["host_states"] == {"active": 1, "paused": 0, "idle": 1, "quarantined": 0}
    poll(
        lambda: "hosts: 1 active, 1 idle" in tilehive("status", str(project)).stdout,
        what="status from the files to count the stopped volunteer idle",
    )
    said = (tmp_path / "c.log").read_text()
    assert "'leaver' stopped: not waited for until it asks again" in said


def training_with_one_volunteer(
    tmp_path, reaper
) -> tuple[Path, subprocess.Popen, str, subprocess.Popen]:
    """A long project under freivalds, its coordinator (logging to c.log) and one volunteer:
    (the project, the coordinator, its URL, the volunteer)."""
    project = tmp_path / "project"
    settings = {**SMALL, "training.steps": 5000, "work.tile": 16, "work.policy": "freivalds"}
    projects.create(project, **settings)
    coordinator = reaper(start_coordinator(project, "127.0.0.1:0", tmp_path / "c.log"))
    url = first_url(coordinator)
    return project, coordinator, url, reaper(start_volunteer(url, tmp_path / "v"))


def test_a_volunteer_killed_is_said_to_be_quiet_before_it_counts_as_gone(tmp_path, reaper):
    """Killed (or asleep, or cut off) it says nothing: it counts as connected for a minute,
    and the operator heard nothing meanwhile. Work it could take now waits, and says why,
    once it is well past due to ask again."""
    _, _, url, volunteer = training_with_one_volunteer(tmp_path, reaper)
    poll(lambda: status_of(url)["training"]["step"] >= 1, what="a step done")
    volunteer.kill()
    volunteer.wait()
    waits: list[dict] = []
    poll(
        lambda: waits.append(status_of(url).get("waiting")) or waits[-1],
        timeout=120,
        what="work to wait",
    )
    # Said before the minute after which it counts as gone (no_volunteers).
    assert waits[-1]["reason"] == "hosts_quiet", waits[-1]
    text = (tmp_path / "c.log").read_text()
    assert "have not been heard from since " in text and "(stopped, asleep or cut off?)" in text


def test_status_says_a_pause_once_and_no_eta_while_paused_or_without_a_coordinator(
    tmp_path, reaper
):
    """Once steps are timed there is an ETA; a pause takes it away everywhere an operator
    looks (the text, --json from the URL and from the files, the dashboard), and a stopped
    coordinator too."""
    project, coordinator, url, volunteer = training_with_one_volunteer(tmp_path, reaper)
    poll(
        lambda: status_of(url)["training"].get("eta_seconds") is not None,
        what="a timed step, and an ETA from it",
    )
    assert tilehive("admin", "pause", url, "--project", str(project)).stdout == "paused\n"
    again = tilehive("admin", "pause", url, "--project", str(project))
    assert again.returncode == 0 and "was paused already: nothing changed" in again.stdout
    poll(lambda: status_of(str(project))["waiting"] is not None, what="the pause as a wait")
    said = tilehive("status", str(project)).stdout
    assert said.count("paused") == 1 and "waiting:" not in said, said
    assert "ETA: none while paused" in said
    assert f"coordinator: serving {url}" in said  # where to look, and to send `admin` to
    assert "ETA: none while paused" in tilehive("status", url).stdout
    for target in (url, str(project)):
        assert status_of(target)["training"]["eta_seconds"] is None, target
    with urllib.request.urlopen(url + "/", timeout=10) as reply:
        assert "ETA none while paused" in reply.read().decode()
    volunteer.send_signal(signal.SIGINT)
    assert volunteer.wait(60) == 0
    assert tilehive("admin", "resume", url, "--project", str(project)).returncode == 0
    coordinator.send_signal(signal.SIGINT)
    assert coordinator.wait(60) == 130
    # The operator's doings are in the coordinator's log too, each once.
    logged = (tmp_path / "c.log").read_text()
    assert logged.count("project paused by the operator") == 1
    assert logged.count("project resumed by the operator") == 1
    assert "the project is paused" not in logged  # said once, not again as a wait
    said = tilehive("status", str(project)).stdout
    assert "coordinator: not running" in said and "ETA: none while no coordinator runs" in said


def test_status_of_a_project_trained_locally_names_that_run_not_a_coordinator_to_start(tmp_path):
    """`tilehive coordinator DIR` would be refused while `train --local` holds the project."""
    project = tmp_path / "p"
    projects.create(project, **{**SMALL, "training.steps": 100_000})
    command = [sys.executable, "-m", "coordinator.cli", "train", str(project), "--local"]
    with subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL) as local:
        try:
            poll(lambda: (project / "train.jsonl").exists(), what="the first local step")
            said = tilehive("status", str(project)).stdout
            assert f"`tilehive train --local` (pid {local.pid}) trains the project" in said
            assert "tilehive coordinator DIR" not in said and "ETA: none" not in said, said
            assert status_of(str(project))["training_locally"] == local.pid
        finally:
            local.kill()


# ---- item 5: the logs show the newest, say when they cut, refuse unknown states ------------


async def test_logs_show_the_newest_and_say_when_they_cut(worked):
    *_, project, _ = worked
    everything = tilehive("logs", "validation", str(project), "--json", "--limit", "100000")
    decisions = [json.loads(line) for line in everything.stdout.splitlines()]
    assert len(decisions) > 3 and "showing the newest" not in everything.stderr
    newest = tilehive("logs", "validation", str(project), "--json", "--limit", "3")
    assert [json.loads(x)["id"] for x in newest.stdout.splitlines()] == [
        d["id"] for d in decisions[-3:]
    ]
    assert f"showing the newest 3 of {len(decisions)} decisions" in newest.stderr
    failures = tilehive("logs", "validation", str(project), "--failures", "--json")
    states = {json.loads(x)["state"] for x in failures.stdout.splitlines()}
    assert "invalid" in states and states <= {"invalid", "no_quorum"}
    tasks = tilehive("logs", "tasks", str(project), "--limit", "2")
    assert len(tasks.stdout.splitlines()) == 3  # the header and two work units
    assert "showing the newest 2 of " in tasks.stderr and "--limit N for more" in tasks.stderr
    for command, state in (("tasks", "assimilated"), ("validation", "valid")):
        bad = tilehive("logs", command, str(project), "--state", "bogus")
        assert bad.returncode == 2 and "'bogus' is not one of" in bad.stderr
        # --failures is states of its own: one of the two was silently ignored
        both = tilehive("logs", command, str(project), "--failures", "--state", state)
        assert both.returncode == 2 and "give --failures or --state, not both" in both.stderr
        # One typed wins over the other set in the environment for every call
        typed = tilehive("logs", command, str(project), "--state", state, "--json",
                         env={"TILEHIVE_FAILURES": "1"})  # fmt: skip
        assert typed.returncode == 0 and typed.stdout, typed.stderr
        assert {json.loads(x)["state"] for x in typed.stdout.splitlines()} == {state}
    # A filter that matches nothing says so; a header alone read as a failure to look.
    none = tilehive("logs", "tasks", str(project), "--step", "99")
    assert none.returncode == 0 and len(none.stdout.splitlines()) == 1
    assert "-- no work units match --" in none.stderr
    # A step purged by a checkpoint (step 1, by checkpoints at 1 and 2: rows go one
    # checkpoint behind): its decisions outlive its work units for a minute, and an empty
    # answer read as lost history.
    coordinator = worked[0]
    for step in (1, 2):
        await coordinator.retention.prune(step)
    archive = project / "logs" / "workunits.jsonl.gz"
    purged = tilehive("logs", "tasks", str(project), "--step", "1")
    said = f"-- no work units match; a checkpoint archived the step in {archive} --"
    assert said in purged.stderr
    # There is no step 0 (training starts at 1): refused, not said to be archived.
    zero = tilehive("logs", "tasks", str(project), "--step", "0")
    assert zero.returncode == 2 and "--step" in zero.stderr and "archived" not in zero.stderr
    later = tilehive("logs", "tasks", str(project), "--step", "99")  # not run yet: not archived
    assert "-- no work units match --" in later.stderr
    none = tilehive("logs", "validation", str(project), "--step", "99")
    assert none.returncode == 0 and len(none.stdout.splitlines()) == 1
    assert "-- no decisions match --" in none.stderr
    # Other filters matching nothing name the archive of the steps purged, where the
    # failures status counts may all be (step 2 is the oldest held now).
    decisions = project / "logs" / "events.jsonl.gz"
    if not decisions.exists():
        decisions.write_bytes(gzip.compress(b""))
    nobody = tilehive("logs", "validation", str(project), "--host", "1", "--since", "1s")
    said = f"-- no decisions match; checkpoints archived the steps before 2 in {decisions} --"
    assert said in nobody.stderr, nobody.stderr
    alone = tilehive("logs", "tasks", str(project), "--by-step")
    assert alone.returncode == 2 and "--by-step" in alone.stderr
    assert "is for --follow" in alone.stderr


async def test_logs_follow_one_line_per_step(worked):
    *_, project, _ = worked
    with following("logs", "tasks", str(project), "-f", "--by-step") as follower:
        while "one line per step" not in await asyncio.to_thread(follower.stderr.readline):
            pass
        # What the trainer appends when step 1 ends (the worked products were step 1's).
        record = {"step": 1, "loss": 5.25, "seconds": 0.5, "time": 0}
        with (project / "train.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        line = await asyncio.wait_for(asyncio.to_thread(follower.stdout.readline), 30)
        assert "step 1: loss 5.2500" in line and "work units (" in line
        assert re.search(r"[1-9]\d* invalid results", line)


async def test_logs_follow_waits_for_a_coordinator_that_has_not_run_yet(tmp_path, reaper):
    """An operator may start the follower first, before the coordinator and the host it asks
    about: it ended with an error instead."""
    project = tmp_path / "project"
    projects.create(project, **{**SMALL, "training.steps": 1, "work.policy": "freivalds"})

    async def line(stream) -> str:
        said = await asyncio.wait_for(asyncio.to_thread(stream.readline), 120)
        assert said, "the follower ended"  # at its end, readline answers "" at once
        return said

    with following("logs", "validation", str(project), "--follow", "--host", "late") as follower:
        assert "waiting for its first" in await line(follower.stderr)
        coordinator = reaper(start_coordinator(project, "127.0.0.1:0", tmp_path / "c.log"))
        # and then for the host it asks about, which has not registered yet either
        while "no host named 'late' yet; following until one registers" not in (
            await line(follower.stderr)
        ):
            pass
        reaper(start_volunteer(first_url(coordinator), tmp_path / "v0", "--name", "late"))
        while " late " not in (said := await line(follower.stdout)):
            pass
        assert " freivalds valid " in said
    nothing = tilehive("logs", "tasks", str(project.parent / "elsewhere"))
    assert nothing.returncode == 1 and "is not a project" in nothing.stderr


# ---- item 7: names ------------------------------------------------------------------


async def test_admin_quarantine_takes_a_name_and_refuses_an_ambiguous_one(worked):
    co, url, _, project, _ = worked
    names = [h.name for h in co.ledger.hosts.values()]
    unique = next(n for n in names if names.count(n) == 1)
    shared = next(n for n in names if names.count(n) > 1)  # v0: the liar and a crew member
    host = next(h for h in co.ledger.hosts.values() if h.name == unique)
    done = await asyncio.to_thread(
        tilehive, "admin", "quarantine", url, unique, "--project", str(project)
    )
    assert done.returncode == 0 and f"host {host.id} {unique!r} quarantined" in done.stdout
    assert co.ledger.hosts[host.id].quarantined
    # A healthy host "released" is left as it is: a release starts a host over
    healthy = next(h for h in co.ledger.hosts.values() if not h.quarantined)
    said = await asyncio.to_thread(
        tilehive, "admin", "release", url, str(healthy.id), "--project", str(project)
    )
    assert said.returncode == 0 and "was not quarantined: nothing changed" in said.stdout
    assert co.ledger.hosts[healthy.id] == healthy
    twice = await asyncio.to_thread(
        tilehive, "admin", "release", url, shared, "--project", str(project)
    )
    assert twice.returncode == 1 and f"hosts are named {shared}: give the id" in twice.stderr
    nobody = await asyncio.to_thread(
        tilehive, "admin", "release", url, "nobody", "--project", str(project)
    )
    assert nobody.returncode == 1 and "404: no host named nobody" in nobody.stderr


def test_a_volunteer_quarantined_by_the_operator_is_told_so_and_says_so(tmp_path, reaper):
    project = tmp_path / "project"
    projects.create(project, **{**SMALL, "training.steps": 5000, "work.tile": 16})
    coordinator = reaper(start_coordinator(project, "127.0.0.1:0", tmp_path / "c.log"))
    url = first_url(coordinator)
    volunteer = reaper(start_volunteer(url, tmp_path / "v", "--name", "mallory"))
    poll(lambda: volunteer_status(tmp_path / "v").get("tiles", 0) > 0, what="a tile")
    done = tilehive("admin", "quarantine", url, "mallory", "--project", str(project))
    assert done.returncode == 0, done.stderr
    assert volunteer.wait(60) == 77  # refused for good: it stops asking, and says so
    status = volunteer_status(tmp_path / "v")
    assert status["state"] == "refused"
    assert status["note"].endswith("is quarantined by the project's operator"), status
    line = tilehive("volunteer", "status", "--state-dir", str(tmp_path / "v")).stdout
    assert line.startswith("not running: host ") and "by the project's operator" in line


def test_two_volunteers_on_one_machine_get_two_default_names(tmp_path, reaper):
    project = tmp_path / "project"
    # Steps enough to be still training when the status is read (the reaper stops it).
    projects.create(project, **{**SMALL, "training.steps": 5000, "work.tile": 16})
    coordinator = reaper(start_coordinator(project, "127.0.0.1:0", tmp_path / "c.log"))
    url = first_url(coordinator)
    for name in ("alpha", "beta"):
        reaper(start_volunteer(url, tmp_path / name))
    names = lambda: sorted(n for (n,) in committed(project, "SELECT name FROM hosts"))  # noqa: E731
    poll(lambda: len(names()) == 2, what="two registrations")
    host = socket.gethostname()
    assert names() == [f"{host}/alpha", f"{host}/beta"]
    poll(lambda: volunteer_status(tmp_path / "alpha").get("tiles", 0) > 0, what="a tile")
    line = tilehive("volunteer", "status", "--state-dir", str(tmp_path / "alpha")).stdout
    assert "GFLOPS delivered (benchmark " in line


# ---- item 6: the demo shows its dashboard ---------------------------------------------


def test_the_demo_shows_its_dashboard_until_enter(tmp_path):
    directory = tmp_path / "demo"
    projects.create(directory, **{**SMALL, "training.steps": 2, "work.tile": 16})
    controller, terminal = pty.openpty()  # a terminal on stdin: the demo waits for Enter
    demo = subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", "demo", "--volunteers", "2", "--dir", directory],
        stdin=terminal,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        env=ENV,
    )
    os.close(terminal)
    try:
        said = []
        while not said or "press Enter to stop" not in said[-1]:
            line = demo.stdout.readline()
            assert line, "the demo ended before training was done: " + "".join(said)
            said.append(line)
        text = "".join(said)
        url = re.search(r"dashboard: (http://\S+)/", text).group(1)
        assert "each needs the one before" in text and "computing" in text
        with urllib.request.urlopen(url + "/", timeout=10) as reply:
            assert "Training finished: all 2 steps done" in reply.read().decode()
        os.write(controller, b"\n")
        assert demo.wait(60) == 0
        rest = demo.stdout.read()
        assert f"checkpoints: {directory / 'checkpoints'}" in rest
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        demo.stdout.close()
        os.close(controller)


def test_the_demo_with_no_wait_stops_when_training_is_done(tmp_path):
    directory = tmp_path / "demo"
    projects.create(directory, **{**SMALL, "training.steps": 2, "work.tile": 16})
    result = tilehive(
        "demo",
        "--volunteers",
        "2",
        "--dir",
        str(directory),
        "--no-wait",
        "--steps",
        "5",
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "dashboard: http://127.0.0.1:" in result.stdout
    assert "press Enter" not in result.stdout
    # --steps is a new project's: this one keeps its 2, and the demo says so
    assert f"--steps 5 is for a new project: {directory} keeps its own 2" in result.stdout
    assert (directory / "checkpoints" / "step-000002.npz").exists()
    assert f"checkpoints: {directory / 'checkpoints'} (the last of step 2)" in result.stdout
    # Run again for more steps, its volunteers are the same two hosts: each run registered
    # them anew (a new port, a new URL), and every name then named several hosts.
    toml = directory / "project.toml"
    toml.write_text(re.sub(r"(?m)^steps = 2\b", "steps = 3", toml.read_text()))
    again = tilehive("demo", "--volunteers", "2", "--dir", str(directory), "--no-wait", timeout=300)
    assert again.returncode == 0, again.stderr
    assert (directory / "checkpoints" / "step-000003.npz").exists()
    assert len(committed(directory, "SELECT id FROM hosts")) == 2


def started_by(directory: Path) -> list[int]:
    """The processes whose command line names `directory` (a demo's coordinator and
    volunteers all do)."""
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and str(directory) in (entry / "cmdline").read_text():
                found.append(int(entry.name))
    return found


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_demo_stops_what_it_started_and_removes_its_project(tmp_path, signum):
    demo = subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", "demo", "--steps", "500", "--volunteers", "2"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        env={**ENV, "TMPDIR": str(tmp_path)},  # where its temporary project goes
    )
    try:
        while "dashboard: http://" not in (line := demo.stdout.readline()):
            assert line, "the demo ended before it started its coordinator"
        [directory] = tmp_path.glob("tilehive-demo-*")
        poll(lambda: len(started_by(directory)) == 3, what="a coordinator and two volunteers")
        demo.send_signal(signum)
        assert demo.wait(90) == 128 + signum
        said = demo.stdout.read()
        assert f"{signal.Signals(signum).name} received; stopping" in said
        assert "the project was temporary and is removed" in said
        assert not directory.exists()
        assert started_by(directory) == []
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        demo.stdout.close()
        for pid in started_by(tmp_path):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_the_demo_refuses_fewer_volunteers_than_a_tile_needs(tmp_path):
    result = tilehive("demo", "--volunteers", "1", "--no-wait", timeout=60)
    assert result.returncode == 1
    assert "quorum policy has each tile computed by 2 different volunteers" in result.stderr
    assert "use --volunteers 2 or more" in result.stderr
    # A project checked by Freivalds alone needs only one.
    directory = tmp_path / "demo"
    projects.create(directory, **{**SMALL, "training.steps": 1, "work.policy": "freivalds"})
    result = tilehive(
        "demo", "--volunteers", "1", "--dir", str(directory), "--no-wait", timeout=300
    )
    assert result.returncode == 0, result.stderr


def test_the_demo_of_a_finished_or_busy_project_says_so_and_starts_nothing(tmp_path, reaper):
    """It started three volunteers (three new hosts each time) for a finished project and
    said they computed 0% of the time; on a project a coordinator serves, it said only that
    its coordinator did not start."""
    directory = tmp_path / "demo"
    projects.create(directory, **{**SMALL, "training.steps": 1, "work.policy": "freivalds"})
    assert tilehive("train", str(directory), "--local", timeout=300).returncode == 0
    done = tilehive("demo", "--dir", str(directory), "--no-wait", timeout=120)
    assert done.returncode == 0, done.stderr
    assert "nothing to do: all 1 steps of" in done.stdout and "dashboard" not in done.stdout
    assert not list(directory.glob("volunteer-*")) and not (directory / "state.db").exists()
    served = tilehive("coordinator", str(directory), "--bind", "127.0.0.1:0", timeout=120)
    assert served.returncode == 0 and "nothing to do: all 1 steps are done already" in served.stdout
    assert "volunteers connect to" not in served.stdout  # there is nothing to connect for
    busy = tmp_path / "busy"
    projects.create(busy, **{**SMALL, "training.steps": 5000, "work.policy": "freivalds"})
    coordinator = reaper(start_coordinator(busy, "127.0.0.1:0", tmp_path / "c.log"))
    url = first_url(coordinator)
    refused = tilehive("demo", "--dir", str(busy), "--no-wait", timeout=120)
    assert refused.returncode == 1 and refused.stdout == ""
    assert f"is in use by `tilehive coordinator` (pid {coordinator.pid}) serving {url}" in (
        refused.stderr
    )
    assert not list(busy.glob("volunteer-*"))


async def test_work_waits_for_volunteers_then_for_a_larger_one(tmp_path, rng):
    async with running(tmp_path, tile=16) as (co, queue, url):
        a, b = operands(rng, 32, 32, 40_000, False, False)  # panels of 2.5 MB
        product = asyncio.ensure_future(queue.matmul(a, b, step=1, label="wide"))
        try:
            await wait_until(lambda: co.ledger.unsent)
            for _ in range(2):  # a reason counts once two looks agree
                co.waiting.check(time.time())
            assert co.waiting.current.reason == "no_volunteers"
            assert "none has asked for work" in co.waiting.current.message
            async with CoordinatorClient(url) as client:
                await client.register("small", max_memory_mb=1)
                # The first ask is no news that no volunteer asks: it says what this one meets.
                reply = await client.request_work("r1", capacity=2, wait=False)
                assert reply["assignments"] == [] and "raise --max-memory" in reply["note"]
                reply = await client.request_work("r2", capacity=0, wait=False)
                assert "none has asked for work" not in reply.get("note", "")
                for _ in range(2):
                    co.waiting.check(time.time())
                wait = co.waiting.current
                assert wait.reason == "hosts_too_small" and "offers 1 MB" in wait.message
                status = (await client.status())["waiting"]
                assert status["reason"] == "hosts_too_small" and status["tiles"] > 0
        finally:
            product.cancel()
            with contextlib.suppress(BaseException):
                await product


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (lambda text: text.replace('policy = "quorum"', 'policy = "bogus"'), "work.policy"),
        (lambda text: text + "\nx = [\n", "is not valid TOML"),
    ],
    ids=["a setting out of range", "not TOML"],
)
def test_status_of_a_project_whose_settings_are_broken_says_so(tmp_path, edit, said):
    """It shows what the files say, says why train and coordinator would refuse the
    project, and exits 1 (it said step 0 of ? and exited 0)."""
    project = tmp_path / "project"
    projects.create(project, **SMALL)
    settings = project / "project.toml"
    assert 'policy = "quorum"' in settings.read_text()
    settings.write_text(edit(settings.read_text()))
    text = tilehive("status", str(project))
    assert text.returncode == 1 and "step 0 of ?" in text.stdout
    assert text.stderr.startswith(f"Error: {settings}") and said in text.stderr
    assert len(text.stderr.splitlines()) == 1
    as_json = tilehive("status", str(project), "--json")
    assert as_json.returncode == 1 and said in json.loads(as_json.stdout)["settings_error"]
    # The commands that refuse it name the file too (the coordinator named only the key).
    for command in (("coordinator", "--bind", "127.0.0.1:0"), ("train", "--local")):
        refused = tilehive(command[0], str(project), *command[1:])
        assert refused.returncode == 1 and said in refused.stderr, refused.stderr
        assert refused.stderr.startswith(f"Error: {settings}"), refused.stderr


def test_a_volunteer_the_coordinator_refuses_exits_with_its_own_code_and_says_why(tmp_path, reaper):
    """Refused for a missing or a wrong invite code, it said so and exited 0, which a
    systemd unit (Restart=on-failure) takes for a project finished."""
    directory = tmp_path / "invited"
    projects.create(directory, **{**SMALL, "access.invite_code": "s3cret"})
    coordinator = reaper(start_coordinator(directory, "127.0.0.1:0", tmp_path / "c.log"))
    url = first_url(coordinator)
    for i, invite in enumerate(([], ["--invite", "wrong"])):
        refused = tilehive(
            "volunteer", "start", url, "--state-dir", str(tmp_path / f"v{i}"), *invite, timeout=120
        )
        assert refused.returncode == 77, refused.stderr  # sysexits' EX_NOPERM
        assert "Traceback" not in refused.stderr
        said = [line for line in refused.stderr.splitlines() if "refuses this host" in line]
        assert len(said) == 1, refused.stderr
        assert ("needs an invite code" if not invite else "wrong invite code") in said[0]
