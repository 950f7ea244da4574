"""Work that would stall the event loop goes to a worker thread, or is cut into pieces with
the loop's other work in between; small work stays on it.

A hop to a worker thread and back costs the loop a hand-off, a wake-up through its self-pipe
and a fight for the GIL with the thread: a fraction of a millisecond, paid per product and
per report, and on two shared cores a preempted thread besides. On the reference machine
hashing a megabyte costs 0.12 ms and checking one with Freivalds 0.05 ms (in cache; more
from memory), so work on less than four runs where it is, and the API still answers within
half a millisecond of it. At two, a tiny-gpt step made about 18 hops more and took 4-8%
longer (docs/performance-history.md, the twenty-sixth round).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

import numpy as np

T = TypeVar("T")

INLINE_BYTES = 4 << 20  # work on fewer bytes than this runs on the event loop
PIECE_BYTES = 1 << 20  # a copy on the loop yields to its other work after each piece


async def offload(work: Callable[[], T], size: int) -> T:
    """`work()`, on a worker thread when it touches `size` bytes or more."""
    if size < INLINE_BYTES:
        return work()
    return await asyncio.to_thread(work)


async def copy_in_pieces(out: np.ndarray, data: np.ndarray) -> None:
    """`out[...] = data` on the event loop, a block of rows of about PIECE_BYTES at a time,
    letting the loop's other callbacks run between blocks."""
    rows = max(1, PIECE_BYTES // max(1, data[:1].nbytes))
    for r0 in range(0, len(data), rows):
        if r0:
            await asyncio.sleep(0)
        out[r0 : r0 + rows] = data[r0 : r0 + rows]
