"""A host's uplink, as the coordinator times its reports: what it is, and what it changes
(deadlines of the results a report may carry, why work waits)."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest

import kernels
from coordinator.engine.config import CoordinatorConfig
from coordinator.engine.coordinator import Coordinator
from coordinator.engine.uplinks import FREE_PER_BYTE, MIN_SAMPLE, STALE, Uplinks
from coordinator.engine.waiting import explain
from coordinator.state.memory import MemoryStore
from coordinator.work.protocol import RegisterRequest, ReportRequest, ResultReport, WorkRequest
from coordinator.work.records import Policy
from tests.factories import operands


def test_only_bodies_large_enough_to_time_are_timed():
    uplinks = Uplinks()
    now = time.time()
    uplinks.timed(1, MIN_SAMPLE - 1, 10.0, now)  # its time is the loop's, not the link's
    assert uplinks.rate(1) is None and uplinks.per_byte(1) == 0.0
    uplinks.timed(1, 1_000_000, 10.0, now)
    assert uplinks.rate(1) == pytest.approx(100_000)
    assert uplinks.per_byte(1) == pytest.approx(1e-5)


def test_an_uplink_follows_its_latest_reports():
    uplinks = Uplinks()
    uplinks.timed(1, 1_000_000, 10.0, time.time())  # 100 KB/s
    for _ in range(20):
        uplinks.timed(1, 1_000_000, 1.0, time.time())  # then 1 MB/s
    assert uplinks.rate(1) == pytest.approx(1e6, rel=0.01)


def test_an_uplink_not_timed_for_long_is_unknown_and_its_next_report_taken_as_it_is():
    """A laptop taken from home to the office: an average from long ago says little. Kept,
    a link timed slow would get no tile large enough to be timed again."""
    uplinks = Uplinks()
    uplinks.timed(1, 1_000_000, 10.0, now=0.0)  # 100 KB/s
    uplinks.timed(1, 1_000_000, 1.0, now=STALE)  # 1 MB/s, while the average is fresh
    assert uplinks.rate(1, now=STALE) == pytest.approx(1 / (0.7e-5 + 0.3e-6))
    assert uplinks.per_byte(1, now=2 * STALE) == pytest.approx(0.7e-5 + 0.3e-6)
    assert uplinks.per_byte(1, now=2 * STALE + 1) == 0.0  # not timed for too long: unknown
    assert uplinks.rate(1, now=2 * STALE + 1) is None
    uplinks.timed(1, 1_000_000, 1.0, now=2 * STALE + 1)  # after the long silence
    assert uplinks.rate(1, now=2 * STALE + 1) == pytest.approx(1e6)


def test_a_fast_uplink_counts_as_free():
    """Loopback or a LAN, read by a busy loop at tens of MB/s: deadlines and tiles stay as
    they were."""
    uplinks = Uplinks()
    uplinks.timed(1, 8_000_000, 8_000_000 * FREE_PER_BYTE / 2, time.time())
    assert uplinks.rate(1) == pytest.approx(2 / FREE_PER_BYTE)
    assert uplinks.per_byte(1) == 0.0
    assert uplinks.typical([1, 2]) == 0.0


async def started(tmp_path, tile: int = 16) -> Coordinator:
    config = CoordinatorConfig(
        directory=tmp_path, tile=tile, policy=Policy.FREIVALDS, long_poll=0.05
    )
    co = Coordinator(config, MemoryStore())
    await co.start()
    return co


async def test_the_results_a_report_may_carry_are_leased_while_it_arrives(tmp_path, rng):
    """A host's first tiles go out before its uplink is known, with deadlines of seconds.
    While a report arrives, each sign of it leases the results the host held when it began
    the deadline floor from then (a result given to it later is not its to carry): they
    time out only once the report stops coming."""
    co = await started(tmp_path)
    try:
        host, _ = await co.hosts.register(RegisterRequest("h", 10.0, 1, 512), time.time())
        a, b = operands(rng, 32, 16, 16, True, False)
        product = asyncio.create_task(co.products.matmul(a, b, trans_a=True, label="x"))
        await asyncio.wait_for(_published(co), 10)
        request = WorkRequest("r1", 1, (), (), None, False)
        answer = await co.requests.request_work(host, request, time.time())
        (first,) = msgpack.unpackb(answer.body)["assignments"]
        sent = co.ledger.results[first["result_id"]]
        began = time.time()
        # The report is still arriving 100 s on: the result is due 5 s after that.
        co.reports.arriving(host.id, began, began + 100.0)
        assert co.ledger.results[first["result_id"]].report_deadline == began + 105.0
        assert sent.report_deadline < began + 10  # as it was sent
        # Given after the report began: not leased.
        second = WorkRequest("r2", 1, (), (first["result_id"],), None, False)
        answer = await co.requests.request_work(host, second, time.time())
        (later,) = msgpack.unpackb(answer.body)["assignments"]
        due = co.ledger.results[later["result_id"]].report_deadline
        co.reports.arriving(host.id, began, began + 101.0)
        assert co.ledger.results[later["result_id"]].report_deadline == due
        product.cancel()
    finally:
        await co.stop()


async def test_the_crowds_cost_line_takes_out_a_tiles_upload_not_its_panels(tmp_path, rng):
    """A result back 0.5 s after it was sent, 1 ms of it computing, from a host whose
    uplink takes 0.12 s for the 12 KB tile: 0.38 s is what a tile costs beyond its
    arithmetic and its upload. The panels' 18 KB came down, not up."""
    co = await started(tmp_path, tile=64)
    try:
        host, _ = await co.hosts.register(RegisterRequest("h", 10.0, 1, 512), time.time())
        co.uplinks.timed(host.id, 1_000_000, 10.0, time.time())  # 100 KB/s
        a, b = operands(rng, 64, 48, 40, True, False)
        product = asyncio.create_task(co.products.matmul(a, b, trans_a=True, label="x"))
        await asyncio.wait_for(_published(co), 10)
        request = WorkRequest("r1", 1, (), (), None, False)
        (assignment,) = msgpack.unpackb(
            (await co.requests.request_work(host, request, time.time())).body
        )["assignments"]
        tile = kernels.gemm(
            co.blobs.get_array(assignment["a"]), co.blobs.get_array(assignment["b"]), trans_a=True
        )
        blob = kernels.encode_array(tile)
        entry = ResultReport(assignment["result_id"], kernels.blob_id(blob), blob, None, 0.001)
        sent = co.ledger.results[assignment["result_id"]].sent_time
        await co.reports.report(host, ReportRequest((entry,)), sent + 0.5)
        overhead, _ = co.crowd.cost()
        assert overhead == pytest.approx(0.5 - 0.001 - 4 * 64 * 48 * 1e-5)
        await asyncio.wait_for(product, 10)
    finally:
        await co.stop()


async def test_a_tile_no_host_can_send_in_time_waits_says_why_then_goes_to_an_idle_one(
    tmp_path, rng
):
    """Work waits, and says why: the volunteer is told in its reply, the operator by the
    wait's reason (the log, status, the dashboard). Once the wait is said, a host with
    nothing queued on its uplink takes the tile all the same, due at delay_bound, rather
    than leave it unsent for ever (a product cut before any uplink was known)."""
    co = await started(tmp_path, tile=64)
    try:
        host, _ = await co.hosts.register(RegisterRequest("h", 10.0, 1, 512), time.time())
        # 100 B/s: a 16 KB tile takes 164 s
        co.uplinks.timed(host.id, 1_000_000, 10_000.0, time.time())
        a, b = operands(rng, 128, 64, 16, True, False)  # two tiles of 64 x 64
        product = asyncio.create_task(co.products.matmul(a, b, trans_a=True, label="x"))
        await asyncio.wait_for(_published(co), 10)
        request = WorkRequest("r1", 4, (), (), None, False)
        reply = msgpack.unpackb((await co.requests.request_work(host, request, time.time())).body)
        assert reply["assignments"] == []
        assert "uplink" in reply["note"] and "delay_bound" in reply["note"]
        wait = explain(co.ledger, False, time.time(), None, co._too_slow)
        assert wait is not None and wait.reason == "hosts_too_slow", wait
        assert "faster uplink" in wait.message
        now = time.time()
        while co.waiting.reason != "hosts_too_slow":  # two looks in a row say a wait
            co.waiting.check(now)
            assert time.time() - now < 10
        request = WorkRequest("r2", 4, (), (), None, False)
        reply = msgpack.unpackb((await co.requests.request_work(host, request, time.time())).body)
        (assignment,) = reply["assignments"]
        assert assignment["deadline_in"] == pytest.approx(60.0, abs=1.0)  # delay_bound
        again = WorkRequest("r3", 4, (), (assignment["result_id"],), None, False)
        reply = msgpack.unpackb((await co.requests.request_work(host, again, time.time())).body)
        assert reply["assignments"] == []  # one at a time: its uplink holds one already
        assert len(co.ledger.unsent) == 1
        product.cancel()
    finally:
        await co.stop()


async def _published(co: Coordinator) -> None:
    while not co.ledger.unsent:
        await asyncio.sleep(0.01)  # polled under the caller's deadline
