"""Kernel benchmark: our deterministic sgemm vs numpy/OpenBLAS, and Freivalds' share.

Run:  .venv/bin/python benchmarks/kernels.py [--repeats N] [--rounds R] [--only SHAPE]

Every row is measured side by side in one process. OpenBLAS is measured with its best kernel
for this CPU: if OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE are set (some machines pin an older
kernel for safety) the script re-runs itself with both unset, for this command alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
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

ROUNDS = freivalds.DEFAULT_ROUNDS if freivalds is not None else 0  # --rounds sets it

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
    pool_bytes: int,
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
        row.update(measure_freivalds(rng, a, b, flags, repeats, pool_bytes))
    return row


def last_level_cache() -> int:
    """Bytes of the largest CPU cache (sysfs), or 32 MiB when the system does not say."""
    sizes = []
    for index in range(8):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size") as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG") or 0) * scale)
    return max(sizes, default=32 << 20)


def measure_freivalds(rng, a, b, flags, repeats: int, pool_bytes: int) -> dict:
    """Check time over 1-thread product time (the check runs on one thread), three ways.

    warm: each timed back to back on one tile, its operands in cache.
    cold: each call on the next tile of a pool of distinct tiles whose operands (a, b, c)
      add up to pool_bytes (twice the last-level cache), so every operand comes from memory
      while the code stays warm, as on a validator checking a stream of tiles; the checks
      and the products are timed in separate loops (alternating blocks), so that neither
      pays for the other's traffic.
    alternating: check and product timed alternately on one tile (this file's "cold" before
      2026-11-22): the check finds the operands wherever the product left them (partly
      evicted by time and the product's own writes), the product finds them warm.
    path: each side as tilehive runs it, on the pool's tiles kept in a real BlobStore on
      disk: the validator loads a, b and c (read and hash-verified, Engine._freivalds_all) and
      then checks; a volunteer has a and b just downloaded and verified, and then computes.
      Only the check and the product are timed; the loads are the blob store's cost.
    """
    key = bytes(range(32))
    reps = max(repeats, 21)

    def tile(a, b):
        c = kernels.gemm(a, b, **flags)
        return a, b, c, np.empty_like(c)

    def verify(t):
        return freivalds.verify(t[0], t[1], t[2], key=key, wu_id="bench", rounds=ROUNDS, **flags)

    def compute(t):
        return kernels.gemm(t[0], t[1], out=t[3], **flags)

    first = tile(a, b)
    count = max(3, -(-pool_bytes // sum(x.nbytes for x in first[:3])))
    pool = [first] + [
        tile(
            rng.standard_normal(a.shape).astype(np.float32),
            rng.standard_normal(b.shape).astype(np.float32),
        )
        for _ in range(count - 1)
    ]
    warm_check = median_time(lambda: verify(first), reps)
    warm_compute = median_time(lambda: compute(first), reps)
    cold: tuple[list[float], list[float]] = ([], [])
    for _ in range(2):
        for fn, bucket in ((verify, cold[0]), (compute, cold[1])):
            for i in range(max(reps, count)):
                t = pool[i % count]
                start = time.perf_counter()
                fn(t)
                bucket.append(time.perf_counter() - start)
    cold_check, cold_compute = statistics.median(cold[0]), statistics.median(cold[1])
    alt_check, alt_compute = interleaved_medians(
        lambda: verify(first), lambda: compute(first), reps
    )
    path_check, path_compute = measure_path(pool, verify, compute, max(reps, count))
    return {
        "freivalds_warm": warm_check / warm_compute,
        "freivalds": cold_check / cold_compute,
        "freivalds_alt": alt_check / alt_compute,
        "freivalds_path": path_check / path_compute,
        "check_ms": (warm_check * 1e3, cold_check * 1e3, path_check * 1e3),
        "compute_ms": (warm_compute * 1e3, cold_compute * 1e3, path_compute * 1e3),
    }


def measure_path(pool: list, verify, compute, calls: int) -> tuple[float, float]:
    """Median check and product times right after their operands are loaded from a BlobStore
    (measure_freivalds' "path")."""
    from coordinator.state.blobs import BlobStore

    with tempfile.TemporaryDirectory() as tmp:
        store = BlobStore(tmp, max_blob_bytes=1 << 30, memory_bytes=0)
        ids = [[store.put_array(x) for x in t[:3]] for t in pool]
        checks, products = [], []
        for i in range(calls):
            a, b, c = (store.get_array(blob) for blob in ids[i % len(ids)])
            start = time.perf_counter()
            verify((a, b, c))
            checks.append(time.perf_counter() - start)
        for i in range(calls):
            a, b = (store.get_array(blob) for blob in ids[i % len(ids)][:2])
            out = np.empty_like(pool[0][3])
            start = time.perf_counter()
            compute((a, b, None, out))
            products.append(time.perf_counter() - start)
    return statistics.median(checks), statistics.median(products)


def measure(repeats: int, pool_bytes: int, only: str | None = None) -> list[dict]:
    rng = np.random.default_rng(0)
    shapes = [s for s in SHAPES if only is None or only in f"{s[0]}x{s[1]}x{s[2]} {s[5]}"]
    return [measure_row(rng, *shape, repeats, pool_bytes) for shape in shapes]


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
        "| ratio 2t | ours 2t/1t | Freivalds / compute: warm | cold | alternating | path |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        frei = (
            f"{100 * r['freivalds_warm']:.1f}% | {100 * r['freivalds']:.1f}% | "
            f"{100 * r['freivalds_alt']:.1f}% | {100 * r['freivalds_path']:.1f}%"
            if "freivalds" in r
            else "n/a | n/a | n/a | n/a"
        )
        lines.append(
            f"| {r['shape']} | {r['ours_1']:.1f} | {r['numpy_1']:.1f} | "
            f"{r['ours_1'] / r['numpy_1']:.2f} | {r['ours_2']:.1f} | {r['numpy_2']:.1f} | "
            f"{r['ours_2'] / r['numpy_2']:.2f} | {r['ours_2'] / r['ours_1']:.2f} | {frei} |"
        )
    return "\n".join(lines)


def times(rows: list[dict]) -> str:
    lines = [
        "| shape | check ms: warm | cold | path | 1t product ms: warm | cold | path |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "check_ms" in r:
            cells = " | ".join(f"{ms:.3f}" for ms in (*r["check_ms"], *r["compute_ms"]))
            lines.append(f"| {r['shape']} | {cells} |")
    return "\n".join(lines)


def main() -> None:
    global ROUNDS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per cell (best of)")
    parser.add_argument(
        "--pool-mb",
        type=int,
        default=None,
        help="tiles cycled through for the cold Freivalds figure (default: twice the "
        "last-level cache)",
    )
    parser.add_argument(
        "--rounds", type=int, default=ROUNDS, help="Freivalds rounds (default: DEFAULT_ROUNDS)"
    )
    parser.add_argument("--only", help="measure only the shapes whose name contains this")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON only")
    args = parser.parse_args()
    ROUNDS = args.rounds
    pool_bytes = (args.pool_mb << 20) if args.pool_mb else 2 * last_level_cache()
    if args.json:
        print(
            json.dumps({"machine": machine(), "rows": measure(args.repeats, pool_bytes, args.only)})
        )
        return
    print(f"Machine: {machine()}\n")
    rows = measure(args.repeats, pool_bytes, args.only)
    print(table(rows))
    print()
    print(times(rows))
    print(
        "\nGFLOPS = 2mnk / best-of-N wall time; ratio = ours / numpy at the same thread count. "
        f"Freivalds / compute = median verify time ({ROUNDS} rounds, one thread) / median "
        "1-thread gemm time under the same cache condition: warm = each timed back to back "
        f"on one tile; cold = each call on the next tile of a pool of {pool_bytes >> 20} MiB "
        "of operands (from memory, code warm); alternating = verify and gemm timed "
        "alternately on one tile; path = each right after its operands were loaded from a "
        "BlobStore on disk, as the validator and a volunteer run them."
    )


if __name__ == "__main__":
    main()
