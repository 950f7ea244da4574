"""The kernels' shared thread pool: runs a kernel over ranges of its output, one per thread.

Kernels release the GIL, so Python threads run them in parallel. Every element of an output
belongs to exactly one range, so how the work is split never changes a bit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def executor(workers: int) -> ThreadPoolExecutor:
    """A pool of at least `workers` threads, grown (never shrunk) on demand."""
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < workers:
            # The smaller pool is not shut down: another thread may be submitting to it right
            # now; its idle workers exit once it is garbage.
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tilehive-kernel")
            _pool_size = workers
        return _pool


def run_ranges(fn: Callable[[int, int], object], ranges: Sequence[tuple[int, int]]) -> None:
    """fn(start, end) for every range: the first on this thread, the others on the pool."""
    if not ranges:
        return
    if len(ranges) == 1:
        fn(*ranges[0])
        return
    pool = executor(len(ranges) - 1)
    futures = [pool.submit(fn, start, end) for start, end in ranges[1:]]
    try:
        fn(*ranges[0])
    finally:
        for future in futures:
            future.result()
