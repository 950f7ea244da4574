"""Network benchmark: tiny-gpt trained by emulated laptops 30 ms away, against the limit.

Run:  .venv/bin/python benchmarks/network.py [--quick]

A real `tilehive coordinator DIR` process trains tiny-gpt (the model's defaults, the
Freivalds policy, so that one host can train it too) for 1, 10 and 100 emulated laptops
(volunteer/emulator.py: real HTTP on loopback, real tiles; each request waits out a 30 ms
round trip and its bytes at the laptop's bandwidth, each tile its compute time at the
laptop's speed). Seconds per step are the median of steps 2.. in DIR/train.jsonl.

The limit is the step time that the step's products allow, from what the run committed:
every dependent product costs at least one round trip (D of them a step: the forward and
backward products of one micro-batch, which wait for each other; the micro-batches and the
weight gradients run beside them), and the products' FLOPs and bytes (each operand panel
down and each tile up once) are shared by the hosts at their speed and bandwidth. Each of
these alone bounds the step from below:

    limit = max(D x RTT, FLOPs / (H x GFLOPS), down bytes / (H x down), up bytes / (H x up))

It leaves out the coordinator's own arithmetic, which a step also waits for, and assumes
the four overlap perfectly, so the system comes close to it, never under it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

from benchmarks import serve_switched  # noqa: E402
from benchmarks.report import Row  # noqa: E402
from coordinator.training import project as projects  # noqa: E402
from volunteer.emulator import run_emulation  # noqa: E402
from volunteer.profile import parse  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
COORDINATOR = [sys.executable, "-m", "coordinator.cli", "coordinator"]
RTT_MS = 30.0
GFLOPS = 25.0  # the laptops profile's median
DOWN_MBPS, UP_MBPS = 100.0, 20.0

LAPTOPS = f"""
name = "laptops-30ms"
description = "laptops {RTT_MS:g} ms away: no churn, errors or lies, so the pace is the point"
[[group]]
name = "laptop"
share = 1.0
gflops = {GFLOPS}
threads = 4
max_memory_mb = 1000
download_mbps = {DOWN_MBPS}
upload_mbps = {UP_MBPS}
latency_ms = {RTT_MS}
session_s = 1000000.0
offline_s = 1.0
churn = 0.0
graceful = 1.0
error_rate = 0.0
lie_rate = 0.0
"""


def limit(directory: Path, hosts: int, micro_batches: int) -> tuple[float, dict]:
    """The step time the committed products allow (see the module's docstring)."""
    with sqlite3.connect(f"file:{directory / 'state.db'}?mode=ro", uri=True) as db:
        gemms = db.execute("SELECT step, label, m, n, k FROM gemms").fetchall()
    steps = sorted({step for step, *_ in gemms})
    last = steps[-1]
    step = [g for g in gemms if g[0] == last]
    flops = sum(2.0 * m * n * k for _, _, m, n, k in step)
    down = sum(4.0 * (m * k + k * n) for _, _, m, n, k in step)
    up = sum(4.0 * m * n for _, _, m, n, _ in step)
    chained = [label for _, label, *_ in step if label.endswith((".fwd", ".dx"))]
    depth = len(chained) / micro_batches
    bounds = {
        "round trips": depth * RTT_MS / 1e3,
        "compute": flops / (hosts * GFLOPS * 1e9),
        "download": down * 8 / (hosts * DOWN_MBPS * 1e6),
        "upload": up * 8 / (hosts * UP_MBPS * 1e6),
    }
    binding = max(bounds, key=bounds.get)
    parts = {
        "depth": depth,
        "gflop": flops / 1e9,
        "down_mb": down / 1e6,
        "up_mb": up / 1e6,
        "binding": binding,
    }
    return bounds[binding], parts


async def train(directory: Path, hosts: int, timeout: float) -> None:
    log = (directory.parent / f"{directory.name}.log").open("w")
    bind = f"127.0.0.1:{serve_switched.free_port()}"
    process = subprocess.Popen(
        # --keep-serving: the emulator sees the project finished in /v1/status, then stops.
        [*COORDINATOR, str(directory), "--bind", bind, "--keep-serving"],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        cwd=ROOT,
        env=ENV,
    )
    try:
        line = await asyncio.to_thread(process.stdout.readline)
        found = re.search(r"connect to (\S+)", line)
        if not found:
            raise RuntimeError(f"the coordinator did not start: {line!r}")
        report = await run_emulation(
            found.group(1),
            hosts,
            parse(LAPTOPS, "laptops-30ms"),
            until_done=True,
            duration=timeout,
            seed=1,
            ramp=0.2,
            interval=1.0,
        )
        if report.errors:
            raise RuntimeError(f"emulated hosts met errors: {report.errors}")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()
        log.close()


def run(quick: bool = False) -> list[Row]:
    steps = 3 if quick else 6
    rows = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tilehive-network-") as tmp:
        for hosts in (1, 10, 100):
            directory = Path(tmp) / f"tiny-{hosts}"
            project = projects.create(
                directory,
                **{
                    "training.steps": steps,
                    "training.checkpoint_every": steps,
                    "training.eval_every": steps,
                    "corpus.max_mb": 1,
                    "work.policy": "freivalds",
                    "access.registrations_per_hour": 100000,
                },
            )
            asyncio.run(train(directory, hosts, timeout=900))
            lines = (directory / "train.jsonl").read_text().splitlines()
            if len(lines) != steps:
                raise RuntimeError(f"{hosts} hosts trained {len(lines)} of {steps} steps")
            seconds = statistics.median(json.loads(x)["seconds"] for x in lines[1:] if x)
            bound, parts = limit(directory, hosts, project.training.micro_batches)
            rows.append(
                Row(
                    "network",
                    f"tiny-gpt, {hosts} emulated laptop{'s' if hosts > 1 else ''} "
                    f"{RTT_MS:g} ms away: seconds per step / the limit",
                    f"{seconds:.2f} / {bound:.2f} s ({seconds / bound:.1f}x)",
                    note=(
                        f"freivalds; laptops of {GFLOPS:g} GFLOPS, {DOWN_MBPS:g}/{UP_MBPS:g} "
                        f"Mbit/s; the limit is the {parts['binding']}: of "
                        f"{parts['depth']:.0f} dependent products x {RTT_MS:g} ms, "
                        f"{parts['gflop']:.1f} GFLOP, {parts['down_mb']:.1f} MB down and "
                        f"{parts['up_mb']:.1f} MB up shared by {hosts}; "
                        f"median of steps 2-{steps}"
                    ),
                )
            )
    elapsed = f"; {time.perf_counter() - started:.0f}s in all"
    rows[-1] = dataclasses.replace(rows[-1], note=rows[-1].note + elapsed)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    args = parser.parse_args()
    for row in run(args.quick):
        print(f"{row.area} {row.measure}: {row.value}  ({row.note})")


if __name__ == "__main__":
    main()
