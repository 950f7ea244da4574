"""Panel encoding benchmark: how long the coordinator's event loop stalls while a worker
thread encodes a product's operand panels, with `bytes.join` (kernels.encode_array, which
holds the GIL for the whole copy of a memoryview) against kernels.array_blob (one numpy copy
with the GIL released).

Run:  .venv/bin/python benchmarks/panel_stalls.py [--rounds N]

Each round encodes the panels of the larger project's operands, a 2048 x 2048 float32
activation (16 MB) whole and as 8 column panels of 256 (strided views), on a worker thread,
while the event loop ticks; once each way, alternately. The figures are medians over the
rounds: the loop's longest gap between two ticks, the sum of its gaps over 1 ms, and the
encoding's wall time. The interpreter is set as a coordinator's (its GIL switch interval).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from collections.abc import Callable

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import numpy as np  # noqa: E402

import kernels  # noqa: E402
from benchmarks.report import Row, run_alone  # noqa: E402
from coordinator.cli.serve import tune_interpreter  # noqa: E402
from coordinator.engine.recovery import panels  # noqa: E402

SIDE, TILE = 2048, 256


def joined(view: np.ndarray) -> bytes:
    """The encoding before array_blob: a contiguous copy of a strided panel, then a join."""
    return kernels.encode_array(np.ascontiguousarray(view))


async def stalls_while(encode: Callable[[np.ndarray], object], views: list[np.ndarray]):
    """(longest gap between the loop's ticks, the sum of its gaps over 1 ms, encoding wall
    seconds) while a worker thread encodes `views`."""
    done = asyncio.Event()
    gaps: list[float] = []

    async def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    started = time.perf_counter()
    await asyncio.to_thread(lambda: [encode(v) for v in views])
    wall = time.perf_counter() - started
    done.set()
    await ticker
    return max(gaps), sum(g for g in gaps if g > 1e-3), wall


def run(rounds: int = 5) -> list[Row]:
    tune_interpreter()
    x = np.random.default_rng(0).standard_normal((SIDE, SIDE), dtype=np.float32)
    _, cols = panels(x, x, False, False, TILE, SIDE, SIDE)
    views = [x, *cols]  # the operand whole, and strided column panels
    assert all(bytes(kernels.array_blob(v)) == joined(v) for v in views[:2])
    ways = {"join": joined, "array_blob": kernels.array_blob}
    measured: dict[str, list[tuple[float, float, float]]] = {way: [] for way in ways}
    for _ in range(rounds):
        for way, encode in ways.items():
            measured[way].append(asyncio.run(stalls_while(encode, views)))
    med = {
        way: tuple(statistics.median(m[i] for m in runs) for i in range(3))
        for way, runs in measured.items()
    }
    (gap_j, sum_j, wall_j), (gap_a, sum_a, wall_a) = med["join"], med["array_blob"]
    mb = sum(v.nbytes for v in views) / 1e6
    note = f"{mb:.0f} MB of panels on a worker thread; medians of {rounds} alternating rounds"
    return [
        Row(
            "panels",
            "the event loop's longest stall while a worker encodes panels: array_blob / join",
            f"{gap_a / gap_j:.2f}x",
            note=f"{gap_a * 1e3:.1f} against {gap_j * 1e3:.1f} ms; {note}",
        ),
        Row(
            "panels",
            "the event loop's time in stalls over 1 ms meanwhile: array_blob / join",
            f"{sum_a / sum_j:.2f}x" if sum_j else "n/a",
            note=f"{sum_a * 1e3:.1f} against {sum_j * 1e3:.1f} ms",
        ),
        Row(
            "panels",
            "wall time to encode them: array_blob / join",
            f"{wall_a / wall_j:.2f}x",
            note=f"{wall_a * 1e3:.1f} against {wall_j * 1e3:.1f} ms",
        ),
    ]


def main() -> None:
    run_alone(__doc__, run, rounds=5)


if __name__ == "__main__":
    main()
