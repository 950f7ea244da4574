"""The coordinator end to end: the real aiohttp server, a real SQLite file, protocol clients."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import kernels
from coordinator.engine import coordinator as coordinator_module
from coordinator.engine.passes import COMMIT_WINDOW
from coordinator.rules.scheduler import SchedulerConfig
from coordinator.work.records import Outcome, Policy, Redundancy, ServerState
from kernels import nn
from tests.factories import TIMEOUT, bits, operands, running, volunteers
from tests.volunteers import Behaviour, ScriptedVolunteer, wait_until
from volunteer.client import CoordinatorClient, ServerRefused, compute_tile


@pytest.mark.parametrize("policy", list(Policy))
async def test_odd_shaped_products_through_several_clients_equal_the_kernel(tmp_path, rng, policy):
    async with (
        running(tmp_path, policy=policy, tile=16) as (_co, queue, url),
        volunteers(url, [Behaviour()] * 3) as crew,
    ):
        jobs = []
        for m, n, k, ta, tb in [
            (37, 29, 23, False, False),
            (17, 45, 33, False, True),
            (40, 9, 19, True, False),
        ]:
            a, b = operands(rng, m, n, k, ta, tb)
            jobs.append((a, b, ta, tb, queue.matmul(a, b, trans_a=ta, trans_b=tb, label=f"{m}")))
        results = await crew.finish(asyncio.gather(*(j[4] for j in jobs)))
        for (a, b, ta, tb, _), got in zip(jobs, results, strict=True):
            assert np.array_equal(bits(got), bits(kernels.gemm(a, b, trans_a=ta, trans_b=tb)))


async def test_a_lost_work_reply_is_resent_not_duplicated(tmp_path, rng):
    async with running(tmp_path, tile=16) as (co, queue, url):
        a, b = operands(rng, 20, 20, 8, False, False)
        product = asyncio.ensure_future(queue.matmul(a, b))
        await wait_until(lambda: co.ledger.unsent)
        async with CoordinatorClient(url) as client:
            await client.register("flaky")
            first = await client.request_work("r1", capacity=2)
            again = await client.request_work("r1", capacity=2)
            # The retried request gets the same answer; the panels that rode along on the
            # first come only once (the host fetches what it lacks). The first, over TCP,
            # offered the local socket, and the client moved to it.
            assert client.local == first["local_socket"]
            assert again == {k: v for k, v in first.items() if k not in ("blobs", "local_socket")}
            taken = [x["result_id"] for x in first["assignments"]]
            assert len(taken) == 2
            # The host never saw r1's reply: it asks anew and lists nothing in progress.
            second = await client.request_work("r2", capacity=2, in_progress=[])
            resent = [x["result_id"] for x in second["assignments"]]
            assert resent == taken  # the same results again, not fresh replicas
            assert second["abort"] == []
        async with volunteers(url, [Behaviour()] * 2) as crew:
            await wait_until(lambda: all(co.ledger.results[r].host_id for r in taken))
            # The flaky host's two results stay assigned to it: nobody else gets them.
            hosts = {co.ledger.results[r].host_id for r in taken}
            assert len(hosts) == 1
            product.cancel()
        del crew


async def test_a_client_that_never_answers_is_timed_out_and_its_work_done_by_another(tmp_path, rng):
    redundancy = Redundancy(delay_bound=0.5)
    async with running(tmp_path, tile=16, redundancy=redundancy) as (co, queue, url):
        a, b = operands(rng, 32, 32, 16, False, False)
        product = asyncio.ensure_future(queue.matmul(a, b))
        async with volunteers(url, [Behaviour(silent=True, capacity=4)]) as silent:
            await wait_until(lambda: len(silent[0].taken) == 4)
            async with volunteers(url, [Behaviour()] * 3) as crew:
                got = await crew.finish(product)
        assert np.array_equal(bits(got), bits(kernels.gemm(a, b)))
        events = await co.store.events(kind="result", state="no_reply")
        assert {e.result_id for e in events} == set(silent[0].taken)
        silent_host = co.ledger.hosts[silent[0].host_id]
        assert silent_host.error_count == 4 and silent_host.max_in_progress < 4


@pytest.mark.parametrize("policy", list(Policy))
async def test_a_wrong_tile_is_caught_under_each_policy(tmp_path, rng, policy):
    async with running(tmp_path, policy=policy, tile=16) as (co, queue, url):
        a, b = operands(rng, 32, 48, 24, False, True)
        product = asyncio.ensure_future(queue.matmul(a, b, trans_b=True))
        async with volunteers(url, [Behaviour(lie=True, capacity=3)]) as liar:
            await wait_until(lambda: liar[0].done >= 1)
            async with volunteers(url, [Behaviour()] * 3) as crew:
                got = await crew.finish(product)
        assert np.array_equal(bits(got), bits(kernels.gemm(a, b, trans_b=True)))
        liar_host = co.ledger.hosts[liar[0].host_id]
        assert liar_host.invalid_count >= 1 and liar_host.consecutive_valid == 0
        invalid = await co.store.events(kind="validation", state="invalid", host_id=liar_host.id)
        assert invalid, "the wrong tile must be logged as invalid"
        reasons = " ".join(e.message for e in invalid)
        assert ("hash mismatch" in reasons) or ("freivalds" in reasons.lower())


async def test_tail_acceleration_finishes_a_gemm_held_up_by_a_slow_host(tmp_path, rng):
    # A deadline far away: only a spare replica can finish the GEMM in time.
    redundancy = Redundancy(delay_bound=600.0)
    async with running(tmp_path, policy=Policy.FREIVALDS, tile=16, redundancy=redundancy) as (
        co,
        queue,
        url,
    ):
        a, b = operands(rng, 48, 64, 16, False, False)  # 12 tiles
        product = asyncio.ensure_future(queue.matmul(a, b))
        async with volunteers(url, [Behaviour(silent=True, capacity=1)]) as slow:
            await wait_until(lambda: len(slow[0].taken) == 1)
            async with volunteers(url, [Behaviour()] * 2) as crew:
                got = await crew.finish(product)
            (held,) = slow[0].taken
            async with CoordinatorClient(url, token=slow[0].token) as client:
                reply = await client.request_work("late", capacity=0, in_progress=[held])
            assert reply["abort"] == [held]  # the slow host is told to drop its copy
        assert np.array_equal(bits(got), bits(kernels.gemm(a, b)))
        accelerated = await co.store.events(kind="wu", state="accelerated")
        assert len(accelerated) == 1
        aborted = await co.store.events(kind="result", state="aborted")
        assert [e.result_id for e in aborted] == [held]


async def test_the_tiles_of_a_volunteer_paused_for_its_owner_go_to_another_at_once(tmp_path, rng):
    """An `--idle-only` volunteer whose owner uses the machine holds tiles it will not
    compute until its owner is done: other volunteers compute them now, not at their
    deadlines (ten minutes here, with no tail or straggler spares to help), and it is told
    to drop its copies when it asks again, its standing intact: it did not sit on them."""
    settings = {"tail_fraction": 2.0, "straggler_floor": 600.0}
    settings["scheduler"] = SchedulerConfig(deadline_floor=600.0)
    redundancy = Redundancy(delay_bound=1200.0)
    async with running(
        tmp_path, policy=Policy.FREIVALDS, tile=16, redundancy=redundancy, **settings
    ) as (co, queue, url):
        a, b = operands(rng, 48, 64, 16, False, False)  # 12 tiles
        product = asyncio.ensure_future(queue.matmul(a, b))
        await wait_until(lambda: co.ledger.unsent)
        async with CoordinatorClient(url) as paused:
            host_id = await paused.register("idle-only")
            assigned = (await paused.request_work("w1", capacity=2))["assignments"]
            held = sorted(x["result_id"] for x in assigned)
            assert len(held) == 2
            await paused.request_work("w2", capacity=0, wait=False, paused=True, in_progress=held)
            async with volunteers(url, [Behaviour()] * 2) as crew:
                got = await crew.finish(product)
            reply = await paused.request_work("w3", capacity=0, wait=False, in_progress=held)
            assert sorted(reply["abort"]) == held
        assert np.array_equal(bits(got), bits(kernels.gemm(a, b)))
        spared = await co.store.events(kind="wu", state="accelerated")
        assert len(spared) == 2 and all("paused" in e.message for e in spared)
        host = co.ledger.hosts[host_id]
        assert host.error_count == 0 and co.requests.cooling.left(host.id, time.time()) == 0


async def test_a_host_paused_for_its_owner_is_counted_and_shown_as_such_and_logged_once(
    tmp_path, rng
):
    """The operator sees why a host takes no work: status counts it paused, not active, the
    dashboard's hosts table says so, and the task log says when each pause began and ended,
    once each: not again as the host repeats that it is paused, nor when it reports the tile
    it was computing with that word riding on the report, nor as it gives its tiles back
    and stops (a review found `resumed` said for those)."""
    from coordinator.server.dashboard import host_condition
    from coordinator.state.reader import ProjectReader

    settings = {"tile": 16, "tail_fraction": 2.0, "straggler_floor": 600.0}
    async with running(tmp_path, policy=Policy.FREIVALDS, **settings) as (co, queue, url):
        a, b = operands(rng, 32, 16, 8, False, False)  # two tiles
        product = asyncio.ensure_future(queue.matmul(a, b))
        await wait_until(lambda: co.ledger.unsent)
        async with CoordinatorClient(url) as host:
            host_id = await host.register("laptop")

            def looks() -> tuple[str, str, dict]:
                states = co.progress.status()["host_states"]
                return (*host_condition(co, co.ledger.hosts[host_id], time.time()), states)

            def ask(name: str, **fields) -> dict:
                fields = {"capacity": 0, "wait": False, **fields}
                return host.request_work(name, in_progress=held, **fields)

            first, second = (await host.request_work("a", capacity=2))["assignments"]
            held = [first["result_id"], second["result_id"]]
            assert looks() == ("ok", "ok", {"active": 1, "paused": 0, "idle": 0, "quarantined": 0})
            for name in ("p1", "p2", "p3"):  # a paused volunteer says so every 10 to 30 s
                await ask(name, paused=True)
            paused = ("paused", "paused: its owner uses the machine (--idle-only)")
            assert looks() == (*paused, {"active": 0, "paused": 1, "idle": 0, "quarantined": 0})
            # The tile it was computing as its owner came back, with the paused word riding.
            tile_a = await host.fetch_blob(first["a"], max_bytes=1 << 20)
            tile_b = await host.fetch_blob(first["b"], max_bytes=1 << 20)
            tile = compute_tile(first, tile_a, tile_b)[1]
            held = [second["result_id"]]
            riding = {"request_id": "p4", "capacity": 0, "in_progress": held, "paused": True}
            await host.report([{"result_id": first["result_id"], "tile": tile}], work=riding)
            assert looks()[2]["paused"] == 1
            await ask("b")
            assert looks()[2]["active"] == 1
            await ask("p5", paused=True)
            # It stops while paused: gives its tile back, and says it leaves.
            await host.report([{"result_id": second["result_id"], "abandoned": True}])
            assert looks()[2]["paused"] == 1
            held = []
            await ask("bye", leaving=True)
            assert looks()[:2] == ("ok", "stopped")
        product.cancel()
        await co.ledger.flush()
        said = [(e.state, e.message) for e in await co.store.events(kind="host")]
        assert [state for state, _ in said] == ["registered", "paused", "resumed", "paused", "left"]
        assert said[1][1] == (
            f"host {host_id} 'laptop' paused: its owner is using the machine, so it takes no "
            "work (--idle-only)"
        )
        # status DIR reads the same from the task log: it left, so it is not paused.
        with ProjectReader(tmp_path / "project" / "state.db") as reader:
            assert reader.paused_hosts(0.0) == set()


async def test_a_pause_begun_alone_has_its_tiles_spared_once_another_volunteer_comes(tmp_path, rng):
    """With no other host at work a spare would go to no one, and none is made; the pause
    is not forgotten for that: the tiles are spared once another volunteer comes."""
    async with running(tmp_path, policy=Policy.FREIVALDS, tile=16, tail_fraction=2.0) as (
        co,
        queue,
        url,
    ):
        a, b = operands(rng, 48, 64, 16, False, False)  # 12 tiles
        product = asyncio.ensure_future(queue.matmul(a, b))
        await wait_until(lambda: co.ledger.unsent)
        async with CoordinatorClient(url) as paused, CoordinatorClient(url) as later:
            await paused.register("idle-only")
            assigned = (await paused.request_work("p1", capacity=2))["assignments"]
            held = [x["result_id"] for x in assigned]
            await paused.request_work("p2", capacity=0, wait=False, paused=True, in_progress=held)
            wus = [co.ledger.results[r].wu_id for r in held]
            await co.passes.step(time.time())
            assert not any(co.ledger.wus[wu].accelerated for wu in wus)
            await later.register("later")
            await later.request_work("l1", capacity=0, wait=False)
            await wait_until(lambda: all(co.ledger.wus[wu].accelerated for wu in wus))
        product.cancel()


async def test_a_host_saying_paused_between_taking_tiles_is_judged_once_it_asks_again(
    tmp_path, rng
):
    """A pause spares a host's tiles and does not count against it; once it asks again it
    has a straggler's time to report them, like any host, or it sat on them: no trust, and
    no new work for a while. (A review: a hoarder saying `paused` between its asks took
    five times the tiles of one that did not, and was never cooled.)"""
    settings = {"tail_fraction": 2.0, "straggler_floor": 0.3}
    async with running(tmp_path, policy=Policy.FREIVALDS, tile=16, **settings) as (co, queue, url):
        a, b = operands(rng, 48, 64, 16, False, False)  # 12 tiles
        product = asyncio.ensure_future(queue.matmul(a, b))
        await wait_until(lambda: co.ledger.unsent)
        async with CoordinatorClient(url) as hoarder, CoordinatorClient(url) as other:
            host_id = await hoarder.register("hoarder")
            await other.register("other")
            await other.request_work("o1", capacity=0, wait=False)  # at work: spares can go
            assigned = (await hoarder.request_work("h1", capacity=2))["assignments"]
            held = [x["result_id"] for x in assigned]
            await hoarder.request_work("h2", capacity=0, wait=False, paused=True, in_progress=held)
            wus = [co.ledger.results[r].wu_id for r in held]
            await wait_until(lambda: all(co.ledger.wus[wu].accelerated for wu in wus))
            # The passes run as if seconds had gone by, long past a straggler's time; each a
            # straggler's look (engine/passes.py, STRAGGLER_LOOK) after the one before.
            await co.passes.step(time.time() + 3.0)
            assert co.requests.cooling.left(host_id, time.time()) == 0  # paused: not judged
            await hoarder.request_work("h3", capacity=0, wait=False, in_progress=held)
            await co.passes.step(time.time() + 4.0)
            assert co.requests.cooling.left(host_id, time.time()) > 0
            assert co.ledger.hosts[host_id].error_count == 1
        product.cancel()


async def test_a_waiting_work_request_gets_work_as_soon_as_it_is_published(tmp_path, rng):
    async with (
        running(tmp_path, tile=16, long_poll=30.0) as (co, queue, url),
        CoordinatorClient(url) as client,
    ):
        await client.register("eager")
        asking = asyncio.ensure_future(client.request_work("w1", capacity=1))
        await wait_until(lambda: co.requests._inflight)  # the request is waiting for work
        a, b = operands(rng, 16, 16, 8, False, False)
        product = asyncio.ensure_future(queue.matmul(a, b))
        reply = await asyncio.wait_for(asking, timeout=10)  # far less than the 30 s poll
        (assignment,) = reply["assignments"]
        assert reply["delay"] == 0
        busy = [assignment["result_id"]]
        idle = await client.request_work("w2", capacity=0, in_progress=busy)
        assert idle["assignments"] == []  # nothing asked for: answered at once
        product.cancel()


async def test_a_volunteer_on_the_coordinators_machine_gets_the_cores_it_computes_on(
    tmp_path, monkeypatch
):
    monkeypatch.delenv(nn.THREADS_ENV, raising=False)
    monkeypatch.setattr(nn, "cpu_count", lambda: 4)
    async with (
        running(tmp_path, tile=16) as (co, _queue, url),
        CoordinatorClient(url) as client,
    ):
        assert nn.default_threads() == 4
        await client.register("here", threads=3)
        await client.request_work("w1", capacity=0)  # through loopback, as tilehive demo's
        assert nn.default_threads() == 1
        assert co.neighbours.threads == 3
    assert nn.default_threads() == 4  # a stopped coordinator lifts its cap


async def test_replicas_nobody_needs_end_judged_or_dropped_when_their_product_is_done(
    tmp_path, rng
):
    # Four replicas per tile and three hosts: each tile keeps one replica nobody was sent.
    # The third host's copy of one tile arrives after that tile was decided, in the same pass
    # as the quorum that completes the product (the demo left such results "pending").
    redundancy = Redundancy(target_nresults=4, min_quorum=2)
    async with running(tmp_path, tile=16, redundancy=redundancy) as (co, queue, url):
        a, b = operands(rng, 32, 16, 8, False, False)  # two tiles
        product = asyncio.ensure_future(queue.matmul(a, b))
        await wait_until(lambda: len(co.ledger.unsent) == 8)
        stop = asyncio.Event()
        clients = [CoordinatorClient(url) for _ in range(3)]
        reports: list[dict[str, dict]] = []
        for i, client in enumerate(clients):
            await client.__aenter__()
            await client.register(f"h{i}")
            reply = await client.request_work(f"h{i}-0", capacity=2)
            helper = ScriptedVolunteer(url, f"h{i}")
            by_wu = {}
            for assignment in reply["assignments"]:
                wu = co.ledger.results[assignment["result_id"]].wu_id
                by_wu[wu] = await helper._compute(client, stop, assignment)
            reports.append(by_wu)
        first, last = sorted(reports[0])  # the pass validates work units in this order
        gemm_id = co.ledger.wus[last].gemm_id
        try:
            await clients[0].report([reports[0][last]])
            await clients[1].report([reports[1][last]])
            await wait_until(lambda: co.ledger.wus[last].canonical_hash is not None)
            async with co.passes.lock:  # the next three reports land in one pass
                await clients[2].report([reports[2][last]])
                await clients[0].report([reports[0][first]])
                await clients[1].report([reports[1][first]])
            got = await asyncio.wait_for(product, TIMEOUT)
        finally:
            for client in clients:
                await client.__aexit__(None, None, None)
        assert np.array_equal(bits(got), bits(kernels.gemm(a, b)))
        late = reports[2][last]["result_id"]
        await co.ledger.flush()  # the pass's decisions are committed within COMMIT_WINDOW
        _, results = await co.store.gemm_work(gemm_id)
        states = {
            r.id: (r.server_state.value, r.outcome.value, r.validate_state.value) for r in results
        }
        assert len(states) == 8
        assert states[late] == ("over", "success", "valid")
        assert [s for s in states.values() if s[0] == "unsent"] == []
        assert [s for s in states.values() if s[1] == "success" and s[2] == "init"] == []
        judged = await co.store.events(kind="validation", state="valid")
        assert any(e.result_id == late and "late" in e.message for e in judged)


async def test_small_panels_come_inside_the_work_reply_unless_the_host_has_them(tmp_path, rng):
    """A product's small operand panels ride along on the answer that assigns its tiles, so
    a volunteer fetches nothing before it computes; panels it says it holds are not sent."""
    async with running(tmp_path, policy=Policy.FREIVALDS, tile=16) as (_co, queue, url):
        a, b = operands(rng, 16, 16, 8, False, False)
        product = asyncio.ensure_future(queue.matmul(a, b))
        async with CoordinatorClient(url) as alice, CoordinatorClient(url) as bob:
            await alice.register("alice")
            await bob.register("bob")
            reply = await alice.request_work("a1", capacity=1)
            (assignment,) = reply["assignments"]
            panels = {assignment["a"], assignment["b"]}
            assert set(reply["blobs"]) == panels
            for blob_id, data in reply["blobs"].items():
                kernels.verify_blob(data, blob_id)  # named by their content, as downloads
            await alice.report([{"result_id": assignment["result_id"], "abandoned": True}])
            again = await bob.request_work("b1", capacity=1, cached=sorted(panels))
            assert again["assignments"] and not again.get("blobs")
        product.cancel()


async def test_the_panels_inside_a_work_reply_fit_the_memory_the_host_offers(tmp_path, rng):
    """A host with little memory gets no more panels inside one answer than it offers for a
    work unit (up to 64 MB went to any host): the rest it fetches in turn, as its budget
    allows. What it offers is what it says now, not what it said when it registered (a
    volunteer restarted with a lower --max-memory kept its old figure)."""
    async with running(tmp_path, policy=Policy.FREIVALDS, tile=16) as (_co, queue, url):
        a, b = operands(rng, 64, 16, 12_288, False, False)  # 4 tiles, panels of 0.75 MB
        product = asyncio.ensure_future(queue.matmul(a, b))
        async with CoordinatorClient(url) as small:
            # It offered more when it registered, and has been restarted with less since.
            await small.register("small", max_memory_mb=500)
            reply = await small.request_work("s1", capacity=4, max_memory_mb=2)
            panels = {x[side] for x in reply["assignments"] for side in "ab"}
            assert len(reply["assignments"]) >= 2 and len(panels) >= 3  # 2.25 MB or more
            assert sum(len(data) for data in reply["blobs"].values()) <= 2 << 20
            assert reply["blobs"]  # still as many as fit
        product.cancel()


async def _computed(co, client, rng, step: int, request_id: str) -> list[str]:
    """A one-tile product of `step` computed by `client`; returns the panels it held.
    Asked again while the product is in flight, the coordinator names none of them."""
    a, b = operands(rng, 16, 16, 8, False, False)
    product = asyncio.ensure_future(co.products.matmul(a, b, step=step))
    await wait_until(lambda: co.ledger.unsent)
    (job,) = (await client.request_work(request_id, capacity=1))["assignments"]
    panels = [job["a"], job["b"]]
    same_step = await client.request_work(
        request_id + "+", capacity=0, cached=panels, in_progress=[job["result_id"]]
    )
    assert "forget" not in same_step
    blobs = [await client.fetch_blob(job[k], max_bytes=1 << 20) for k in "ab"]
    output_hash, tile = compute_tile(job, *blobs)
    await client.report([{"result_id": job["result_id"], "hash": output_hash, "tile": tile}])
    await asyncio.wait_for(product, TIMEOUT)
    return panels


async def _told_to_forget(co, client, rng, step: int, cached: list[str]) -> list[str]:
    """What an answer tells the host to drop of `cached` while a product of `step` is in
    flight (the product is left unfinished)."""
    a, b = operands(rng, 16, 16, 8, False, False)
    product = asyncio.ensure_future(co.products.matmul(a, b, step=step))
    try:
        await wait_until(lambda: co.ledger.unsent)
        reply = await client.request_work(f"forget-{step}", capacity=1, cached=cached)
        (job,) = reply["assignments"]
        again = await client.request_work(
            f"again-{step}",
            capacity=0,
            cached=[job["a"], job["b"]],
            in_progress=[job["result_id"]],
        )
        assert "forget" not in again  # the panels of the step in flight
        return sorted(reply.get("forget", []))
    finally:
        product.cancel()


async def test_a_host_is_told_to_forget_the_panels_of_an_earlier_step(tmp_path, rng):
    """Once a later step's products are in flight, panels only an earlier step used are of
    no more use (the model changed in between): the answer tells the host to drop them, so
    its cache, and the list of it in every request, hold current work. Panels of a step
    in flight, and panels the coordinator does not know, are not named."""
    async with (
        running(tmp_path, policy=Policy.FREIVALDS, tile=16) as (co, _queue, url),
        CoordinatorClient(url) as client,
    ):
        await client.register("h")
        old = await _computed(co, client, rng, 1, "w1")
        unknown = "f" * 64
        assert await _told_to_forget(co, client, rng, 2, [*old, unknown]) == sorted(old)


async def test_panels_of_a_checkpointed_step_or_from_before_a_restart_are_still_named(
    tmp_path, rng
):
    """A checkpoint deletes the earlier steps' blobs, and a restart starts with an empty
    ledger: hosts still hold those panels, and are told to drop them all the same."""
    async with (
        running(tmp_path, policy=Policy.FREIVALDS, tile=16) as (co, _queue, url),
        CoordinatorClient(url) as client,
    ):
        await client.register("h")
        first = await _computed(co, client, rng, 1, "w1")
        await co.retention.prune(1)  # the checkpoint after step 1
        second = await _computed(co, client, rng, 2, "w2")
        assert await _told_to_forget(co, client, rng, 3, first) == sorted(first)
    async with (  # the same project, restarted
        running(tmp_path, policy=Policy.FREIVALDS, tile=16) as (co, _queue, url),
        CoordinatorClient(url) as client,
    ):
        await client.register("h2")
        told = await _told_to_forget(co, client, rng, 4, [*first, *second])
        assert told == sorted([*first, *second])


async def _one_tile_reported(
    co, url, rng, work: dict | None, watch=None
) -> tuple[asyncio.Future, dict]:
    """A one-tile product, its tile computed and reported by a protocol client (the report
    awaited through `watch`, when given); returns the product and the answer."""
    a, b = operands(rng, 16, 16, 8, False, False)
    product = asyncio.ensure_future(co.products.matmul(a, b, step=1))
    await wait_until(lambda: co.ledger.unsent)
    async with CoordinatorClient(url) as client:
        await client.register("h")
        (job,) = (await client.request_work("w1", capacity=1))["assignments"]
        blobs = [await client.fetch_blob(job[k], max_bytes=1 << 20) for k in "ab"]
        output_hash, tile = compute_tile(job, *blobs)
        entry = {"result_id": job["result_id"], "hash": output_hash, "tile": tile}
        report = client.report([entry], work=work)
        answer = await (report if watch is None else watch(report))
    assert answer["accepted"] == [job["result_id"]]
    assert np.array_equal(bits(await asyncio.wait_for(product, TIMEOUT)), bits(kernels.gemm(a, b)))
    return product, answer


async def test_a_report_that_asks_for_work_is_committed_with_the_answer_just_after_it_leaves(
    tmp_path, rng, monkeypatch
):
    """A report that asks for more work is committed with the answer to that ask, in one
    transaction, by the passes within PROMISE_WINDOW of the reply: the host does not wait
    for the commit, and the database holds the report a moment later."""
    monkeypatch.setattr(coordinator_module, "WAIT_CHECK_EVERY", 3600.0)  # it commits too
    ask = {"request_id": "w2", "capacity": 1, "cached": [], "in_progress": [], "wait": False}
    async with running(tmp_path, tile=16, policy=Policy.FREIVALDS) as (co, _queue, url):
        commits: list = []
        commit = co.store.commit

        async def counted(batch):
            commits.append(batch)
            await commit(batch)

        async def watch(report):
            monkeypatch.setattr(co.store, "commit", counted)
            # No pass may run meanwhile: the passes make the commit that a reply asks for.
            async with co.passes.lock:
                answer = await report
                assert commits == [], "the reply waited for its commit"
                held = await co.store.result(answer["accepted"][0])
                # Not yet in the store at all when its assignment's commit is still waiting
                # for the promises of the next few milliseconds (passes.PROMISE_WINDOW).
                assert held is None or held.server_state is ServerState.IN_PROGRESS, (
                    "committed before the reply"
                )
            return answer

        _, answer = await _one_tile_reported(co, url, rng, ask, watch)
        assert answer["work"]["assignments"] == []
        await wait_until(lambda: commits)
        # One transaction: the report's and the answer's (with the pass's verdict on it).
        assert list(commits[0].results) == answer["accepted"]
        assert (await co.store.result(answer["accepted"][0])).outcome is Outcome.SUCCESS


async def test_a_finished_product_is_committed_within_the_commit_window_with_no_reply_after_it(
    tmp_path, rng, monkeypatch
):
    """A pass's decisions wait for the next reply's commit, but no longer than COMMIT_WINDOW:
    with no host asking again, the product's end still reaches the database."""
    # The watch over why work waits commits what it says; here it must say nothing.
    monkeypatch.setattr(coordinator_module, "WAIT_CHECK_EVERY", 3600.0)
    async with running(tmp_path, tile=16, policy=Policy.FREIVALDS) as (co, _queue, url):
        # A report without a work request is committed by the next pass, with its verdict.
        await _one_tile_reported(co, url, rng, None)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20 * COMMIT_WINDOW  # 2 s: ten times the window, for CI
        while [e.state for e in await co.store.events(kind="gemm")] != ["created", "done"]:
            assert loop.time() < deadline, "the finished product was never committed"
            await asyncio.sleep(COMMIT_WINDOW / 10)


class Watched(ScriptedVolunteer):
    """Notes, as each tile's kernel ends, whether the next work was already there."""

    def __init__(self, url: str, name: str, behaviour: Behaviour) -> None:
        super().__init__(url, name, behaviour)
        self.queued_after: list[int] = []  # tiles queued as each tile finished
        self.asked_ahead: list[bool] = []  # a work request was in flight as it finished
        self.started_asking: list[bool] = []

    async def _kernel(self, assignment, a, b):
        asking = self.asking is not None and not self.asking.done()
        self.started_asking.append(asking)  # a request in flight as this tile starts
        done = await super()._kernel(assignment, a, b)
        if self.asking is not None:
            await asyncio.wait_for(asyncio.shield(self.asking), TIMEOUT)
        self.asked_ahead.append(self.asking is not None)
        self.queued_after.append(len(self.queue))
        return done


async def watched_products(tmp_path, rng, behaviour: Behaviour, count: int) -> Watched:
    """`count` one-tile products computed by one Watched volunteer, checked bit for bit."""
    async with running(tmp_path, policy=Policy.FREIVALDS, tile=16) as (_co, queue, url):
        volunteer = Watched(url, "watched", behaviour)
        stop = asyncio.Event()
        task = asyncio.create_task(volunteer.run(stop))
        pairs = [operands(rng, 16, 16, 8, False, False) for _ in range(count)]
        products = (queue.matmul(a, b, label=f"p{i}") for i, (a, b) in enumerate(pairs))
        results = await asyncio.wait_for(asyncio.gather(*products), TIMEOUT)
        stop.set()
        await task
    for (a, b), got in zip(pairs, results, strict=True):
        assert np.array_equal(bits(got), bits(kernels.gemm(a, b)))
    return volunteer


async def test_a_slow_tile_has_the_next_work_asked_for_while_it_computes(tmp_path, rng):
    """A tile that takes longer than a round trip: the volunteer asks for its next work
    while it computes, so that work is in its queue when the tile is done (it never waits
    for the network between tiles); every tile reported once, the products exact."""
    slow = Behaviour(capacity=1, seconds_per_tile=0.3)
    volunteer = await watched_products(tmp_path, rng, slow, 3)
    # The first tile's speed is not yet known: the next is asked for after it. Then the
    # volunteer knows its tiles outlast its round trips and asks during each (during the
    # last for nothing), and the third tile was queued while the second computed.
    assert volunteer.asked_ahead == [False, True, True]
    assert volunteer.queued_after == [0, 1, 0]
    assert volunteer.stats.duplicate == 0 and volunteer.stats.reported == 3


async def test_with_slow_work_queued_the_volunteer_asks_and_reports_while_it_computes(
    tmp_path, rng
):
    """Holding work that outlasts a round trip, the volunteer never waits for an answer
    before its next tile: its report and its next ask go out while that tile computes."""
    slow = Behaviour(capacity=2, seconds_per_tile=0.3)
    volunteer = await watched_products(tmp_path, rng, slow, 4)
    # Two tiles came in the first answer; the first one's speed known, the second started
    # with the report of the first (and an ask) on its way, not after its answer.
    assert volunteer.started_asking[:2] == [False, True]
    assert volunteer.stats.reported == 4 and volunteer.stats.duplicate == 0


async def test_a_quick_tile_does_not_ask_ahead(tmp_path, rng):
    """Tiles shorter than a round trip: asking during one would still be out when it is
    done, and its report would need a call of its own; the volunteer asks after each."""
    volunteer = await watched_products(tmp_path, rng, Behaviour(capacity=1), 3)
    assert volunteer.asked_ahead == [False, False, False]
    assert volunteer.stats.reported == 3


class Bounded(ScriptedVolunteer):
    """A volunteer that notes, as each tile starts, the tile bytes still undelivered and
    whether more tiles were queued behind it."""

    def __init__(self, url: str, name: str, behaviour: Behaviour) -> None:
        super().__init__(url, name, behaviour)
        self.waiting_at_start: list[int] = []
        self.queued_behind: list[int] = []

    async def _kernel(self, assignment, a, b):
        self.queued_behind.append(len(self.queue))
        reports = [*self.sending, *self.pending]
        self.waiting_at_start.append(sum(len(r.get("tile", b"")) for r in reports))
        return await super()._kernel(assignment, a, b)


async def test_finished_tiles_waiting_to_be_reported_hold_the_next_tile_back(tmp_path, rng):
    """A volunteer's finished tiles stay in memory until the coordinator has them; while
    they and the next tile would overflow its work half, it reports before computing on,
    so that tiles waiting for an uplink or for a fuller batch cannot carry it past
    --max-memory. Every tile still reported once, the products exact."""
    from volunteer.policy import WORKSPACE_PER_THREAD, tile_memory

    async with running(tmp_path, policy=Policy.FREIVALDS, tile=16) as (co, queue, url):
        pairs = [operands(rng, 16, 16, 2, False, False) for _ in range(8)]
        products = [
            asyncio.ensure_future(queue.matmul(a, b, label=f"p{i}"))
            for i, (a, b) in enumerate(pairs)
        ]
        await wait_until(lambda: len(co.ledger.unsent) == 8)  # all eight to hand out at once
        volunteer = Bounded(url, "bounded", Behaviour(capacity=8))
        tile = len(kernels.encode_array(np.zeros((16, 16), np.float32)))
        panels = 2 * len(kernels.encode_array(np.zeros((16, 2), np.float32)))
        half = tile_memory({"m": 16, "n": 16}, volunteer.threads) + panels  # one tile fits
        volunteer.budget = 2 * half
        stop = asyncio.Event()
        task = asyncio.create_task(volunteer.run(stop))
        results = await asyncio.wait_for(asyncio.gather(*products), TIMEOUT)
        stop.set()
        await task
    for (a, b), got in zip(pairs, results, strict=True):
        assert np.array_equal(bits(got), bits(kernels.gemm(a, b)))
    assert max(volunteer.queued_behind) >= 3  # tiles enough to pile up behind one another
    room = half - WORKSPACE_PER_THREAD * volunteer.threads - 4 * 16 * 16
    assert max(volunteer.waiting_at_start) <= room < 3 * tile
    assert volunteer.stats.reported == 8 and volunteer.stats.duplicate == 0


async def test_a_done_products_blobs_leave_memory_but_a_panel_another_reads_stays(tmp_path, rng):
    """A finished product's tiles and panels are let go at once (nothing fills memory until
    the next checkpoint); a panel another product in flight reads is kept, and a host that
    asks for a let-go panel hears that its work is not needed (410), not "not found"."""
    async with running(tmp_path, policy=Policy.FREIVALDS, tile=16) as (co, queue, url):
        (a1, b), (a2, _) = (
            operands(rng, 16, 16, 8, False, False),
            operands(rng, 16, 16, 8, False, False),
        )
        first = asyncio.ensure_future(queue.matmul(a1, b, label="first"))
        second = asyncio.ensure_future(queue.matmul(a2, b, label="second"))
        await wait_until(lambda: len(co.ledger.unsent) == 2)
        async with CoordinatorClient(url) as client:
            await client.register("h")
            reply = await client.request_work("w1", capacity=2)
            jobs = {job["a"]: job for job in reply["assignments"]}
            job1, job2 = jobs[kernels.array_id(a1)], jobs[kernels.array_id(a2)]

            async def report(job):
                output_hash, tile = compute_tile(
                    job, reply["blobs"][job["a"]], reply["blobs"][job["b"]]
                )
                await client.report(
                    [{"result_id": job["result_id"], "hash": output_hash, "tile": tile}]
                )
                return output_hash

            tile1 = await report(job1)
            assert np.array_equal(
                bits(await asyncio.wait_for(first, TIMEOUT)), bits(kernels.gemm(a1, b))
            )
            assert co.blobs.in_memory(job1["a"]) is None and co.blobs.in_memory(tile1) is None
            assert co.blobs.in_memory(job2["b"]) is not None  # the second product reads b
            with pytest.raises(ServerRefused) as gone:
                await client.fetch_blob(job1["a"], max_bytes=1 << 20)
            assert (gone.value.status, gone.value.code) == (410, "gone")
            assert await client.fetch_blob(job2["b"], max_bytes=1 << 20)
            await report(job2)
            await asyncio.wait_for(second, TIMEOUT)
            assert co.blobs.in_memory(job2["b"]) is None and co.blobs.in_memory(job2["a"]) is None
