"""Kernel benchmark: our deterministic sgemm vs numpy/OpenBLAS, and Freivalds' share.

Run:  .venv/bin/python benchmarks/kernels.py [--markdown] [--repeats N]

Every row is measured side by side in one process. OpenBLAS is measured with its best kernel
for this CPU: if OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE are set (some machines pin an older
kernel for safety) the script re-runs itself with both unset, for this command alone.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

# This file is named like the package it measures: keep its own folder off the import path.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

PINNED = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
if any(name in os.environ for name in PINNED) and "TILEHIVE_BENCH_CHILD" not in os.environ:
    env = {k: v for k, v in os.environ.items() if k not in PINNED}
    env["TILEHIVE_BENCH_CHILD"] = "1"
    os.execve(sys.executable, [sys.executable, *sys.argv], env)

import numpy as np  # noqa: E402
from threadpoolctl import threadpool_info, threadpool_limits  # noqa: E402

import kernels  # noqa: E402

try:
    from validation import freivalds
except ImportError:  # before the validation package lands
    freivalds = None

SHAPES = [  # (m, n, k, trans_a, trans_b, label)
    (128, 128, 128, False, False, "square"),
    (256, 256, 256, False, False, "square"),
    (512, 512, 512, False, False, "square"),
    (1024, 1024, 1024, False, False, "square"),
    (512, 512, 512, False, True, "dY@W^T"),
    (512, 512, 512, True, False, "X^T@dY"),
    (2048, 384, 96, False, False, "tall X@W"),
]


def best_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_medians(first, second, repeats: int) -> tuple[float, float]:
    """Median times of two calls timed alternately, so clock ramps and caches favour neither."""
    first(), second()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, bucket in ((first, times[0]), (second, times[1])):
            start = time.perf_counter()
            fn()
            bucket.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def measure_row(
    rng: np.random.Generator,
    m: int,
    n: int,
    k: int,
    trans_a: bool,
    trans_b: bool,
    label: str,
    repeats: int,
) -> dict:
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
    opa = a.T if trans_a else a
    opb = b.T if trans_b else b
    out = np.empty((m, n), np.float32)
    flags = {"trans_a": trans_a, "trans_b": trans_b}
    flops = 2.0 * m * n * k
    row = {"shape": f"{m}x{n}x{k} {label}"}
    for threads in (1, 2):
        ours = best_time(lambda t=threads: kernels.gemm(a, b, out=out, threads=t, **flags), repeats)
        row[f"ours_{threads}"] = flops / ours / 1e9
    for threads in (1, 2):
        with threadpool_limits(limits=threads):
            theirs = best_time(lambda: np.matmul(opa, opb, out=out), repeats)
        row[f"numpy_{threads}"] = flops / theirs / 1e9
    # OpenBLAS's threads spin for a while after a call; let them park before we measure on.
    time.sleep(0.5)
    if freivalds is not None:
        c = kernels.gemm(a, b, **flags)
        key = bytes(range(32))

        def verify():
            return freivalds.verify(a, b, c, key=key, wu_id="bench", **flags)

        def compute():
            return kernels.gemm(a, b, out=out, **flags)

        cold, compute_time = interleaved_medians(verify, compute, max(repeats, 21))
        warm = median_time(verify, max(repeats, 21))
        row["freivalds"] = cold / compute_time
        row["freivalds_warm"] = warm / compute_time
    return row


def measure(repeats: int) -> list[dict]:
    rng = np.random.default_rng(0)
    return [measure_row(rng, *shape, repeats) for shape in SHAPES]


def machine() -> str:
    blas = [
        f"{info.get('internal_api')} {info.get('version')} ({info.get('architecture')})"
        for info in threadpool_info()
        if info.get("user_api") == "blas"
    ]
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores; Python {platform.python_version()}, numpy "
        f"{np.__version__}, BLAS {', '.join(blas) or 'unknown'}; tilehive kernel "
        f"{kernels.kernel_name()}"
    )


def table(rows: list[dict]) -> str:
    lines = [
        "| shape (m x n x k) | ours 1t GFLOPS | numpy 1t | ratio 1t | ours 2t | numpy 2t "
        "| ratio 2t | ours 2t/1t | Freivalds / compute, warm | cold |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        frei = (
            f"{100 * r['freivalds_warm']:.1f}% | {100 * r['freivalds']:.1f}%"
            if "freivalds" in r
            else "n/a | n/a"
        )
        lines.append(
            f"| {r['shape']} | {r['ours_1']:.1f} | {r['numpy_1']:.1f} | "
            f"{r['ours_1'] / r['numpy_1']:.2f} | {r['ours_2']:.1f} | {r['numpy_2']:.1f} | "
            f"{r['ours_2'] / r['numpy_2']:.2f} | {r['ours_2'] / r['ours_1']:.2f} | {frei} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per cell (best of)")
    args = parser.parse_args()
    print(f"Machine: {machine()}\n")
    print(table(measure(args.repeats)))
    print(
        "\nGFLOPS = 2mnk / best-of-N wall time; ratio = ours / numpy at the same thread count; "
        "Freivalds / compute = median verify time (default rounds) / median 1-thread gemm time; "
        "warm: verify timed back to back (operands in cache), cold: verify and gemm timed "
        "alternately (the gemm evicts the operands, as on a validator reading tiles from disk)."
    )


if __name__ == "__main__":
    main()
