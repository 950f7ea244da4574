"""A host's uplink, as the coordinator times its reports: what it is, and what it changes
(deadlines of the results a report may carry, why work waits)."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest

from coordinator.engine.config import CoordinatorConfig
from coordinator.engine.coordinator import Coordinator
from coordinator.engine.uplinks import FREE_PER_BYTE, MIN_SAMPLE, Uplinks
from coordinator.engine.waiting import explain
from coordinator.state.memory import MemoryStore
from coordinator.work.protocol import RegisterRequest, WorkRequest
from coordinator.work.records import Policy
from tests.factories import operands


def test_only_bodies_large_enough_to_time_are_timed():
    uplinks = Uplinks()
    uplinks.timed(1, MIN_SAMPLE - 1, 10.0)  # its time is the loop's, not the link's
    assert uplinks.rate(1) is None and uplinks.per_byte(1) == 0.0
    uplinks.timed(1, 1_000_000, 10.0)
    assert uplinks.rate(1) == pytest.approx(100_000)
    assert uplinks.per_byte(1) == pytest.approx(1e-5)


def test_an_uplink_follows_its_latest_reports():
    uplinks = Uplinks()
    uplinks.timed(1, 1_000_000, 10.0)  # 100 KB/s
    for _ in range(20):
        uplinks.timed(1, 1_000_000, 1.0)  # then 1 MB/s
    assert uplinks.rate(1) == pytest.approx(1e6, rel=0.01)


def test_a_fast_uplink_counts_as_free():
    """Loopback or a LAN, read by a busy loop at tens of MB/s: deadlines and tiles stay as
    they were."""
    uplinks = Uplinks()
    uplinks.timed(1, 8_000_000, 8_000_000 * FREE_PER_BYTE / 2)
    assert uplinks.rate(1) == pytest.approx(2 / FREE_PER_BYTE)
    assert uplinks.per_byte(1) == 0.0
    assert uplinks.typical([1, 2]) == (0.0, 0.0)


async def started(tmp_path, tile: int = 16) -> Coordinator:
    config = CoordinatorConfig(
        directory=tmp_path, tile=tile, policy=Policy.FREIVALDS, long_poll=0.05
    )
    co = Coordinator(config, MemoryStore())
    await co.start()
    return co


async def test_the_results_a_slow_report_may_carry_do_not_time_out_while_it_arrives(tmp_path, rng):
    """A host's first tiles go out before its uplink is known, with deadlines of seconds.
    While a report arrives at 100 KB/s, the results it held when the report began are due
    only once the rest of it could have arrived (twice over, and the floor); a result
    given to it later is not."""
    co = await started(tmp_path)
    try:
        host, _ = await co.hosts.register(RegisterRequest("h", 10.0, 1, 512), time.time())
        a, b = operands(rng, 32, 16, 16, True, False)
        product = asyncio.create_task(co.products.matmul(a, b, trans_a=True, label="x"))
        await asyncio.wait_for(_published(co), 10)
        request = WorkRequest("r1", 1, (), (), None, False)
        answer = await co.requests.request_work(host, request, time.time())
        (first,) = msgpack.unpackb(answer.body)["assignments"]
        now = time.time()
        before = co.ledger.results[first["result_id"]].report_deadline
        # 2 MB of 12 arrived in 20 s, the report begun after the tile was sent: 10 MB to go
        # at 100 KB/s is 100 s, and its deadline 2 x 100 s + 5 s from now.
        co.reports.arriving(host.id, 2_000_000, 12_000_000, 20.0, now + 20.0)
        after = co.ledger.results[first["result_id"]].report_deadline
        assert before < now + 10
        assert after == pytest.approx(now + 20.0 + 2 * 100.0 + 5.0)
        # A report begun before the tile was sent cannot carry it.
        second = WorkRequest("r2", 1, (), (first["result_id"],), None, False)
        answer = await co.requests.request_work(host, second, time.time())
        (later,) = msgpack.unpackb(answer.body)["assignments"]
        due = co.ledger.results[later["result_id"]].report_deadline
        co.reports.arriving(host.id, 2_000_000, 12_000_000, 60.0, time.time())
        assert co.ledger.results[later["result_id"]].report_deadline == due
        product.cancel()
    finally:
        await co.stop()


async def test_once_the_uplink_is_known_a_tile_it_cannot_send_in_time_is_not_given_to_it(
    tmp_path, rng
):
    """Work waits, and says why: the volunteer is told in its reply, the operator by the
    wait's reason (the log, status, the dashboard)."""
    co = await started(tmp_path, tile=64)
    try:
        host, _ = await co.hosts.register(RegisterRequest("h", 10.0, 1, 512), time.time())
        co.uplinks.timed(host.id, 1_000_000, 10_000.0)  # 100 B/s: a 16 KB tile takes 164 s
        a, b = operands(rng, 64, 64, 16, True, False)
        product = asyncio.create_task(co.products.matmul(a, b, trans_a=True, label="x"))
        await asyncio.wait_for(_published(co), 10)
        request = WorkRequest("r1", 4, (), (), None, False)
        reply = msgpack.unpackb((await co.requests.request_work(host, request, time.time())).body)
        assert reply["assignments"] == []
        assert "uplink" in reply["note"] and "delay_bound" in reply["note"]
        wait = explain(co.ledger, False, time.time(), None, co._too_slow)
        assert wait is not None and wait.reason == "hosts_too_slow", wait
        assert "faster uplink" in wait.message
        product.cancel()
    finally:
        await co.stop()


async def _published(co: Coordinator) -> None:
    while not co.ledger.unsent:
        await asyncio.sleep(0.01)  # polled under the caller's deadline
