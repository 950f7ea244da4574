"""The volunteer as a systemd user service: the unit file, filled in for this installation."""

from __future__ import annotations

import shutil
import sys
from importlib import resources
from pathlib import Path

UNIT_NAME = "tilehive-volunteer.service"
MEMORY_HEADROOM_MB = 100  # the interpreter and libraries, beyond --max-memory
# The exit code of a volunteer the coordinator refuses (quarantined, or its registration
# refused for a missing or wrong invite code: sysexits' EX_NOPERM). Asking again would be
# refused again, so the unit does not restart it (RestartPreventExitStatus).
REFUSED_EXIT = 77


def quoted(value: str, command: bool = True) -> str:
    """`value` as one word of a systemd line: in double quotes, its backslashes and quotes
    escaped, and `%` doubled, which systemd would expand (a specifier), as it would `$` on a
    `command` line (a variable; elsewhere, as in Environment=, `$` is plain text). ValueError
    for a control character: a newline would end the line and begin another setting."""
    if not value.isprintable():
        raise ValueError(f"{value!r} holds a control character, which a unit file cannot hold")
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    return '"' + (escaped.replace("$", "$$") if command else escaped) + '"'


def tilehive_command() -> str:
    """The `tilehive` this installation runs: the script beside this Python, if there is
    one, else this Python running the package (so ExecStart works wherever it was
    installed, a venv included)."""
    beside = Path(sys.executable).with_name("tilehive")
    if beside.exists():
        return quoted(str(beside))
    found = shutil.which("tilehive")
    if found:
        return quoted(found)
    return f"{quoted(sys.executable)} -m coordinator.cli"


def unit(
    url: str,
    state_dir: Path,
    threads: int,
    max_memory: int,
    options: list[str],
    invite: str | None = None,
) -> str:
    """The unit file's text for a volunteer of `url` (checked: volunteer.address.check_url),
    with `options` of `volunteer start` added to its command line, and the invite code, if
    any, in its environment (TILEHIVE_INVITE): on a command line every user of the machine
    could read it. ValueError for a value no unit file can hold."""
    template = resources.files("volunteer.systemd").joinpath(UNIT_NAME).read_text()
    return template.format(
        url=quoted(url),
        described=url.replace("%", "%%"),  # specifiers are expanded in a description too
        tilehive=tilehive_command(),
        state_dir=quoted(str(state_dir.expanduser().resolve())),
        threads=threads,
        max_memory=max_memory,
        options="".join(f" {quoted(option)}" for option in options),
        environment=(
            f"Environment={quoted(f'TILEHIVE_INVITE={invite}', command=False)}\n" if invite else ""
        ),
        refused_exit=REFUSED_EXIT,
        memory_max=max_memory + MEMORY_HEADROOM_MB,
    )


def user_unit_path() -> Path:
    return Path.home() / ".config" / "systemd" / "user" / UNIT_NAME
