"""The benchmark suite: every row of the table in docs/performance.md, measured in one run.

Run:  .venv/bin/python benchmarks/run.py [--quick] [--write] [--only AREA ...]

Before the first area and after the last, two short probes of the machine's speed
(benchmarks/steadiness.py): the table's first rows say whether it held still. Areas, in
order: kernels and validation (benchmarks/kernels.py), coordinator (a coordinator
process pinned to one core, `tilehive emulate`'s engine on the other, at 100, 1,000 and
10,000 hosts), training, network (emulated laptops 30 ms away), communication, tails, a
host that hoards tiles, a volunteer on a slow uplink, and the Dask peer
(benchmarks/training.py, network.py, communication.py, tails.py, hoarding.py, uplink.py,
peer_dask.py). `--write` replaces the table in
docs/performance.md; without it the table is only printed. `--quick` is a smoke run (small
repeats, 100 hosts only) whose figures are not for the record.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

from benchmarks import steadiness  # noqa: E402
from benchmarks.report import Row, verdict, write_into  # noqa: E402

ROOT = Path(_HERE).parent
DOC = ROOT / "docs" / "performance.md"
PYTHON = sys.executable

# Hosts with nothing modelled: no latency, bandwidth or compute time to wait out, many
# threads (a quota of 64 tiles in progress), no churn, errors or lies. What is left is the
# coordinator's own cost per work unit.
LOOPBACK_PROFILE = """
name = "loopback"
description = "hosts with no modelled cost, for the coordinator's throughput"
[[group]]
name = "loopback"
share = 1.0
gflops = 1000.0
threads = 16
max_memory_mb = 1000
download_mbps = 100000.0
upload_mbps = 100000.0
latency_ms = 0.0
session_s = 1000000.0
offline_s = 1.0
churn = 0.0
graceful = 1.0
error_rate = 0.0
lie_rate = 0.0
"""


def kernel_rows(quick: bool) -> list[Row]:
    shape = "512x512x512 square"
    out = subprocess.run(
        [
            PYTHON,
            str(ROOT / "benchmarks" / "kernels.py"),
            *("--only", shape, "--json", "--repeats", "3" if quick else "9"),
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    (r,) = json.loads(out.stdout.strip().splitlines()[-1])["rows"]
    ratio_1, ratio_2 = r["ours_1"] / r["numpy_1"], r["ours_2"] / r["numpy_2"]
    return [
        Row(
            "kernels",
            "sgemm 512^3, 1 thread: ours / numpy (OpenBLAS)",
            f"{ratio_1:.2f} ({r['ours_1']:.0f} / {r['numpy_1']:.0f} GFLOPS)",
            ">= 0.80 (moonshot 1.00)",
            verdict(ratio_1 >= 0.8),
        ),
        Row(
            "kernels",
            "sgemm 512^3, 2 threads: ours / numpy",
            f"{ratio_2:.2f} ({r['ours_2']:.0f} / {r['numpy_2']:.0f} GFLOPS)",
        ),
        Row("kernels", "ours 2 threads / 1 thread, 512^3", f"{r['ours_2'] / r['ours_1']:.2f}x"),
        Row(
            "validation",
            "Freivalds (2 rounds) / computing the tile, 512^3, warm",
            f"{100 * r['freivalds_warm']:.1f}%",
            "<= 5%",
            verdict(r["freivalds_warm"] <= 0.05),
        ),
        Row(
            "validation",
            "the same, cold (operands from memory)",
            f"{100 * r['freivalds']:.1f}%",
            "<= 5%",
            verdict(r["freivalds"] <= 0.05),
            "memory-bound: reading A, B and C is most of it",
        ),
        Row(
            "validation",
            "the same, in tilehive's path (each right after loading its operands from a "
            "BlobStore on disk)",
            f"{100 * r['freivalds_path']:.1f}%",
            "<= 5%",
            verdict(r["freivalds_path"] <= 0.05),
        ),
    ]


async def _coordinator_at(
    core: int, hosts: int, window: float, profile: str, product: list[str], long_poll: bool
) -> tuple[dict, object]:
    """A coordinator process pinned to `core`; `hosts` emulated hosts in this process."""
    from volunteer.emulator import run_emulation
    from volunteer.profile import parse

    with tempfile.TemporaryDirectory() as tmp:
        process = subprocess.Popen(
            [
                PYTHON,
                str(ROOT / "benchmarks" / "coordinator_process.py"),
                f"{tmp}/project",
                *("--port", "0", "--products", "0", "--duration", str(window), "--linger"),
                *("--wait-hosts", str(hosts), "--cpu", str(core), *product),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
        )
        try:
            url = process.stdout.readline().strip()
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            lines: list[str] = []

            def read_result() -> None:
                lines.append(process.stdout.readline())
                loop.call_soon_threadsafe(stop.set)

            threading.Thread(target=read_result, daemon=True).start()
            report = await run_emulation(
                url,
                hosts,
                parse(LOOPBACK_PROFILE) if profile == "loopback" else profile,
                stop=stop,
                duration=window + 120 + hosts / 100,
                seed=0,
                long_poll=long_poll,
            )
            process.terminate()
            process.wait(timeout=60)
            result = json.loads(lines[-1]) if lines and lines[-1].strip() else {}
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    return result, report


@contextlib.contextmanager
def emulator_on_last_core():
    """Pins this process (the emulator) to the last core; yields the first, for the
    coordinator."""
    if not hasattr(os, "sched_setaffinity"):
        yield 0
        return
    before = os.sched_getaffinity(0)
    cores = sorted(before)
    if len(cores) > 1:
        os.sched_setaffinity(0, {cores[-1]})
    try:
        yield cores[0]
    finally:
        os.sched_setaffinity(0, before)


THROUGHPUT_WINDOWS = 3  # windows of the throughput row; its figures are the median one's
TINY = ["--tile", "4", "--k", "8", "--tiles", "40"]  # 1,600 work units of 256 flops
TRAINING_LIKE = ["--tile", "128", "--k", "512", "--tiles", "8"]  # 64 of 16.8 MFLOP


def coordinator_rows(quick: bool) -> list[Row]:
    rows = []
    window = 5.0 if quick else 20.0
    with emulator_on_last_core() as core:
        # The median of three windows: on a shared machine one window's figure moves by 5-8%
        # from run to run, and the bar is a figure, not a ratio of two runs side by side.
        runs = [
            asyncio.run(_coordinator_at(core, 100, window, "loopback", TINY, True))[0]
            for _ in range(1 if quick else THROUGHPUT_WINDOWS)
        ]
        runs.sort(key=lambda r: r.get("wu_per_cpu_s", 0.0))
        result = runs[len(runs) // 2]
        each = ", ".join(f"{r.get('wu_per_cpu_s', 0.0):.0f}" for r in runs)
        cpu = result.get("cpu_seconds", 0.0) / max(result.get("seconds", 1.0), 1e-9)
        rows.append(
            Row(
                "coordinator",
                "work units issued, validated and assimilated per second (100 loopback hosts, "
                "tiny tiles, quorum 2)",
                f"{result.get('wu_per_s', 0):.0f} WU/s",
                note=f"the coordinator's core {cpu:.0%} busy; the emulator on the other core "
                "is the limit",
            )
        )
        per_cpu = result.get("wu_per_cpu_s", 0.0)
        written = result.get("bytes_written_per_wu")
        notes = [f"median of {len(runs)} windows run in turn: {each}"] if len(runs) > 1 else []
        if written:
            notes.append(f"{written / 1000:.1f} KB written a work unit")
        rows.append(
            Row(
                "coordinator",
                "work units per second of the coordinator's CPU (all its threads), same run",
                f"{per_cpu:.0f} WU/s",
                ">= 5,000 WU/s (moonshot 20,000)",
                verdict(per_cpu >= 5000),
                note="; ".join(notes),
            )
        )
        for hosts in [100] if quick else [100, 1000, 10000]:
            overflows = listen_overflows()
            result, report = asyncio.run(
                _coordinator_at(core, hosts, window, "mixed", TRAINING_LIKE, False)
            )
            dropped = ""
            if overflows is not None and (after := listen_overflows()) is not None:
                dropped = f"; connections dropped by a full listen queue: {after - overflows:,}"
            p99 = result.get("work_p99_ms", float("nan"))
            client = report.latency.get("work", {})
            rows.append(
                Row(
                    "coordinator",
                    f"{hosts:,} hosts (`mixed` profile): work request p50 / p99 at the coordinator",
                    f"{result.get('work_p50_ms', float('nan')):.1f} / {p99:.1f} ms",
                    "p99 < 50 ms at 1,000 hosts" if hosts == 1000 else "",
                    verdict(p99 < 50) if hosts == 1000 else "",
                    f"{result.get('work_requests', 0):,} requests; seen by the hosts p50 "
                    f"{client.get('p50_ms', float('nan')):.0f} / p99 "
                    f"{client.get('p99_ms', float('nan')):.0f} ms{dropped}",
                )
            )
            notes = [", ".join(f"{k} x{v}" for k, v in sorted(report.errors.items()))[:120]]
            if report.cut_off:  # every host stopping at once: not errors (docs/emulator.md)
                notes.append(f"calls cut off by the emulation's end: {report.cut_off:,}")
            rows.append(
                Row(
                    "coordinator",
                    f"{hosts:,} hosts: errors seen by the hosts; work units per second",
                    f"{report.error_count:,}; {result.get('wu_per_s', 0):.1f} WU/s",
                    "no error at 10,000 hosts" if hosts == 10000 else "",
                    verdict(report.error_count == 0) if hosts == 10000 else "",
                    "; ".join(filter(None, notes)),
                )
            )
    return rows


def listen_overflows() -> int | None:
    """The kernel's count of connections dropped because a listen queue was full (Linux; all
    of the machine's sockets); None where it cannot be read."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return None
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            counters = dict(zip(names.split()[1:], values.split()[1:], strict=False))
            return int(counters["ListenOverflows"]) if "ListenOverflows" in counters else None
    return None


def module_rows(name: str, quick: bool) -> list[Row]:
    """Rows from benchmarks/NAME.py's run(quick); a missing or failing module is a row too."""
    try:
        module = importlib.import_module(f"benchmarks.{name}")
    except ImportError as exc:
        return [Row(name, "not measured", "-", note=f"cannot import benchmarks.{name}: {exc}")]
    try:
        return module.run(quick=quick)
    except Exception as exc:  # a benchmark that fails is reported, the suite goes on
        return [Row(name, "not measured", "-", note=f"{type(exc).__name__}: {exc}"[:200])]


AREAS = {
    "kernels": kernel_rows,
    "coordinator": coordinator_rows,
    "arithmetic": lambda quick: module_rows("arithmetic", quick),
    "training": lambda quick: module_rows("training", quick),
    "network": lambda quick: module_rows("network", quick),
    "transfer": lambda quick: module_rows("transfer", quick),
    "communication": lambda quick: module_rows("communication", quick),
    "tails": lambda quick: module_rows("tails", quick),
    "hoarding": lambda quick: module_rows("hoarding", quick),
    "uplink": lambda quick: module_rows("uplink", quick),
    "peer": lambda quick: module_rows("peer_dask", quick),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run, not for the record")
    parser.add_argument("--write", action="store_true", help="write the table into the docs")
    parser.add_argument("--only", nargs="*", choices=sorted(AREAS), help="only these areas")
    args = parser.parse_args()
    if args.write and args.only:
        parser.error("--write records the whole table: run every area (drop --only)")
    rows: list[Row] = []
    started = time.strftime("%Y-%m-%d")
    at_start = steadiness.measure()
    for area, measure in AREAS.items():
        if args.only and area not in args.only:
            continue
        print(f"== {area}", file=sys.stderr, flush=True)
        began = time.perf_counter()
        try:
            rows.extend(measure(args.quick))
        except Exception as exc:  # one area failing is a row; the rest are still measured
            rows.append(Row(area, "not measured", "-", note=f"{type(exc).__name__}: {exc}"[:200]))
        print(f"   {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
    try:
        rows[:0] = steadiness.rows(at_start, steadiness.measure())  # first: how to read the rest
    except Exception as exc:  # the probe failing loses the probe's rows, not the table
        rows.insert(0, Row("machine", "not measured", "-", note=f"{type(exc).__name__}: {exc}"))
    from benchmarks.report import table

    print(table(rows))
    if args.write:
        command = ".venv/bin/python benchmarks/run.py --write" + (" --quick" if args.quick else "")
        write_into(DOC, rows, command, started)
        print(f"written into {DOC}", file=sys.stderr)


if __name__ == "__main__":
    main()
