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
`--max-memory 200` peaked at 280-340 MB (docs/performance-history.md, the nineteenth round). So it
takes the opposite setting: one arena, and every block of 2 MiB or more mapped on its own and
unmapped when freed, so that its resident memory is what it holds. The price is the zeroed
pages of each new block, which the coordinator's setting saves.

Part of that price can be had back. The volunteer's large buffers (a body read from the
network, the tile its kernel writes) take their memory from `empty_bytes`, which in the
volunteer's setting maps each one on its own, starting at a 2 MiB boundary, and asks the
kernel for 2 MiB pages in it (`MADV_HUGEPAGE`). A page fault then fills 2 MiB instead of
4 KiB, and the kernel that writes the tile and reads its operands misses the TLB less. On
the larger project a volunteer took 72,000-78,000 page faults in 6 steps instead of
733,000-743,000, its system time fell by about an eighth, and the step by 1-5% (three pairs:
2.58-2.70 s against 2.68-2.73 s), its peak no higher (174-177 MB against 175-179;
docs/performance-history.md, the twenty-fourth round; `benchmarks/malloc.py` isolates it:
0.73x the CPU of np.empty's buffers). glibc's own mappings start 16 bytes past a page and
numpy advises only arrays of 4 MiB or more, so most of such a buffer came in 4 KiB pages
before. Where the kernel must compact memory to find a huge page, a fault
may wait for it: numpy already asks the same for its large arrays, in every process.

The rest can be had back within the volunteer's budget. A step makes and frees the same few
sizes of buffers over and over (the larger project's panels and tiles: 1.5 GB a step), and
zeroing their fresh pages was 8% of the CPU of both processes under `perf`, most of it the
kernel's thread writing a tile into a fresh buffer and the main thread filling a body read
from the network. So a freed buffer's mapping is kept (`Recycler`) for the next buffer of
exactly its size, as long as the buffers in use and those kept fit a limit the daemon sets
within the memory it gives its work and its cache (`recycle_within`): its resident size
stays within what it may hold, a kept buffer is unmapped before a fresh one would pass the
limit, and all of them are whenever the daemon waits (`let_go`).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import mmap
import os
import sys
import threading
import weakref

import numpy as np

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on a 64-bit machine
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: in effect, never trim
RETURN_THRESHOLD = 2 << 20  # the volunteer's: blocks of this size or more unmapped when freed
HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64 and most arm64 kernels

# Whether empty_bytes maps large buffers on their own (the volunteer's setting).
_own_mappings = False


def keep_freed_memory() -> bool:
    """Tune glibc's malloc for speed, as above; True if it took. A no-op off glibc, and
    when the user set any of these in the environment (their setting wins). Call it before
    other threads start: a thread that has allocated keeps its arena."""
    return _tune(((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD)))


def return_freed_memory() -> bool:
    """Tune glibc's malloc for a bounded resident size, as above (the volunteer daemon's),
    and map large buffers on their own (`empty_bytes`); True if it took. The same conditions
    as keep_freed_memory: where the user set malloc's thresholds, neither is done."""
    global _own_mappings
    # Setting the threshold also stops glibc from raising it, and the trim threshold with it.
    took = _tune(((M_MMAP_THRESHOLD, RETURN_THRESHOLD),))
    _own_mappings = took and hasattr(mmap, "MADV_HUGEPAGE")
    return took


def empty_bytes(nbytes: int) -> np.ndarray:
    """A writable uint8 array of `nbytes`, its contents whatever the memory held.

    After `return_freed_memory`, a buffer of a huge page or more is a private mapping of its
    own whose data starts on a huge page, with huge pages asked for over the whole ones it
    spans. The rest of the mapping, from the last, partial huge page on, is kept in small
    pages even where the kernel gives huge pages unasked, so that nothing past the buffer
    becomes resident. When the last view of the array goes, its mapping is unmapped, or kept
    for the next buffer of its size (`recycle_within`). Otherwise, and below a huge page, it
    is `np.empty`."""
    if not _own_mappings or nbytes < HUGE_PAGE:
        return np.empty(nbytes, np.uint8)
    return recycler.take(nbytes)


def recycle_within(limit: int) -> None:
    """Keep freed large buffers for reuse while those in use and those kept total at most
    `limit` bytes (0: keep none). Only after `return_freed_memory`."""
    recycler.limit = max(0, limit)


def let_go() -> None:
    """Unmap every freed buffer kept for reuse: the process holds only what it uses."""
    recycler.let_go()


class Recycler:
    """The mappings of freed large buffers, kept for the next buffer of the same size.

    A buffer's mapping comes back when the last view of its array goes: a finalizer on the
    array queues it, from whichever thread dropped it, without a lock, since that can happen
    in the middle of any allocation (the garbage collector). The next `take` files what was
    queued, then reuses a kept mapping of exactly the size asked for, or unmaps the oldest
    kept until the new one fits the limit beside the buffers in use."""

    def __init__(self) -> None:
        self.limit = 0
        self.in_use = 0  # bytes of the buffers handed out and not yet freed
        self._kept: collections.OrderedDict[int, tuple[int, mmap.mmap, int]] = (
            collections.OrderedDict()
        )
        self._freed: collections.deque[tuple[int, mmap.mmap, int]] = collections.deque()
        self._lock = threading.Lock()  # two threads taking at once

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            self._file_freed()
            same = next((key for key, kept in self._kept.items() if kept[0] == nbytes), None)
            if same is not None:
                _, mapping, start = self._kept.pop(same)
            else:
                # The oldest kept go first, before the new mapping makes the process grow.
                while self._kept and self.in_use + self.kept_bytes() + nbytes > self.limit:
                    self._kept.popitem(last=False)  # its last reference: unmapped
                mapping, start = _fresh_mapping(nbytes)
            self.in_use += nbytes
        try:
            whole = np.frombuffer(mapping, np.uint8)
            freed = weakref.finalize(whole, self._freed.append, (nbytes, mapping, start))
        except BaseException:
            with self._lock:
                self.in_use -= nbytes  # never handed out: nothing will give it back
            raise
        freed.atexit = False  # nothing to keep at exit
        return whole[start : start + nbytes]

    def let_go(self) -> None:
        with self._lock:
            self._file_freed()
            self._kept.clear()

    def kept_bytes(self) -> int:
        return sum(size for size, _, _ in self._kept.values())  # a few dozen at most

    def _file_freed(self) -> None:
        freed = []
        while self._freed:
            freed.append(self._freed.popleft())
        self.in_use -= sum(size for size, _, _ in freed)  # all of them first: none is in use
        for size, mapping, start in freed:
            if self.in_use + self.kept_bytes() + size <= self.limit:
                self._kept[id(mapping)] = (size, mapping, start)


recycler = Recycler()


def _fresh_mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """A private mapping with room for `nbytes` from a huge page boundary, and that start."""
    # Room to move the start to a huge page boundary; the part skipped is never touched.
    try:
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:  # out of memory, as np.empty would say it (not a network error)
        raise MemoryError(f"cannot map {nbytes} bytes: {exc.strerror}") from exc
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    start = -address % HUGE_PAGE
    huge = nbytes // HUGE_PAGE * HUGE_PAGE
    with contextlib.suppress(OSError):  # a kernel without transparent huge pages
        mapping.madvise(mmap.MADV_HUGEPAGE, start, huge)
        mapping.madvise(mmap.MADV_NOHUGEPAGE, start + huge, len(mapping) - start - huge)
    return mapping, start


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
