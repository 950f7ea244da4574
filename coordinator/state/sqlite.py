"""The Store on SQLite through aiosqlite: WAL, foreign keys, one writer connection."""

from __future__ import annotations

import logging
import re
from importlib import resources
from pathlib import Path
from typing import Any

import aiosqlite

from coordinator.state.queries import QueryStore, load_queries

log = logging.getLogger(__name__)


def migrations() -> list[tuple[int, str]]:
    """(version, script) for every file in migrations/, in order."""
    folder = resources.files("coordinator.state").joinpath("migrations")
    found = []
    for entry in folder.iterdir():
        match = re.fullmatch(r"(\d{4})_\w+\.sql", entry.name)
        if match:
            found.append((int(match.group(1)), entry.read_text()))
    return sorted(found)


class SqliteStore(QueryStore):
    """State in one SQLite file. WAL with synchronous=NORMAL: a killed process loses nothing
    committed (only a power cut could drop the last transactions)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._db: aiosqlite.Connection | None = None
        self._sql = load_queries()

    @property
    def db(self) -> aiosqlite.Connection:
        if self._db is None:
            raise RuntimeError("store is not open")
        return self._db

    async def open(self) -> None:
        self._db = await aiosqlite.connect(self.path, isolation_level=None)
        self._db.row_factory = aiosqlite.Row
        await self._db.execute("PRAGMA journal_mode=WAL")
        await self._db.execute("PRAGMA synchronous=NORMAL")
        await self._db.execute("PRAGMA foreign_keys=ON")
        await self._migrate()

    async def _migrate(self) -> None:
        async with self.db.execute("PRAGMA user_version") as cursor:
            (version,) = await cursor.fetchone()
        for number, script in migrations():
            if number <= version:
                continue
            log.info("applying schema migration %04d", number, extra={"db": str(self.path)})
            await self.db.executescript(
                f"BEGIN;\n{script}\nPRAGMA user_version = {number};\nCOMMIT;"
            )

    async def close(self) -> None:
        if self._db is not None:
            await self._db.close()
            self._db = None

    async def _query(self, name: str, **values: Any) -> list[aiosqlite.Row]:
        async with self.db.execute(self._sql[name], values) as cursor:
            return list(await cursor.fetchall())

    async def _execute(self, name: str, **values: Any) -> None:
        await self.db.execute(self._sql[name], values)

    async def _transaction(self, statements: list[tuple[str, list[dict[str, Any]]]]) -> None:
        db = self.db
        await db.execute("BEGIN IMMEDIATE")
        try:
            for name, rows in statements:
                await db.executemany(self._sql[name], rows)
            await db.execute("COMMIT")
        except BaseException:
            await db.execute("ROLLBACK")
            raise
