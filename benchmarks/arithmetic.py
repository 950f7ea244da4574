"""The coordinator's own arithmetic: a `--local` step's time and the matrix products' share of it.

Run:  .venv/bin/python benchmarks/arithmetic.py [--quick] [--threads N]

For tiny-gpt (the model's defaults) and for the larger project of issue 13 (4 layers, width
512, 8 heads, context 128, batch 32, tile 256), trains a few steps exactly as `tilehive train
DIR --local --threads N` does (the same Trainer and LocalBackend, in this process) and times
every product: the linear layers' GEMMs (`Backend.matmul`) and the attention's per-head
products (`Backend.batched`). A step's GEMM share is its time in those products over its
whole time (forward, backward, AdamW; not evaluation or checkpoints). Everything else is the
model kernels of kernels.nn (TILEHIVE_MODEL_THREADS threads; by default one per CPU), which
is what this share measures. Figures are medians over steps 2.. (step 1 warms caches up).
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

from benchmarks.report import Row, verdict  # noqa: E402
from coordinator.training import project as projects  # noqa: E402
from coordinator.training.trainer import LocalBackend, Trainer  # noqa: E402
from kernels import nn  # noqa: E402

BAR = 0.70  # the brief: the matrix products are >= 70% of a --local step (moonshot 85%)

LARGER = {
    "model.layers": 4,
    "model.width": 512,
    "model.heads": 8,
    "model.context": 128,
    "training.batch_size": 32,
    "work.tile": 256,
    "work.policy": "freivalds",
}


class TimedBackend(LocalBackend):
    """LocalBackend that adds up the seconds spent in products."""

    def __init__(self, threads: int) -> None:
        super().__init__(threads)
        self.gemm_seconds = 0.0

    async def matmul(self, a, b, *, trans_a: bool, trans_b: bool, label: str):
        started = time.perf_counter()
        try:
            return await super().matmul(a, b, trans_a=trans_a, trans_b=trans_b, label=label)
        finally:
            self.gemm_seconds += time.perf_counter() - started

    def batched(self, a, b, *, trans_a: bool = False, trans_b: bool = False):
        started = time.perf_counter()
        try:
            return LocalBackend.batched(a, b, trans_a=trans_a, trans_b=trans_b)
        finally:
            self.gemm_seconds += time.perf_counter() - started


def measure(directory: Path, settings: dict, steps: int, threads: int) -> tuple[float, float]:
    """(median step seconds, median GEMM share) of a --local run of `steps` steps."""
    project = projects.create(
        directory,
        **{
            **settings,
            "training.steps": steps,
            "training.eval_every": 10 * steps,
            "training.checkpoint_every": 10 * steps,
            "corpus.max_mb": 1,
        },
    )
    backend = TimedBackend(threads)
    trainer = Trainer(project, backend)
    seconds, shares = [], []
    mark = [0.0]

    def on_step(report) -> None:
        gemm = backend.gemm_seconds - mark[0]
        mark[0] = backend.gemm_seconds
        seconds.append(report.seconds)
        shares.append(gemm / report.seconds)

    asyncio.run(trainer.run(on_step=on_step))
    return statistics.median(seconds[1:] or seconds), statistics.median(shares[1:] or shares)


def run(quick: bool = False, threads: int = 1) -> list[Row]:
    rows = []
    model_threads = nn.default_threads()
    with tempfile.TemporaryDirectory(prefix="tilehive-arithmetic-") as tmp:
        for name, settings, steps in (
            ("tiny-gpt", {}, 4 if quick else 8),
            ("larger", LARGER, 3 if quick else 4),
        ):
            step, share = measure(Path(tmp) / name, settings, steps, threads)
            note = (
                f"median of steps 2-{steps}; GEMM {threads} thread(s), model kernels "
                f"{model_threads} ({nn.kernel_name()})"
            )
            rows.append(
                Row("arithmetic", f"--local seconds per step, {name}", f"{step:.3f}", note=note)
            )
            is_larger = name == "larger"
            rows.append(
                Row(
                    "arithmetic",
                    f"matrix products' share of a --local step, {name}",
                    f"{share:.0%}",
                    bar=f">= {BAR:.0%} (larger model)" if is_larger else "",
                    verdict=verdict(share >= BAR) if is_larger else "",
                    note=f"{share * step:.3f} s of {step:.3f} s in GEMM",
                )
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    parser.add_argument("--threads", type=int, default=1, help="GEMM threads (as --threads)")
    args = parser.parse_args()
    for row in run(args.quick, args.threads):
        print(f"{row.area} {row.measure}: {row.value} {row.bar} {row.verdict}  ({row.note})")


if __name__ == "__main__":
    main()
