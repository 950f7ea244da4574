"""A freed array's memory is reused by the next array of its size, without fresh pages (the
coordinator's setting); or given back at once, so the process holds what it uses (the
volunteer's)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="tunes glibc's malloc, on Linux only"
)

# Minor page faults taken by allocating and filling five 16 MiB arrays after five were freed,
# on the main thread and on another: a thread's own arena grows in heaps of 64 MiB and
# unmaps one as soon as it is empty.
FAULTS_OF_ARRAYS_MADE_AGAIN = """
import resource, sys, threading
import numpy as np
from kernels.malloc import keep_freed_memory
took = keep_freed_memory() if sys.argv[1] == "tuned" else False
faults = []
def make_again():
    x = [np.ones(4 << 20, np.float32) for _ in range(5)]; del x
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    y = [np.ones(4 << 20, np.float32) for _ in range(5)]
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
make_again()
worker = threading.Thread(target=make_again); worker.start(); worker.join()
print(took, *faults)
"""


# Resident MiB left over once a 16 MiB tile and then five 4 MiB panels, each filled, are
# freed: glibc raises its mapping threshold to the tile's size when the tile is unmapped,
# so by default the panels come from the heap, and stay resident once freed.
RESIDENT_AFTER_FREEING = """
import sys
import numpy as np
from kernels.malloc import return_freed_memory
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
took = return_freed_memory() if sys.argv[1] == "tuned" else False
before = resident()
tile = np.ones(4 << 20, np.float32); del tile
panels = [np.ones(1 << 20, np.float32) for _ in range(5)]; del panels
print(took, resident() - before)
"""


def run_probe(script: str, mode: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    clean.pop("GLIBC_TUNABLES", None)
    return subprocess.run(
        [sys.executable, "-c", script, mode],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()


def faults_of_arrays_made_again(mode: str, **env: str) -> tuple[bool, int, int]:
    out = run_probe(FAULTS_OF_ARRAYS_MADE_AGAIN, mode, **env)
    return out[0] == "True", int(out[1]), int(out[2])


def test_a_freed_array_is_reused_without_fresh_pages() -> None:
    took, main_thread, worker = faults_of_arrays_made_again("tuned")
    if not took:
        pytest.skip("not glibc's malloc")
    _, untuned_main, untuned_worker = faults_of_arrays_made_again("default")
    # 80 MiB is 20,480 pages (40 huge ones): untuned, glibc maps blocks afresh.
    assert main_thread < 8 and untuned_main >= 40
    assert worker < 8 and untuned_worker >= 8


def test_a_threshold_set_in_the_environment_wins() -> None:
    took, _, _ = faults_of_arrays_made_again("tuned", MALLOC_TRIM_THRESHOLD_="131072")
    assert not took
    took, _, _ = faults_of_arrays_made_again("tuned", GLIBC_TUNABLES="glibc.malloc.arena_max=4")
    assert not took


def test_the_volunteers_setting_gives_freed_arrays_back() -> None:
    took, left = run_probe(RESIDENT_AFTER_FREEING, "tuned")
    if took != "True":
        pytest.skip("not glibc's malloc")
    _, untuned_left = run_probe(RESIDENT_AFTER_FREEING, "default")
    assert float(left) < 4 and float(untuned_left) >= 16


# Minor page faults taken by filling a fresh 8 MiB buffer from empty_bytes (and huge pages the
# kernel could not find meanwhile), whether its data starts on a huge page, whether a view
# outlives the array it was cut from, and whether a size just past a huge page and a small
# one are whole and writable.
A_LARGE_BUFFER = """
import gc, resource, sys
from kernels.malloc import empty_bytes, return_freed_memory
def fallbacks():
    with open("/proc/vmstat") as f:
        return sum(int(v) for k, v in (l.split() for l in f) if k == "thp_fault_fallback")
took = return_freed_memory()
buffer = empty_bytes(8 << 20)
before, missed = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, fallbacks()
buffer[:] = 7
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
missed = fallbacks() - missed
aligned = buffer.ctypes.data % (2 << 20) == 0
view = buffer[1 << 20 :]
del buffer
gc.collect()
view[:] = 9  # the mapping lives as long as a view of it
odd, small = empty_bytes((2 << 20) + 1), empty_bytes(1 << 20)
odd[:] = 3
whole = view.sum() == 9 * len(view) and len(odd) == (2 << 20) + 1 and odd.sum() == 3 * len(odd)
print(took, faults, missed, aligned, whole, small.flags.owndata)
"""


def huge_pages_given() -> bool:
    """Whether this kernel gives this process transparent huge pages when asked."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return False
        with open("/proc/self/status") as f:
            return "THP_enabled:\t0" not in f.read()
    except OSError:
        return False


def test_the_volunteers_large_buffers_are_in_huge_pages() -> None:
    took, faults, missed, aligned, whole, small_is_numpys = run_probe(A_LARGE_BUFFER, "tuned")
    if took != "True":
        pytest.skip("not glibc's malloc")
    assert aligned == "True" and whole == "True" and small_is_numpys == "True"
    if not huge_pages_given() or int(missed):
        pytest.skip("this kernel gave no huge page")
    # 8 MiB is 2,048 small pages or 4 huge ones (the first and last may stay small).
    assert int(faults) < 200


# What a buffer the process has no room for raises: MemoryError, as np.empty's would, not the
# OSError of a failed mapping (which a volunteer would take for a network error and retry).
NO_ROOM = """
import resource
from kernels.malloc import empty_bytes, return_freed_memory
took = return_freed_memory()
with open("/proc/self/statm") as f:
    mapped = int(f.read().split()[0]) * resource.getpagesize()
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, (mapped + (256 << 20), hard))  # room for 256 MiB more
try:
    empty_bytes(2 << 30)
except MemoryError:
    print(took, "MemoryError")
"""


def test_a_buffer_without_room_is_a_memory_error() -> None:
    took, raised = run_probe(NO_ROOM, "tuned")
    if took != "True":
        pytest.skip("not glibc's malloc")
    assert raised == "MemoryError"


# A daemon's freed buffers, kept within a limit of 24 MiB: whether an 8 MiB buffer taken
# after one was freed is that one (its old bytes, not a fresh mapping's zeros), also when the
# first was freed by another thread; the resident MiB added by a 20 MiB buffer that does not
# fit beside the kept one (which must go first); those still added once it is freed and the
# next buffer taken (kept); after `let_go`; and, within a limit of 16 MiB, what a freed
# 20 MiB buffer leaves resident (it does not fit: unmapped).
RECYCLED = """
import os, threading
from kernels import malloc
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
took = malloc.return_freed_memory()
malloc.recycle_within(24 << 20)
tile = malloc.empty_bytes(8 << 20); tile[:] = 7; del tile
again = malloc.empty_bytes(8 << 20)
reused = bool((again == 7).all())
again[:] = 5
dropper = threading.Thread(target=lambda: globals().pop("again"))
dropper.start(); dropper.join()
across = bool((malloc.empty_bytes(8 << 20) == 5).all())  # dropped at once: kept again
base = resident()
other = malloc.empty_bytes(20 << 20); other[:] = 1
beside = resident() - base
del other
small = malloc.empty_bytes(2 << 20); small[:] = 1  # files the freed one: kept, 22 of 24
kept = resident() - base
malloc.let_go()
after_rest = resident() - base
malloc.recycle_within(16 << 20)
big = malloc.empty_bytes(20 << 20); big[:] = 1
before = resident()
del big
small = malloc.empty_bytes(2 << 20)  # files the freed one: 20 MiB do not fit 16
dropped = resident() - before
print(took, reused, across, round(beside), round(kept), round(after_rest), round(dropped))
"""


def test_a_daemons_freed_buffer_is_reused_within_its_limit_and_given_back_at_rest() -> None:
    took, reused, across, beside, kept, after_rest, dropped = run_probe(RECYCLED, "tuned")
    if took != "True":
        pytest.skip("not glibc's malloc")
    assert reused == "True" and across == "True"
    # The kept 8 MiB were unmapped before the 20 MiB were mapped: 24 at most, never 28.
    assert int(beside) <= 13
    assert int(kept) >= 13  # the 20 freed and kept, within the limit, and the 2 taken
    assert int(after_rest) <= -6  # given back: the 20 and the 8 before them
    assert int(dropped) <= -18  # beyond the limit: unmapped when it was filed
