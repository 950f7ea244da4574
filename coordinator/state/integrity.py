"""Telling a damaged state.db from a new one, and saying what to do about it."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from shlex import quote

# SQLite's names for a file that is not a database, or one whose pages do not add up.
DAMAGE = frozenset({"SQLITE_CORRUPT", "SQLITE_NOTADB"})


def database_uri(path: Path, mode: str, immutable: bool = False) -> str:
    """The SQLite URI that opens `path` in `mode` (ro, rw), read as a file nobody changes
    if `immutable`: the path percent-encoded, so that a folder named with '#', '?' or '%'
    opens the file it names, not another."""
    return f"{path.resolve().as_uri()}?mode={mode}" + ("&immutable=1" if immutable else "")


class DamagedState(Exception):
    """The project's state.db cannot be read. Restore it from a backup, or move it away: the
    next coordinator starts a new one and resumes training from the last checkpoint, while the
    task and validation history and the hosts' trust start over."""

    def __init__(self, path: Path, what: str) -> None:
        super().__init__(
            f"{path} is damaged ({what}): restore it from a backup, or move it away "
            f"(mv {quote(str(path))} {quote(str(path) + '.damaged')}) to go on from the last "
            "checkpoint with a new one "
            "(task history and host trust start over)"
        )
        self.path = path


def is_damage(exc: sqlite3.DatabaseError) -> bool:
    """Whether SQLite failed because the file is damaged (not because it is busy or locked)."""
    return getattr(exc, "sqlite_errorname", None) in DAMAGE


@contextlib.contextmanager
def reported(path: Path) -> Iterator[None]:
    """Turn SQLite's complaint about a damaged file into DamagedState; other errors (a busy
    or locked database) pass unchanged."""
    try:
        yield
    except sqlite3.DatabaseError as exc:
        if is_damage(exc):
            raise DamagedState(path, str(exc)) from exc
        raise


def has_trained(directory: Path) -> bool:
    """Whether the project left traces of training beside its database."""
    metrics = directory / "train.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        return True
    checkpoints = directory / "checkpoints"
    return checkpoints.is_dir() and any(checkpoints.glob("step-*.npz"))


def check_empty(path: Path) -> None:
    """A 0-byte state.db is what SQLite leaves when it is killed before its first write, so it
    is a new project, unless the project has trained: then the state it had is gone."""
    if path.stat().st_size == 0 and has_trained(path.parent):
        raise DamagedState(path, "it is empty (0 bytes), but the project has trained")


def check(path: Path) -> None:
    """Raise DamagedState unless `path` is absent, a new project's empty file, or a SQLite
    database whose every page reads back (`PRAGMA quick_check`). Run before the coordinator
    opens its store, so that a damaged file is reported instead of half-loaded."""
    if not path.exists():
        return
    check_empty(path)
    if path.stat().st_size == 0:
        return
    with reported(path):
        connection = sqlite3.connect(database_uri(path, "rw"), uri=True, timeout=10)
        with contextlib.closing(connection) as db:
            verdict = [row[0] for row in db.execute("PRAGMA quick_check")]
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master")}
    if verdict != ["ok"]:
        raise DamagedState(path, f"SQLite's check says: {verdict[0]}")
    if tables and "workunits" not in tables:
        raise DamagedState(path, "it is a SQLite database, but not a tilehive project's state")
