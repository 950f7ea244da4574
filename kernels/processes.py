"""tilehive's own processes on a machine, told apart from its owner's programs by name.

A coordinator and a volunteer name their process (`name_this_process`: Linux's `comm`, what
`top` and `ps -o comm` show) so that a volunteer asked to compute only while the machine is
idle (`--idle-only`, volunteer/idle.py) does not take the coordinator it serves, or a
volunteer beside it, for the owner at work. A name is no credential: a program that takes
one of these names only makes an idle-only volunteer on its own machine work beside it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

COORDINATOR = "tilehive-coord"
VOLUNTEER = "tilehive-vol"
OURS = frozenset({COORDINATOR, VOLUNTEER})
PROC = Path("/proc")
_PR_SET_NAME = 15  # prctl(2): name the calling thread, the process's name on its main thread

log = logging.getLogger(__name__)


def name_this_process(name: str) -> None:
    """Give this process `name` (at most 15 bytes, as Linux keeps it). Called from the main
    thread at a command's start; threads started after it take the name too. Elsewhere
    than Linux, nothing happens."""
    if not sys.platform.startswith("linux"):
        return
    try:
        failed = ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0) != 0
    except (OSError, AttributeError):
        failed = True
    if failed:  # an idle-only volunteer on this machine then counts this process its owner's
        log.debug("could not name this process %s", name)


def process_name(pid: int, proc: Path = PROC) -> str | None:
    """The process's name, None when it is gone (or there is no /proc)."""
    try:
        return (proc / str(pid) / "comm").read_text().strip()
    except OSError:
        return None


def ours(proc: Path = PROC) -> Iterator[int]:
    """The pids of tilehive's coordinators and volunteers running on this machine."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(proc):
            if entry.name.isdigit() and process_name(int(entry.name), proc) in OURS:
                yield int(entry.name)


def cpu_seconds(pid: int, proc: Path = PROC) -> float | None:
    """CPU seconds the process has used, all its threads, user and system; None when it is
    gone."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    # After the name in parentheses (which may hold spaces): utime and stime are the 12th
    # and 13th fields (proc(5), fields 14 and 15 counting from the pid).
    fields = stat.rsplit(")", 1)[1].split()
    return (float(fields[11]) + float(fields[12])) / os.sysconf("SC_CLK_TCK")
