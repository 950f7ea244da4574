"""Blob memory benchmark: a distributed step with the blobs held in memory (the default
`--blob-memory`) against the same step with every blob written to disk (`--blob-memory 0`).

Run:  .venv/bin/python benchmarks/blob_memory.py [--rounds N] [--model tiny-gpt|larger]

One volunteer daemon of one thread on loopback, the Freivalds policy, the projects of
benchmarks/training.py. The two settings run alternately, `--rounds` times each, so that a
machine busy for a while slows both; the figure is the ratio of their median steps. Every
run's last checkpoint must be bitwise equal to the first's (exit 1 if not).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

from benchmarks.report import Row  # noqa: E402
from benchmarks.training import (  # noqa: E402
    LARGER,
    checkpoint_bits,
    step_seconds,
    train_distributed,
    typical,
)
from coordinator.training import project as projects  # noqa: E402

SETTINGS = {"held": (), "written": ("--blob-memory", "0")}
STEPS = {"tiny-gpt": 8, "larger": 3}


def run(rounds: int = 2, models: tuple[str, ...] = ("tiny-gpt", "larger")) -> list[Row]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="tilehive-blob-memory-") as tmp:
        for model in models:
            steps = STEPS[model]
            extra = LARGER if model == "larger" else {}
            settings = {
                **extra,
                "training.steps": steps,
                "training.checkpoint_every": steps,
                "training.eval_every": steps,
                "corpus.max_mb": 1,
                "work.policy": "freivalds",
            }
            last = f"checkpoints/step-{steps:06d}.npz"
            seconds: dict[str, list[float]] = {name: [] for name in SETTINGS}
            reference = None
            for turn in range(rounds):
                for name, options in SETTINGS.items():
                    directory = Path(tmp) / f"{model}-{name}-{turn}"
                    projects.create(directory, **settings)
                    train_distributed(directory, 1, timeout=1800, options=options)
                    seconds[name].append(typical(step_seconds(directory)))
                    bits = checkpoint_bits(directory / last)
                    reference = reference or bits
                    if bits != reference:
                        raise SystemExit(f"CHECKPOINTS DIFFER: {directory.name}")
            held, written = (statistics.median(seconds[name]) for name in SETTINGS)
            rows.append(
                Row(
                    "blob memory",
                    f"{model}, 1 volunteer: step with blobs held in memory / every blob written",
                    f"{held / written:.2f}x",
                    note=f"{held:.3f} against {written:.3f} s per step, medians of "
                    f"{rounds} alternating runs each; all checkpoints bitwise equal",
                )
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="runs of each setting")
    parser.add_argument("--model", action="append", choices=list(STEPS))
    args = parser.parse_args()
    for row in run(args.rounds, tuple(args.model or STEPS)):
        print(f"{row.area} {row.measure}: {row.value}  ({row.note})")


if __name__ == "__main__":
    main()
