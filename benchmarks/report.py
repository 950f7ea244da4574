"""Rows of the benchmark suite and the markdown table they become in docs/performance.md.

Every benchmark module exposes `run(quick: bool) -> list[Row]`; `benchmarks/run.py` calls
them in one process tree, one after another, and writes one table between the markers
below, so every figure in it comes from the same run on the same machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

BEGIN = "<!-- benchmarks:begin (written by benchmarks/run.py; edits here are lost) -->"
END = "<!-- benchmarks:end -->"


@dataclass(frozen=True)
class Row:
    """One measured figure: what, how much, against which bar, and what to know about it."""

    area: str  # kernels, coordinator, training, network, transfer, tails, peer, ...
    measure: str
    value: str
    bar: str = ""  # the brief's bar, if it sets one
    verdict: str = ""  # met / missed / (empty: no bar)
    note: str = ""


def run_alone(doc: str, run: Callable[[int], list[Row]], rounds: int) -> None:
    """The command line of a benchmark outside the suite: `--rounds N` (default `rounds`),
    then its rows, a line each."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=rounds)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    for row in run(args.rounds):
        print(f"{row.area} {row.measure}: {row.value}  ({row.note})")


def machine() -> str:
    """The CPU, cores and memory, as the table's caption."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory = ""
    try:
        kib = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))
        memory = f", {kib / 2**20:.0f} GiB"
    except (OSError, AttributeError):
        pass
    return f"{cpu}, {cores} cores{memory}; Python {platform.python_version()}"


def table(rows: list[Row]) -> str:
    lines = [
        "| area | measure | value | bar | |",
        "|---|---|---:|---|---|",
    ]
    for r in rows:
        verdict = f"**{r.verdict}**" if r.verdict else ""
        measure = f"{r.measure} ({r.note})" if r.note else r.measure
        lines.append(f"| {r.area} | {measure} | {r.value} | {r.bar} | {verdict} |")
    return "\n".join(lines)


def section(rows: list[Row], command: str, when: str) -> str:
    return "\n".join(
        [
            BEGIN,
            f"`{command}` ({when}) on {machine()}:",
            "",
            table(rows),
            END,
        ]
    )


def write_into(document: Path, rows: list[Row], command: str, when: str) -> None:
    """Replace the table between the markers (or append it) in `document`."""
    text = document.read_text() if document.exists() else "# Performance\n"
    new = section(rows, command, when)
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        text = head + new + tail
    else:
        text = text.rstrip("\n") + "\n\n## The benchmark suite\n\n" + new + "\n"
    document.write_text(text)


def verdict(ok: bool) -> str:
    return "met" if ok else "missed"
