"""A volunteer's state directory: its identity with a coordinator, pid file, log and status.

One directory per volunteer; several volunteers on one machine each use their own
(`--state-dir`). The pid file is held with an exclusive flock for the daemon's whole life,
so a second start against the same directory is refused, and a pid file left by a killed
daemon is recognised as stale because nobody holds its lock.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def default_state_dir() -> Path:
    """$XDG_STATE_HOME/tilehive/volunteer, or ~/.local/state/tilehive/volunteer."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(Path.home(), ".local", "state")
    return Path(base) / "tilehive" / "volunteer"


class AlreadyRunning(RuntimeError):
    """Another volunteer holds this state directory."""


def write_private(path: Path, text: str) -> None:
    """Write a file atomically, readable and writable by its owner only (0600)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class StateDir:
    path: Path

    def __post_init__(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)

    @property
    def identity_file(self) -> Path:
        return self.path / "identity.json"

    @property
    def pid_file(self) -> Path:
        return self.path / "volunteer.pid"

    @property
    def log_file(self) -> Path:
        return self.path / "volunteer.log"

    @property
    def status_file(self) -> Path:
        return self.path / "status.json"

    def identity(self, url: str) -> dict[str, Any] | None:
        """The saved host id and token for this coordinator URL, if any."""
        try:
            saved = json.loads(self.identity_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        if not isinstance(saved, dict) or saved.get("url") != url or "token" not in saved:
            return None
        return saved

    def save_identity(self, url: str, host_id: int, token: str, name: str) -> None:
        identity = {"url": url, "host_id": host_id, "token": token, "name": name}
        write_private(self.identity_file, json.dumps(identity))

    def write_status(self, status: dict[str, Any]) -> None:
        write_private(self.status_file, json.dumps(status))

    def read_status(self) -> dict[str, Any] | None:
        """What the daemon last wrote of itself; None when nothing is there, or when what is
        there is not a status (a damaged file, or one written by something else)."""
        try:
            saved = json.loads(self.status_file.read_text())
        except (FileNotFoundError, ValueError):  # ValueError: not JSON, or not UTF-8
            return None
        return saved if isinstance(saved, dict) else None

    def lock(self) -> int:
        """Take the pid file's lock and write our pid; returns the fd to keep open."""
        fd = os.open(self.pid_file, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise AlreadyRunning(
                    f"a volunteer (pid {self.running_pid() or '?'}) already runs with state "
                    f"directory {self.path}; stop it first or use another --state-dir"
                ) from exc
            raise
        self.write_pid(fd)
        return fd

    def write_pid(self, fd: int) -> None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        os.fsync(fd)

    def running_pid(self) -> int | None:
        """The pid of the live volunteer holding this directory, or None (a stale pid file
        left by a killed volunteer is removed)."""
        try:
            fd = os.open(self.pid_file, os.O_RDWR)
        except FileNotFoundError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                text = os.pread(fd, 32, 0).decode().strip()
                return int(text) if text.isdigit() else None
            # We got the lock: nobody runs here. The file is stale.
            self.pid_file.unlink(missing_ok=True)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def holds(self, fd: int) -> bool:
        """Whether the pid file whose lock `fd` holds is still this directory's: not once
        the directory was deleted or replaced, when nothing could find this volunteer."""
        try:
            here, held = os.stat(self.pid_file), os.fstat(fd)
        except FileNotFoundError:
            return False
        return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)

    def release(self, fd: int) -> None:
        """Remove the pid file and drop the lock (clean exit). Only our own: after the
        directory was deleted under us, another volunteer may have made it anew."""
        if self.holds(fd):
            self.pid_file.unlink(missing_ok=True)
        os.close(fd)
