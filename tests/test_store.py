"""The SQLite store: every field of every record survives a commit and a reload."""

from __future__ import annotations

import dataclasses

from coordinator.state.sqlite import SqliteStore
from coordinator.state.store import Batch
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


async def test_every_changed_field_survives_a_reload(tmp_path):
    gemm, host, wu, result = records()
    store = SqliteStore(tmp_path / "state.db")
    await store.open()
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
    await store.close()
    store = SqliteStore(tmp_path / "state.db")
    await store.open()
    snapshot = await store.load()
    assert snapshot.gemms == [gemm]
    assert snapshot.workunits == [changed_wu]
    assert snapshot.results == [changed_result]
    assert snapshot.hosts == [changed_host]
    (logged,) = await store.events()
    assert dataclasses.replace(logged, id=None) == event
    await store.commit(Batch({gemm.id: gemm.evolve(state=GemmState.DONE)}))
    assert (await store.load()).gemms == []
    assert (await store.gemm(gemm.id)).state is GemmState.DONE
    await store.close()
