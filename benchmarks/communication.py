"""Communication benchmark: bytes on the wire per training step against their lower bound,
with and without cache-aware scheduling and hash-only check replicas.

Run:  .venv/bin/python benchmarks/communication.py [--quick]

The same small tiny-gpt project is trained for a few steps, one run per combination of
the two switches (SchedulerConfig.cache_preference, SchedulerConfig.hash_only_replicas), with
adaptive replication on (the project default) and off, one run after another in the same
process tree: a real coordinator process (benchmarks/serve_switched.py --train: the training
loop of `tilehive coordinator`, aiohttp on loopback, SQLite, blob store, quorum policy) and
three real volunteer daemons (`tilehive volunteer start URL --threads 1`). Bytes are the
coordinator's own count (/metrics `tilehive_bytes`: HTTP bodies in and out, headers not
included): operand downloads, work requests and replies, reports.

The lower bound, per run: every operand panel fetched once by each host that was sent work
on it, plus every output tile uploaded once (each counted as its blob: header and float32
data). The floor below it (in the notes) is every panel once and every tile once: all the
work on one host.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
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

MB = 1e6

CASES = [  # name, options, what
    ("default", (), "cache-aware scheduling and hash-only replicas (the defaults)"),
    ("no-cache", ("--no-cache-preference",), "without cache-aware scheduling"),
    ("no-hash", ("--no-hash-only",), "without hash-only replicas: every replica uploads"),
    ("neither", ("--no-cache-preference", "--no-hash-only"), "without either"),
]


def measure(workdir: Path, settings: dict, hosts: int, name: str, options: tuple) -> dict:
    directory = workdir / name
    projects.create(directory, **settings)
    process, url = serve_switched.start(directory, "--train", "--wait-hosts", str(hosts), *options)
    crew = []
    try:
        crew = serve_switched.start_volunteers(url, workdir / f"{name}-volunteers", hosts)
        row = serve_switched.result(process, 900)
    finally:
        serve_switched.stop_all(crew)
        serve_switched.close(process)
    rates = []
    for i in range(hosts):
        status = workdir / f"{name}-volunteers" / f"volunteer-{i}" / "status.json"
        with contextlib.suppress(OSError, ValueError, KeyError):
            rates.append(json.loads(status.read_text())["cache_hit_rate"])
    row["cache_hit_rate"] = sum(rates) / len(rates) if rates else float("nan")
    row["tiles_in"] = row["stats"]["tiles_in"]
    row["wire"] = row["bytes_in"] + row["bytes_out"]
    row["bound"] = row["host_panel_bytes"] + row["tile_bytes"]
    row["floor"] = row["panel_bytes_once"] + row["tile_bytes"]
    return row


def run(quick: bool = False) -> list[Row]:
    steps = 2 if quick else 4
    hosts = 3
    settings = {"training.steps": steps, "training.checkpoint_every": steps, "corpus.max_mb": 1}
    # Adaptive replication (the project default) soon sends most work units to one trusted
    # host alone, Freivalds-checked: no check replica at all. Without it every work unit
    # has a quorum of two, which is where hash-only replicas matter.
    plans = [(True, CASES[:1] + CASES[3:])] if quick else [(True, CASES), (False, CASES)]
    measured = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tilehive-communication-") as tmp:
        for adaptive, cases in plans:
            for name, options, _ in cases:
                key = f"{name}-{'adaptive' if adaptive else 'quorum'}"
                project = {**settings, "work.adaptive_replication": adaptive}
                measured[key] = measure(Path(tmp), project, hosts, key, options)
    elapsed = time.perf_counter() - started
    rows = []
    for adaptive, cases in plans:
        suffix = "adaptive" if adaptive else "quorum"
        base = measured[f"default-{suffix}"]
        for name, _, what in cases:
            r = measured[f"{name}-{suffix}"]
            notes = [
                f"{r['wire'] / steps / MB:.1f} MB per step ({r['bytes_out'] / steps / MB:.1f} "
                f"out, {r['bytes_in'] / steps / MB:.1f} in) against a bound of "
                f"{r['bound'] / steps / MB:.1f}; {r['wire'] / r['floor']:.2f}x the floor of "
                f"every panel and tile once; volunteer cache hit rate {r['cache_hit_rate']:.2f}"
            ]
            if name == "default":
                notes.append(
                    f"tiny-gpt defaults (2 layers, width 128, tile 128, quorum policy), {steps} "
                    f"steps, {hosts} volunteer daemons, {r['workunits'] / steps:.0f} work units "
                    "and "
                    f"{r['tiles_in'] / steps:.0f} results per step"
                )
            else:
                notes.append(f"{r['wire'] / base['wire']:.2f}x the bytes of the defaults")
            replication = "adaptive replication on" if adaptive else "adaptive replication off"
            rows.append(
                Row(
                    "communication",
                    f"bytes per step / lower bound, {what}, {replication}",
                    f"{r['wire'] / r['bound']:.2f}x",
                    note="; ".join(notes),
                )
            )
    last = rows[-1]
    rows[-1] = Row(last.area, last.measure, last.value, note=f"{last.note}; {elapsed:.0f}s in all")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, hosts and cases")
    args = parser.parse_args()
    for row in run(args.quick):
        print(f"{row.area} {row.measure}: {row.value}  ({row.note})")


if __name__ == "__main__":
    main()
