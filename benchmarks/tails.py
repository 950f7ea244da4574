"""Tails benchmark: the time of a fixed chain of products when 10% of hosts are 10x slower,
with and without tail acceleration.

Run:  .venv/bin/python benchmarks/tails.py [--quick]

A real coordinator process (benchmarks/serve_switched.py: aiohttp on loopback, SQLite, blob
store, quorum policy) computes the same products one after another, as a training step's
dependent products are, for emulated volunteers (volunteer/emulator.py: real HTTP, real
tiles, compute time modelled): 90% of them at FAST GFLOPS, 10% at a tenth of that. Runs
with tail acceleration on (the default: spare replicas for the last 10% of a product's
tiles, for fast reliable hosts) and off (tail_fraction above 1) take turns, three rounds
(one with --quick); the ratio is the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import numpy as np  # noqa: E402

from benchmarks import serve_switched  # noqa: E402
from benchmarks.report import Row  # noqa: E402
from volunteer.emulator import run_emulation  # noqa: E402
from volunteer.profile import parse  # noqa: E402

FAST = 0.2  # modelled GFLOPS of a fast host: a 128x128x512 tile takes 84 ms
SLOW = FAST / 10


def profile(gflops: float, name: str):
    return parse(
        f"""
name = "{name}"
description = "hosts of {gflops} GFLOPS on loopback"

[[group]]
name = "{name}"
share = 1.0
gflops = {gflops}
"""
    )


def operands(path: Path, products: int, size: int, k: int) -> None:
    rng = np.random.default_rng(0)
    arrays = {}
    for i in range(products):
        arrays[f"a{i}"] = rng.standard_normal((size, k)).astype(np.float32)
        arrays[f"b{i}"] = rng.standard_normal((k, size)).astype(np.float32)
    np.savez(path, **arrays)


async def _emulate(url: str, process, hosts: int) -> tuple[list, dict]:
    """The crew (exactly hosts // 10 slow ones) until the coordinator reports its result."""
    stop = asyncio.Event()
    slow = max(1, hosts // 10)

    async def watch() -> dict:
        try:
            return await asyncio.to_thread(serve_switched.result, process, 600)
        finally:
            stop.set()

    watcher = asyncio.create_task(watch())
    common = {"stop": stop, "seed": 1, "ramp": 0.5, "stop_timeout": 5.0}
    reports = await asyncio.gather(
        run_emulation(url, hosts - slow, profile(FAST, "fast"), name_prefix="fast", **common),
        run_emulation(url, slow, profile(SLOW, "slow"), name_prefix="slow", **common),
    )
    return reports, await watcher


def measure(workdir: Path, npz: Path, hosts: int, tail_fraction: float, name: str) -> dict:
    directory = workdir / name
    process, url = serve_switched.start(
        directory,
        "--operands",
        str(npz),
        "--tile",
        "128",
        "--wait-hosts",
        str(hosts),
        "--tail-fraction",
        str(tail_fraction),
    )
    try:
        reports, row = asyncio.run(_emulate(url, process, hosts))
    finally:
        serve_switched.close(process)
    row["errors"] = sum(r.error_count for r in reports)
    row["error_kinds"] = [r.errors for r in reports]
    row["aborted"] = sum(r.aborted for r in reports)
    return row


def run(quick: bool = False) -> list[Row]:
    hosts = 10 if quick else 20
    products = 3 if quick else 8
    repeats = 1 if quick else 3
    size, k = (512, 512) if quick else (1024, 512)
    tiles = (size // 128) ** 2
    on_runs, off_runs = [], []
    with tempfile.TemporaryDirectory(prefix="tilehive-tails-") as tmp:
        workdir = Path(tmp)
        npz = workdir / "operands.npz"
        operands(npz, products, size, k)
        started = time.perf_counter()
        for i in range(repeats):  # in turn, so a busy spell on the machine hits both
            on_runs.append(measure(workdir, npz, hosts, 0.9, f"accelerated-{i}"))
            off_runs.append(measure(workdir, npz, hosts, 2.0, f"plain-{i}"))
        elapsed = time.perf_counter() - started
    ratios = [off["seconds"] / on["seconds"] for on, off in zip(on_runs, off_runs, strict=True)]
    on_s = [r["seconds"] for r in on_runs]
    off_s = [r["seconds"] for r in off_runs]
    rounds = f"median of {repeats} rounds" if repeats > 1 else "one round"
    setup = (
        f"{products} products {size}x{size}x{k} in {tiles} tiles of 128, one after another, "
        f"quorum; {hosts} emulated hosts, {max(1, hosts // 10)} of them at {SLOW:g} GFLOPS "
        f"and the rest at {FAST:g}"
    )

    def per_product(runs: list[dict]) -> float:
        return statistics.median(x for r in runs for x in r["per_product"])

    return [
        Row(
            "tails",
            "seconds for the chain, tail acceleration on",
            f"{statistics.median(on_s):.1f}",
            note=f"{setup}; {rounds}: {', '.join(f'{x:.1f}' for x in on_s)}; median product "
            f"{per_product(on_runs):.2f}s; {sum(r['accelerated'] for r in on_runs)} spare "
            f"replicas, {sum(r['errors'] for r in on_runs)} emulator errors",
        ),
        Row(
            "tails",
            "seconds for the chain, tail acceleration off",
            f"{statistics.median(off_s):.1f}",
            note=f"tail_fraction 2.0: no spares; {rounds}: {', '.join(f'{x:.1f}' for x in off_s)};"
            f" median product {per_product(off_runs):.2f}s; "
            f"{sum(r['errors'] for r in off_runs)} emulator errors",
        ),
        Row(
            "tails",
            "time without / with tail acceleration",
            f"{statistics.median(ratios):.2f}x",
            note=f"{rounds} run in turn: {', '.join(f'{x:.2f}' for x in ratios)}; "
            f"{elapsed:.0f}s in all",
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer hosts and products")
    args = parser.parse_args()
    for row in run(args.quick):
        print(f"{row.area:8} {row.measure}: {row.value}  ({row.note})")


if __name__ == "__main__":
    main()
