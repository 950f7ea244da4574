"""A coordinator process for the communication, tails and peer benchmarks, with its switches.

Run:  .venv/bin/python benchmarks/serve_switched.py DIR --port P (--operands NPZ | --train)
          [--policy quorum|freivalds|both] [--tile T] [--wait-hosts N] [--no-cache-preference]
          [--no-hash-only] [--tail-fraction F] [--output NPZ]

It prints its URL, waits for N hosts to register, then either computes the products in
NPZ (`a0`, `b0`, `a1`, ...: one after another, as the dependent products of a training step
are) or trains the project in DIR (`--train`, as `tilehive coordinator DIR` does), and prints
one JSON line: seconds from the first product to the last assimilation (and per product),
the bytes the coordinator received and sent (its /metrics counters: HTTP bodies), and what
the lower bound on those bytes needs (the panels each host was sent work on, the tiles).
With `--linger` it then serves on (no work) until its stdin closes, so hosts can stop first.
`--output` saves the products (`c0`, `c1`, ...) for a bitwise comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import numpy as np  # noqa: E402

import kernels  # noqa: E402
from coordinator.engine.coordinator import Coordinator, CoordinatorConfig  # noqa: E402
from coordinator.rules.access import AccessConfig  # noqa: E402
from coordinator.rules.scheduler import SchedulerConfig  # noqa: E402
from coordinator.server.api import serve  # noqa: E402
from coordinator.state.sqlite import SqliteStore  # noqa: E402
from coordinator.work.records import Policy  # noqa: E402

OPEN_ACCESS = AccessConfig(registrations_per_hour=1_000_000, host_rate=1000.0, host_burst=2000.0)


def blob_size(rows: int, cols: int) -> int:
    """Bytes of the blob of a float32 rows x cols array (header included)."""
    return len(kernels.encode_array(np.zeros((rows, cols), np.float32)))


def wire_floor(directory: Path) -> dict:
    """The lower bound's parts, from the committed state: every operand panel once per host
    that was sent work on it, every output tile once, and every panel once (one host)."""
    with sqlite3.connect(f"file:{directory / 'state.db'}?mode=ro", uri=True) as db:
        wus = db.execute("SELECT id, i0, i1, j0, j1, k, a_panel, b_panel FROM workunits").fetchall()
        accelerated = db.execute(
            "SELECT COUNT(*) FROM events WHERE kind = 'wu' AND state = 'accelerated'"
        ).fetchone()[0]
        sent = db.execute(
            "SELECT DISTINCT host_id, wu_id FROM results WHERE host_id IS NOT NULL"
        ).fetchall()
    panel: dict[str, int] = {}
    tiles = 0
    by_id = {}
    for wu_id, i0, i1, j0, j1, k, a_panel, b_panel in wus:
        panel[a_panel] = blob_size(i1 - i0, k)
        panel[b_panel] = blob_size(k, j1 - j0)
        tiles += blob_size(i1 - i0, j1 - j0)
        by_id[wu_id] = (a_panel, b_panel)
    pairs = {(host, p) for host, wu_id in sent for p in by_id[wu_id]}
    return {
        "workunits": len(wus),
        "host_panel_bytes": sum(panel[p] for _, p in pairs),
        "panel_bytes_once": sum(panel.values()),
        "tile_bytes": tiles,
        "hosts": len({host for host, _ in sent}),
        "accelerated": accelerated,
    }


def wire_bytes(coordinator: Coordinator) -> tuple[float, float]:
    counter = coordinator.metrics.bytes
    return counter.labels("in")._value.get(), counter.labels("out")._value.get()


async def run(args: argparse.Namespace) -> dict:
    directory = Path(args.directory)
    scheduler = SchedulerConfig(
        cache_preference=not args.no_cache_preference,
        hash_only_replicas=not args.no_hash_only,
    )
    if args.train:
        from coordinator.cli.serve import _train, coordinator_config
        from coordinator.training.project import load

        project = load(directory)
        base = coordinator_config(project)
        config = dataclasses.replace(
            base,
            scheduler=dataclasses.replace(
                base.scheduler,
                cache_preference=scheduler.cache_preference,
                hash_only_replicas=scheduler.hash_only_replicas,
            ),
            tail_fraction=args.tail_fraction,
            access=OPEN_ACCESS,
        )
    else:
        config = CoordinatorConfig(
            directory=directory,
            tile=args.tile,
            policy=Policy(args.policy),
            no_work_delay=0.25,
            tail_fraction=args.tail_fraction,
            scheduler=scheduler,
            access=OPEN_ACCESS,
            seed=0,
        )
    coordinator = Coordinator(config, SqliteStore(config.directory / "state.db"))
    runner, url = await serve(coordinator, "127.0.0.1", args.port)
    try:
        print(url, flush=True)
        while len(coordinator.ledger.hosts) < args.wait_hosts:
            await asyncio.sleep(0.05)
        bytes_in, bytes_out = wire_bytes(coordinator)
        wall = time.perf_counter()
        per_product: list[float] = []
        steps = 0
        if args.train:
            stop = asyncio.Event()  # never set: the benchmark trains to the end
            code = await _train(coordinator, project, url, False, stop)
            if code != 0:
                raise SystemExit(f"training failed with exit code {code}")
            steps = project.training.steps
            lines = (directory / "train.jsonl").read_text().splitlines()
            per_product = [json.loads(line)["seconds"] for line in lines if line.strip()]
        else:
            queue = coordinator.products
            outputs = {}
            with np.load(args.operands) as data:
                count = sum(1 for name in data.files if name.startswith("a"))
                operands = [(data[f"a{i}"], data[f"b{i}"]) for i in range(count)]
            for i, (a, b) in enumerate(operands):
                started = time.perf_counter()
                outputs[f"c{i}"] = await queue.matmul(a, b, step=i, label=f"product {i}")
                per_product.append(time.perf_counter() - started)
            if args.output:
                np.savez(args.output, **outputs)
        seconds = time.perf_counter() - wall
        now_in, now_out = wire_bytes(coordinator)
        row = {
            "seconds": seconds,
            "per_product": per_product,
            "steps": steps,
            "bytes_in": now_in - bytes_in,
            "bytes_out": now_out - bytes_out,
            "stats": {k: v for k, v in coordinator.stats.items() if isinstance(v, int | float)},
        }
        row.update(wire_floor(directory))
        print(json.dumps(row), flush=True)
        if args.linger:
            # Keep answering (work requests get "no work") until whoever started us closes
            # our stdin: the hosts stop first, and see no refused connections.
            await asyncio.to_thread(sys.stdin.read)
    finally:
        await runner.cleanup()
    return row


# ---- for the benchmarks that start this process ---------------------------------------------

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parent.parent


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(directory: Path, *options: str) -> tuple[subprocess.Popen, str]:
    """This script as a process serving `directory`; returns it and its URL. Its log goes to
    directory/../NAME.log (NAME: the directory's name)."""
    log = directory.parent / f"{directory.name}.log"
    with log.open("a") as stderr:
        process = subprocess.Popen(
            [
                sys.executable,
                str(SCRIPT),
                str(directory),
                "--port",
                str(free_port()),
                "--linger",
                *options,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    url = process.stdout.readline().strip()
    if not url.startswith("http"):
        process.kill()
        process.wait()
        raise RuntimeError(f"the coordinator did not start: {log.read_text()[-2000:]}")
    return process, url


def start_training(directory: Path, log: Path, *options: str) -> tuple[subprocess.Popen, str, int]:
    """`tilehive coordinator DIRECTORY` (with `options`) on a free loopback port, its output
    appended to `log`; returns the process, its URL and its port."""
    port = free_port()
    tilehive = [sys.executable, "-m", "coordinator.cli"]
    command = [*tilehive, "coordinator", str(directory), "--bind", f"127.0.0.1:{port}", *options]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("a") as out:
        process = subprocess.Popen(command, stdout=out, stderr=out, cwd=ROOT, env=env)
    return process, f"http://127.0.0.1:{port}", port


def result(process: subprocess.Popen, timeout: float) -> dict:
    """The process's JSON line, once its work is done (it then serves on: see `close`)."""
    import selectors

    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout):
            raise TimeoutError(f"the coordinator did not finish in {timeout:.0f}s")
    line = process.stdout.readline()
    if not line.strip():
        process.wait()
        raise RuntimeError(f"the coordinator exited with {process.returncode} and no result")
    return json.loads(line)


def close(process: subprocess.Popen) -> None:
    """Stop a lingering coordinator process (or kill one that would not stop)."""
    if process.poll() is None:
        try:
            process.stdin.close()
            process.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            process.kill()
            process.wait()
    process.stdout.close()


def start_volunteers(url: str, directory: Path, count: int) -> list[subprocess.Popen]:
    """`count` real `tilehive volunteer start URL --threads 1` daemons, one state dir each."""
    crew = []
    for i in range(count):
        state = directory / f"volunteer-{i}"
        state.mkdir(parents=True, exist_ok=True)
        with (state / "out").open("a") as out:
            crew.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "coordinator.cli.main",
                        "volunteer",
                        "start",
                        url,
                        "--state-dir",
                        str(state),
                        "--threads",
                        "1",
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                    env={**os.environ, "PYTHONPATH": str(ROOT), "TILEHIVE_MAX_BACKOFF": "0.5"},
                )
            )
    return crew


def stop_all(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--port", type=int, required=True)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--operands", help="an npz of a0, b0, a1, b1, ...")
    what.add_argument("--train", action="store_true", help="train the project in DIR")
    parser.add_argument("--output", help="save the products here (npz)")
    parser.add_argument("--tile", type=int, default=128)
    parser.add_argument("--policy", default="quorum", choices=[p.value for p in Policy])
    parser.add_argument("--wait-hosts", type=int, default=0, help="start once N registered")
    parser.add_argument("--no-cache-preference", action="store_true")
    parser.add_argument("--no-hash-only", action="store_true")
    parser.add_argument(
        "--tail-fraction", type=float, default=0.9, help="above 1: no tail acceleration"
    )
    parser.add_argument(
        "--linger", action="store_true", help="after the JSON line, serve until stdin closes"
    )
    args = parser.parse_args()
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
