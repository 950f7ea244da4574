"""The engine alone: a Coordinator over the in-memory store, driven by in-process hosts.

No HTTP, no SQLite: the parts are called as the server calls them, so these tests pin the
engine's own behaviour (publish, assign, report, validate, assimilate, prune)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gzip
import json
import logging
import math
import re
import time
import types

import msgpack
import numpy as np
import pytest

import kernels
from coordinator.cli import serve
from coordinator.engine import retention
from coordinator.engine.config import CoordinatorConfig
from coordinator.engine.coordinator import Coordinator
from coordinator.rules.scheduler import SchedulerConfig
from coordinator.state.memory import MemoryStore
from coordinator.work.protocol import RegisterRequest, ReportRequest, ResultReport, WorkRequest
from coordinator.work.records import (
    Gemm,
    GemmState,
    Policy,
    Redundancy,
    Result,
    ServerState,
    new_result_id,
    tile_workunit,
)
from tests.factories import bits, operands
from tests.volunteers import wait_until


async def honest_host(
    co: Coordinator, name: str, stop: asyncio.Event, behaviour: str = "honest"
) -> int:
    """Ask (long-polling), compute with the real kernel, report, until stopped; returns how
    many results it reported. An "error" host reports a client error for everything it
    gets; an "abandon" host gives everything back and asks again, naming its panels cached
    to steer the scheduler back to the same work."""
    host, _ = await co.hosts.register(RegisterRequest(name, 10.0, 1, 512), time.time())
    reported, cached = 0, ()
    while not stop.is_set():
        request = WorkRequest(f"{name}-{reported}-{time.monotonic_ns()}", 8, cached, (), None, True)
        reply = msgpack.unpackb((await co.requests.request_work(host, request, time.time())).body)
        entries = []
        for a in reply["assignments"]:
            if behaviour == "error":
                entries.append(ResultReport(a["result_id"], None, None, "out of memory", 0.0))
                continue
            if behaviour == "abandon":
                entries.append(ResultReport(a["result_id"], None, None, None, 0.0, True))
                cached = (a["a"], a["b"])
                continue
            tile = kernels.gemm(
                co.blobs.get_array(a["a"]),
                co.blobs.get_array(a["b"]),
                trans_a=a["trans_a"],
                trans_b=a["trans_b"],
            )
            blob = kernels.encode_array(tile)
            upload = blob if a["upload"] == "tile" else None
            entries.append(ResultReport(a["result_id"], kernels.blob_id(blob), upload, None, 0.0))
        if entries:
            await co.reports.report(host, ReportRequest(tuple(entries)), time.time())
            reported += len(entries)
    return reported


@pytest.fixture
async def engine(tmp_path):
    config = CoordinatorConfig(
        directory=tmp_path, tile=16, policy=Policy.QUORUM, seed=1, long_poll=0.05
    )
    co = Coordinator(config, MemoryStore())
    await co.start()
    yield co
    await co.stop()


def test_result_ids_are_distinct_hex_and_lead_with_the_time():
    ids = [new_result_id() for _ in range(2000)]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    assert [i[:11] for i in ids] == sorted(i[:11] for i in ids)


@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (False, True), (True, False)])
async def test_a_product_computed_by_two_hosts_has_the_kernels_bits(engine, rng, trans_a, trans_b):
    a, b = operands(rng, 40, 24, 33, trans_a, trans_b)
    stop = asyncio.Event()
    hosts = [asyncio.create_task(honest_host(engine, f"h{i}", stop)) for i in range(2)]
    product = await asyncio.wait_for(
        engine.products.matmul(a, b, trans_a=trans_a, trans_b=trans_b, label="x"), 30
    )
    stop.set()
    reported = await asyncio.gather(*hosts)
    expected = kernels.gemm(a, b, trans_a=trans_a, trans_b=trans_b)
    np.testing.assert_array_equal(bits(product), bits(expected))
    assert reported == [6, 6]  # quorum: each host computed one replica of each of 3x2 tiles
    assert engine.products.outputs == {}  # the finished product left memory
    await engine.ledger.flush()
    assert await engine.store.workunit_counts() == {"assimilated": 6}
    # Status counts the whole project from memory, as the store does.
    assert engine.progress.full_status()["workunits"] == {"assimilated": 6}
    # Each verdict says how it was reached and what it did to its host's trust, in the
    # fields `tilehive logs validation` shows: each host's run of valid results grows by one.
    verdicts = await engine.store.events(kind="validation")
    assert len(verdicts) == 12
    runs: dict[int, list[tuple[int, int]]] = {}
    for event in verdicts:
        data = json.loads(event.data)
        assert data.keys() == {"method", "compared", "trust_before", "trust_after"}
        assert (data["method"], data["compared"], event.state) == ("quorum", 2, "valid")
        runs.setdefault(event.host_id, []).append((data["trust_before"], data["trust_after"]))
    assert sorted(runs.values()) == [[(i, i + 1) for i in range(6)]] * 2


async def test_stored_work_replies_are_pruned_by_age_and_count(engine, rng):
    a, b = operands(rng, 32, 32, 8, False, False)
    stop = asyncio.Event()
    hosts = [asyncio.create_task(honest_host(engine, f"h{i}", stop)) for i in range(2)]
    await asyncio.wait_for(engine.products.matmul(a, b), 30)
    stop.set()
    await asyncio.gather(*hosts)
    await engine.ledger.flush()
    stored = await engine.store.reply_count()
    assert stored > 0  # replies that assigned work were stored for retries
    await engine.requests.prune_replies(time.time())
    assert await engine.store.reply_count() == stored  # young, and under the count
    await engine.requests.prune_replies(time.time() + engine.config.reply_ttl + 1)
    assert await engine.store.reply_count() == 0


async def test_hosts_that_err_on_a_work_unit_cannot_stop_the_product(engine, rng):
    """Five fresh hosts each take a replica and report an error: the work unit's error
    budget runs out, the coordinator computes the tile itself, and the product is exact."""
    a, b = operands(rng, 16, 16, 8, False, False)  # one tile
    stop = asyncio.Event()
    product = asyncio.create_task(engine.products.matmul(a, b))
    liars = [asyncio.create_task(honest_host(engine, f"e{i}", stop, "error")) for i in range(6)]
    result = await asyncio.wait_for(product, 30)
    stop.set()
    await asyncio.gather(*liars)
    np.testing.assert_array_equal(bits(result), bits(kernels.gemm(a, b)))
    await engine.ledger.flush()
    events = await engine.store.events(kind="wu")
    assert any(e.state == "exhausted" and "too many errors" in e.message for e in events)
    assert any("computed by the coordinator" in e.message for e in events)
    assert sum(1 for h in engine.ledger.hosts.values() if h.error_count) >= 5  # they pay


async def test_a_host_never_gets_back_a_tile_it_handed_back(tmp_path, rng):
    """Under Freivalds one replica decides; a host that gives its tile back and asks again
    (naming the panels as cached) is not given the same work unit again, so it cannot spend
    the work unit's budget; an honest host then computes it."""
    config = CoordinatorConfig(
        directory=tmp_path, tile=16, policy=Policy.FREIVALDS, seed=1, long_poll=0.05
    )
    co = Coordinator(config, MemoryStore())
    await co.start()
    try:
        a, b = operands(rng, 16, 16, 8, False, False)
        stop = asyncio.Event()
        product = asyncio.create_task(co.products.matmul(a, b))
        quitter = asyncio.create_task(honest_host(co, "quitter", stop, "abandon"))
        await wait_until(lambda: co.stats["work_requests"] >= 5)
        assert not product.done()  # nobody else may compute it yet
        honest = asyncio.create_task(honest_host(co, "honest", stop))
        result = await asyncio.wait_for(product, 30)
        stop.set()
        handed_back, computed = await asyncio.gather(quitter, honest)
        assert handed_back == 1  # given once, never again
        assert computed == 1
        np.testing.assert_array_equal(bits(result), bits(kernels.gemm(a, b)))
    finally:
        await co.stop()


async def computed_then_blobs_lost(
    config: CoordinatorConfig, store: MemoryStore, a: np.ndarray, b: np.ndarray
) -> np.ndarray:
    """A @ B computed by a coordinator over `store`, which then stops and loses every blob.
    Returns the product."""
    co = Coordinator(config, store)
    await co.start()
    stop = asyncio.Event()
    host = asyncio.create_task(honest_host(co, "h", stop))
    product = await asyncio.wait_for(co.products.matmul(a, b), 30)
    stop.set()
    await host
    await co.stop()
    lose_every_blob(config)
    return product


async def published_then_stopped(
    config: CoordinatorConfig, store: MemoryStore, a: np.ndarray, b: np.ndarray
) -> None:
    """A @ B published by a coordinator over `store`, which stops before anyone computes it."""
    co = Coordinator(config, store)
    await co.start()
    pending = asyncio.create_task(co.products.matmul(a, b))
    await wait_until(lambda: co.ledger.unsent)
    await co.stop()
    pending.cancel()


@contextlib.asynccontextmanager
async def with_two_hosts(config: CoordinatorConfig, store: MemoryStore):
    """A coordinator started over `store` (restarted, as after a stop) with two honest hosts
    asking it for work, until the block ends."""
    again = Coordinator(config, store)
    await again.start()
    stop = asyncio.Event()
    hosts = [asyncio.create_task(honest_host(again, f"h{i}", stop)) for i in range(2)]
    try:
        yield again
    finally:
        stop.set()
        await asyncio.gather(*hosts)
        await again.stop()


async def computed_by_two_hosts(
    config: CoordinatorConfig, store: MemoryStore, a: np.ndarray, b: np.ndarray, step: int = 0
) -> np.ndarray:
    """A @ B (of `step`) by a coordinator started over `store` and two honest hosts."""
    async with with_two_hosts(config, store) as co:
        return await asyncio.wait_for(co.products.matmul(a, b, step=step), 30)


async def test_a_product_new_to_this_run_costs_no_lookup_and_one_made_before_is_looked_up(
    tmp_path, rng
):
    """Only the coordinator writes products, and it holds each in memory until it forgets
    it: a product of a step newer than any stored, and not forgotten in this run, needs no
    trip to the store. After a restart, or once forgotten, a product is looked up there."""
    config = CoordinatorConfig(
        directory=tmp_path, tile=16, policy=Policy.QUORUM, seed=1, long_poll=0.05
    )
    store = MemoryStore()
    looked_up: list[str] = []
    lookup = store.gemm

    async def counted(gemm_id: str) -> Gemm | None:
        looked_up.append(gemm_id)
        return await lookup(gemm_id)

    store.gemm = counted
    a, b = operands(rng, 32, 16, 8, False, False)
    expected = bits(kernels.gemm(a, b))
    np.testing.assert_array_equal(
        bits(await computed_by_two_hosts(config, store, a, b, step=3)), expected
    )
    assert looked_up == []
    (made,) = store.tables["gemms"]
    async with with_two_hosts(config, store) as again:
        assert again.ledger.stored_through == 3
        # Step 3 is in the store: looked up (its tiles left with its panels: run again).
        product = await asyncio.wait_for(again.products.matmul(a, b, step=3), 30)
        np.testing.assert_array_equal(bits(product), expected)
        assert looked_up[0] == made
        # Step 4 is new: no lookup. Asked for again once forgotten, it is looked up.
        seen = len(looked_up)
        await asyncio.wait_for(again.products.matmul(a, b, step=4), 30)
        assert len(looked_up) == seen
        product = await asyncio.wait_for(again.products.matmul(a, b, step=4), 30)
        np.testing.assert_array_equal(bits(product), expected)
        assert len(looked_up) > seen
        # A checkpoint's pruning lets go of what this run forgot: the store has the word.
        again.ledger.forget_steps(4)
        assert again.ledger.may_be_stored("any", 4) and not again.ledger.may_be_stored("any", 5)


async def test_replicas_not_yet_sent_are_not_written_and_are_issued_again_after_a_restart(
    tmp_path, rng
):
    """An unsent replica promises nothing to anyone: the store holds a result from the moment
    it is sent. A coordinator stopped before any was sent comes back, issues the replicas
    again, and the product has the kernel's bits."""
    config = CoordinatorConfig(
        directory=tmp_path, tile=16, policy=Policy.QUORUM, seed=1, long_poll=0.05
    )
    store = MemoryStore()
    a, b = operands(rng, 32, 16, 8, False, False)
    await published_then_stopped(config, store, a, b)
    (gemm,) = store.tables["gemms"].values()
    workunits, results = await store.gemm_work(gemm["id"])
    assert len(workunits) == 2 and results == []
    product = await computed_by_two_hosts(config, store, a, b)
    np.testing.assert_array_equal(bits(product), bits(kernels.gemm(a, b)))
    _, results = await store.gemm_work(gemm["id"])
    assert len(results) == 4 and all(r.server_state.value == "over" for r in results)


async def test_replicas_sent_before_a_restart_time_out_after_it(tmp_path, rng):
    """A replica's deadline is written with it; its work unit's transition time, which a
    send only moves earlier, is not (Ledger.reschedule). A coordinator restarted while a
    host that went silent holds replicas still times them out and has them computed
    again, and the product has the kernel's bits."""
    config = CoordinatorConfig(
        directory=tmp_path,
        tile=16,
        policy=Policy.QUORUM,
        seed=1,
        long_poll=0.05,
        scheduler=SchedulerConfig(deadline_floor=0.3, deadline_slack=0.0),
    )
    store = MemoryStore()
    a, b = operands(rng, 32, 16, 8, False, False)
    co = Coordinator(config, store)
    await co.start()
    pending = asyncio.create_task(co.products.matmul(a, b))
    await wait_until(lambda: co.ledger.unsent)
    await co.ledger.flush()  # published: the sends below only move the transition times
    sent = set()
    for name in ("silent-1", "silent-2"):  # each takes one replica of each work unit
        host, _ = await co.hosts.register(RegisterRequest(name, 10.0, 1, 512), time.time())
        request = WorkRequest(name, 8, (), (), None, False)
        reply = (await co.requests.request_work(host, request, time.time())).body
        sent |= {a["result_id"] for a in msgpack.unpackb(reply)["assignments"]}
    assert len(sent) == 4  # every replica: no report will touch these work units
    await co.stop()
    pending.cancel()
    product = await computed_by_two_hosts(config, store, a, b)
    np.testing.assert_array_equal(bits(product), bits(kernels.gemm(a, b)))
    (gemm,) = store.tables["gemms"].values()
    _, results = await store.gemm_work(gemm["id"])
    assert {r.outcome.value for r in results if r.id in sent} == {"no_reply"}


async def test_a_replica_reported_before_its_row_is_written_is_late_not_unknown(tmp_path):
    """A spare sent just before its product finished can come back before the commit that
    writes it lands, its product already out of memory: it is a late report (200), not an
    unknown result (404, which a volunteer counts as an error)."""
    co = Coordinator(CoordinatorConfig(directory=tmp_path, tile=4, seed=1), MemoryStore())
    await co.start()
    try:
        host, _ = await co.hosts.register(RegisterRequest("spare", 10.0, 1, 512), time.time())
        await co.ledger.flush()
        now = time.time()
        gemm = Gemm("g" * 64, 1, "l0", 4, 4, 4, False, False, 4, "a" * 64, "b" * 64, Policy.QUORUM)
        wu = tile_workunit(gemm, (0, 4, 0, 4), "a" * 64, "b" * 64, Redundancy(), 1)
        spare = Result(
            new_result_id(),
            wu.id,
            host_id=host.id,
            server_state=ServerState.IN_PROGRESS,
            sent_time=now,
            report_deadline=now + 60,
        )
        co.ledger.put_gemm(gemm)
        co.ledger.put_wu(wu)
        co.ledger.put_result(spare)  # queued: the reply that sent it has just left
        co.ledger.put_gemm(gemm.evolve(state=GemmState.DONE))
        co.ledger.forget_gemm(gemm.id)  # the product finished meanwhile
        report = ReportRequest((ResultReport(spare.id, "c" * 64, None, None, 0.01),))
        summary = await co.reports.report(host, report, time.time())
        assert summary["late"] == [spare.id]
    finally:
        await co.stop()


def lose_every_blob(config: CoordinatorConfig) -> None:
    """What a power cut (or a kill) may do to the blob store: blobs are never synced."""
    for blob in list((config.directory / "blobs").rglob("*")):
        if blob.is_file():
            blob.unlink()


async def test_blobs_lost_to_a_power_cut_are_stored_or_computed_again(tmp_path, rng):
    """Blobs are not synced: a power cut may take a finished product's tiles and panels while
    the database keeps the product. Asked for again, the product is exact: panels come back
    from the operands, tiles from the kernel."""
    config = CoordinatorConfig(directory=tmp_path, tile=16, policy=Policy.FREIVALDS, seed=1)
    store = MemoryStore()
    a, b = operands(rng, 32, 32, 8, False, False)
    first = await computed_then_blobs_lost(config, store, a, b)
    again = Coordinator(config, store)
    await again.start()
    try:
        second = await asyncio.wait_for(again.products.matmul(a, b), 30)
    finally:
        await again.stop()
    np.testing.assert_array_equal(bits(second), bits(first))
    np.testing.assert_array_equal(bits(second), bits(kernels.gemm(a, b)))


async def test_a_product_made_before_a_kill_keeps_the_panels_it_shares_with_a_new_one(
    tmp_path, rng, monkeypatch
):
    """After a kill a finished product's tiles are gone and its panels may be only in the
    memory of a new product with the same weight (another micro-batch). The new one letting
    go of them (done, or dropped) while the old one recomputes its tiles must not delete
    them under it: the old product holds its panels too."""
    config = CoordinatorConfig(
        directory=tmp_path, tile=16, policy=Policy.FREIVALDS, seed=1, long_poll=0.05
    )
    store = MemoryStore()
    a, b = operands(rng, 32, 32, 8, False, False)
    other, _ = operands(rng, 32, 32, 8, False, False)
    first = await computed_then_blobs_lost(config, store, a, b)
    again = Coordinator(config, store)
    await again.start()
    pending = asyncio.create_task(again.products.matmul(other, b))  # shares b's panels
    try:
        await wait_until(lambda: again.ledger.unsent)
        (new,) = again.ledger.gemms.values()
        fill = again.products._fill

        def fill_once_the_new_one_let_go(out, wus):
            again.products._let_go(new.id)
            fill(out, wus)

        monkeypatch.setattr(again.products, "_fill", fill_once_the_new_one_let_go)
        second = await asyncio.wait_for(again.products.matmul(a, b), 30)
    finally:
        pending.cancel()
        await again.stop()
    np.testing.assert_array_equal(bits(second), bits(first))


async def test_a_product_restored_unfinished_keeps_its_panels_for_the_volunteers(tmp_path, rng):
    """Volunteers fetch a restored product's panels before the training loop asks for it
    again: a new product with the same weight letting go of them meanwhile must not delete
    them."""
    config = CoordinatorConfig(
        directory=tmp_path, tile=16, policy=Policy.FREIVALDS, seed=1, long_poll=0.05
    )
    store = MemoryStore()
    a, b = operands(rng, 32, 32, 8, False, False)
    other, _ = operands(rng, 32, 32, 8, False, False)
    await published_then_stopped(config, store, a, b)  # a clean stop writes the panels
    again = Coordinator(config, store)
    await again.start()
    try:
        (restored,) = again.ledger.gemms.values()
        panels = {
            p for wu in again.ledger.workunits_for(restored.id) for p in (wu.a_panel, wu.b_panel)
        }
        pending = asyncio.create_task(again.products.matmul(other, b))
        await wait_until(lambda: len(again.ledger.gemms) == 2)
        (new,) = [g for g in again.ledger.gemms.values() if g.id != restored.id]
        again.products.drop(new, "dropped by the test", time.time())
        assert all(again.blobs.has(p) and not again.blobs.released(p) for p in panels)
        # Computed at last, the restored product lets go of every hold it took.
        stop = asyncio.Event()
        host = asyncio.create_task(honest_host(again, "h", stop))
        result = await asyncio.wait_for(again.products.matmul(a, b), 30)
        stop.set()
        await host
        assert all(again.blobs.released(p) for p in panels)
        assert not again.products.held
    finally:
        pending.cancel()
        await again.stop()
    np.testing.assert_array_equal(bits(result), bits(kernels.gemm(a, b)))


async def test_an_active_product_whose_blobs_a_power_cut_took_is_run_again(tmp_path, rng):
    """A restarted coordinator drops an unfinished product whose panels are gone (as if it
    had failed in an earlier run); asked for again, it is published anew and exact."""
    config = CoordinatorConfig(
        directory=tmp_path, tile=16, policy=Policy.FREIVALDS, seed=1, long_poll=0.05
    )
    store = MemoryStore()
    a, b = operands(rng, 32, 32, 8, False, False)
    await published_then_stopped(config, store, a, b)
    lose_every_blob(config)
    unsent = await computed_after_restart(config, store, a, b)
    assert unsent == 0  # nothing of the lost product was handed out


async def computed_after_restart(config, store, a: np.ndarray, b: np.ndarray) -> int:
    """A @ B asked of a coordinator restarted over `store`, with an honest host: bitwise
    the kernel's. Returns how many results were unsent at the restart, before the ask."""
    again = Coordinator(config, store)
    await again.start()
    try:
        before = len(again.ledger.unsent)
        stop = asyncio.Event()
        host = asyncio.create_task(honest_host(again, "h", stop))
        result = await asyncio.wait_for(again.products.matmul(a, b), 30)
        stop.set()
        await host
    finally:
        await again.stop()
    np.testing.assert_array_equal(bits(result), bits(kernels.gemm(a, b)))
    return before


async def test_a_product_lost_at_several_stops_is_said_once_with_what_happens_to_it(
    tmp_path, rng, caplog
):
    """Killed three times, a restart said a line for each earlier attempt ("failed in an
    earlier run ... attempt 2", "... attempt 3", ...), and said "running it again" of one it
    resumed."""
    caplog.set_level(logging.INFO, logger="coordinator.engine.products")
    config = CoordinatorConfig(
        directory=tmp_path, tile=16, policy=Policy.FREIVALDS, seed=1, long_poll=0.05
    )
    store = MemoryStore()
    a, b = operands(rng, 32, 32, 8, False, False)
    for _ in range(2):  # published, then its blobs lost at a stop, twice
        await published_then_stopped(config, store, a, b)
        lose_every_blob(config)
    await published_then_stopped(config, store, a, b)  # the third attempt, in flight
    caplog.clear()
    await computed_after_restart(config, store, a, b)
    said = [r.getMessage() for r in caplog.records if "earlier run" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].endswith(
        "did not finish in 2 earlier runs (its panels or tiles, held in memory, were lost at "
        "a stop); resuming attempt 3, in flight at the stop"
    ), said


async def test_a_product_restored_but_not_asked_for_again_is_let_go_after_its_step(tmp_path, rng):
    """A product in flight at a stop, which training does not ask for again (a version
    that names products otherwise gives them other ids), went on to volunteers until a
    checkpoint purged its step."""
    config = CoordinatorConfig(directory=tmp_path, tile=16, policy=Policy.FREIVALDS, seed=1)
    store = MemoryStore()
    a, b = operands(rng, 32, 32, 8, False, False)
    await published_then_stopped(config, store, a, b)  # at step 0, its label ""
    again = Coordinator(config, store)
    await again.start()
    try:
        (restored,) = again.ledger.gemms.values()
        await wait_until(lambda: again.ledger.unsent)  # handed out, though nothing awaits it
        assert again.products.drop_unasked(restored.step - 1, time.time()) == 0  # not yet
        assert again.products.drop_unasked(restored.step, time.time()) == 1
        assert not again.ledger.unsent
        await again.ledger.flush()
        assert (await again.store.gemm(restored.id)).state is GemmState.FAILED
    finally:
        await again.stop()


@contextlib.asynccontextmanager
async def crowd(tmp_path, size: int):
    """A coordinator allowing idle hosts 10 asks a second, and `size` registered hosts;
    yields it and an `ask(host, tag, in_progress=())` that returns the reply's map."""
    config = CoordinatorConfig(
        directory=tmp_path, tile=16, policy=Policy.FREIVALDS, no_work_delay=0.25, long_poll=0.0
    )
    co = Coordinator(dataclasses.replace(config, idle_asks_per_s=10.0), MemoryStore())
    await co.start()

    async def ask(host, tag: str, in_progress: tuple[str, ...] = ()) -> dict:
        request = WorkRequest(f"r{host.id}-{tag}", 1, (), in_progress, None, False)
        return msgpack.unpackb((await co.requests.request_work(host, request, time.time())).body)

    try:
        register = co.hosts.register
        hosts = [
            (await register(RegisterRequest(f"h{i}", 10.0, 1, 512), time.time()))[0]
            for i in range(size)
        ]
        yield co, hosts, ask
    finally:
        await co.stop()


async def test_a_crowd_larger_than_the_work_is_asked_to_spread_its_asks(tmp_path, rng):
    """Many hosts without work are told to wait longer, together asking about
    `idle_asks_per_s` times a second, and why; a host given work is no longer idle."""
    async with crowd(tmp_path, 30) as (co, hosts, ask):
        replies = [await ask(host, "first") for host in hosts]
        assert [r["delay"] for r in replies[:2]] == [0.25, 0.25]  # few idle: soon again
        assert replies[-1]["delay"] == pytest.approx(3.0, abs=0.01)  # 30 idle, 10 asks a s
        assert "more volunteers than work" in replies[-1]["note"]
        assert "note" not in replies[0]
        pending = asyncio.create_task(co.products.matmul(*operands(rng, 16, 16, 8, False, False)))
        await wait_until(lambda: co.ledger.unsent)
        given = await ask(hosts[0], "given")
        assert given["assignments"] and given["delay"] == 0
        computing = (given["assignments"][0]["result_id"],)
        assert not (await ask(hosts[0], "ahead", computing))["assignments"]  # not idle
        assert (await ask(hosts[1], "again"))["delay"] == pytest.approx(2.9, abs=0.01)  # 29 idle
        pending.cancel()


async def test_a_host_asking_alone_takes_its_share_of_a_product_not_all_of_it(tmp_path, rng):
    """Four hosts in contact, of eight threads each, one asking for up to 16 results of a
    product of 16 tiles while the others are busy: it gets its share, four, not all sixteen
    it asked for (its quota allows them). Each of the others, asking after, gets four too:
    the product is spread over all of them rather than queued on the first."""
    async with crowd(tmp_path, 0) as (co, _, _):
        register = co.hosts.register
        hosts = [
            (await register(RegisterRequest(f"h{i}", 10.0, 8, 512), time.time()))[0]
            for i in range(4)
        ]
        pending = asyncio.create_task(co.products.matmul(*operands(rng, 64, 64, 8, False, False)))
        await wait_until(lambda: len(co.ledger.unsent) == 16)

        async def ask(host) -> list[str]:
            request = WorkRequest(f"r{host.id}", 16, (), (), None, False)
            answer = await co.requests.request_work(host, request, time.time())
            return [a["result_id"] for a in msgpack.unpackb(answer.body)["assignments"]]

        given = [await ask(host) for host in hosts]
        assert [len(g) for g in given] == [4, 4, 4, 4]
        assert not co.ledger.unsent
        pending.cancel()


async def test_a_host_holding_its_share_is_given_more_as_soon_as_it_reports(tmp_path, rng):
    """A crowd of four; the other three never ask. The one that does holds its share of a
    product of four tiles, one, and asks ahead while it computes, waiting for work: told
    why it gets nothing more yet, its ask waits, and its report wakes it with the next
    tile at once rather than after the long poll (30 s here)."""
    config = CoordinatorConfig(
        directory=tmp_path, tile=16, policy=Policy.FREIVALDS, seed=1, long_poll=30.0
    )
    co = Coordinator(config, MemoryStore())
    await co.start()
    try:
        register = co.hosts.register
        hosts = [
            (await register(RegisterRequest(f"h{i}", 10.0, 8, 512), time.time()))[0]
            for i in range(4)
        ]
        host = hosts[0]
        product = asyncio.create_task(co.products.matmul(*operands(rng, 32, 32, 8, False, False)))
        await wait_until(lambda: len(co.ledger.unsent) == 4)

        async def ask(tag: str, in_progress: tuple[str, ...], wait: bool) -> dict:
            request = WorkRequest(f"r-{tag}", 8, (), in_progress, None, wait)
            answer = await co.requests.request_work(host, request, time.time())
            return msgpack.unpackb(answer.body)

        first = await ask("first", (), False)
        assert len(first["assignments"]) == 1
        held = first["assignments"][0]
        told = await ask("told", (held["result_id"],), False)
        assert told["assignments"] == []
        assert "holds its share" in told["note"]

        ahead = asyncio.create_task(ask("ahead", (held["result_id"],), True))
        await wait_until(lambda: co.requests.waiters.hosts == 1)  # its ask waits
        tile = kernels.encode_array(
            kernels.gemm(co.blobs.get_array(held["a"]), co.blobs.get_array(held["b"]))
        )
        entry = ResultReport(held["result_id"], kernels.blob_id(tile), tile, None, 0.0)
        await co.reports.report(host, ReportRequest((entry,)), time.time())
        woken = await asyncio.wait_for(ahead, 10.0)
        assert len(woken["assignments"]) == 1
        assert woken["assignments"][0]["result_id"] != held["result_id"]
        product.cancel()
        await asyncio.gather(product, return_exceptions=True)
    finally:
        await co.stop()


async def test_a_finished_coordinator_waits_for_hosts_it_told_to_wait_long(tmp_path, monkeypatch):
    """Before it exits, a finished coordinator waits for the hosts in contact to hear it:
    past its grace when it told a crowd of idle hosts to wait longer than that."""
    monkeypatch.setattr(serve, "FINISH_GRACE", 1.0)
    async with crowd(tmp_path, 20) as (co, hosts, ask):
        delays = [(await ask(host, "first"))["delay"] for host in hosts]
        assert delays[-1] == pytest.approx(2.0, abs=0.01)  # 20 idle hosts, 10 asks a second
        co.requests.finish()

        async def ask_after_its_delay() -> None:  # as the volunteer does
            await asyncio.sleep(delays[-1])
            await ask(hosts[-1], "again")

        asking = asyncio.create_task(ask_after_its_delay())
        for host in hosts[:-1]:  # the others ask again at once
            await ask(host, "again")
        await serve.tell_volunteers(co, asyncio.Event())
        assert hosts[-1].id in co.requests.told  # it waited for the last one
        await asking


async def test_an_idle_hosts_ask_does_not_wait_for_a_commit(tmp_path, monkeypatch):
    """A reply without work promises nothing: it is not held back until the store has
    committed (10,000 idle hosts would queue behind every commit)."""
    config = CoordinatorConfig(directory=tmp_path, tile=16, long_poll=0.0)
    co = Coordinator(config, MemoryStore())
    await co.start()
    try:
        host, _ = await co.hosts.register(RegisterRequest("h", 10.0, 1, 512), time.time())
        release = asyncio.Event()
        commit = co.store.commit

        async def stuck_commit(batch):
            await release.wait()
            await commit(batch)

        monkeypatch.setattr(co.store, "commit", stuck_commit)
        co.ledger.put_host(host.evolve(gflops=11.0))
        stuck = asyncio.create_task(co.ledger.flush())
        request = WorkRequest("r1", 1, (), (), None, False)
        answer = await asyncio.wait_for(co.requests.request_work(host, request, time.time()), 10)
        assert msgpack.unpackb(answer.body)["assignments"] == []
        assert not stuck.done()
    finally:
        release.set()
        await co.stop()


async def test_a_commit_cancelled_half_way_still_lands(tmp_path):
    """A stop cancels the passes, maybe while they commit: what they decided is committed
    all the same, never dropped with the cancelled task."""
    from coordinator.state.ledger import Ledger
    from coordinator.work.events import Event

    store = MemoryStore()
    entered, release = asyncio.Event(), asyncio.Event()
    commit = store.commit

    async def slow_commit(batch):
        entered.set()
        await release.wait()
        await commit(batch)

    store.commit = slow_commit
    ledger = Ledger(store)
    ledger.log([Event(1.0, "gemm", "failed", "decided just before the stop")])
    flushing = asyncio.create_task(ledger.flush())
    await entered.wait()
    flushing.cancel()
    release.set()
    with contextlib.suppress(asyncio.CancelledError):
        await flushing
    assert [e.message for e in await store.events()] == ["decided just before the stop"]


async def test_the_promises_of_replies_a_few_milliseconds_apart_share_one_commit(monkeypatch):
    """A reply's promise is due PROMISE_WINDOW after it leaves, and the replies leaving
    meanwhile join that commit without putting it off; after the commit, the next promise
    opens a window of its own."""
    from coordinator.engine.passes import COMMIT_WINDOW, PROMISE_WINDOW
    from coordinator.state import ledger as ledgers
    from coordinator.work.events import Event

    clock = [100.0]
    # The ledger's clock only: the event loop keeps the real one.
    monkeypatch.setattr(ledgers, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    ledger = ledgers.Ledger(MemoryStore())

    def due() -> float:
        return ledger.commit_due_in(COMMIT_WINDOW, PROMISE_WINDOW)

    assert due() == math.inf  # nothing queued
    ledger.log([Event(1.0, "result", "in_progress", "a pass's decision")])
    assert due() == pytest.approx(COMMIT_WINDOW)  # decided, promised to nobody
    ledger.commit_soon()  # the first reply that promises it leaves
    assert due() == pytest.approx(PROMISE_WINDOW)
    clock[0] += PROMISE_WINDOW / 2
    ledger.log([Event(1.0, "result", "over", "a report accepted")])
    ledger.commit_soon()  # a second reply, half a window later: the same commit
    assert due() == pytest.approx(PROMISE_WINDOW / 2)
    clock[0] = 100.0 + PROMISE_WINDOW  # the first promise's window is over
    assert due() == 0
    await ledger.flush()
    assert due() == math.inf
    ledger.log([Event(1.0, "result", "in_progress", "the next reply's assignment")])
    ledger.commit_soon()  # a new window from this promise, not the last commit's
    assert due() == pytest.approx(PROMISE_WINDOW)


async def test_a_reply_promising_work_is_committed_after_the_window_not_by_the_next_pass(
    tmp_path, rng, monkeypatch
):
    """Two hosts given work one after the other: the pass each reply wakes commits
    nothing, and once the window of the first reply is over, one commit holds both
    assignments."""
    from coordinator.engine import passes

    # Both windows long beside a pass, for a slow CI (a commit is due at the sooner).
    monkeypatch.setattr(passes, "PROMISE_WINDOW", 1.0)
    monkeypatch.setattr(passes, "COMMIT_WINDOW", 2.0)
    async with crowd(tmp_path, 2) as (co, hosts, ask):
        pending = asyncio.create_task(co.products.matmul(*operands(rng, 32, 16, 8, False, False)))
        await wait_until(lambda: len(co.ledger.unsent) == 2)
        await co.ledger.flush()  # the product's publication
        commits: list = []
        commit = co.store.commit

        async def counted(batch):
            commits.append(batch)
            await commit(batch)

        monkeypatch.setattr(co.store, "commit", counted)
        passes_run: list[float] = []
        promised_after: list[int] = []  # passes run when each promise woke the passes
        after_pass, on_promise = co.passes.after_pass, co.ledger.on_promise

        def noted(now: float) -> None:
            after_pass(now)
            passes_run.append(now)

        def promised() -> None:
            promised_after.append(len(passes_run))
            on_promise()

        co.passes.after_pass, co.ledger.on_promise = noted, promised
        first = (await ask(hosts[0], "a"))["assignments"]
        # The pass the promise woke (its commit, if any, follows before it yields).
        await wait_until(lambda: promised_after and len(passes_run) > promised_after[0])
        assert commits == [], "the next pass committed the promise"
        second = (await ask(hosts[1], "b"))["assignments"]
        await wait_until(lambda: commits)
        assert len(commits) == 1
        given = {a["result_id"] for a in first + second}
        assert len(given) == 2 and given <= set(commits[0].results)
        pending.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pending


@pytest.mark.parametrize("keep_recent", [False, True], ids=["a minute on", "at once"])
async def test_a_checkpoint_purges_earlier_steps_and_archives_their_events(
    tmp_path, rng, monkeypatch, keep_recent
):
    """After a checkpoint the rows of the steps before the previous checkpoint go (the
    database stays bounded however long a project runs); their events go to
    DIR/logs/events.jsonl.gz first, and the project's totals stay whole. The last
    minute's events stay for a later purge: status counts its tiles a second over them."""
    config = CoordinatorConfig(directory=tmp_path, tile=16, policy=Policy.QUORUM, seed=1)
    co = Coordinator(config, MemoryStore())
    await co.start()
    stop = asyncio.Event()
    hosts = [asyncio.create_task(honest_host(co, f"h{i}", stop)) for i in range(2)]
    try:
        for step in (1, 2, 3):
            a, b = operands(rng, 32, 16, 8, False, False)
            await asyncio.wait_for(co.products.matmul(a, b, step=step), 30)
        await co.ledger.flush()
        totals = await co.store.workunit_counts()
        await co.retention.prune(1)  # rows are purged one checkpoint behind
        assert {w["step"] for w in co.store.tables["workunits"].values()} == {1, 2, 3}
        if keep_recent:
            await co.retention.prune(2)
            assert {w["step"] for w in co.store.tables["workunits"].values()} == {2, 3}
            assert await co.store.events_through(1)  # all of the last minute: kept
            assert not (tmp_path / "logs" / "events.jsonl.gz").exists()  # nor archived yet
            return
        monkeypatch.setattr(retention, "RECENT_EVENTS", 0.0)  # as if a minute had passed
        await co.retention.prune(2)
    finally:
        stop.set()
        await asyncio.gather(*hosts)
        await co.stop()
    store = co.store
    assert {w["step"] for w in store.tables["workunits"].values()} == {2, 3}
    assert {g["step"] for g in store.tables["gemms"].values()} == {2, 3}
    assert await store.events_through(1) == []
    assert await store.workunit_counts() == totals == {"assimilated": 6}
    with gzip.open(tmp_path / "logs" / "events.jsonl.gz", "rt") as f:
        archived = [json.loads(line) for line in f]
    assert {e["step"] for e in archived} == {1}
    assert any(e["kind"] == "validation" and e["state"] == "valid" for e in archived)


async def test_a_blob_store_that_cannot_be_written_is_why_work_waits(engine):
    """The blob writer's failure is said once, as the reason work waits, and clears with it."""
    engine.blobs.failure = OSError(28, "No space left on device")
    now = time.time()
    engine.waiting.check(now)  # a new reason counts on the second look in a row
    assert engine.waiting.check(now + 1)
    wait = engine.waiting.current
    assert wait.reason == "storage"
    assert "cannot be written (No space left on device)" in wait.message
    engine.blobs.failure = None
    assert engine.waiting.check(now + 2) and engine.waiting.current is None


async def test_a_wait_that_changed_reasons_flows_again_after_all_of_it(engine, caplog):
    """Said once, without "work waits: work waits"; when work flows it says how long the
    whole wait was (it said the last reason's 7 s of a 52-s wait)."""
    caplog.set_level(logging.INFO, logger="coordinator.engine.waiting")
    engine.blobs.failure = OSError(28, "No space left on device")
    now = time.time()
    engine.waiting.check(now)
    assert engine.waiting.check(now + 1) and engine.waiting.reason == "storage"
    engine.requests.paused = True  # the operator's pause counts at once
    assert engine.waiting.check(now + 40) and engine.waiting.reason == "paused"
    engine.requests.paused = False
    engine.blobs.failure = None
    assert engine.waiting.check(now + 53) and engine.waiting.current is None
    said = [r.getMessage() for r in caplog.records]
    assert "work flows again (it waited 52s: paused)" in said, said
    assert any(m.startswith("work waits for the blob store") for m in said), said
    assert not any("work waits: work waits" in m for m in said)


@pytest.mark.parametrize(
    ("round_trip", "expected", "order"),
    [
        (0.001, 1, ["mb0 resumed", "host answered", "mb1 resumed"]),  # on loopback
        (0.030, 2, ["mb0 resumed", "mb1 resumed", "host answered"]),  # 30 ms away
    ],
)
async def test_a_waiting_host_gets_the_first_micro_batchs_next_product_before_the_second_runs(
    tmp_path, rng, round_trip, expected, order
):
    """Two micro-batches' products reported together, with an ask for more work riding on
    the report (as the volunteer sends them), and validated in one pass: the first one's
    next product answers the ask before the second micro-batch resumes, so the host
    computes it while the coordinator does the second's element-wise work
    (Products.finish hands each product over), instead of both going out together. A host
    far away (a round trip over twice the loop's time between products) waits for the
    second's product too: one round trip for both."""
    config = CoordinatorConfig(
        directory=tmp_path, tile=64, policy=Policy.FREIVALDS, seed=1, long_poll=30
    )
    co = Coordinator(config, MemoryStore())
    await co.start()
    try:
        host, _ = await co.hosts.register(RegisterRequest("h", 10.0, 1, 512), time.time())
        co.products.between = 0.002  # as measured on tiny-gpt's loop
        happened: list[str] = []
        w = rng.standard_normal((16, 16)).astype(np.float32)

        async def micro_batch(i: int) -> None:
            x = rng.standard_normal((8, 16)).astype(np.float32)
            y = await co.products.matmul(x, w, step=1, label=f"mb{i} first")
            happened.append(f"mb{i} resumed")
            await co.products.matmul(y, w, step=1, label=f"mb{i} next")

        chains = [asyncio.create_task(micro_batch(i)) for i in range(2)]
        await wait_until(lambda: len(co.ledger.unsent) == 2)
        ask = WorkRequest("first", 2, (), (), None, True)
        reply = msgpack.unpackb((await co.requests.request_work(host, ask, time.time())).body)
        assert len(reply["assignments"]) == 2  # both micro-batches' first products
        entries = []
        for a in reply["assignments"]:
            tile = kernels.gemm(co.blobs.get_array(a["a"]), co.blobs.get_array(a["b"]))
            blob = kernels.encode_array(tile)
            entries.append(ResultReport(a["result_id"], kernels.blob_id(blob), blob, None, 0.0))
        await co.ledger.flush()  # the answer's promise, committed while the host computed
        # As server/api.py answers a report that asks for work: report, then long-poll.
        more = WorkRequest("next", 2, (), (), None, True, round_trip)
        await co.reports.report(host, ReportRequest(tuple(entries), more), time.time())
        # Awaited in this task, as the server's handler does (long_poll bounds the wait).
        answer = await co.requests.request_work(host, more, time.time())
        happened.append("host answered")
        assert len(msgpack.unpackb(answer.body)["assignments"]) == expected
        await wait_until(lambda: len(happened) == 3)
        assert happened == order
        assert co.products.between != 0.002  # measured again: mb0's next product came
        for chain in chains:
            chain.cancel()
        await asyncio.gather(*chains, return_exceptions=True)
    finally:
        await co.stop()


def test_tiles_per_second_is_the_last_minutes_tiles_over_a_minute(monkeypatch):
    """As `status` from the files counts it (results of the last 60 s over 60), so the
    coordinator's figure agrees with it, a quiet spell included."""
    from coordinator.engine.progress import Progress
    from coordinator.state.ledger import Ledger

    stats = {"tiles_in": 0}
    progress = Progress(Ledger(store=None), stats)
    clock = [1000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    for second in range(30):  # 10 tiles a second for 30 s, sampled after each pass
        stats["tiles_in"] += 10
        progress.sample_rate(1000.0 + second)
    clock[0] = 1029.0
    assert progress.tiles_per_second() == 300 / 60
    clock[0] = 1080.0  # 51 s without a tile: the burst's 9 last seconds left in the minute
    assert progress.tiles_per_second() == (300 - 210) / 60
