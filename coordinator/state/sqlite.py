"""The Store on SQLite: WAL, foreign keys, one connection shared by the loop and a thread.

The hot path runs on the event loop itself: the commit that follows a handler's reply
(a few dozen rows) and the point lookups of a product or a result take 0.1-0.2 ms of
SQLite, less than a trip to another thread and back, and a thread would also have to win
the GIL back for every row it binds while the server and the training thread hold it (a
tiny-gpt step commits about 150 times: 13% of the step went to those trips). What may
take longer (bulk deletes after a checkpoint, queries for logs and restarts, commits of
hundreds of rows) runs on the store's thread. A lock keeps the two from ever using the
connection at once, and the loop never waits for it: while the thread holds it, the
loop's work queues behind, on the thread.

Checkpoints of the WAL into the database file (two fsyncs) run every half second on the
store's thread (`_checkpoint_every`), so that no commit on the loop pays for one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import re
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from coordinator.state.queries import Params, QueryStore, load_queries, many_rows

log = logging.getLogger(__name__)

T = TypeVar("T")


def migrations() -> list[tuple[int, str]]:
    """(version, script) for every file in migrations/, in order."""
    folder = resources.files("coordinator.state").joinpath("migrations")
    found = []
    for entry in folder.iterdir():
        match = re.fullmatch(r"(\d{4})_\w+\.sql", entry.name)
        if match:
            found.append((int(match.group(1)), entry.read_text()))
    return sorted(found)


# What runs on the event loop: point lookups, and the write-through commits of at most
# LIGHT_ROWS rows (a handler's; publishing a large product's work units goes to the thread).
LIGHT_QUERIES = frozenset({"select_gemm", "select_result", "select_reply"})
LIGHT_WRITES = frozenset(
    {
        "upsert_gemm",
        "upsert_host",
        "upsert_workunit",
        "upsert_result",
        "insert_event",
        "insert_reply",
    }
)
LIGHT_ROWS = 256
# Writes that only append rows (events: eight a work unit) bind up to ROWS_AT_ONCE rows a
# statement (queries.many_rows), as far as SQLite's limit on a statement's parameters
# allows, rather than run the statement once a row: 1.0 us an event against 2.0
# (docs/performance-history.md, the twenty-first round). Upserts gained nothing measurable.
APPENDS = frozenset({"insert_event"})
ROWS_AT_ONCE = 256

PAGE_CACHE_KIB = 64 << 10  # SQLite's page cache for the coordinator's connection

CHECKPOINT_EVERY = 0.5  # seconds between checkpoints of the WAL into the database file
# Pages in the WAL at which a commit would checkpoint by itself, on the loop: only if the
# store's thread were stuck (SQLite's default is 1,000: several times a tiny-gpt step).
BACKSTOP_PAGES = 50_000


class SqliteStore(QueryStore):
    """State in one SQLite file. WAL with synchronous=NORMAL: a killed process loses nothing
    committed (only a power cut could drop the last transactions)."""

    appends = APPENDS  # the writes that bind many rows a statement

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._db: sqlite3.Connection | None = None
        self._thread: ThreadPoolExecutor | None = None
        self._checkpoints: asyncio.Task | None = None
        self._lock = threading.Lock()  # whoever uses the connection holds it
        self._sql = load_queries()

    async def _run(self, work: Callable[[sqlite3.Connection], T], *, light: bool = False) -> T:
        """`work(connection)`: on the loop when `light` and the connection is free, else on
        the store's thread."""
        if self._db is None or self._thread is None:
            raise RuntimeError("store is not open")
        db = self._db
        if light and self._lock.acquire(blocking=False):
            try:
                return work(db)
            finally:
                self._lock.release()
        return await asyncio.get_running_loop().run_in_executor(
            self._thread, self._locked, work, db
        )

    def _locked(self, work: Callable[[sqlite3.Connection], T], db: sqlite3.Connection) -> T:
        with self._lock:
            return work(db)

    async def open(self) -> None:
        # One worker: the heavy work runs in the order it was asked for.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tilehive-sqlite")
        loop = asyncio.get_running_loop()
        try:
            self._db = await loop.run_in_executor(self._thread, self._connect)
            await self._migrate()
            self._checkpoints = asyncio.create_task(self._checkpoint_every(CHECKPOINT_EVERY))
        except BaseException:
            await self.close()
            raise

    def _connect(self) -> sqlite3.Connection:
        # Used from the loop and the store's thread, never at once (self._lock).
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        # Work units and results are keyed by random hashes, so each commit writes pages all
        # over their indexes: SQLite's default cache (2 MB) rereads most of them, 64 MB holds
        # those of tens of thousands of work units (docs/performance-history.md, ninth round).
        db.execute(f"PRAGMA cache_size=-{PAGE_CACHE_KIB}")
        db.execute("PRAGMA foreign_keys=ON")
        db.execute(f"PRAGMA wal_autocheckpoint={BACKSTOP_PAGES}")  # _checkpoint_every's job
        return db

    async def _migrate(self) -> None:
        (version,) = await self._run(lambda db: db.execute("PRAGMA user_version").fetchone())
        due = [(number, script) for number, script in migrations() if number > version]
        if due and version == 0:  # one line for a new database, not one per migration
            log.info("new state database, schema %d", due[-1][0], extra={"db": str(self.path)})
        for number, script in due:
            if version:
                log.info("upgrading the state database to schema %d", number)
            sql = f"BEGIN;\n{script}\nPRAGMA user_version = {number};\nCOMMIT;"
            await self._run(lambda db, sql=sql: db.executescript(sql))

    async def close(self) -> None:
        if self._checkpoints is not None:
            checkpoints, self._checkpoints = self._checkpoints, None
            checkpoints.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await checkpoints
        thread, db = self._thread, self._db
        self._thread = self._db = None
        if thread is None:
            return
        if db is not None:
            await asyncio.get_running_loop().run_in_executor(thread, self._locked, _close, db)
        thread.shutdown(wait=True)

    async def _checkpoint_every(self, seconds: float) -> None:
        """Copy the WAL into the database file every `seconds`, on the store's thread.

        Left to itself, SQLite checkpoints inside whichever commit fills the WAL, with two
        fsyncs: on the loop, that would stall every request. On the store's thread, holding
        the connection, the checkpoint sees no commit land while it runs, so it completes
        and the next commit starts the WAL over (a checkpoint beside a stream of commits
        never catches up, and the WAL grows). The loop's commits meanwhile queue on the
        thread, a few milliseconds, and the loop goes on serving."""
        while True:
            await asyncio.sleep(seconds)
            try:
                await self._run(_checkpoint)
            except sqlite3.Error as exc:  # busy or failing: the next round tries again
                log.warning("checkpoint of %s failed: %s", self.path, exc)

    async def _query(self, name: str, **values: Any) -> list[sqlite3.Row]:
        sql = self._sql[name]
        light = name in LIGHT_QUERIES
        return await self._run(lambda db: db.execute(sql, values).fetchall(), light=light)

    async def _execute(self, name: str, **values: Any) -> None:
        sql = self._sql[name]
        await self._run(lambda db: db.execute(sql, values).close())

    async def _transaction(self, statements: list[tuple[str, list[Params]]]) -> None:
        named = [(self._sql[name], name in self.appends, rows) for name, rows in statements]
        light = all(name in LIGHT_WRITES for name, _ in statements) and (
            sum(len(rows) for _, rows in statements) <= LIGHT_ROWS
        )

        def transaction(db: sqlite3.Connection) -> None:
            db.execute("BEGIN IMMEDIATE")
            try:
                for sql, append, rows in named:
                    if append:
                        append_rows(db, sql, rows)
                    else:
                        db.executemany(sql, rows)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

        await self._run(transaction, light=light)


def append_rows(db: sqlite3.Connection, sql: str, rows: list[tuple]) -> None:
    """Run a write of one row of a record's values (queries.WRITES) for every row, many rows
    a statement. The last rows go in statements of a power of two rows each, so that a
    write has at most nine shapes, all kept prepared in the connection's statement cache."""
    if not rows:
        return
    width = len(rows[0])
    most = max(1, min(ROWS_AT_ONCE, db.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // width))
    start = 0
    while start < len(rows):
        left = len(rows) - start
        n = most if left >= most else 1 << (left.bit_length() - 1)
        part = rows[start : start + n]
        db.execute(many_rows(sql, n, width), list(itertools.chain.from_iterable(part)))
        start += n


def _close(db: sqlite3.Connection) -> None:
    db.close()


def _checkpoint(db: sqlite3.Connection) -> None:
    db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
