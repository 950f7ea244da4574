"""Megabyte bodies move in pieces: panels down, a report of tiles up, bit for bit."""

from __future__ import annotations

import asyncio

import msgpack
import numpy as np
import pytest

import kernels
from coordinator.server.api import PIECE_BYTES
from coordinator.work.records import Policy
from tests.factories import bits, running
from tests.volunteers import wait_until
from volunteer import client as client_module
from volunteer.client import CoordinatorClient, ServerRefused, compute_tile


@pytest.mark.parametrize("framed", [True, False], ids=["framed", "plain"])
async def test_a_product_of_megabyte_panels_goes_down_and_comes_back_up_exactly(
    tmp_path, monkeypatch, framed
):
    """Framed (the panels ride behind the answer, the tile behind the report, each uncopied)
    or plain msgpack (a client that does not read frames): the same bits."""
    if not framed:
        monkeypatch.setattr(client_module, "ACCEPT", client_module.CONTENT_TYPE)
    rng = np.random.default_rng(7)
    a = rng.standard_normal((1024, 512), dtype=np.float32)  # 2 MB: sent in pieces
    b = rng.standard_normal((512, 512), dtype=np.float32)  # 1 MB
    async with running(tmp_path, tile=1024, policy=Policy.FREIVALDS) as (co, products, url):
        stored_tiles = []
        put_many = co.blobs.put_many

        def spy(blobs, **options):
            stored_tiles.extend(blobs)
            return put_many(blobs, **options)

        monkeypatch.setattr(co.blobs, "put_many", spy)
        product = asyncio.ensure_future(products.matmul(a, b))
        await wait_until(lambda: co.ledger.unsent)
        async with CoordinatorClient(url) as client:
            await client.register("h")
            reply = await client.request_work("w", capacity=1, wait=False)
            (job,) = reply["assignments"]
            assert client.frames is framed and set(reply["blobs"]) == {job["a"], job["b"]}
            kind = memoryview if framed else bytes
            assert all(isinstance(data, kind) for data in reply["blobs"].values())
            with pytest.raises(ServerRefused, match="blob over"):
                await client.fetch_blob(job["a"], max_bytes=PIECE_BYTES)  # refused unread
            a_blob = await client.fetch_blob(job["a"], max_bytes=4 << 20)
            b_blob = await client.fetch_blob(job["b"], max_bytes=4 << 20)
            assert kernels.blob_id(a_blob) == job["a"] and len(a_blob) > 2 * PIECE_BYTES
            output_hash, tile = compute_tile(job, a_blob, b_blob)
            assert len(tile) > PIECE_BYTES  # the report goes up in pieces too
            reply = await client.report(
                [{"result_id": job["result_id"], "hash": output_hash, "tile": tile}]
            )
            assert reply["accepted"] == [job["result_id"]]
            # Framed, the stored tile is the report body's own bytes: never copied.
            (stored,) = [data for data, blob in stored_tiles if blob == output_hash]
            assert isinstance(stored, memoryview) is framed and bytes(stored) == bytes(tile)
        got = await asyncio.wait_for(product, 30)
    assert np.array_equal(bits(got), bits(kernels.gemm(a, b)))


class SlowReader:
    """An HTTP server on loopback that takes a request body `rate` bytes a second (a slow
    link between volunteer and coordinator; 0: it never reads) and answers a report."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.received = 0
        self.serving: list[asyncio.Task] = []

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        for task in self.serving:
            task.cancel()
        await asyncio.gather(*self.serving, return_exceptions=True)
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.serving.append(asyncio.current_task())
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            if not self.rate:
                await asyncio.Event().wait()  # held open, never read
            piece = 1 << 16
            while self.received < length:
                self.received += len(await reader.read(min(piece, length - self.received)))
                await asyncio.sleep(piece / self.rate)  # the link's pace
            body = msgpack.packb({"accepted": ["0" * 32]})
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/msgpack\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        finally:
            writer.close()


async def test_a_report_over_a_slow_link_is_not_cut_off_for_taking_long():
    """A report takes its timeout and a second more for each 16 KiB: 12 MB at about 8 MB/s
    outlasts the client's timeout of 0.3 s (and what the socket buffers hold) and arrives."""
    tile = bytes(12 << 20)
    async with SlowReader(rate=8 << 20) as url, CoordinatorClient(url, timeout=0.3) as client:
        reply = await client.report([{"result_id": "0" * 32, "hash": "0" * 64, "tile": tile}])
    assert reply["accepted"] == ["0" * 32]


async def test_a_report_nobody_reads_is_given_up_at_its_deadline(monkeypatch):
    """The upload's deadline holds while the body goes up: a coordinator that stops reading
    does not hold the volunteer's report for ever."""
    monkeypatch.setattr(client_module, "MIN_RATE", 1 << 40)  # the deadline: 0.3 s
    tile = bytes(12 << 20)
    async with SlowReader(rate=0) as url, CoordinatorClient(url, timeout=0.3) as client:
        sending = asyncio.ensure_future(
            client.report([{"result_id": "0" * 32, "hash": "0" * 64, "tile": tile}])
        )
        # Without the deadline the call would hang: fail then, rather than hang the suite.
        done, _ = await asyncio.wait([sending], timeout=60)
        if not done:
            sending.cancel()
            pytest.fail("the report was not given up at its deadline")
        with pytest.raises(TimeoutError):
            await sending
