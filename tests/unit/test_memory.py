"""A freed array's memory is reused by the next array of its size, without fresh pages."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="tunes glibc's malloc, on Linux only"
)

# Minor page faults taken by allocating and filling a 16 MiB array after one was freed.
FAULTS_OF_A_SECOND_ARRAY = """
import resource, sys
import numpy as np
from kernels.memory import keep_freed_memory
took = keep_freed_memory() if sys.argv[1] == "tuned" else False
x = np.ones(4 << 20, np.float32); del x
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
y = np.ones(4 << 20, np.float32)
print(took, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def second_array(mode: str, **env: str) -> tuple[bool, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    clean.pop("GLIBC_TUNABLES", None)
    out = subprocess.run(
        [sys.executable, "-c", FAULTS_OF_A_SECOND_ARRAY, mode],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return out[0] == "True", int(out[1])


def test_a_freed_array_is_reused_without_fresh_pages() -> None:
    took, faults = second_array("tuned")
    if not took:
        pytest.skip("not glibc's malloc")
    _, untuned = second_array("default")
    # 16 MiB is 4,096 pages (8 huge ones): untuned, glibc maps the block afresh.
    assert faults < 8 <= untuned


def test_a_threshold_set_in_the_environment_wins() -> None:
    took, _ = second_array("tuned", MALLOC_TRIM_THRESHOLD_="131072")
    assert not took
    took, _ = second_array("tuned", GLIBC_TUNABLES="glibc.malloc.mmap_threshold=65536")
    assert not took
