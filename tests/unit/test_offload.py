"""Work beside the server's event loop: a large copy on the loop lets requests in between."""

from __future__ import annotations

import asyncio

import numpy as np

from coordinator.engine.offload import PIECE_BYTES, copy_in_pieces


async def test_a_large_tile_is_copied_whole_with_the_loop_running_between_pieces(rng):
    tile = rng.standard_normal((2048, 1024)).astype(np.float32)  # 8 MB
    out = np.zeros((4096, 1024), np.float32)
    turns = 0

    async def server() -> None:  # stands for the requests the loop answers meanwhile
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    other = asyncio.create_task(server())
    await asyncio.sleep(0)
    before = turns
    await copy_in_pieces(out[1024:3072], tile)
    other.cancel()
    assert np.array_equal(out[1024:3072], tile)
    assert not out[:1024].any() and not out[3072:].any()
    assert turns - before >= tile.nbytes // PIECE_BYTES - 1


async def test_a_small_tile_is_copied_without_yielding(rng):
    tile = rng.standard_normal((16, 16)).astype(np.float32)
    out = np.empty_like(tile)
    ran = False

    def mark() -> None:
        nonlocal ran
        ran = True

    asyncio.get_running_loop().call_soon(mark)
    await copy_in_pieces(out, tile)
    assert np.array_equal(out, tile) and not ran
