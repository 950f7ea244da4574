"""The Store contract: every driver (SQLite, in memory) passes the same tests.

The in-memory store answers the named queries of queries.sql in Python; these tests, run
against both, and the check that it answers every name, keep the fake from drifting."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import re
import sqlite3

import pytest

from coordinator.state import queries, reader
from coordinator.state.memory import MemoryStore
from coordinator.state.queries import load_queries
from coordinator.state.sqlite import SqliteStore
from coordinator.state.store import Batch, Reply
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

HASH = "ab" * 32


class Driver:
    """One store driver, opened; `reopen` is a restart (the in-memory one keeps its tables)."""

    def __init__(self, kind: str, tmp_path) -> None:
        self.kind, self.path = kind, tmp_path / "state.db"
        self.memory = MemoryStore()

    def make(self):
        return SqliteStore(self.path) if self.kind == "sqlite" else self.memory

    async def reopen(self, store):
        await store.close()
        store = self.make()
        await store.open()
        return store


@pytest.fixture(params=["sqlite", "memory"])
async def driver(request, tmp_path):
    return Driver(request.param, tmp_path)


@pytest.fixture
async def store(driver):
    store = driver.make()
    await store.open()
    yield store
    await store.close()


def records():
    gemm = Gemm("g" * 64, 3, "l0.fwd", 8, 8, 4, False, True, 4, HASH, HASH, Policy.BOTH)
    host = Host(1, "h", "t" * 64, 1.0, 2.0)
    wu = WorkUnit(
        "w" * 64,
        gemm.id,
        3,
        0,
        4,
        0,
        4,
        4,
        HASH,
        HASH,
        False,
        True,
        1,
        Policy.BOTH,
        2,
        2,
        4,
        8,
        60.0,
    )
    result = Result("r" * 32, wu.id, host_id=1)
    return gemm, host, wu, result


async def test_every_changed_field_survives_a_reload(driver, store):
    gemm, host, wu, result = records()
    await store.commit(Batch({gemm.id: gemm}, {wu.id: wu}, {result.id: result}, {1: host}))
    # Change every mutable field, as the scheduler, transitioner and validator do.
    changed_wu = wu.evolve(
        target_nresults=1,
        min_quorum=1,
        state=WuState.VALIDATED,
        canonical_result=result.id,
        canonical_hash=HASH,
        error_mask=2,
        transition_time=123.5,
        accelerated=True,
    )
    changed_result = result.evolve(
        server_state=ServerState.OVER,
        outcome=Outcome.SUCCESS,
        validate_state=ValidateState.VALID,
        upload_tile=False,
        sent_time=1.0,
        received_time=2.0,
        report_deadline=3.0,
        output_hash=HASH,
        has_tile=True,
        error="e",
    )
    changed_host = host.evolve(
        last_contact=9.0,
        gflops=5.0,
        threads=2,
        max_memory_mb=7,
        consecutive_valid=3,
        valid_count=4,
        invalid_count=1,
        error_count=2,
        max_in_progress=6,
        quarantined=True,
    )
    event = Event(1.0, "wu", "validated", "why", 3, gemm.id, wu.id, result.id, 1)
    await store.commit(
        Batch({}, {wu.id: changed_wu}, {result.id: changed_result}, {1: changed_host}, [event])
    )
    store = await driver.reopen(store)
    snapshot = await store.load()
    assert snapshot.gemms == [gemm]
    assert snapshot.workunits == [changed_wu]
    assert snapshot.results == [changed_result]
    assert snapshot.hosts == [changed_host]
    (logged,) = await store.events()
    assert logged.evolve(id=None) == event
    await store.commit(Batch({gemm.id: gemm.evolve(state=GemmState.DONE)}))
    assert (await store.load()).gemms == []
    assert (await store.gemm(gemm.id)).state is GemmState.DONE
    await store.close()


async def test_stored_replies_are_pruned_by_age_and_by_count_per_host(store):
    _, host, _, _ = records()
    await store.commit(Batch(hosts={1: host, 2: dataclasses.replace(host, id=2, token_hash="u")}))
    replies = [
        Reply(host, f"req-{host}-{i}", float(i), b"body") for host in (1, 2) for i in range(6)
    ]
    await store.commit(Batch(replies=replies))
    assert await store.reply_count() == 12
    await store.prune_replies(before=1.0, keep=3)  # the oldest by age, then all but 3 newest
    assert await store.reply_count() == 6
    assert await store.reply(1, "req-1-5") == b"body"
    assert await store.reply(1, "req-1-2") is None  # past the newest three
    assert await store.reply(2, "req-2-0") is None  # too old
    await store.prune_replies(before=5.0, keep=3)
    assert await store.reply_count() == 2


async def test_blobs_of_finished_steps_are_prunable_unless_a_later_product_uses_them(store):
    gemm, host, wu, result = records()
    done = gemm.evolve(state=GemmState.DONE)
    tile = "cd" * 32
    later = dataclasses.replace(gemm, id="h" * 64, step=9)
    later_wu = dataclasses.replace(wu, id="x" * 64, gemm_id=later.id, step=9, b_panel=tile)
    finished = result.evolve(output_hash=tile, has_tile=True, outcome=Outcome.SUCCESS)
    await store.commit(
        Batch(
            {done.id: done, later.id: later},
            {wu.id: wu, later_wu.id: later_wu},
            {result.id: finished},
            {1: host},
        )
    )
    assert await store.prunable_blobs(through_step=3) == set()  # both are panels of step 9
    await store.mark_pruned(through_step=3)
    assert (await store.gemm(gemm.id)).state is GemmState.PRUNED
    assert (await store.gemm(later.id)).state is GemmState.ACTIVE


async def test_blobs_are_listed_until_marked_pruned_and_a_failed_products_too(store):
    """Marked only once the files are deleted: a kill in between lists them again at the
    next checkpoint, rather than leave them on disk for good. A failed product is never
    run again by its id, so its blobs go too; a pruned one keeps none alive."""
    gemm, host, wu, _ = records()
    failed = dataclasses.replace(gemm, id="f" * 64, state=GemmState.FAILED)
    failed_wu = dataclasses.replace(wu, id="y" * 64, gemm_id=failed.id, a_panel="ef" * 32)
    done = gemm.evolve(state=GemmState.DONE)
    await store.commit(
        Batch(
            {done.id: done, failed.id: failed}, {wu.id: wu, failed_wu.id: failed_wu}, {}, {1: host}
        )
    )
    blobs = {wu.a_panel, wu.b_panel, failed_wu.a_panel}
    assert await store.prunable_blobs(through_step=3) == blobs
    assert await store.prunable_blobs(through_step=3) == blobs  # killed before marking
    await store.mark_pruned(through_step=3)
    assert (await store.gemm(gemm.id)).state is GemmState.PRUNED
    assert (await store.gemm(failed.id)).state is GemmState.FAILED
    assert await store.prunable_blobs(through_step=3) == {failed_wu.a_panel, wu.b_panel}


async def test_events_filter_and_counts(store):
    gemm, host, wu, result = records()
    invalid = result.evolve(validate_state=ValidateState.INVALID)
    events = [
        Event(1.0, "wu", "created", "a", 3, gemm.id, wu.id),
        Event(2.0, "validation", "invalid", "b", 3, gemm.id, wu.id, result.id, 1),
        Event(3.0, "validation", "invalid", "c", 4, gemm.id, wu.id, result.id, 1),
    ]
    await store.commit(Batch({gemm.id: gemm}, {wu.id: wu}, {result.id: invalid}, {1: host}, events))
    assert [e.message for e in await store.events(kind="validation")] == ["b", "c"]
    assert [e.message for e in await store.events(step=3)] == ["a", "b"]
    assert [e.message for e in await store.events(after=1, limit=1)] == ["b"]
    assert [e.message for e in await store.recent_events("validation", "invalid", 5)] == ["c", "b"]
    assert await store.workunit_counts() == {"active": 1}
    assert await store.invalid_count() == 1


def test_the_memory_store_answers_every_query_the_store_sends_and_no_other():
    """The store's queries are the named blocks that queries.py sends; the rest of
    queries.sql is the read-only reader's, which runs on SQLite alone."""
    sent = {name for name in load_queries() if f'"{name}"' in inspect.getsource(queries)}
    read = {name for name in load_queries() if f'"{name}"' in inspect.getsource(reader)}
    answered = {
        name.removesuffix("_run")
        for name, _ in inspect.getmembers(MemoryStore, inspect.isfunction)
        if name.endswith("_run")
    }
    assert answered == sent
    assert sent | read == set(load_queries())  # no named query is left unused


def test_every_write_binds_each_column_to_its_records_field():
    """A write's values are a record's fields in order (queries.values), so the column list
    and the numbered parameters of each write must name the same field, one by one."""
    sql = load_queries()
    for name, record_type in queries.WRITES.items():
        found = re.search(r"INTO \w+ \((.*?)\)\s*VALUES \((.*?)\)", sql[name], re.S)
        assert found, name
        cols = [c.strip() for c in found.group(1).split(",")]
        numbers = [int(p.strip().removeprefix("?")) for p in found.group(2).split(",")]
        fields = queries.columns(record_type)
        assert [fields[n - 1] for n in numbers] == cols, name
        unbound = set(fields) - set(cols)
        assert unbound <= {"id"} and (not unbound or record_type is Event), name


async def test_sqlite_stores_enums_as_text_and_flags_as_integers(tmp_path):
    """Records pass their StrEnums and bools to SQLite as they are; what lands must be the
    plain text and integers that the read-only reader and other tools query."""
    store = SqliteStore(tmp_path / "state.db")
    await store.open()
    gemm, host, wu, result = records()
    await store.commit(Batch({gemm.id: gemm}, {wu.id: wu}, {result.id: result}, {1: host}))
    await store.close()
    db = sqlite3.connect(tmp_path / "state.db")
    row = db.execute(
        "SELECT typeof(policy), policy, typeof(trans_b), trans_b, state FROM workunits"
    ).fetchone()
    assert row == ("text", "both", "integer", 1, "active")
    assert db.execute("SELECT upload_tile, server_state FROM results").fetchone() == (
        1,
        "unsent",
    )
    db.close()


async def test_a_stream_of_commits_keeps_the_wal_bounded(tmp_path, monkeypatch):
    """The coordinator commits hundreds of times a second; the store's own checkpoints must
    complete between them, so that the WAL starts over instead of growing until a commit
    (on the event loop) has to checkpoint it."""
    from coordinator.state import sqlite as sqlite_store

    monkeypatch.setattr(sqlite_store, "CHECKPOINT_EVERY", 0.02)
    store = SqliteStore(tmp_path / "state.db")
    await store.open()
    gemm, host, wu, _ = records()
    wal, largest = tmp_path / "state.db-wal", 0
    try:
        for burst in range(40):
            for i in range(25):
                events = [Event(float(i), "wu", "created", "x" * 500, burst, gemm.id, wu.id)] * 20
                await store.commit(Batch({gemm.id: gemm}, {wu.id: wu}, {}, {1: host}, events))
            largest = max(largest, wal.stat().st_size)
            await asyncio.sleep(0.03)  # a pause between bursts, as a server's loop has
        written = (tmp_path / "state.db").stat().st_size + wal.stat().st_size
    finally:
        await store.close()
    # 20,000 events of half a kilobyte went through the WAL, about a burst at a time.
    assert written > 10 << 20
    assert largest < written / 4, (largest, written)


async def test_results_an_older_coordinator_wrote_unsent_are_dropped_on_upgrade(tmp_path):
    """Results are now first written when assigned, and their host kept from that first
    row on (a result is one assignment to one host). An unsent result's row from before
    would never take the host it is assigned to: schema 5 drops such rows, and the
    transitioner issues those replicas again, as for any replica not yet sent."""
    path = tmp_path / "state.db"
    store = SqliteStore(path)
    await store.open()
    gemm, host, wu, result = records()
    sent = result.evolve(server_state=ServerState.IN_PROGRESS)
    unsent = Result("u" * 32, wu.id)
    await store.commit(
        Batch({gemm.id: gemm}, {wu.id: wu}, {sent.id: sent, unsent.id: unsent}, {1: host})
    )
    await store.close()
    db = sqlite3.connect(path)
    # As the coordinator before this schema left it (without schema 7's column too).
    db.execute("ALTER TABLE hosts DROP COLUMN gone")
    db.execute("PRAGMA user_version = 4")
    db.commit()
    db.close()
    store = SqliteStore(path)
    await store.open()
    try:
        assert [r.id for r in (await store.load()).results] == [sent.id]
        # From here on a result's host is the one its first row took.
        await store.commit(Batch(results={sent.id: sent.evolve(host_id=None, error="e")}))
        (kept,) = (await store.load()).results
        assert (kept.host_id, kept.error) == (1, "e")
    finally:
        await store.close()


async def test_an_upgraded_projects_log_reads_as_before_and_goes_on(tmp_path):
    """Schema 6 drops the events' kind and step indexes: a project's log from before reads
    the same by kind and by step, and new events follow the old ones."""
    path = tmp_path / "state.db"
    store = SqliteStore(path)
    await store.open()
    gemm, host, wu, _ = records()
    old = [
        Event(1.0, "wu", "validated", "quorum", 1, gemm.id, wu.id),
        Event(2.0, "host", "registered", "host 1 'a'", host_id=1),
        Event(3.0, "wu", "assimilated", "tile written", 1, gemm.id, wu.id),
    ]
    await store.commit(Batch({gemm.id: gemm}, {wu.id: wu}, {}, {1: host}, old))
    await store.close()
    db = sqlite3.connect(path)
    db.execute("CREATE INDEX events_kind ON events(kind, id)")  # as schema 5 left them
    db.execute("CREATE INDEX events_step ON events(step)")
    db.execute("ALTER TABLE hosts DROP COLUMN gone")  # schema 7's
    db.execute("PRAGMA user_version = 5")
    db.commit()
    db.close()
    store = SqliteStore(path)
    await store.open()
    try:
        assert [e.state for e in await store.events(kind="wu")] == ["validated", "assimilated"]
        assert [e.state for e in await store.events(step=1)] == ["validated", "assimilated"]
        await store.commit(Batch(events=[Event(4.0, "gemm", "done", "done", 1, gemm.id)]))
        events = await store.events()
        assert [e.time for e in events] == [1.0, 2.0, 3.0, 4.0]
        assert events[-1].id > events[-2].id
        db = sqlite3.connect(path)
        indexes = db.execute(
            "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'events'"
        ).fetchall()
        db.close()
        assert not [name for (name,) in indexes if not name.startswith("sqlite_")]
    finally:
        await store.close()


async def test_a_commit_of_hundreds_of_events_keeps_each_whole_and_in_order(store):
    """The SQLite store binds many events a statement (256, then powers of two): every
    event of a large commit comes back whole, numbered in the order it was logged."""
    gemm, host, wu, result = records()
    events = [
        Event(
            float(i), "result", f"s{i}", f"m{i}", i % 7, gemm.id, wu.id, result.id, 1, data=f"{i}"
        )
        for i in range(256 + 64 + 32 + 5)
    ]
    await store.commit(Batch({gemm.id: gemm}, {wu.id: wu}, {result.id: result}, {1: host}, events))
    logged = await store.events(limit=1000)
    assert [e.evolve(id=None) for e in logged] == events
    ids = [e.id for e in logged]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)


async def test_panel_steps_are_the_newest_step_of_each_stored_panel(store):
    gemm, host, wu, _ = records()
    later = wu.evolve(id="v" * 64, step=7, b_panel="b" * 64)
    await store.commit(Batch({gemm.id: gemm}, {wu.id: wu, later.id: later}, {}, {1: host}))
    assert await store.panel_steps() == {HASH: 7, "b" * 64: 7}
