"""The Store as named queries: every operation is a block of queries.sql, run by a driver.

`QueryStore` turns records into query parameters and rows back into records; a driver only
runs a named query. `SqliteStore` runs the SQL text; `MemoryStore` answers each name with
Python over dicts, for unit tests. Both answer the same names, and a test holds the
in-memory answers to every name in queries.sql, so the fake cannot drift from the real set.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import math
import operator
import re
from collections.abc import Callable, Mapping
from importlib import resources
from typing import Any

from coordinator.state.store import Batch, Reply, Snapshot, Store
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

Row = Mapping[str, Any]
Params = Mapping[str, Any] | tuple


def load_queries() -> dict[str, str]:
    """The named blocks of queries.sql."""
    text = resources.files("coordinator.state").joinpath("queries.sql").read_text()
    blocks = re.split(r"^-- name: (\w+)\s*$", text, flags=re.MULTILINE)
    return {name: sql.strip() for name, sql in zip(blocks[1::2], blocks[2::2], strict=True)}


# The statement that writes each kind of record. Its values are the record's fields in order,
# as numbered parameters (?1, ?2, ...), so a record becomes a row in one C call.
WRITES: dict[str, type] = {
    "upsert_gemm": Gemm,
    "upsert_host": Host,
    "upsert_workunit": WorkUnit,
    "upsert_result": Result,
    "insert_event": Event,
    "insert_reply": Reply,
}


@functools.cache
def many_rows(sql: str, n: int, width: int) -> str:
    """A write of WRITES (one row: a VALUES group of numbered parameters, ?1 to ?width) as a
    write of n rows at once: the group repeated, the i-th copy's parameters numbered from
    i * width + 1, so that the rows' values follow one another in one flat sequence."""
    match = re.search(r"VALUES\s*(\([^()]*\))", sql)
    if match is None:
        raise ValueError("not a write of one VALUES group")
    group = match.group(1)
    copies = [
        re.sub(r"\?(\d+)", lambda p, at=i * width: f"?{int(p.group(1)) + at}", group)
        for i in range(n)
    ]
    return sql[: match.start(1)] + ",\n".join(copies) + sql[match.end(1) :]


@functools.cache
def columns(record_type: type) -> tuple[str, ...]:
    """A record type's field names: the order of its values in a row."""
    if issubclass(record_type, tuple):  # a named tuple (Event)
        return record_type._fields
    return tuple(f.name for f in dataclasses.fields(record_type))


@functools.cache
def _getter(record_type: type) -> Callable[[Any], tuple]:
    if issubclass(record_type, tuple):  # a named tuple is its own row
        return _itself
    return operator.attrgetter(*columns(record_type))


def _itself(record: tuple) -> tuple:
    return record


def values(record: Any) -> tuple:
    """A record as a row of query values, in its fields' order.

    A commit turns every changed record into a row (several a work unit), so this is on the
    hot path: one C call, no dict. Enums and bools pass as they are: the records' enums are
    StrEnums, and sqlite3 binds a subclass of str as text and a bool as an integer."""
    return _getter(type(record))(record)


def to_gemm(row: Row) -> Gemm:
    d = dict(row)
    d.update(
        trans_a=bool(d["trans_a"]),
        trans_b=bool(d["trans_b"]),
        policy=Policy(d["policy"]),
        state=GemmState(d["state"]),
    )
    return Gemm(**d)


def to_workunit(row: Row) -> WorkUnit:
    d = dict(row)
    d.update(
        trans_a=bool(d["trans_a"]),
        trans_b=bool(d["trans_b"]),
        accelerated=bool(d["accelerated"]),
        policy=Policy(d["policy"]),
        state=WuState(d["state"]),
    )
    return WorkUnit(**d)


def to_result(row: Row) -> Result:
    d = dict(row)
    d.update(
        server_state=ServerState(d["server_state"]),
        outcome=Outcome(d["outcome"]),
        validate_state=ValidateState(d["validate_state"]),
        upload_tile=bool(d["upload_tile"]),
        has_tile=bool(d["has_tile"]),
    )
    return Result(**d)


def to_host(row: Row) -> Host:
    d = dict(row)
    d["quarantined"] = bool(d["quarantined"])
    d["gone"] = bool(d["gone"])
    return Host(**d)


class QueryStore(Store):
    """Every Store operation as named queries; drivers implement the four primitives."""

    @abc.abstractmethod
    async def _query(self, name: str, **values: Any) -> list[Row]:
        """Run a named query and return its rows."""

    @abc.abstractmethod
    async def _execute(self, name: str, **values: Any) -> None:
        """Run a named statement on its own (committed at once)."""

    @abc.abstractmethod
    async def _transaction(self, statements: list[tuple[str, list[Params]]]) -> None:
        """Run (name, rows) statements, each once per row, in one transaction. A row is a
        record's `values` for the statements of WRITES, named values for the rest."""

    async def commit(self, batch: Batch) -> None:
        if not batch:
            return
        # Parents before children, for the foreign keys.
        statements = [
            ("upsert_gemm", [values(g) for g in batch.gemms.values()]),
            ("upsert_host", [values(h) for h in batch.hosts.values()]),
            ("upsert_workunit", [values(w) for w in batch.workunits.values()]),
            ("upsert_result", [values(r) for r in batch.results.values()]),
            ("insert_event", [values(e) for e in batch.events]),  # the store numbers them
            ("insert_reply", [values(r) for r in batch.replies]),
        ]
        await self._transaction([(name, rows) for name, rows in statements if rows])

    async def load(self) -> Snapshot:
        hosts = [to_host(r) for r in await self._query("select_hosts")]
        gemms = [to_gemm(r) for r in await self._query("select_active_gemms")]
        workunits, results = [], []
        for gemm in gemms:
            wus, res = await self.gemm_work(gemm.id)
            workunits += wus
            results += res
        return Snapshot(
            hosts=hosts,
            gemms=gemms,
            workunits=workunits,
            results=results,
            workunit_counts=await self.workunit_counts(),
            invalid_count=await self.invalid_count(),
            last_gemm_step=(await self._query("select_last_gemm_step"))[0]["step"],
        )

    async def gemm(self, gemm_id: str) -> Gemm | None:
        rows = await self._query("select_gemm", id=gemm_id)
        return to_gemm(rows[0]) if rows else None

    async def gemm_work(self, gemm_id: str) -> tuple[list[WorkUnit], list[Result]]:
        wus = await self._query("select_workunits_of_gemm", gemm_id=gemm_id)
        res = await self._query("select_results_of_gemm", gemm_id=gemm_id)
        return [to_workunit(r) for r in wus], [to_result(r) for r in res]

    async def result(self, result_id: str) -> Result | None:
        rows = await self._query("select_result", id=result_id)
        return to_result(rows[0]) if rows else None

    async def reply(self, host_id: int, request_id: str) -> bytes | None:
        rows = await self._query("select_reply", host_id=host_id, request_id=request_id)
        return bytes(rows[0]["body"]) if rows else None

    async def prune_replies(self, before: float, keep: int) -> None:
        await self._execute("prune_replies", before=before, keep=keep)

    async def reply_count(self) -> int:
        return (await self._query("count_replies"))[0]["n"]

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
        rows = await self._query(
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
        old = {r["blob"] for r in await self._query("select_blobs_through_step", step=through_step)}
        live = {r["blob"] for r in await self._query("select_blobs_after_step", step=through_step)}
        return old - live

    async def mark_pruned(self, through_step: int) -> None:
        await self._execute("mark_gemms_pruned", step=through_step)

    async def events_through(self, step: int, before: float = math.inf) -> list[Event]:
        rows = await self._query("select_events_through_step", step=step, before=before)
        return [Event(**dict(r)) for r in rows]

    async def workunits_through(self, step: int) -> list[WorkUnit]:
        rows = await self._query("select_workunits_through_step", step=step)
        return [to_workunit(r) for r in rows]

    async def panel_steps(self) -> dict[str, int]:
        return {r["panel"]: r["step"] for r in await self._query("select_panel_steps")}

    async def purge(self, through_step: int, events_before: float = math.inf) -> None:
        step = [{"step": through_step}]
        await self._transaction(
            [
                ("add_purged_workunits", step),
                ("add_purged_invalid", step),
                ("delete_results_through_step", step),
                ("delete_workunits_through_step", step),
                ("delete_gemms_through_step", step),
                ("delete_events_through_step", [{"step": through_step, "before": events_before}]),
            ]
        )

    async def recent_events(self, kind: str, state: str, limit: int) -> list[Event]:
        rows = await self._query("select_recent_events", kind=kind, state=state, limit=limit)
        return [Event(**dict(r)) for r in rows]

    async def workunit_counts(self) -> dict[str, int]:
        return {r["state"]: r["n"] for r in await self._query("count_workunits_by_state")}

    async def invalid_count(self) -> int:
        return (await self._query("count_invalid_results"))[0]["n"]
