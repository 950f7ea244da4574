"""The Store on SQLite through aiosqlite: WAL, foreign keys, one writer connection."""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import re
from importlib import resources
from pathlib import Path
from typing import Any

import aiosqlite

from coordinator.state.store import Batch, Snapshot, Store
from coordinator.work.events import Event
from coordinator.work.records import (
    Gemm,
    GemmState,
    Host,
    Outcome,
    Policy,
    Result,
    ServerState,
    ValidateState,
    WorkUnit,
    WuState,
)

log = logging.getLogger(__name__)


def load_queries() -> dict[str, str]:
    """The named blocks of queries.sql."""
    text = resources.files("coordinator.state").joinpath("queries.sql").read_text()
    blocks = re.split(r"^-- name: (\w+)\s*$", text, flags=re.MULTILINE)
    return {name: sql.strip() for name, sql in zip(blocks[1::2], blocks[2::2], strict=True)}


def migrations() -> list[tuple[int, str]]:
    """(version, script) for every file in migrations/, in order."""
    folder = resources.files("coordinator.state").joinpath("migrations")
    found = []
    for entry in folder.iterdir():
        match = re.fullmatch(r"(\d{4})_\w+\.sql", entry.name)
        if match:
            found.append((int(match.group(1)), entry.read_text()))
    return sorted(found)


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _row(record: Any) -> dict[str, Any]:
    """A record as SQL parameters: enums as their values, bools as integers."""
    row = {}
    for name in _field_names(type(record)):
        value = getattr(record, name)
        if isinstance(value, enum.Enum):
            value = value.value
        elif value is True or value is False:
            value = int(value)
        row[name] = value
    return row


def _gemm(row: aiosqlite.Row) -> Gemm:
    d = dict(row)
    d.update(
        trans_a=bool(d["trans_a"]),
        trans_b=bool(d["trans_b"]),
        policy=Policy(d["policy"]),
        state=GemmState(d["state"]),
    )
    return Gemm(**d)


def _workunit(row: aiosqlite.Row) -> WorkUnit:
    d = dict(row)
    d.update(
        trans_a=bool(d["trans_a"]),
        trans_b=bool(d["trans_b"]),
        accelerated=bool(d["accelerated"]),
        policy=Policy(d["policy"]),
        state=WuState(d["state"]),
    )
    return WorkUnit(**d)


def _result(row: aiosqlite.Row) -> Result:
    d = dict(row)
    d.update(
        server_state=ServerState(d["server_state"]),
        outcome=Outcome(d["outcome"]),
        validate_state=ValidateState(d["validate_state"]),
        upload_tile=bool(d["upload_tile"]),
        has_tile=bool(d["has_tile"]),
    )
    return Result(**d)


def _host(row: aiosqlite.Row) -> Host:
    d = dict(row)
    d["quarantined"] = bool(d["quarantined"])
    return Host(**d)


class SqliteStore(Store):
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

    async def commit(self, batch: Batch) -> None:
        if not batch:
            return
        db = self.db
        await db.execute("BEGIN IMMEDIATE")
        try:
            # Parents before children, for the foreign keys.
            if batch.gemms:
                await db.executemany(
                    self._sql["upsert_gemm"], [_row(g) for g in batch.gemms.values()]
                )
            if batch.hosts:
                await db.executemany(
                    self._sql["upsert_host"], [_row(h) for h in batch.hosts.values()]
                )
            if batch.workunits:
                await db.executemany(
                    self._sql["upsert_workunit"], [_row(w) for w in batch.workunits.values()]
                )
            if batch.results:
                await db.executemany(
                    self._sql["upsert_result"], [_row(r) for r in batch.results.values()]
                )
            if batch.events:
                rows = []
                for event in batch.events:
                    row = _row(event)
                    del row["id"]
                    rows.append(row)
                await db.executemany(self._sql["insert_event"], rows)
            if batch.replies:
                await db.executemany(self._sql["insert_reply"], [_row(r) for r in batch.replies])
            await db.execute("COMMIT")
        except BaseException:
            await db.execute("ROLLBACK")
            raise

    async def _all(self, name: str, **params: Any) -> list[aiosqlite.Row]:
        async with self.db.execute(self._sql[name], params) as cursor:
            return list(await cursor.fetchall())

    async def load(self) -> Snapshot:
        hosts = [_host(r) for r in await self._all("select_hosts")]
        gemms = [_gemm(r) for r in await self._all("select_active_gemms")]
        workunits, results = [], []
        for gemm in gemms:
            wus, res = await self.gemm_work(gemm.id)
            workunits += wus
            results += res
        return Snapshot(hosts=hosts, gemms=gemms, workunits=workunits, results=results)

    async def gemm(self, gemm_id: str) -> Gemm | None:
        rows = await self._all("select_gemm", id=gemm_id)
        return _gemm(rows[0]) if rows else None

    async def gemm_work(self, gemm_id: str) -> tuple[list[WorkUnit], list[Result]]:
        wus = [_workunit(r) for r in await self._all("select_workunits_of_gemm", gemm_id=gemm_id)]
        res = [_result(r) for r in await self._all("select_results_of_gemm", gemm_id=gemm_id)]
        return wus, res

    async def result(self, result_id: str) -> Result | None:
        rows = await self._all("select_result", id=result_id)
        return _result(rows[0]) if rows else None

    async def reply(self, host_id: int, request_id: str) -> bytes | None:
        rows = await self._all("select_reply", host_id=host_id, request_id=request_id)
        return bytes(rows[0]["body"]) if rows else None

    async def prune_replies(self, before: float, keep: int) -> None:
        await self.db.execute(self._sql["prune_replies"], {"before": before, "keep": keep})

    async def reply_count(self) -> int:
        return (await self._all("count_replies"))[0][0]

    async def events(
        self,
        *,
        after: int = 0,
        kind: str | None = None,
        step: int | None = None,
        state: str | None = None,
        host_id: int | None = None,
        limit: int = 1000,
    ) -> list[Event]:
        rows = await self._all(
            "select_events",
            after=after,
            kind=kind,
            step=step,
            state=state,
            host_id=host_id,
            limit=limit,
        )
        return [Event(**dict(r)) for r in rows]

    async def prunable_blobs(self, through_step: int) -> set[str]:
        old = {r[0] for r in await self._all("select_blobs_through_step", step=through_step)}
        live = {r[0] for r in await self._all("select_blobs_after_step", step=through_step)}
        await self.db.execute(self._sql["mark_gemms_pruned"], {"step": through_step})
        return old - live

    async def recent_events(self, kind: str, state: str, limit: int) -> list[Event]:
        rows = await self._all("select_recent_events", kind=kind, state=state, limit=limit)
        return [Event(**dict(r)) for r in rows]

    async def workunit_counts(self) -> dict[str, int]:
        return {r["state"]: r["n"] for r in await self._all("count_workunits_by_state")}

    async def invalid_count(self) -> int:
        return (await self._all("count_invalid_results"))[0]["n"]
