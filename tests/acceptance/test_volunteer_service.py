"""`tilehive volunteer install-service`: a systemd user unit that runs this installation's
volunteer at idle priority within its memory."""

from __future__ import annotations

import re
import shlex
import subprocess

from tests.procs import tilehive


def test_the_unit_runs_this_installations_volunteer_at_idle_priority(tmp_path):
    unit = tmp_path / "units" / "tilehive-volunteer.service"
    state = tmp_path / "state"
    done = tilehive(
        "volunteer",
        "install-service",
        "http://coordinator.example:8470",
        "--unit",
        str(unit),
        "--state-dir",
        str(state),
        "--max-memory",
        "300",
        "--threads",
        "1",
    )
    assert done.returncode == 0, done.stderr
    assert f"wrote {unit}" in done.stdout
    lines = dict(
        line.split("=", 1)
        for line in unit.read_text().splitlines()
        if "=" in line and line[0] != "#"
    )
    assert (lines["Nice"], lines["CPUSchedulingPolicy"], lines["IOSchedulingClass"]) == (
        "19",
        "idle",
        "idle",
    )
    assert lines["MemoryMax"] == "400M"  # --max-memory and the interpreter's share
    command = shlex.split(lines["ExecStart"])
    assert command[command.index("--state-dir") + 1] == str(state.resolve())
    start = command.index("start")
    assert command[start + 1] == "http://coordinator.example:8470"
    assert command[command.index("--max-memory") + 1] == "300"
    # ExecStart names a tilehive that exists and runs, wherever this one is installed.
    program = command[: command.index("volunteer")]
    ran = subprocess.run([*program, "volunteer", "start", "--help"], capture_output=True, text=True)
    assert ran.returncode == 0 and "--max-memory" in ran.stdout


def test_print_shows_the_unit_and_writes_nothing(tmp_path):
    done = tilehive(
        "volunteer", "install-service", "http://h:1", "--print", "--state-dir", str(tmp_path / "s")
    )
    assert done.returncode == 0
    assert "[Service]" in done.stdout and "ExecStart=" in done.stdout
    assert not (tmp_path / "s").exists()


def systemd_words(line: str) -> list[str]:
    """A unit's command line as systemd reads it: quotes and backslashes as a shell's
    double quotes have them, then `%%` and `$$` as a single `%` and `$`. A lone `%` or `$`
    would be expanded by systemd (a specifier, a variable): it fails here."""
    words = []
    for word in shlex.split(line):
        lone = re.sub(r"%%|\$\$", "", word)
        assert "%" not in lone and "$" not in lone, f"systemd would expand {word!r}"
        words.append(word.replace("%%", "%").replace("$$", "$"))
    return words


def test_the_unit_holds_odd_values_as_written_and_refuses_what_it_cannot(tmp_path):
    url = 'http://coordinator.example:8470/a%cb$HOME"q'
    state = tmp_path / "state dir %c $USER \\ end"
    done = tilehive(
        "volunteer", "install-service", url, "--print", "--state-dir", str(state), "--threads", "1"
    )
    assert done.returncode == 0, done.stderr
    lines = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    command = systemd_words(lines["ExecStart"])
    assert command[command.index("start") + 1] == url
    assert command[command.index("--state-dir") + 1] == str(state.resolve())
    assert lines["Description"].endswith('a%%cb$HOME"q')  # no specifier expanded there
    for bad in ("localhost:1", "http://x:1/\nExecStartPre=/bin/touch /tmp/pwned", "http://x:1/\\"):
        refused = tilehive("volunteer", "install-service", bad, "--print")
        assert refused.returncode == 1 and refused.stdout == "", refused.stdout
        assert refused.stderr.startswith("Error: ") and len(refused.stderr.splitlines()) == 1


def test_the_unit_takes_the_name_the_invite_code_and_idle_only_and_never_restarts_a_refusal(
    tmp_path,
):
    """A project that needs an invite code could not be joined through the unit (it had no
    --invite), and a volunteer it refused exited 0; now it exits 77, which the unit does not
    restart: it would only be refused again. The code is in the unit's environment, not on
    the command line every user of the machine can read, and the unit is the user's alone."""
    unit = tmp_path / "tilehive-volunteer.service"
    done = tilehive(
        "volunteer",
        "install-service",
        "http://h:1",
        "--unit",
        str(unit),
        *("--name", "lab pc %1", "--invite", 'se"cret$x', "--idle-only"),
    )
    assert done.returncode == 0, done.stderr
    assert unit.stat().st_mode & 0o777 == 0o600
    lines = dict(line.split("=", 1) for line in unit.read_text().splitlines() if "=" in line)
    command = systemd_words(lines["ExecStart"])
    assert command[command.index("--name") + 1] == "lab pc %1"
    assert "--idle-only" in command and "--invite" not in command
    (variable,) = shlex.split(lines["Environment"])
    assert variable.replace("%%", "%") == 'TILEHIVE_INVITE=se"cret$x'  # `$` is plain there
    assert lines["Restart"] == "on-failure" and lines["RestartPreventExitStatus"] == "77"
    bad = tilehive("volunteer", "install-service", "http://h:1", "--print", "--name", "123")
    assert bad.returncode == 1 and bad.stderr.startswith("Error: --name '123'")
