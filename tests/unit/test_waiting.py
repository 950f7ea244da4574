"""Why work waits, when the volunteers that could take it have gone quiet: killed, asleep
or cut off, they count as connected for a minute, and the operator heard nothing meanwhile."""

from __future__ import annotations

import asyncio
import logging
import time

import msgpack

from coordinator.engine.config import CoordinatorConfig
from coordinator.engine.coordinator import Coordinator
from coordinator.engine.requests import IDLE_DELAY_CAP
from coordinator.engine.waiting import CONNECTED_WITHIN, QUIET_AFTER, Wait, clock, explain
from coordinator.server.dashboard import host_condition
from coordinator.state.memory import MemoryStore
from coordinator.work.protocol import RegisterRequest, WorkRequest
from coordinator.work.records import Policy
from tests.factories import operands
from tests.volunteers import wait_until


async def test_work_a_quiet_volunteer_could_take_waits_for_it_and_says_so(tmp_path, rng):
    config = CoordinatorConfig(directory=tmp_path, tile=16, policy=Policy.FREIVALDS)
    co = Coordinator(config, MemoryStore())
    await co.start()
    try:
        host, _ = await co.hosts.register(RegisterRequest("h", 10.0, 1, 512), time.time())
        # It asks with no room (computing something else): told when to ask again.
        request = WorkRequest("r1", 0, (), (), None, False)
        reply = msgpack.unpackb((await co.requests.request_work(host, request, time.time())).body)
        asked = co.ledger.hosts[host.id].last_contact
        due = asked + reply["delay"]
        a, b = operands(rng, 32, 16, 16, True, False)
        product = asyncio.create_task(co.products.matmul(a, b, trans_a=True, label="x"))
        await wait_until(lambda: co.ledger.unsent, 10)
        # Within its backoff it will come: work flows.
        assert explain(co.ledger, False, due + QUIET_AFTER - 1, quiet=co._quiet) is None
        # Long past it, and a minute not yet gone: it has gone quiet, and that is why.
        now = due + QUIET_AFTER + 1
        assert now - asked < CONNECTED_WITHIN
        wait = explain(co.ledger, False, now, quiet=co._quiet)
        assert wait is not None and wait.reason == "hosts_quiet"
        assert f"not been heard from since {clock(asked)} " in wait.message
        assert f"counts as gone {CONNECTED_WITHIN:.0f}s after its last word" in wait.message
        # A volunteer that holds work is due by its deadlines instead, never quiet.
        request = WorkRequest("r2", 4, (), (), None, False)
        reply = msgpack.unpackb((await co.requests.request_work(host, request, time.time())).body)
        assert reply["assignments"]
        assert co._quiet(co.ledger.hosts[host.id], time.time() + 3 * QUIET_AFTER) == 0.0
        product.cancel()
    finally:
        await co.stop()


async def test_a_quiet_volunteer_does_not_hide_one_heard_from_that_may_take_the_work(tmp_path, rng):
    co = Coordinator(CoordinatorConfig(directory=tmp_path, tile=16), MemoryStore())
    await co.start()
    try:
        now = time.time()
        quiet, _ = await co.hosts.register(RegisterRequest("quiet", 10.0, 1, 512), now)
        awake, _ = await co.hosts.register(RegisterRequest("awake", 10.0, 1, 512), now)
        a, b = operands(rng, 32, 16, 16, True, False)
        product = asyncio.create_task(co.products.matmul(a, b, trans_a=True, label="x"))
        await wait_until(lambda: co.ledger.unsent, 10)
        later = now + 60  # both long past due, the first quiet still, the other just asked
        co.ledger.put_host(co.ledger.hosts[awake.id].evolve(last_contact=later - 1))
        co.requests.next_ask[quiet.id] = co.requests.next_ask[awake.id] = later - 1
        co.ledger.put_host(co.ledger.hosts[quiet.id].evolve(last_contact=later - 30))
        assert co._quiet(co.ledger.hosts[quiet.id], later) == 0.0  # told to come at later-1
        co.requests.next_ask[quiet.id] = later - 30
        assert co._quiet(co.ledger.hosts[quiet.id], later) == 30.0
        assert explain(co.ledger, False, later, quiet=co._quiet) is None  # work flows
        product.cancel()
    finally:
        await co.stop()


async def test_a_restarted_coordinator_gives_each_host_the_longest_delay_it_tells(tmp_path):
    """What a host was told before a restart is not known: it may be waiting out a delay of
    up to IDLE_DELAY_CAP, and is not called quiet before that has passed."""
    co = Coordinator(CoordinatorConfig(directory=tmp_path, tile=16), MemoryStore())
    await co.start()
    try:
        started = co.requests.started
        host, _ = await co.hosts.register(RegisterRequest("h", 10.0, 1, 512), started)
        co.ledger.put_host(co.ledger.hosts[host.id].evolve(last_contact=started - 50))
        host = co.ledger.hosts[host.id]
        assert co.requests.due_back(host) == started + IDLE_DELAY_CAP
        assert co._quiet(host, started + IDLE_DELAY_CAP + QUIET_AFTER - 1) == 0.0
        assert co._quiet(host, started + IDLE_DELAY_CAP + QUIET_AFTER + 1) > 0.0
    finally:
        await co.stop()


async def test_work_only_volunteers_paused_by_their_owners_could_take_waits_for_them(tmp_path, rng):
    """An `--idle-only` volunteer whose owner uses the machine says so now and then, asking
    for nothing: it is connected, not gone, and the operator hears why work waits."""
    co = Coordinator(CoordinatorConfig(directory=tmp_path, tile=16), MemoryStore())
    await co.start()
    try:
        host, _ = await co.hosts.register(RegisterRequest("h", 10.0, 1, 512), time.time())
        a, b = operands(rng, 32, 16, 16, True, False)
        product = asyncio.create_task(co.products.matmul(a, b, trans_a=True, label="x"))
        await wait_until(lambda: co.ledger.unsent, 10)
        paused = WorkRequest("r1", 0, (), (), None, False, paused=True)
        reply = msgpack.unpackb((await co.requests.request_work(host, paused, time.time())).body)
        assert reply["assignments"] == []
        looks = {"quiet": co._quiet, "owner_busy": co._owner_busy}
        wait = explain(co.ledger, False, time.time(), **looks)
        assert wait is not None and wait.reason == "hosts_paused"
        assert "paused while their owners use their machines (--idle-only)" in wait.message
        # Its words stop (killed while paused): it goes quiet like any other.
        later = co.requests.due_back(co.ledger.hosts[host.id]) + QUIET_AFTER + 1
        wait = explain(co.ledger, False, later, **looks)
        assert wait is not None and wait.reason == "hosts_quiet"
        # Its owner gone, it asks again: work flows.
        request = WorkRequest("r2", 0, (), (), None, False)
        await co.requests.request_work(host, request, time.time())
        assert explain(co.ledger, False, time.time(), **looks) is None
        product.cancel()
    finally:
        await co.stop()


async def test_products_are_cut_and_shared_for_the_volunteers_not_paused(tmp_path):
    """A paused volunteer in contact is no part of the crowd: the one still working takes
    a product's tiles as if alone, not half of them a round trip."""
    co = Coordinator(CoordinatorConfig(directory=tmp_path, tile=16), MemoryStore())
    await co.start()
    try:
        now = time.time()
        for name in ("worker", "paused"):
            host, _ = await co.hosts.register(RegisterRequest(name, 10.0, 1, 512), now)
            await co.requests.request_work(host, WorkRequest("r1", 0, (), (), None, False), now)
        assert co.crowd.crowd(now + 2).hosts == 2
        paused = WorkRequest("r2", 0, (), (), None, False, paused=True)
        await co.requests.request_work(host, paused, now)
        assert co.crowd.crowd(now + 4).hosts == 1
        await co.requests.request_work(host, WorkRequest("r3", 0, (), (), None, False), now)
        assert co.crowd.crowd(now + 6).hosts == 2
    finally:
        await co.stop()


async def test_a_volunteer_that_registered_but_never_asked_does_not_make_work_flow(
    tmp_path, rng, caplog
):
    """Killed between registering and its first ask (or a script that only registers), it
    took no work: it is no volunteer connected, and the log said "work flows again" at its
    registration, then that it had gone quiet 40 s later. Its first ask counts."""
    caplog.set_level(logging.INFO, logger="coordinator.engine.waiting")
    co = Coordinator(CoordinatorConfig(directory=tmp_path, tile=16), MemoryStore())
    await co.start()
    try:
        a, b = operands(rng, 32, 16, 16, True, False)
        product = asyncio.create_task(co.products.matmul(a, b, trans_a=True, label="x"))
        await wait_until(lambda: co.ledger.unsent, 10)
        now = time.time()
        co.waiting.check(now)
        assert co.waiting.check(now + 1) and co.waiting.reason == "no_volunteers"
        host, _ = await co.hosts.register(RegisterRequest("h", 10.0, 1, 512), now + 2)
        assert not co.waiting.check(now + 3) and co.waiting.reason == "no_volunteers"
        assert not any("flows again" in r.getMessage() for r in caplog.records)
        assert co.progress.host_states(now + 3)["active"] == 0  # status agrees
        said = host_condition(co, co.ledger.hosts[host.id], now + 3)  # and the dashboard
        assert said == ("ok", "registered; has not asked yet")
        request = WorkRequest("r1", 0, (), (), None, False)  # asks, with no room just now
        await co.requests.request_work(host, request, now + 4)
        assert co.waiting.check(now + 5) and co.waiting.current is None
        assert co.progress.host_states(now + 5)["active"] == 1
        assert any("work flows again" in r.getMessage() for r in caplog.records)
        product.cancel()
    finally:
        await co.stop()


async def test_a_volunteer_that_joined_during_a_wait_for_another_is_not_told_to_start_one(
    tmp_path, rng
):
    """It is the other volunteer the wait asked for: asking between two products (no work
    just then), it was told "start another volunteer" in 3 of 6 tries. Those the wait
    counted are told why their work waits."""
    config = CoordinatorConfig(directory=tmp_path, tile=16, policy=Policy.QUORUM)
    co = Coordinator(config, MemoryStore())
    await co.start()
    try:
        now = time.time()
        first, _ = await co.hosts.register(RegisterRequest("first", 10.0, 1, 512), now)
        ask = WorkRequest("r1", 8, (), (), None, False)
        a, b = operands(rng, 16, 16, 16, True, False)
        product = asyncio.create_task(co.products.matmul(a, b, trans_a=True, label="x"))
        await wait_until(lambda: co.ledger.unsent, 10)
        await co.requests.request_work(co.ledger.hosts[first.id], ask, time.time())
        later = time.time()
        co.waiting.check(later)
        assert co.waiting.check(later + 0.1) and co.waiting.reason == "needs_hosts"
        said = co.waiting.current.message
        assert co.waiting.note(co.ledger.hosts[first.id]) == said
        second, _ = await co.hosts.register(RegisterRequest("second", 10.0, 1, 512), later)
        assert co.waiting.note(co.ledger.hosts[second.id]) is None
        co.waiting.current = Wait("hosts_too_small", "work waits for a larger volunteer", 4)
        assert co.waiting.note(co.ledger.hosts[second.id]) == "work waits for a larger volunteer"
        product.cancel()
    finally:
        await co.stop()
