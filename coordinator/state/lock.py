"""One writer per project: an exclusive lock on DIR/project.lock for the writer's whole life.

`tilehive coordinator` and `tilehive train --local` both write a project's state and
checkpoints, so each holds the lock while it runs. The kernel drops a flock when its holder
exits in any way (kill -9 included), so a crash never leaves a project locked. The file
names the holder (pid, command, URL) for whoever is refused.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

LOCK_FILE = "project.lock"


class ProjectBusy(Exception):
    """Another process holds the project: it is served, or trained locally, already."""


class ProjectLock:
    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self._fd: int | None = None
        self._holder: dict[str, object] = {}

    def acquire(self, command: str) -> None:
        """Hold the project or raise ProjectBusy naming who does."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise ProjectBusy(_refusal(self.directory, holder)) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.describe(pid=os.getpid(), command=command)

    def describe(self, **holder: object) -> None:
        """Add to what the lock file says about its holder (its URL once it serves)."""
        if self._fd is None:
            raise RuntimeError("the project lock is not held")
        self._holder.update(holder)
        data = json.dumps(self._holder).encode() + b"\n"
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # drops the flock
            self._fd = None

    def __enter__(self) -> ProjectLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def holder(directory: Path | str) -> dict | None:
    """What the lock file says of a holder that still runs (pid, command, url, and `since`:
    when it last described itself, i.e. started serving), or None. Read without locking,
    so that a reader never stands in a starting writer's way: the kernel's table of locks
    says whether the file is held (a holder killed, even one not yet reaped, holds nothing,
    and after a reboot its pid may be another program's); where that table cannot be read,
    whether the pid the file names still runs."""
    try:
        fd = os.open(Path(directory) / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        found = _read(fd)
        info = os.fstat(fd)
        found["since"] = info.st_mtime
    finally:
        os.close(fd)
    pid = found.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return None
    held = _flocked(info)
    if held is not None:
        return found if held else None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # another user's process: it runs
    return found


def _flocked(info: os.stat_result) -> bool | None:
    """Whether some process holds a flock on the file `info` describes, from Linux's
    /proc/locks; None where it cannot be read. A line names the file by device and inode,
    matched on the inode alone: on an overlay or a btrfs subvolume the device may be another
    than stat says (and the holder's pid another, in a container's namespace). Another file
    of the same inode number on another device, flocked too, would read as held."""
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as table:
            lines = table.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK":
            continue  # a POSIX lock, or a process waiting for one ("1: -> FLOCK ...")
        if fields[5].endswith(f":{info.st_ino}"):
            return True
    return False


def _read(fd: int) -> dict:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def in_use(directory: Path) -> str | None:
    """Why the project cannot be taken now (who holds it, as ProjectBusy says), or None.
    Asks the lock itself, held for an instant: the pid a lock file names may be another
    program's after a reboot."""
    try:
        fd = os.open(Path(directory) / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return _refusal(Path(directory), _read(fd))
    finally:
        os.close(fd)  # drops the lock, if this took it
    return None


def _refusal(directory: Path, holder: dict) -> str:
    pid = holder.get("pid", "unknown")
    command = holder.get("command", "another tilehive process")
    url = holder.get("url")
    where = f" serving {url}" if url else ""
    return (
        f"{directory} is in use by `tilehive {command}` (pid {pid}){where}; "
        "one process at a time may run a project: stop that one first"
    )
