"""A coordinator process serving products of many tiny tiles, for the throughput benchmarks.

Run:  .venv/bin/python benchmarks/coordinator_process.py DIR --port P [--products N] ...

It prints its URL, publishes PRODUCTS products of TILES x TILES work units each (k = 8, so a
tile costs a volunteer microseconds and the time is the coordinator's), one after another or
all at once, and, when every one is assimilated, prints one JSON line: work units, results,
seconds from the first assignment to the last assimilation, and the CPU seconds the
coordinator used. `--cpu N` pins it to one core, as the brief's bar is "on one core";
`--profile FILE` writes a cProfile of the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import sys
import time
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import numpy as np  # noqa: E402

from coordinator.access import AccessConfig  # noqa: E402
from coordinator.api import serve  # noqa: E402
from coordinator.engine import Coordinator, CoordinatorConfig  # noqa: E402
from coordinator.queue import WorkQueue  # noqa: E402
from coordinator.workunits import Policy  # noqa: E402

K = 8  # inner dimension: a tile is 2*tile*tile*K flops, nothing


async def run(args: argparse.Namespace) -> dict:
    config = CoordinatorConfig(
        directory=Path(args.directory),
        tile=args.tile,
        policy=Policy(args.policy),
        no_work_delay=0.2,
        long_poll=2.0,
        access=AccessConfig(registrations_per_hour=1_000_000, host_rate=1000.0, host_burst=2000.0),
        seed=0,
    )
    coordinator = Coordinator(config)
    runner, url = await serve(coordinator, "127.0.0.1", args.port)
    print(url, flush=True)
    rng = np.random.default_rng(0)
    size = args.tiles * args.tile
    queue = WorkQueue(coordinator)
    pairs = [
        (
            rng.standard_normal((size, K)).astype(np.float32),
            rng.standard_normal((K, size)).astype(np.float32),
        )
        for _ in range(args.products)
    ]
    if args.wait_hosts:
        while len(coordinator.ledger.hosts) < args.wait_hosts:
            await asyncio.sleep(0.05)
    cpu, wall = time.process_time(), time.perf_counter()
    for i, (a, b) in enumerate(pairs):
        await queue.matmul(a, b, step=i)
    seconds = time.perf_counter() - wall
    cpu = time.process_time() - cpu
    wus = args.products * args.tiles**2
    results = int(coordinator.stats["tiles_in"])
    await runner.cleanup()
    return {
        "wus": wus,
        "results": results,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "wu_per_s": wus / seconds,
        "hosts": args.wait_hosts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tiles", type=int, default=40, help="tiles per side")
    parser.add_argument("--tile", type=int, default=4)
    parser.add_argument("--products", type=int, default=2)
    parser.add_argument("--policy", default="quorum", choices=[p.value for p in Policy])
    parser.add_argument("--wait-hosts", type=int, default=0, help="start once N registered")
    parser.add_argument("--cpu", type=int, default=None, help="pin to this core")
    parser.add_argument("--profile", default=None, help="write a cProfile here")
    args = parser.parse_args()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        profiler.enable()
    row = asyncio.run(run(args))
    if profiler:
        profiler.disable()
        profiler.dump_stats(args.profile)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
