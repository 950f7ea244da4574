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
