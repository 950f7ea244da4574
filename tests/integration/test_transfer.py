"""Megabyte bodies move in pieces: panels down, a report of tiles up, bit for bit."""

from __future__ import annotations

import asyncio

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
