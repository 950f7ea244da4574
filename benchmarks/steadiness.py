"""Whether the machine kept its speed through a run of the suite: the same two probes at
its start and at its end.

The suite runs for about twenty minutes on a shared virtual machine whose speed moves
under it: the forty-second round's recording began with a `--local` tiny-gpt step of 0.048 s
and read 0.062 s a quarter of an hour later. Each area's ratios are measured side by side,
so they hold better than its absolute figures, but a reader comparing two areas, or two
recordings, needs to know whether the machine held still. The probes are short (about a
second each) and measure the two speeds the table depends on: Python's (the coordinator's
loop) and the kernel's.

Run alone: .venv/bin/python benchmarks/steadiness.py (the two probes, twice, back to back).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import numpy as np  # noqa: E402

import kernels  # noqa: E402
from benchmarks.report import Row  # noqa: E402

REPEATS = 7  # the probe's time is the fastest of these: what the machine can do right now
MOVED = 0.10  # a change of either speed beyond this many parts says: compare ratios only


@dataclass(frozen=True)
class Speeds:
    python_ms: float  # the Python probe's time: dictionaries, tuples, strings, calls
    gflops: float  # the kernel on one thread at 512^3


def _python_work() -> int:
    """The kind of work the coordinator's loop does for each message: small dictionaries,
    tuples and strings."""
    seen: dict[int, tuple[int, str]] = {}
    for i in range(100_000):
        seen[i & 1023] = (i, str(i))
    return len(seen)


def measure() -> Speeds:
    python = []
    for _ in range(REPEATS):
        began = time.perf_counter()
        _python_work()
        python.append(time.perf_counter() - began)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((512, 512), dtype=np.float32)
    b = rng.standard_normal((512, 512), dtype=np.float32)
    out = np.empty((512, 512), np.float32)
    kernels.gemm(a, b, out=out, threads=1)  # warm: code and pages
    gemm = []
    for _ in range(REPEATS):
        began = time.perf_counter()
        kernels.gemm(a, b, out=out, threads=1)
        gemm.append(time.perf_counter() - began)
    return Speeds(1e3 * min(python), 2.0 * 512**3 / min(gemm) / 1e9)


def rows(start: Speeds, end: Speeds) -> list[Row]:
    """The speeds at the run's end over those at its start (1.00: the machine held still;
    below 1: it slowed)."""
    python = start.python_ms / end.python_ms
    kernel = end.gflops / start.gflops
    moved = max(abs(python - 1.0), abs(kernel - 1.0)) > MOVED
    warning = (
        "; the machine's speed moved during this run: compare the ratios measured side by "
        "side, not absolute figures across areas"
        if moved
        else ""
    )
    return [
        Row(
            "machine",
            "Python's speed at the run's end / at its start",
            f"{python:.2f}x",
            note=f"a probe of dictionaries, tuples and strings: {start.python_ms:.1f} ms at "
            f"the start, {end.python_ms:.1f} ms at the end, the fastest of {REPEATS}{warning}",
        ),
        Row(
            "machine",
            "the kernel's speed at the run's end / at its start",
            f"{kernel:.2f}x",
            note=f"512^3 on one thread: {start.gflops:.0f} GFLOPS at the start, "
            f"{end.gflops:.0f} at the end, the fastest of {REPEATS}",
        ),
    ]


def main() -> None:
    for row in rows(measure(), measure()):
        print(f"{row.area} {row.measure}: {row.value}  ({row.note})")


if __name__ == "__main__":
    main()
