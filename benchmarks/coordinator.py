"""Coordinator throughput: work units issued, validated and assimilated per second.

Run:  .venv/bin/python benchmarks/coordinator.py [--hosts N] [--tiles N] [--policy P]

A real coordinator (aiohttp server on loopback, SQLite file, blob store) and N protocol
clients in the same process, computing tiny tiles with the real kernel, so the time is the
coordinator's own: HTTP, msgpack, scheduling, validation, commits.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import numpy as np  # noqa: E402

from coordinator.api import serve  # noqa: E402
from coordinator.engine import Coordinator, CoordinatorConfig  # noqa: E402
from coordinator.queue import WorkQueue  # noqa: E402
from coordinator.workunits import Policy  # noqa: E402
from tests.volunteers import Behaviour, ScriptedVolunteer  # noqa: E402


async def measure(hosts: int, tiles_per_side: int, tile: int, policy: Policy) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        config = CoordinatorConfig(
            directory=Path(tmp), tile=tile, policy=policy, no_work_delay=0.01
        )
        coordinator = Coordinator(config)
        runner, url = await serve(coordinator, "127.0.0.1", 0)
        rng = np.random.default_rng(0)
        size = tiles_per_side * tile
        a = rng.standard_normal((size, 8)).astype(np.float32)
        b = rng.standard_normal((8, size)).astype(np.float32)
        stop = asyncio.Event()
        crew = [ScriptedVolunteer(url, f"h{i}", Behaviour(capacity=8)) for i in range(hosts)]
        tasks = [asyncio.create_task(v.run(stop)) for v in crew]
        start = time.perf_counter()
        await WorkQueue(coordinator).matmul(a, b)
        elapsed = time.perf_counter() - start
        stop.set()
        await asyncio.gather(*tasks)
        await runner.cleanup()
        wus = tiles_per_side**2
        return {"wus": wus, "seconds": elapsed, "wu_per_s": wus / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--tiles", type=int, default=40, help="tiles per side (tiles^2 WUs)")
    parser.add_argument("--tile", type=int, default=4)
    parser.add_argument("--policy", default="quorum", choices=[p.value for p in Policy])
    args = parser.parse_args()
    row = asyncio.run(measure(args.hosts, args.tiles, args.tile, Policy(args.policy)))
    print(
        f"{row['wus']} work units ({args.policy}, {args.hosts} in-process hosts, "
        f"{args.tile}x{args.tile} tiles) in {row['seconds']:.2f}s: "
        f"{row['wu_per_s']:.0f} WU/s issued, validated and assimilated"
    )


if __name__ == "__main__":
    main()
