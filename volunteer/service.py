"""The volunteer as a systemd user service: the unit file, filled in for this installation."""

from __future__ import annotations

import shlex
import shutil
import sys
from importlib import resources
from pathlib import Path

UNIT_NAME = "tilehive-volunteer.service"
MEMORY_HEADROOM_MB = 100  # the interpreter and libraries, beyond --max-memory


def tilehive_command() -> str:
    """The `tilehive` this installation runs: the script beside this Python, if there is
    one, else this Python running the package (so ExecStart works wherever it was
    installed, a venv included)."""
    beside = Path(sys.executable).with_name("tilehive")
    if beside.exists():
        return shlex.quote(str(beside))
    found = shutil.which("tilehive")
    if found:
        return shlex.quote(found)
    return f"{shlex.quote(sys.executable)} -m coordinator.cli"


def unit(url: str, state_dir: Path, threads: int, max_memory: int) -> str:
    """The unit file's text for a volunteer of `url`."""
    template = resources.files("volunteer.systemd").joinpath(UNIT_NAME).read_text()
    return template.format(
        url=shlex.quote(url),
        tilehive=tilehive_command(),
        state_dir=shlex.quote(str(state_dir.expanduser().resolve())),
        threads=threads,
        max_memory=max_memory,
        memory_max=max_memory + MEMORY_HEADROOM_MB,
    )


def user_unit_path() -> Path:
    return Path.home() / ".config" / "systemd" / "user" / UNIT_NAME
