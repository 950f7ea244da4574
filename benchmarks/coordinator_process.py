"""A coordinator process serving products of many tiny tiles, for the throughput benchmarks.

Run:  .venv/bin/python benchmarks/coordinator_process.py DIR --port P [--products N] ...

It prints its URL and publishes products of TILES x TILES work units each (by default k = 8,
so a tile costs a volunteer microseconds and the time is the coordinator's), one after another. Once
WAIT_HOSTS hosts have registered it measures, for DURATION seconds (or until PRODUCTS are
done), the work units assimilated, and prints one JSON line: work units, seconds, and the CPU
seconds the coordinator used (all its threads). `--cpu N` pins it to one core, as the
brief's bar is "on one core"; `--profile FILE` writes a cProfile of the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import signal
import sys
import time
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import numpy as np  # noqa: E402
from aiohttp import web  # noqa: E402

from coordinator.cli.serve import tune_interpreter  # noqa: E402
from coordinator.engine.coordinator import Coordinator, CoordinatorConfig  # noqa: E402
from coordinator.rules.access import AccessConfig  # noqa: E402
from coordinator.server.api import serve  # noqa: E402
from coordinator.state.sqlite import SqliteStore  # noqa: E402
from coordinator.work.records import Policy, WuState  # noqa: E402


def bytes_written() -> int | None:
    """Bytes this process has written so far (Linux's /proc/self/io), or None."""
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(": ") for line in f.read().splitlines() if line)
        return int(fields["wchar"])
    except (OSError, KeyError, ValueError):
        return None


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def assimilated(coordinator: Coordinator) -> int:
    """Work units assimilated so far: the ledger's own count (a wrapper around its writes
    cost about 1% of the coordinator's CPU in the throughput row)."""
    return coordinator.ledger.workunit_counts[WuState.ASSIMILATED.value]


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
    coordinator = Coordinator(config, SqliteStore(config.directory / "state.db"))
    work_seconds: list[float] = []  # server side, from the request's arrival to the reply

    @web.middleware
    async def timed(request: web.Request, handler):
        started = time.perf_counter()
        try:
            return await handler(request)
        finally:
            if request.path == "/v1/work":
                work_seconds.append(time.perf_counter() - started)

    runner, url = await serve(coordinator, "127.0.0.1", args.port, outer=[timed])
    print(url, flush=True)
    rng = np.random.default_rng(0)
    size = args.tiles * args.tile
    queue = coordinator.products

    async def products() -> None:
        step = 0
        while args.products == 0 or step < args.products:
            a = rng.standard_normal((size, args.k)).astype(np.float32)
            b = rng.standard_normal((args.k, size)).astype(np.float32)
            await queue.matmul(a, b, step=step)
            step += 1

    producing = asyncio.create_task(products())
    while len(coordinator.ledger.hosts) < args.wait_hosts:
        await asyncio.sleep(0.05)
    base, cpu, wall = assimilated(coordinator), time.process_time(), time.perf_counter()
    written = bytes_written()
    work_seconds.clear()
    if args.duration:
        await asyncio.wait([producing], timeout=args.duration)
    else:
        await producing
    seconds = time.perf_counter() - wall
    cpu = time.process_time() - cpu
    wus = assimilated(coordinator) - base
    if written is not None:
        written = bytes_written() - written
    row = {
        "wus": wus,
        "results": int(coordinator.stats["tiles_in"]),
        "seconds": seconds,
        "cpu_seconds": cpu,
        "wu_per_s": wus / seconds,
        "hosts": len(coordinator.ledger.hosts),
        "wu_per_cpu_s": wus / cpu if cpu else 0.0,
        "work_requests": len(work_seconds),
        # All the process wrote (the store's WAL and its checkpoints, blobs, logs): a
        # commit writes each page it touches whole, so this is what the rows' order costs.
        "bytes_written_per_wu": written / wus if written is not None and wus else None,
        "work_p50_ms": 1000 * percentile(work_seconds, 0.50),
        "work_p99_ms": 1000 * percentile(work_seconds, 0.99),
    }
    print(json.dumps(row), flush=True)
    if args.linger:  # serve on, so the hosts can leave cleanly, until told to stop
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
    producing.cancel()
    await asyncio.gather(producing, return_exceptions=True)
    await runner.cleanup()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tiles", type=int, default=40, help="tiles per side")
    parser.add_argument("--tile", type=int, default=4)
    parser.add_argument("--k", type=int, default=8, help="inner dimension (8: tiles cost nothing)")
    parser.add_argument("--products", type=int, default=2, help="0: one after another, forever")
    parser.add_argument(
        "--duration", type=float, default=0.0, help="measure this long (0: until the products end)"
    )
    parser.add_argument("--policy", default="quorum", choices=[p.value for p in Policy])
    parser.add_argument("--wait-hosts", type=int, default=0, help="start once N registered")
    parser.add_argument(
        "--linger", action="store_true", help="after measuring, serve on until SIGTERM"
    )
    parser.add_argument("--cpu", type=int, default=None, help="pin to this core")
    parser.add_argument("--profile", default=None, help="write a cProfile here")
    args = parser.parse_args()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    tune_interpreter()  # as a coordinator's process runs
    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        profiler.enable()
    asyncio.run(run(args))
    if profiler:
        profiler.disable()
        profiler.dump_stats(args.profile)


if __name__ == "__main__":
    main()
