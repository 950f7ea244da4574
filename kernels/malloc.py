"""Freed arrays keep their memory, so the next array of the same size needs no fresh pages.

A step allocates and frees the same few sizes of large arrays over and over: panels, tiles,
report bodies, the model's activations. glibc's malloc gives each block of 128 KiB or more its
own mapping (the threshold grows with the blocks freed, to at most 32 MiB) and hands freed
memory at the top of its heap back to the kernel once more than 128 KiB is free. Each new
mapping is then zeroed by the kernel a page at a time on first touch: on the larger project that
was about a tenth of the coordinator's CPU (`clear_page_erms` under `perf`), on the two cores
the volunteer's kernel shares with it.

With the mapping threshold at its ceiling and trimming off, a freed block stays in the heap
and the next block of its size reuses it. One arena for all threads: a thread's own arena
grows in heaps of 64 MiB and unmaps a heap as soon as it is empty, whatever the trim
threshold, so a worker thread that makes and drops 16 MiB arrays faulted fresh pages in all
the same (half the coordinator's system time was left after the thresholds alone). Its cost,
threads taking one lock to allocate, does not show: the threads allocate between long stretches
of work, and most hold the GIL when they do.

The cost is that a process keeps its high-water mark of freed memory (what it once needed at
once) instead of returning it; blocks above 32 MiB are still mapped and unmapped one by one.
So the coordinator and `train --local` tune it that way. The volunteer daemon runs on someone
else's machine within its `--max-memory`, and there glibc's defaults were the problem: with the
mapping threshold grown to a 16 MiB tile, every panel and tile after it came from heaps that
freed memory does not leave, one heap per thread, and on the larger project a daemon of
`--max-memory 200` peaked at 280-340 MB (docs/performance.md, the nineteenth round). So it
takes the opposite setting: one arena, and every block of 2 MiB or more mapped on its own and
unmapped when freed, so that its resident memory is what it holds. The price is the zeroed
pages of each new block, which the coordinator's setting saves.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on a 64-bit machine
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: in effect, never trim
RETURN_THRESHOLD = 2 << 20  # the volunteer's: blocks of this size or more unmapped when freed


def keep_freed_memory() -> bool:
    """Tune glibc's malloc for speed, as above; True if it took. A no-op off glibc, and
    when the user set any of these in the environment (their setting wins). Call it before
    other threads start: a thread that has allocated keeps its arena."""
    return _tune(((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD)))


def return_freed_memory() -> bool:
    """Tune glibc's malloc for a bounded resident size, as above (the volunteer daemon's);
    True if it took. The same conditions as keep_freed_memory."""
    # Setting the threshold also stops glibc from raising it, and the trim threshold with it.
    return _tune(((M_MMAP_THRESHOLD, RETURN_THRESHOLD),))


def _tune(settings: tuple[tuple[int, int], ...]) -> bool:
    """mallopt each setting and one arena for all threads; True if every one took."""
    if not sys.platform.startswith("linux"):
        return False
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if any(
        f"MALLOC_{name.upper()}_" in os.environ or f"glibc.malloc.{name}" in tunables
        for name in ("mmap_threshold", "trim_threshold", "arena_max")
    ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # musl's mallopt exists and returns 0: nothing to tune there.
    settings = (*settings, (M_ARENA_MAX, 1))
    return all([bool(mallopt(param, value)) for param, value in settings])  # each one tried
