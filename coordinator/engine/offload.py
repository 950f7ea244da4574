"""Work that would stall the event loop goes to a worker thread; small work stays on it.

A hop to a worker thread and back costs the loop a hand-off, a wake-up through its self-pipe
and a fight for the GIL with the thread: a fraction of a millisecond, paid per product and
per report. Hashing a megabyte, or checking a tile of one with Freivalds, costs 0.1-0.2 ms
on the reference machine, so work on less than two runs where it is, and the API still
answers within a millisecond of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

INLINE_BYTES = 2 << 20  # work on fewer bytes than this runs on the event loop


async def offload(work: Callable[[], T], size: int) -> T:
    """`work()`, on a worker thread when it touches `size` bytes or more."""
    if size < INLINE_BYTES:
        return work()
    return await asyncio.to_thread(work)
