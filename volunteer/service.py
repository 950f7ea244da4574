"""The volunteer as a systemd user service: the unit file, filled in for this installation."""

from __future__ import annotations

import shutil
import sys
from importlib import resources
from pathlib import Path

UNIT_NAME = "tilehive-volunteer.service"
MEMORY_HEADROOM_MB = 100  # the interpreter and libraries, beyond --max-memory


def quoted(value: str) -> str:
    """`value` as one word of a systemd command line: in double quotes, its backslashes and
    quotes escaped, and `%` and `$` doubled, which systemd would otherwise expand (a
    specifier, a variable). ValueError for a control character: a newline would end the
    line and begin another setting of the unit."""
    if not value.isprintable():
        raise ValueError(f"{value!r} holds a control character, which a unit file cannot hold")
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escaped.replace("%", "%%").replace("$", "$$") + '"'


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
    refused_exit: int,
) -> str:
    """The unit file's text for a volunteer of `url` (checked: volunteer.address.check_url),
    with `options` of `volunteer start` added to its command line; `refused_exit`: the exit
    code of a volunteer the coordinator refuses, which systemd then does not restart.
    ValueError for a value no unit file can hold."""
    template = resources.files("volunteer.systemd").joinpath(UNIT_NAME).read_text()
    return template.format(
        url=quoted(url),
        described=url.replace("%", "%%"),  # specifiers are expanded in a description too
        tilehive=tilehive_command(),
        state_dir=quoted(str(state_dir.expanduser().resolve())),
        threads=threads,
        max_memory=max_memory,
        options="".join(f" {quoted(option)}" for option in options),
        refused_exit=refused_exit,
        memory_max=max_memory + MEMORY_HEADROOM_MB,
    )


def user_unit_path() -> Path:
    return Path.home() / ".config" / "systemd" / "user" / UNIT_NAME
