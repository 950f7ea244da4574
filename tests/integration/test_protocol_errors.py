"""Untrusted bytes at the HTTP edge: every bad request is a clear 4xx, the server stays up."""

from __future__ import annotations

import asyncio
import gc
import weakref

import aiohttp
import msgpack
import numpy as np
import pytest

import kernels
import kernels.frames
import kernels.malloc
from coordinator.rules.trust import TrustConfig
from tests.factories import bits, operands, running, volunteers
from tests.volunteers import Behaviour, ScriptedVolunteer, wait_until
from volunteer.client import CoordinatorClient, compute_tile

MSGPACK = {"Content-Type": "application/msgpack"}


async def post(session, url, body, headers=None):
    async with session.post(url, data=body, headers={**MSGPACK, **(headers or {})}) as resp:
        payload = await resp.read()
        return resp.status, msgpack.unpackb(payload) if payload else None


def pack(message) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


@pytest.fixture
async def server(tmp_path, rng):
    # Never quarantined by its refused reports here, so every case reaches the parsers
    # (quarantine after refusals: test_byzantine.py).
    trust = TrustConfig(quarantine_after=10**9)
    async with running(tmp_path, tile=16, max_request_bytes=4096, trust=trust) as (co, queue, url):
        a, b = operands(rng, 24, 24, 8, False, False)
        product = asyncio.ensure_future(queue.matmul(a, b))
        await wait_until(lambda: co.ledger.unsent)
        yield co, url, (a, b, product)
        if not product.done():
            product.cancel()


async def test_malformed_and_forged_requests_get_clear_4xx(server):
    _, url, _ = server
    async with aiohttp.ClientSession() as session, CoordinatorClient(url) as alice:
        await alice.register("alice")
        auth = {"Authorization": f"Bearer {alice.token}"}
        cases = [
            ("/v1/hosts", b"\xc1\xc1 not msgpack", {}, 400, "not valid msgpack"),
            ("/v1/hosts", pack([1, 2, 3]), {}, 400, "must be a msgpack map"),
            ("/v1/hosts", pack({"name": 7}), {}, 400, "'name' must be str"),
            ("/v1/hosts", pack({"name": "x" * 500}), {}, 400, "1 to 64"),
            # digits alone would be read as another host's id by `admin quarantine URL 1`
            ("/v1/hosts", pack({"name": "1"}), {}, 400, "must not be digits alone"),
            ("/v1/hosts", pack({"name": "a", "threads": 1.5}), {}, 400, "'threads' must be int"),
            ("/v1/hosts", pack({"name": "a", "max_memory_mb": 2.5}), {}, 400, "must be int"),
            ("/v1/work", pack({"request_id": "r", "capacity": 1}), {}, 401, "Authorization"),
            (
                "/v1/work",
                pack({"request_id": "r", "capacity": 1}),
                {"Authorization": "Bearer nope"},
                401,
                "unknown token",
            ),
            ("/v1/work", pack({"request_id": "r", "capacity": "many"}), auth, 400, "capacity"),
            ("/v1/work", pack({"request_id": "r", "capacity": True}), auth, 400, "got bool"),
            (
                "/v1/work",
                pack({"request_id": "r", "capacity": 1, "cached": [b"\0" * 64]}),
                auth,
                400,
                "an id of type bytes, not str",
            ),
            ("/v1/work", pack({"request_id": "r", "capacity": 10**6}), auth, 400, "between"),
            (
                "/v1/work",
                pack({"request_id": "r", "capacity": 1, "round_trip": -0.5}),
                auth,
                400,
                "'round_trip' must be between",
            ),
            (
                "/v1/work",
                pack({"request_id": "r", "capacity": 1, "round_trip": "far"}),
                auth,
                400,
                "round_trip",
            ),
            (
                "/v1/work",
                pack({"request_id": "r", "capacity": 2, "leaving": True}),
                auth,
                400,
                "a host that is leaving asks for no work",
            ),
            ("/v1/work", pack({"request_id": "r", "capacity": 0, "leaving": 1}), auth, 400, "int"),
            (
                "/v1/work",
                pack({"request_id": "r", "capacity": 1, "paused": True}),
                auth,
                400,
                "a paused host asks for no work",
            ),
            ("/v1/work", pack({"request_id": "r", "capacity": 0, "paused": "y"}), auth, 400, "str"),
            (
                "/v1/work",
                pack({"request_id": "r", "capacity": 0, "max_memory_mb": -1}),
                auth,
                400,
                "field 'max_memory_mb' must be between 0 and",
            ),
            (
                "/v1/work",
                pack({"request_id": "r", "capacity": 0, "max_memory_mb": "lots"}),
                auth,
                400,
                "str",
            ),
            (
                "/v1/work",
                pack({"request_id": "r", "capacity": 1, "cached": ["zz"]}),
                auth,
                400,
                "malformed id",
            ),
            ("/v1/work", pack({"request_id": "r", "pad": "x" * 10_000}), auth, 413, "limit"),
            ("/v1/results", pack({"results": []}), auth, 400, "1 to 64"),
            (
                "/v1/results",
                pack({"results": [{"result_id": "0" * 32, "hash": "0" * 64}]}),
                auth,
                404,
                "unknown result",
            ),
            (
                "/v1/results",
                pack({"results": [{"result_id": "0" * 32, "hash": "nothex"}]}),
                auth,
                400,
                "hash",
            ),
        ]
        for path, body, headers, status, words in cases:
            got, reply = await post(session, url + path, body, headers)
            assert got == status, (path, body[:40], reply)
            assert words in reply["message"], (words, reply)
        framed = {"Content-Type": "application/x-tilehive-frames", **auth}
        work = pack({"request_id": "r", "capacity": 0})
        for body, words in [
            (b"THF1", "not a valid frame"),
            (b"THF1\xff\x00\x00\x00" + work, "claims 255 bytes"),
            (len(work).to_bytes(4, "little").join([b"XXXX", work]), "bad magic"),
            (b"THF1\x03\x00\x00\x00" + pack(msgpack.ExtType(9, b"")), "extension"),
            (b"THF1\x03\x00\x00\x00" + pack([1, 2]), "must be a msgpack map"),
        ]:
            got, reply = await post(session, url + "/v1/work", body, framed)
            assert got == 400 and words in reply["message"], (body[:20], reply)
        async with session.post(
            url + "/v1/hosts", data=pack({"name": "x"}), headers={"Content-Type": "text/plain"}
        ) as resp:
            assert resp.status == 415
        async with session.get(url + "/v1/blobs/not-a-hash", headers=auth) as resp:
            assert resp.status == 400
        async with session.get(url + "/v1/blobs/" + "ab" * 32, headers=auth) as resp:
            assert resp.status == 404
        async with session.get(url + "/v1/status") as resp:
            assert resp.status == 200


async def test_results_of_another_host_and_bad_tiles_are_refused_and_nothing_changes(server):
    co, url, _ = server
    async with CoordinatorClient(url) as alice, CoordinatorClient(url) as mallory:
        await alice.register("alice")
        await mallory.register("mallory")
        work = await alice.request_work("a1", capacity=1)
        (assignment,) = work["assignments"]
        result_id = assignment["result_id"]
        before = co.ledger.results[result_id]
        forged = {"result_id": result_id, "hash": "0" * 64, "tile": b"x"}
        with pytest.raises(Exception, match="403") as refused:
            await mallory.report([forged])
        assert "not assigned to host" in str(refused.value)
        a = await alice.fetch_blob(assignment["a"], max_bytes=1 << 20)
        b = await alice.fetch_blob(assignment["b"], max_bytes=1 << 20)
        good_hash, tile = compute_tile(assignment, a, b)
        for entry, words in [
            ({"hash": good_hash, "tile": tile[:-4]}, "hash"),  # truncated: hash mismatch
            ({"hash": "0" * 64, "tile": tile}, "hash mismatch"),
            ({"hash": good_hash}, "asked for the tile"),
            ({}, "field 'hash'"),  # neither the tile nor its hash
            ({"tile": tile[:-4]}, "data bytes"),  # no hash to check, and not a whole tile
            (
                {
                    "hash": kernels.blob_id(kernels.encode_array(np.zeros((3, 3), np.float32))),
                    "tile": kernels.encode_array(np.zeros((3, 3), np.float32)),
                },
                "shape",
            ),
        ]:
            with pytest.raises(Exception, match="400") as bad:
                await alice.report([{"result_id": result_id, **entry}])
            assert words in str(bad.value)
        assert co.ledger.results[result_id] == before  # nothing applied
        # The hash may be left out with the tile (the assignment says so): the coordinator
        # names the tile by the bytes.
        assert assignment["upload"] == "tile" and assignment["hash_needed"] is False
        reply = await alice.report([{"result_id": result_id, "tile": tile}])
        assert reply["accepted"] == [result_id]
        assert co.ledger.results[result_id].output_hash == good_hash
        again = await alice.report([{"result_id": result_id, "hash": good_hash, "tile": tile}])
        assert again["duplicate"] == [result_id]


async def test_the_server_still_finishes_work_after_abuse(server):
    co, url, (a, b, product) = server
    async with aiohttp.ClientSession() as session:
        for body in (b"", b"\x00" * 100, pack({"results": "x"}), pack(None)):
            status, _ = await post(session, url + "/v1/results", body)
            assert 400 <= status < 500
    async with volunteers(url, [Behaviour()] * 2) as crew:
        got = await crew.finish(product)
    assert np.array_equal(bits(got), bits(kernels.gemm(a, b)))
    await wait_until(lambda: not co.outputs)


async def test_work_given_back_goes_out_again_and_costs_the_host_nothing(server):
    co, url, _ = server
    async with CoordinatorClient(url) as alice, CoordinatorClient(url) as bob:
        alice_id = await alice.register("alice")
        await bob.register("bob")
        (assignment,) = (await alice.request_work("a1", capacity=1))["assignments"]
        result_id = assignment["result_id"]
        with pytest.raises(Exception, match="400") as bad:
            await alice.report([{"result_id": result_id, "abandoned": True, "error": "x"}])
        assert "carries no error" in str(bad.value)
        reply = await alice.report([{"result_id": result_id, "abandoned": True}])
        assert reply["accepted"] == [result_id]
        assert co.ledger.results[result_id].outcome.value == "no_reply"
        record = co.ledger.hosts[alice_id]
        assert (record.error_count, record.max_in_progress) == (0, 4)
        taken = (await bob.request_work("b1", capacity=9, wait=False))["assignments"]
        assert assignment["wu_id"] in {a["wu_id"] for a in taken}
    # The replies' promises reach the store within the passes' PROMISE_WINDOW of them.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30.0
    while not any(
        e.state == "abandoned" and e.result_id == result_id
        for e in await co.store.events(kind="result")
    ):
        assert loop.time() < deadline, "the abandoned result was never committed"
        await asyncio.sleep(0.01)


async def test_a_report_carries_the_next_work_request_and_its_answer(server):
    """One round trip per product: the reply to a report holds the answer to the work request
    that rode on it, with new assignments; a malformed one is a 400 and changes nothing."""
    co, url, _ = server
    async with CoordinatorClient(url) as alice:
        await alice.register("alice")
        first = (await alice.request_work("a1", capacity=1))["assignments"]
        (assignment,) = first
        a = await alice.fetch_blob(assignment["a"], max_bytes=1 << 20)
        b = await alice.fetch_blob(assignment["b"], max_bytes=1 << 20)
        output_hash, tile = compute_tile(assignment, a, b)
        entry = {"result_id": assignment["result_id"], "hash": output_hash, "tile": tile}
        with pytest.raises(Exception, match="400") as bad:
            await alice.report([entry], work={"request_id": "a2", "capacity": "x"})
        assert "work: field 'capacity'" in str(bad.value)
        assert co.ledger.results[assignment["result_id"]].outcome.value == "init"
        work = {"request_id": "a2", "capacity": 2, "in_progress": [], "wait": False}
        reply = await alice.report([entry], work=work)
        assert reply["accepted"] == [assignment["result_id"]]
        assert len(reply["work"]["assignments"]) == 2
        taken = {a["result_id"] for a in reply["work"]["assignments"]}
        assert assignment["result_id"] not in taken
        # The same request id again: the same answer, no new assignment.
        again = await alice.request_work("a2", capacity=2, wait=False)
        assert {a["result_id"] for a in again["assignments"]} == taken


async def raw_exchange(url: str, request: bytes, then_close: bool = False) -> bytes:
    """Bytes straight onto the socket (no client library tidies them), and the status line
    of the answer; with then_close, hang up after sending instead."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        if then_close:
            return b""
        return await reader.readline()
    finally:
        writer.close()


async def test_a_token_with_bytes_no_token_has_is_refused_not_a_500(server):
    _, url, _ = server
    for line in (
        b"POST /v1/work",
        b"POST /v1/results",
        b"POST /v1/admin/pause",
        b"GET /v1/blobs/" + b"0" * 64,
    ):
        request = (
            line + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer caf\xe9\r\n"
            b"Content-Type: application/msgpack\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
        status = await raw_exchange(url, request)
        assert status.startswith(b"HTTP/1.1 401"), (line, status)


async def test_a_body_cut_off_leaves_no_buffer_behind(server, monkeypatch):
    """The stream keeps the error that cut a body off, and the error the frames that read
    it: a buffer held there would stay until a full collection, which the server runs
    rarely, so a stranger could pin a report's megabytes per request. Freed at once."""
    _, url, _ = server
    buffers = []

    def tracked(size: int) -> memoryview:
        array = kernels.malloc.empty_bytes(size)
        buffers.append(weakref.ref(array))
        return memoryview(array)

    monkeypatch.setattr(kernels.frames, "body_buffer", tracked)
    async with CoordinatorClient(url) as alice:
        await alice.register("alice")
        size = 32 << 20  # large enough that the server is reading it when it is cut off
        head = (
            f"POST /v1/results HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {alice.token}\r\n"
            f"Content-Type: application/msgpack\r\nContent-Length: {size}\r\n\r\n"
        ).encode()
        gc.disable()
        try:
            await raw_exchange(url, head + bytes(size // 2), then_close=True)
            await wait_until(lambda: buffers and all(b() is None for b in buffers), timeout=10)
        finally:
            gc.enable()


async def test_a_volunteer_whose_registration_is_malformed_stops_instead_of_asking_forever(
    server,
):
    """The CLI refuses such a --name before start; a coordinator stricter than the
    volunteer (another version) refuses it at registration, every time, so it ends there."""
    _, url, _ = server
    volunteer = ScriptedVolunteer(url, "two\nlines")
    stop = asyncio.Event()
    try:
        await asyncio.wait_for(volunteer.run(stop), timeout=30)
    finally:
        stop.set()
    assert volunteer.refused is not None and volunteer.refused.status == 400
    assert volunteer.state == "refused" and "printable" in volunteer.note


async def test_a_volunteer_that_stops_and_starts_again_takes_back_the_work_it_gave_back(server):
    """A volunteer that stops gives back what it holds, and says it leaves. Restarted, it
    must be able to take that work again: a give-back barred its host from the
    replacement, so a project with one volunteer waited for it for ever (a review: stuck
    at step 17 of 200 after one Ctrl-C and restart)."""
    _, url, _ = server
    async with CoordinatorClient(url) as alone:
        await alone.register("alone")
        held = (await alone.request_work("s1", capacity=64))["assignments"]
        assert held
        given = [{"result_id": h["result_id"], "abandoned": True} for h in held]
        await alone.report(given)
        await alone.request_work("s2", capacity=0, wait=False, leaving=True)
        # the same volunteer, started again
        again = (await alone.request_work("s3", capacity=64, wait=False))["assignments"]
        assert {h["wu_id"] for h in again} >= {h["wu_id"] for h in held}
