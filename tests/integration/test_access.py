"""Authority and limits: the admin API, invite codes, rate limits and slow clients."""

from __future__ import annotations

import asyncio
import contextlib
import io
import threading
import time

import aiohttp
import msgpack
import numpy as np
import pytest

import kernels
from coordinator.engine import offload
from coordinator.engine import requests as work_requests
from coordinator.engine.products import GemmFailed
from coordinator.rules.access import AccessConfig, networks
from coordinator.work.protocol import NotFound
from coordinator.work.records import Policy
from tests.factories import bits, operands, running, volunteers
from tests.procs import tilehive
from tests.volunteers import Behaviour, wait_until
from volunteer.client import CoordinatorClient, ServerRefused, compute_tile


async def admin(client: CoordinatorClient, path: str, token: str | None):
    session = client.session
    headers = {"Content-Type": "application/msgpack"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    async with session.post(client.url + path, data=msgpack.packb({}), headers=headers) as r:
        return r.status, msgpack.unpackb(await r.read())


async def test_the_admin_token_pauses_resumes_and_quarantines(tmp_path, rng):
    async with running(tmp_path, tile=16) as (co, queue, url):
        token = (tmp_path / "project" / "admin.token").read_text().strip()
        assert (tmp_path / "project" / "admin.token").stat().st_mode & 0o777 == 0o600
        async with CoordinatorClient(url) as client:
            host_id = await client.register("h")
            for wrong in (None, "nope", client.token):
                status, reply = await admin(client, "/v1/admin/pause", wrong)
                said = "wrong admin token" if wrong else "admin token required"
                assert status == 401 and reply["message"].startswith(said), reply
            assert (await admin(client, "/v1/admin/pause", token))[0] == 200
            a, b = operands(rng, 16, 16, 8, False, False)
            product = asyncio.ensure_future(queue.matmul(a, b))
            await wait_until(lambda: co.ledger.unsent)
            paused = await client.request_work("p1", capacity=2)
            assert paused["assignments"] == [] and "paused" in paused["note"]
            assert (await admin(client, f"/v1/admin/hosts/{host_id}/quarantine", token))[0] == 200
            with pytest.raises(ServerRefused, match="quarantined"):
                await client.request_work("p2", capacity=2)
            assert (await admin(client, f"/v1/admin/hosts/{host_id}/release", token))[0] == 200
            assert (await admin(client, "/v1/admin/hosts/999/release", token))[0] == 404
            assert (await admin(client, "/v1/admin/resume", token))[0] == 200
        async with volunteers(url, [Behaviour()] * 2) as crew:
            got = await crew.finish(product)
        assert np.array_equal(bits(got), bits(kernels.gemm(a, b)))
        events = await co.store.events(kind="project")
        assert [e.state for e in events] == ["paused", "resumed"]


async def test_an_admin_call_takes_no_body_or_a_small_msgpack_map_and_nothing_else(tmp_path):
    """The body went unread: any bytes of any size were taken, and changed the project."""
    async with running(tmp_path, tile=16) as (co, _, url):
        token = (tmp_path / "project" / "admin.token").read_text().strip()
        auth = {"Authorization": f"Bearer {token}"}
        path = url + "/v1/admin/pause"
        async with aiohttp.ClientSession() as session:
            plain = {**auth, "Content-Type": "text/plain"}
            async with session.post(path, data=b"pause please", headers=plain) as r:
                said = msgpack.unpackb(await r.read())["message"]
                assert r.status == 415 and "application/msgpack" in said
            big = {**auth, "Content-Type": "application/msgpack"}
            huge = io.BytesIO(msgpack.packb("x" * (2 << 20)))
            async with session.post(path, data=huge, headers=big) as r:
                assert r.status == 413
            assert not co.paused
            async with session.post(path, headers=auth) as r:  # no body at all: curl -X POST
                assert r.status == 200 and msgpack.unpackb(await r.read())["paused"] is True
            assert co.paused


@contextlib.asynccontextmanager
async def a_tile_of_step_3_held(co, queue, url: str, a, b):
    """A product of step 3 in flight, and a registered host holding one of its tiles:
    (the product, the host's client, its assignments)."""
    product = asyncio.ensure_future(queue.matmul(a, b, step=3, label="w"))
    await wait_until(lambda: co.ledger.unsent)
    async with CoordinatorClient(url) as client:
        await client.register("h")
        held = (await client.request_work("r1", capacity=1))["assignments"]
        yield product, client, held


async def test_cancelling_a_step_aborts_its_work_and_a_restart_runs_it_again(tmp_path, rng):
    a, b = operands(rng, 32, 32, 8, False, False)
    async with running(tmp_path, tile=16) as (co, queue, url):
        token = (tmp_path / "project" / "admin.token").read_text().strip()
        async with a_tile_of_step_3_held(co, queue, url, a, b) as (product, client, held):
            assert (await admin(client, "/v1/admin/steps/3/cancel", client.token))[0] == 401
            assert (await admin(client, "/v1/admin/steps/x/cancel", token))[0] == 400
            # a digit of another script is no step number (int() would read it as 3)
            assert (await admin(client, "/v1/admin/steps/%EF%BC%93/cancel", token))[0] == 400
            assert (await admin(client, "/v1/admin/steps/4/cancel", token))[0] == 404
            status, counts = await admin(client, "/v1/admin/steps/3/cancel", token)
            assert status == 200
            assert counts == {"step": 3, "gemms": 1, "workunits": 4, "aborted": 1}
            with pytest.raises(GemmFailed, match="step 3 cancelled by the operator"):
                await product
            # The host holding the cancelled work is told to drop it, and gets no more.
            again = await client.request_work(
                "r2", capacity=4, in_progress=[held[0]["result_id"]], wait=False
            )
            assert again["abort"] == [held[0]["result_id"]] and again["assignments"] == []
            assert (await admin(client, "/v1/admin/steps/3/cancel", token))[0] == 404
        # In the same run the product stays failed: its caller hears why.
        with pytest.raises(GemmFailed, match="cancelled"):
            await queue.matmul(a, b, step=3, label="w")
        assert [e.state for e in await co.store.events(kind="gemm")] == ["created", "cancelled"]
        assert [e.state for e in await co.store.events(kind="wu")].count("cancelled") == 4
    # A restarted coordinator runs the step again as a new product, bitwise equal.
    async with (
        running(tmp_path, tile=16) as (co, queue, url),
        volunteers(url, [Behaviour()] * 2) as crew,
    ):
        got = await crew.finish(queue.matmul(a, b, step=3, label="w"))
    assert np.array_equal(bits(got), bits(kernels.gemm(a, b)))


async def test_a_cancel_while_the_last_tile_is_read_waits_for_that_pass_and_the_loop_lives(
    tmp_path, rng, monkeypatch
):
    """The background pass awaits while it reads a tile; a cancel in that gap must neither
    be overwritten by 'done' nor kill the loop (it did: a KeyError, and a hung exit)."""
    # A tile this small is checked on the loop; the gap exists where a large one is read.
    monkeypatch.setattr(offload, "INLINE_BYTES", 0)
    a, b = operands(rng, 16, 16, 8, False, False)
    async with running(tmp_path, tile=16, policy=Policy.FREIVALDS) as (co, queue, url):
        reading, release = threading.Event(), threading.Event()
        get_array = co.blobs.get_array

        def slow_get_array(blob: str):
            reading.set()
            release.wait(30)
            return get_array(blob)

        co.blobs.get_array = slow_get_array
        product = asyncio.ensure_future(queue.matmul(a, b, step=5))
        await wait_until(lambda: co.ledger.unsent)
        async with CoordinatorClient(url) as client:
            await client.register("h")
            (job,) = (await client.request_work("w", capacity=1))["assignments"]
            blobs = [await client.fetch_blob(job[k], max_bytes=1 << 20) for k in "ab"]
            output_hash, tile = compute_tile(job, *blobs)
            await client.report(
                [{"result_id": job["result_id"], "hash": output_hash, "tile": tile}]
            )
        await wait_until(reading.is_set)
        cancel = asyncio.ensure_future(co.operator.cancel_step(5, time.time()))
        release.set()
        (got,) = await asyncio.gather(product, return_exceptions=True)
        (counts,) = await asyncio.gather(cancel, return_exceptions=True)
        assert not co.loop.done(), "the coordinator's loop died"
        await co.ledger.flush()  # the pass's decisions are committed within COMMIT_WINDOW
        states = [e.state for e in await co.store.events(kind="gemm")]
        # The pass that was reading finishes first (the cancel waits for it): the product is
        # done and there is nothing left to cancel. Never both, never a lost cancel.
        assert states == ["created", "done"], states
        assert np.array_equal(bits(got), bits(kernels.gemm(a, b)))
        assert isinstance(counts, NotFound)


async def test_the_admin_command_line(tmp_path):
    async with running(tmp_path, tile=16) as (co, _, url):
        project = str(tmp_path / "project")
        done = await asyncio.to_thread(tilehive, "admin", "pause", url, "--project", project)
        assert done.returncode == 0 and "paused" in done.stdout and co.paused
        done = await asyncio.to_thread(tilehive, "admin", "resume", url, "--token", "wrong")
        assert done.returncode == 1 and "401" in done.stderr and co.paused
        done = await asyncio.to_thread(tilehive, "admin", "resume", url)
        assert done.returncode == 2 and "--project" in done.stderr
        done = await asyncio.to_thread(
            tilehive, "admin", "cancel-step", url, "7", "--project", project
        )
        assert done.returncode == 1 and "404: step 7 has no products" in done.stderr


async def test_a_host_may_report_what_it_was_given_beyond_its_rate(tmp_path, rng):
    """Requests a host makes of its own accord stay within host_rate; each result it is
    given earns it a request, so a volunteer reporting a tile at a time is never throttled
    for doing the work it was given."""
    access = AccessConfig(host_rate=1.0, host_burst=3.0)
    a, b = operands(rng, 32, 8, 8, False, False)
    settings = {"tile": 8, "access": access, "policy": Policy.FREIVALDS}
    async with running(tmp_path, **settings) as (co, queue, url), CoordinatorClient(url) as c:
        await c.register("pipelined")
        product = asyncio.create_task(queue.matmul(a, b))
        await wait_until(lambda: co.ledger.unsent)
        reply = await c.request_work("ask", capacity=2)  # two tokens left of three
        assert len(reply["assignments"]) == 2
        for assignment in reply["assignments"]:  # a request each, both credited
            panels = [reply["blobs"][assignment[side]] for side in "ab"]  # sent inline
            _, tile = compute_tile(assignment, *panels, hashed=False)
            summary = await c.report([{"result_id": assignment["result_id"], "tile": tile}])
            assert summary["accepted"] == [assignment["result_id"]]
        await c.request_work("own accord 1", capacity=0)  # the one left beside the credit
        with pytest.raises(ServerRefused) as refused:
            await c.request_work("own accord 2", capacity=0)
        assert refused.value.status == 429
        product.cancel()


async def test_an_invite_code_guards_registration(tmp_path):
    access = AccessConfig(invite_code="open-sesame")
    async with running(tmp_path, access=access) as (_, _, url), CoordinatorClient(url) as c:
        with pytest.raises(ServerRefused, match="needs an invite code") as refused:
            await c.register("stranger")
        assert refused.value.status == 403
        with pytest.raises(ServerRefused, match="wrong invite code"):
            await c.register("guesser", invite="open")
        assert await c.register("friend", invite="open-sesame") >= 1


async def test_wrong_invite_codes_count_against_the_registration_budget(tmp_path):
    """Else a stranger could guess the code as fast as the coordinator answers."""
    access = AccessConfig(invite_code="open-sesame", registrations_per_hour=3)
    async with running(tmp_path, access=access) as (_, _, url), CoordinatorClient(url) as c:
        for guess in ("a", "b", "c"):
            with pytest.raises(ServerRefused, match="invite code"):
                await c.register("guesser", invite=guess)
        with pytest.raises(ServerRefused, match="registrations") as refused:
            await c.register("guesser", invite="open-sesame")
        assert refused.value.status == 429


async def test_rate_limits_answer_429_with_retry_after(tmp_path, caplog):
    """And a client that asks on and on, refused each time, is one line of the log (the
    next says how many it left out), not hundreds a second."""
    access = AccessConfig(host_rate=1.0, host_burst=3.0, registrations_per_hour=2)
    async with running(tmp_path, access=access) as (_, _, url), CoordinatorClient(url) as c:
        await c.register("busy")
        statuses = []
        for i in range(40):
            try:
                await c.request_work(f"r{i}", capacity=0)
                statuses.append(200)
            except ServerRefused as exc:
                statuses.append(exc.status)
        assert statuses[:3] == [200, 200, 200] and set(statuses[3:]) == {429}
        said = [r for r in caplog.records if r.name == "coordinator.server.api"]
        assert len([r for r in said if ": 429 " in r.getMessage()]) == 1
        headers = {"Authorization": f"Bearer {c.token}", "Content-Type": "application/msgpack"}
        body = msgpack.packb({"request_id": "x", "capacity": 0})
        async with c.session.post(url + "/v1/work", data=body, headers=headers) as reply:
            assert reply.status == 429 and int(reply.headers["Retry-After"]) >= 1
        await CoordinatorClient(url, session=c.session).register("second")
        with pytest.raises(ServerRefused, match="registrations") as refused:
            await CoordinatorClient(url, session=c.session).register("third")
        assert refused.value.status == 429


async def register_as(url: str, session, name: str, forwarded: str | None) -> int:
    """A registration as it arrives through a reverse proxy that says who it came from."""
    headers = {"Content-Type": "application/msgpack"}
    if forwarded is not None:
        headers["X-Forwarded-For"] = forwarded
    body = msgpack.packb({"name": name})
    async with session.post(url + "/v1/hosts", data=body, headers=headers) as reply:
        return reply.status


async def test_behind_a_trusted_proxy_each_volunteer_has_its_own_registration_budget(tmp_path):
    """The docs recommend a TLS reverse proxy; every volunteer then comes from the proxy's
    address, and without it named one stranger's registrations would refuse everyone's."""
    trusted = AccessConfig(registrations_per_hour=2, trusted_proxies=networks("127.0.0.1"))
    async with running(tmp_path, access=trusted) as (_, _, url), aiohttp.ClientSession() as s:
        stranger = [await register_as(url, s, f"s{i}", "203.0.113.9") for i in range(3)]
        assert stranger == [200, 200, 429]
        assert await register_as(url, s, "volunteer", "198.51.100.7") == 200
        # what the client wrote itself, left of what the proxy appended, is not believed
        assert await register_as(url, s, "liar", "192.0.2.1, 203.0.113.9") == 429


async def test_without_a_trusted_proxy_a_forwarded_header_is_not_believed(tmp_path):
    async with running(tmp_path, access=AccessConfig(registrations_per_hour=2)) as (_, _, url):
        async with aiohttp.ClientSession() as s:
            said = [await register_as(url, s, f"h{i}", f"198.51.100.{i}") for i in range(3)]
        assert said == [200, 200, 429]  # all from this machine, whatever the header says


async def test_a_client_that_stalls_its_body_gets_408(tmp_path):
    async with running(tmp_path, body_timeout=0.3) as (_, _, url):
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/hosts HTTP/1.1\r\nHost: x\r\nContent-Type: application/msgpack\r\n"
            b"Content-Length: 100\r\n\r\n\x81"
        )
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 10)
        assert b" 408 " in status_line
        writer.close()
        await writer.wait_closed()


async def report_paced(url: str, token: str, body: bytes, piece: int, every: float) -> bytes:
    """POST /v1/results with `body` sent `piece` bytes at a time, one piece each `every`
    seconds (a slow uplink's pace); the reply's status line, or b"" if the server hung up
    before the body was through."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/results HTTP/1.1\r\nHost: x\r\nContent-Type: application/msgpack\r\n"
        + f"Authorization: Bearer {token}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    )
    try:
        for start in range(0, len(body), piece):
            writer.write(body[start : start + piece])
            await writer.drain()
            if reader.at_eof() or reader._buffer:  # answered (or cut off) before the end
                break
            await asyncio.sleep(every)  # the uplink's pace, not a wait for anything
        return await asyncio.wait_for(reader.readline(), 10)
    except ConnectionError:
        return b""
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def test_a_body_from_a_slow_uplink_arrives_however_long_it_takes(tmp_path):
    """A body may take body_timeout, and a second more for each body_min_rate bytes: a
    large report over a slow uplink is not cut off for taking longer than body_timeout,
    while a client slower than the rate is."""
    # A tile of 30 KB for a result this coordinator never issued: once the body is in,
    # the answer is that it does not know it.
    tile = {"result_id": "0" * 32, "hash": "0" * 64, "tile": b"x" * 30_000}
    body = msgpack.packb({"results": [tile]})
    async with running(tmp_path, body_timeout=0.3, body_min_rate=20_000) as (_, _, url):
        async with CoordinatorClient(url) as client:
            await client.register("slow")
            token = client.token
        # about 50 KB/s: twice the rate, and about 0.6 s in all, twice the grace
        assert b" 404 " in await report_paced(url, token, body, 1_000, 0.02)
        # about 5 KB/s: a quarter of the rate
        assert b" 408 " in await report_paced(url, token, body, 1_000, 0.2)


async def test_a_host_minutes_into_a_report_is_in_contact(tmp_path):
    """Its last contact moves as the body arrives, not only once it is in: a volunteer on a
    slow uplink is counted among those connected (the reason work waits, status)."""
    tile = {"result_id": "0" * 32, "hash": "0" * 64, "tile": b"x" * 30_000}
    body = msgpack.packb({"results": [tile]})
    async with running(tmp_path, body_timeout=0.4, body_min_rate=20_000) as (co, _, url):
        async with CoordinatorClient(url) as client:
            host_id = await client.register("slow")
            token = client.token
        registered = co.ledger.hosts[host_id].last_contact
        sending = asyncio.ensure_future(report_paced(url, token, body, 1_000, 0.02))
        await wait_until(lambda: co.ledger.hosts[host_id].last_contact > registered)
        assert not sending.done()  # heard from while the body still arrives
        assert b" 404 " in await sending


async def test_the_coordinator_times_a_hosts_uplink_from_the_reports_it_takes(tmp_path, rng):
    """A report of a 256 KB tile paced at 200 KB/s, as an emulated uplink sends it
    (CoordinatorClient.pace), reads at the coordinator as an uplink of about that rate. A
    report it refuses is not timed, however slow: a host cannot make its uplink look slow
    with junk (its deadlines longer, its spares' judgement later)."""
    junk = {"result_id": "0" * 32, "hash": "0" * 64, "tile": b"x" * 500_000}
    a, b = operands(rng, 256, 256, 8, False, False)

    async def uplink(nbytes: int) -> None:
        await asyncio.sleep(nbytes / 200_000)  # the link's pace, not a wait for anything

    async def crawl(nbytes: int) -> None:
        await asyncio.sleep(nbytes / 100_000)

    async with running(tmp_path, tile=256, policy=Policy.FREIVALDS) as (co, queue, url):
        async with CoordinatorClient(url) as client:
            host_id = await client.register("slow")
            client.pace = crawl
            with pytest.raises(ServerRefused) as refused:
                await client.report([junk])
            assert refused.value.status == 404  # a result it never issued
            assert co.uplinks.rate(host_id) is None
            product = asyncio.ensure_future(queue.matmul(a, b, step=1, label="w"))
            (assignment,) = (await client.request_work("w1", capacity=1, wait=True))["assignments"]
            tile_a = await client.fetch_blob(assignment["a"], max_bytes=1 << 20)
            tile_b = await client.fetch_blob(assignment["b"], max_bytes=1 << 20)
            tile = compute_tile(assignment, tile_a, tile_b)[1]
            client.pace = uplink
            await client.report([{"result_id": assignment["result_id"], "tile": tile}])
            await asyncio.wait_for(product, 20)
        rate = co.uplinks.rate(host_id)
        assert rate is not None and 150_000 < rate < 250_000, rate


async def test_a_client_that_trickles_its_headers_is_disconnected(tmp_path):
    """Slowloris: a byte of header every 0.05 s never completes a request; the connection is
    dropped once header_timeout has passed, and the server goes on serving others."""
    async with running(tmp_path, header_timeout=0.5) as (co, _, url):
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        header = b"POST /v1/hosts HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000
        loop = asyncio.get_running_loop()
        started = loop.time()
        dropped = False
        for byte in header:
            try:
                writer.write(bytes([byte]))
                await writer.drain()
            except ConnectionError:
                dropped = True
            if dropped or reader.at_eof() or loop.time() - started > 10:
                break
            await asyncio.sleep(0.05)  # the attacker's pace, not synchronisation
        assert dropped or reader.at_eof(), "still connected after 10 s of trickled headers"
        assert await reader.read() == b""  # closed without a reply
        writer.close()
        async with CoordinatorClient(url) as client:
            await client.register("next")
        assert len(co.ledger.hosts) == 1


async def test_unparseable_http_is_a_400_and_one_log_line_not_a_traceback(tmp_path, caplog):
    async with running(tmp_path) as (_, _, url):
        host, port = url.removeprefix("http://").split(":")
        for garbage in (
            b"GET / HTTP/1.1\r\nno colon here\r\n\r\n",
            b"POST /v1/hosts HTTP/1.1\r\nX: " + b"a" * 100_000 + b"\r\n\r\n",
            b"GET / HTTP/9.9\r\n\r\n",
        ):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(garbage)
            await writer.drain()
            status_line = await asyncio.wait_for(reader.readline(), 10)
            assert status_line.split()[1:2] in ([b"400"], [b"431"], [b"505"]), status_line
            writer.close()
        async with CoordinatorClient(url) as client:
            await client.register("next")
    server = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert len(server) == 3 and all(r.exc_info is None for r in server)
    assert all("malformed HTTP" in r.getMessage() for r in server)


async def test_a_volunteer_over_the_rate_limit_slows_down_and_loses_nothing(
    tmp_path, rng, monkeypatch
):
    """A 429 is 'later', not 'never': the daemon keeps its results and sends them again."""
    from volunteer.daemon import Volunteer, VolunteerConfig

    # Two requests a second, and no panel inside an answer: a product of 16 tiles needs its
    # eight panels fetched. Reports of the results a host was given are credited beyond the
    # rate (rules/access.py); fetches are not, so the daemon is throttled whatever the load.
    monkeypatch.setattr(work_requests, "INLINE_BYTES", 0)
    access = AccessConfig(host_rate=2.0, host_burst=2.0)
    settings = {"tile": 8, "access": access, "policy": Policy.FREIVALDS}
    async with running(tmp_path, **settings) as (co, queue, url):
        worker = Volunteer(
            VolunteerConfig(
                url=url,
                state_dir=tmp_path / "vol",
                threads=1,
                max_backoff=1.0,
                low_priority=False,  # in the test process: nice 19 would slow every later test
                # The budget counts this whole process, and the test process holds the suite.
                max_memory_mb=4096,
            )
        )
        worker.prepare()
        stop = asyncio.Event()
        running_worker = asyncio.create_task(worker.run(stop))
        a, b = operands(rng, 32, 32, 8, False, False)
        try:
            got = await asyncio.wait_for(queue.matmul(a, b), 120)
        finally:
            stop.set()
            await running_worker
        assert np.array_equal(bits(got), bits(kernels.gemm(a, b)))
        refused = [e for e in await co.store.events(kind="result") if e.state == "client_error"]
        assert refused == [] and worker.stats.errors > 0  # it was throttled, and lost nothing


async def test_a_late_report_of_a_cancelled_step_purged_since_is_not_written_back(tmp_path, rng):
    """A volunteer held a tile of a step that failed (a restart found its blobs gone, or
    the operator cancelled it) and reports it after two checkpoints purged the step: the
    coordinator must not write its result back for a work unit no longer in the store,
    which broke the whole commit and stopped training (found by a review, 4 of 4 times)."""
    a, b = operands(rng, 32, 32, 8, False, False)
    async with running(tmp_path, tile=16) as (co, queue, url):
        token = (tmp_path / "project" / "admin.token").read_text().strip()
        async with a_tile_of_step_3_held(co, queue, url, a, b) as (product, client, tiles):
            (held,) = tiles
            tile_a = await client.fetch_blob(held["a"], max_bytes=1 << 20)
            tile_b = await client.fetch_blob(held["b"], max_bytes=1 << 20)
            _, tile = compute_tile(held, tile_a, tile_b)
            assert (await admin(client, "/v1/admin/steps/3/cancel", token))[0] == 200
            with pytest.raises(GemmFailed):
                await product
            await co.retention.prune(4)  # a checkpoint after step 4
            await co.retention.prune(6)  # the next: the rows of steps <= 4 are purged
            with pytest.raises(ServerRefused, match="404"):
                await client.report([{"result_id": held["result_id"], "tile": tile}])
            await co.ledger.flush()  # and the next commit goes through
            assert await co.store.result(held["result_id"]) is None


@pytest.mark.parametrize("uplink", [None, 1_000.0], ids=["hoarder", "slow uplink"])
async def test_a_host_that_sits_on_a_products_only_tile_gets_a_spare_beside_it(
    tmp_path, rng, uplink
):
    """A host that takes a tile and never reports it (slow, stopped, or hoarding) held its
    step for the tile's whole deadline, up to a minute, again and again: a product of one
    tile is never 'nearly done' for the tail rule. Now a spare goes to another, proven host
    once the tile has been out far longer than the crowd takes for one, and the host that
    sat on it gets no new work for a while, unless its own uplink, as timed, explains the
    wait (1 KB/s: its 1 KB tile takes a second to send): it is slow, not hoarding."""
    a, b = operands(rng, 16, 16, 8, False, False)
    async with running(tmp_path, tile=16, policy=Policy.FREIVALDS, straggler_floor=0.3) as (
        co,
        queue,
        url,
    ):
        async with CoordinatorClient(url) as hoarder, CoordinatorClient(url) as honest:
            await honest.register("honest")

            async def compute(assignment) -> bytes:
                tile_a = await honest.fetch_blob(assignment["a"], max_bytes=1 << 20)
                tile_b = await honest.fetch_blob(assignment["b"], max_bytes=1 << 20)
                return compute_tile(assignment, tile_a, tile_b)[1]

            # A first product proves the honest host (spares go to proven hosts only).
            first = asyncio.ensure_future(queue.matmul(b, a, step=1, label="w"))
            (mine,) = (await honest.request_work("o0", capacity=1, wait=True))["assignments"]
            await honest.report([{"result_id": mine["result_id"], "tile": await compute(mine)}])
            await asyncio.wait_for(first, 20)
            hoarder_id = await hoarder.register("hoarder")
            if uplink is not None:
                co.uplinks.timed(hoarder_id, 1_000_000, 1_000_000 / uplink, time.time())
            product = asyncio.ensure_future(queue.matmul(a, b, step=2, label="w"))
            await wait_until(lambda: co.ledger.unsent)
            (held,) = (await hoarder.request_work("h1", capacity=1))["assignments"]
            started = time.monotonic()
            work = await honest.request_work("o1", capacity=1, wait=True)
            while not work["assignments"]:
                assert time.monotonic() - started < 4, "no spare before the tile's deadline"
                work = await honest.request_work(f"o{time.monotonic()}", capacity=1, wait=True)
            (spare,) = work["assignments"]
            assert spare["wu_id"] == held["wu_id"] and spare["result_id"] != held["result_id"]
            cooled = await hoarder.request_work(
                "h2", capacity=1, in_progress=[held["result_id"]], wait=False
            )
            if uplink is None:
                assert cooled["assignments"] == [] and "no new work for 2s" in cooled["note"]
            else:
                assert "no new work" not in cooled.get("note", "")
                assert co.ledger.hosts[hoarder_id].max_in_progress == 4  # not halved
                # Judged once its uplink could have sent the tile four times over: still
                # out then, it sat on it after all.
                started = time.monotonic()
                while co.ledger.hosts[hoarder_id].max_in_progress == 4:
                    assert time.monotonic() - started < 20, "never judged"
                    await asyncio.sleep(0.1)  # polled under the deadline above
                cooled = await hoarder.request_work(
                    "h3", capacity=1, in_progress=[held["result_id"]], wait=False
                )
                assert "no new work" in cooled["note"]
            await honest.report([{"result_id": spare["result_id"], "tile": await compute(spare)}])
            got = await asyncio.wait_for(product, 20)
        assert np.array_equal(bits(got), bits(kernels.gemm(a, b)))
        events = await co.store.events(kind="wu", state="accelerated")
        assert any("straggler" in e.message for e in events)


class Probation:
    """A coordinator, an honest host proven by a first product, and a hoarder that took a
    tile and sat on it (a straggler's spare went out): on probation, once its wait is over."""

    def __init__(self, co, queue, hoarder: CoordinatorClient, honest: CoordinatorClient, rng):
        self.co, self.queue, self.hoarder, self.honest = co, queue, hoarder, honest
        self.a, self.b = operands(rng, 16, 16, 8, False, False)
        self.hoarder_id = 0
        self.step = 0

    async def start(self) -> None:
        await self.honest.register("honest")
        await self.finish(self.product())  # spares go to proven hosts
        self.hoarder_id = await self.hoarder.register("hoarder")
        first = self.product()
        await wait_until(lambda: self.co.ledger.unsent)
        await self.hoarder.request_work("h0", capacity=1)
        await self.finish(first)  # by a straggler's spare
        assert self.cooled() and self.co.requests.cooling.on_probation(self.hoarder_id)

    def product(self) -> asyncio.Future:
        self.step += 1
        return asyncio.ensure_future(self.queue.matmul(self.a, self.b, step=self.step))

    async def compute(self, client: CoordinatorClient, assignment: dict) -> bytes:
        tile_a = await client.fetch_blob(assignment["a"], max_bytes=1 << 20)
        tile_b = await client.fetch_blob(assignment["b"], max_bytes=1 << 20)
        return compute_tile(assignment, tile_a, tile_b)[1]

    async def finish(self, product: asyncio.Future) -> np.ndarray:
        """The honest host computes what it is given until the product is done."""
        while not product.done():
            work = await self.honest.request_work(f"o{time.monotonic()}", capacity=1)
            for x in work["assignments"]:
                tile = await self.compute(self.honest, x)
                await self.honest.report([{"result_id": x["result_id"], "tile": tile}])
        got = await asyncio.wait_for(product, 20)
        assert np.array_equal(bits(got), bits(kernels.gemm(self.a, self.b)))
        return got

    def ask(self, name: str) -> dict:
        return self.hoarder.request_work(name, capacity=1, wait=False)

    def cooled(self) -> bool:
        return self.co.requests.cooling.left(self.hoarder_id, time.time()) > 0

    async def takes_a_tile(self) -> tuple[asyncio.Future, dict]:
        """Its wait over, the hoarder takes the only tile of a new product."""
        await wait_until(lambda: not self.cooled())
        product = self.product()
        await wait_until(lambda: self.co.ledger.unsent)
        (taken,) = (await self.ask(f"h{self.step}"))["assignments"]
        return product, taken

    def errors(self) -> tuple[int, int]:
        """The hoarder's missed deadlines, and its tiles sat on in a row."""
        return (
            self.co.ledger.hosts[self.hoarder_id].error_count,
            self.co.requests.cooling.streak.get(self.hoarder_id, 0),
        )


@pytest.fixture
async def probation(tmp_path, rng):
    # A straggler's time of a second: the honest host computes a spare well within it.
    settings = {"tile": 16, "policy": Policy.FREIVALDS, "straggler_floor": 1.0}
    async with (
        running(tmp_path, **settings) as (co, queue, _url),
        CoordinatorClient(_url) as hoarder,
        CoordinatorClient(_url) as honest,
    ):
        hoarding = Probation(co, queue, hoarder, honest, rng)
        await hoarding.start()
        yield hoarding


async def test_a_host_that_sat_on_a_tile_has_a_spare_beside_each_tile_it_takes_until_it_computes(
    probation,
):
    """Once a host has sat on a tile, each tile it takes while it has computed nothing since
    gets a spare at once: its product does not wait a straggler's time again to learn what
    it learnt once (a hoarder cost every product it touched that time: the `hoarding`
    benchmark read 0.60-0.91 of the steps without it, 0.92-1.03 with this). A tile still in
    its hands a straggler's time later was sat on too; one dropped because the spare came
    first is not held against it. Giving tiles back does not end the probation; a result
    it computed does."""
    p, co = probation, probation.co
    # A spare at once, in the answer that gives it the tile. Still in its hands a
    # straggler's time later (the honest host slow to take the spare): sat on.
    product, taken = await p.takes_a_tile()
    wu = co.ledger.wus[taken["wu_id"]]
    assert wu.accelerated and wu.target_nresults == 2
    await wait_until(p.cooled)
    assert p.errors() == (2, 2)  # a missed deadline, and a wait twice as long
    await p.finish(product)
    said = await co.store.events(kind="wu", state="accelerated")
    assert [e.message.split(":")[0] for e in said] == ["straggler", "probation"]
    assert f"host {p.hoarder_id} holding it sat on a tile" in said[1].message

    # Giving a tile back is no missed deadline, and shows nothing computed: still on
    # probation. (A copy dropped because the spare came first: the next test.)
    product, taken = await p.takes_a_tile()
    given = await p.hoarder.report([{"result_id": taken["result_id"], "abandoned": True}])
    assert given["accepted"] == [taken["result_id"]]
    await p.finish(product)
    # The passes run as if seconds had gone by, long past its straggler's time (1 s).
    await co.passes.step(time.time() + 2.0)
    assert p.errors() == (2, 2) and co.requests.cooling.on_probation(p.hoarder_id)

    # A result it computed ends it: its next tile goes out alone.
    product, taken = await p.takes_a_tile()
    assert co.ledger.wus[taken["wu_id"]].accelerated
    tile = await p.compute(p.hoarder, taken)
    await p.hoarder.report([{"result_id": taken["result_id"], "tile": tile}])
    assert not co.requests.cooling.on_probation(p.hoarder_id)
    await p.finish(product)
    product, taken = await p.takes_a_tile()
    assert not co.ledger.wus[taken["wu_id"]].accelerated
    product.cancel()


async def test_a_host_on_probation_that_takes_tiles_and_computes_none_sat_on_them(probation):
    """Its copies dropped because the spares came first, a host on probation is judged for
    none of them alone (it may be honest and slower); having taken PROBATION_TILES with
    spares beside them and computed none, it gets nothing new, not even by waiting for work,
    and once none is left in its hands it sat on them (a second review: a hoarder took
    83-85 tiles in 40 s this way and was never cooled again; a third: one that long-polled
    took 10). Not while its owner uses the machine: from the pause's end."""
    from coordinator.rules.cooling import PROBATION_TILES

    p = probation
    for _ in range(PROBATION_TILES - 1):
        product, _ = await p.takes_a_tile()
        await p.finish(product)
        assert p.errors() == (1, 1)
    product, taken = await p.takes_a_tile()
    waiting = p.product()  # work to wait for
    await wait_until(lambda: p.co.ledger.unsent)
    held = [taken["result_id"]]
    reply = await p.hoarder.request_work("lp", capacity=1, wait=True, in_progress=held)
    assert reply["assignments"] == [] and p.errors() == (1, 1)
    await p.finish(product)
    await p.finish(waiting)
    await p.hoarder.request_work("p1", capacity=0, wait=False, paused=True)
    assert p.errors() == (1, 1)
    reply = await p.ask("then")
    assert reply["assignments"] == [] and "no new work for 4s" in reply["note"]
    assert "took 3 tiles since it last sat on one and computed none" in reply["note"]
    assert p.errors() == (2, 2)
    # Quarantined, then released by the operator: it starts over, no wait, no probation.
    await p.co.operator.set_quarantined(p.hoarder_id, True, time.time())
    await p.co.operator.set_quarantined(p.hoarder_id, False, time.time())
    assert not p.cooled() and not p.co.requests.cooling.on_probation(p.hoarder_id)


async def test_a_host_pausing_for_its_owner_is_judged_for_what_it_held_once_it_is_back(
    probation,
):
    """A host paused for its owner (`--idle-only`) computes nothing until the owner is done:
    the tile it held is judged from the pause's end, with the time it had left, not during
    the pause; and once only, or saying `paused` between its asks would put it off for
    ever."""
    p, co = probation, probation.co
    product, taken = await p.takes_a_tile()
    held = [taken["result_id"]]
    await p.hoarder.request_work("p1", capacity=0, wait=False, paused=True, in_progress=held)
    # The passes run as if seconds had gone by: past its straggler's time (1 s), within
    # its deadline (5 s).
    await co.passes.step(time.time() + 2.0)
    assert p.errors() == (1, 1)  # not judged for the pause
    await p.hoarder.request_work("b1", capacity=0, wait=False, in_progress=held)
    await p.hoarder.request_work("p2", capacity=0, wait=False, paused=True, in_progress=held)
    await co.passes.step(time.time() + 3.0)
    assert p.errors() == (2, 2)  # back, then paused again: judged all the same
    await p.finish(product)


@contextlib.asynccontextmanager
async def one_quarantined(tmp_path, rng, policy: Policy):
    """A product of one tile, two hosts, and the first quarantined by the operator while it
    holds a replica; yields (product, suspect, honest, the replica, the host's admin path,
    the admin token)."""
    a, b = operands(rng, 16, 16, 8, False, False)
    async with running(tmp_path, tile=16, policy=policy) as (co, queue, url):
        token = (tmp_path / "project" / "admin.token").read_text().strip()
        async with CoordinatorClient(url) as suspect, CoordinatorClient(url) as honest:
            suspect_id = await suspect.register("suspect")
            await honest.register("honest")
            product = asyncio.ensure_future(queue.matmul(a, b, step=1, label="w"))
            await wait_until(lambda: co.ledger.unsent)
            (held,) = (await suspect.request_work("s1", capacity=1))["assignments"]
            path = f"/v1/admin/hosts/{suspect_id}"
            assert (await admin(honest, f"{path}/quarantine", token))[0] == 200
            yield product, suspect, honest, held, path, token


async def computed(client: CoordinatorClient, request: str) -> tuple[dict, bytes]:
    """The next assignment (waiting for one) and its tile, computed honestly."""
    (got,) = (await client.request_work(request, capacity=1, wait=True))["assignments"]
    tile_a = await client.fetch_blob(got["a"], max_bytes=1 << 20)
    tile_b = await client.fetch_blob(got["b"], max_bytes=1 << 20)
    return got, compute_tile(got, tile_a, tile_b)[1]


async def test_a_quarantined_hosts_work_goes_to_others_at_once_and_its_reports_are_refused(
    tmp_path, rng
):
    async with one_quarantined(tmp_path, rng, Policy.FREIVALDS) as quarantined:
        product, suspect, honest, held, _, _ = quarantined
        # at once, not after the tile's deadline (a minute here)
        again, tile = await computed(honest, "o1")
        assert again["wu_id"] == held["wu_id"]
        with pytest.raises(ServerRefused, match="quarantined by the project's operator"):
            await suspect.report([{"result_id": held["result_id"], "tile": tile}])
        await honest.report([{"result_id": again["result_id"], "tile": tile}])
        await asyncio.wait_for(product, 20)


async def test_a_released_host_takes_again_the_work_its_quarantine_took_back(tmp_path, rng):
    """Two volunteers and a quorum of two: the replica a quarantine took back from one has
    no other host to go to. Released, that host takes it again and the product finishes
    (the take-back counted as its own give-back, and the work waited for a third host)."""
    async with one_quarantined(tmp_path, rng, Policy.QUORUM) as quarantined:
        product, suspect, honest, held, path, token = quarantined
        mine, tile = await computed(honest, "o1")
        assert mine["wu_id"] == held["wu_id"]
        await honest.report([{"result_id": mine["result_id"], "tile": tile}])
        assert (await admin(honest, f"{path}/release", token))[0] == 200
        again, tile = await computed(suspect, "s2")
        assert again["wu_id"] == held["wu_id"]
        await suspect.report([{"result_id": again["result_id"], "tile": tile}])
        await asyncio.wait_for(product, 20)


async def test_the_open_dashboard_is_made_once_however_many_ask(tmp_path, monkeypatch):
    """Anyone may load the dashboard, and a page costs the event loop milliseconds: asked
    fifty times at once and fifty times in a row, it is made once, not a hundred times."""
    from coordinator.server import dashboard

    made = []
    render = dashboard.render

    async def counted(co, fragment=False):
        made.append(fragment)
        return await render(co, fragment)

    monkeypatch.setattr(dashboard, "render", counted)
    monkeypatch.setattr(dashboard, "RENDER_EVERY", 60.0)  # the whole test inside one window
    async with running(tmp_path) as (_, _, url), aiohttp.ClientSession() as session:

        async def page() -> str:
            async with session.get(url + "/") as reply:
                assert reply.status == 200
                return await reply.text()

        pages = await asyncio.gather(*(page() for _ in range(50)))
        pages += [await page() for _ in range(50)]
    assert made == [False] and len(set(pages)) == 1 and "tilehive" in pages[0]


async def test_a_restart_holds_the_time_the_coordinator_was_down_against_no_host(tmp_path, rng):
    """A host holding a tile when its coordinator stopped cannot report it until the
    coordinator is back and the host has asked again. A restarted coordinator counted the
    time it was down as the host's: the tile out longer than a straggler's time, the host
    'sat on its work' and was cooled before it could say a word, and a deadline passed
    meanwhile halved its quota. Back, the host has a straggler's time from then: one that
    sits on the tile still sat on it."""
    a, b = operands(rng, 16, 16, 8, False, False)
    settings = {"tile": 16, "policy": Policy.FREIVALDS, "straggler_floor": 0.3}

    async def hold_a_tile(step: int) -> tuple[int, str, dict]:
        """A product of one tile; a host holding it as its coordinator stops."""
        async with running(tmp_path, **settings) as (co, queue, url):
            async with CoordinatorClient(url) as holder, CoordinatorClient(url) as other:
                await other.register("other")
                holder_id = await holder.register("holder")
                product = asyncio.ensure_future(queue.matmul(a, b, step=step, label="w"))
                await wait_until(lambda: co.ledger.unsent)
                (held,) = (await holder.request_work("h1", capacity=1))["assignments"]
            await co.ledger.flush()
            product.cancel()
        return holder_id, holder.token, held

    holder_id, token, held = await hold_a_tile(step=1)
    async with running(tmp_path, **settings) as (co, queue, url):
        before = co.ledger.hosts[holder_id]
        deadline = co.ledger.results[held["result_id"]].report_deadline
        product = asyncio.ensure_future(queue.matmul(a, b, step=1, label="w"))  # taken up again
        await wait_until(lambda: any(o.gemm for o in co.products.outputs.values()))
        # The passes run as if the coordinator had been down past a straggler's time
        # (0.3 s), and then past the tile's deadline, before the host asked again.
        await co.passes.step(min(time.time() + 1.0, deadline - 0.1))
        assert co.requests.cooling.left(holder_id, time.time()) == 0
        await co.passes.step(deadline + 1.0)
        after = co.ledger.hosts[holder_id]
        assert (after.max_in_progress, after.error_count) == (
            before.max_in_progress,
            before.error_count,
        )
        # Back, it reports the tile: taken (late, its replica timed out), and checked.
        async with CoordinatorClient(url) as holder:
            holder.token = token
            tile_a = await holder.fetch_blob(held["a"], max_bytes=1 << 20)
            tile_b = await holder.fetch_blob(held["b"], max_bytes=1 << 20)
            tile = compute_tile(held, tile_a, tile_b)[1]
            reply = await holder.report([{"result_id": held["result_id"], "tile": tile}])
            assert held["result_id"] in reply["accepted"] + reply.get("late", [])
        product.cancel()

    holder_id, token, held = await hold_a_tile(step=2)  # another tile, sat on this time
    async with running(tmp_path, **settings) as (co, queue, url):
        deadline = co.ledger.results[held["result_id"]].report_deadline
        product = asyncio.ensure_future(queue.matmul(a, b, step=2, label="w"))
        await wait_until(lambda: any(o.gemm for o in co.products.outputs.values()))
        await co.passes.step(min(time.time() + 1.0, deadline - 0.1))  # not heard: not judged
        assert co.requests.cooling.left(holder_id, time.time()) == 0
        async with CoordinatorClient(url) as holder:
            holder.token = token
            await holder.request_work("h2", capacity=0, in_progress=[held["result_id"]])
        # Heard, it holds the tile on, a straggler's time and more: it sat on it.
        await co.passes.step(min(time.time() + 1.0, deadline - 0.1))
        await co.passes.step(min(time.time() + 2.0, deadline - 0.05))
        assert co.requests.cooling.left(holder_id, time.time()) > 0
        product.cancel()
