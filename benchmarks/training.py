"""Training benchmark: seconds per step of a distributed run divided by `tilehive train --local`.

Run:  .venv/bin/python benchmarks/training.py [--quick]

One small tiny-gpt project (the model's defaults: 2 layers, width 128, tiles of 128; a 1 MB
corpus) is trained the same number of steps, one run after another on this machine:
`tilehive train DIR --local --threads 1`, then `tilehive coordinator DIR` on loopback with 1
and with 2 real volunteer daemons (`tilehive volunteer start URL --threads 1`). One
volunteer cannot form a quorum of two hosts, so the runs compared with it use the Freivalds
policy (one replica, checked); the run with 2 volunteers is also measured with the project
default, quorum. Seconds per step come from each run's DIR/train.jsonl (forward, backward
and optimizer; not evaluation or checkpoints) as the median over steps 2.. (step 1 waits
for the volunteers to start); each distributed run is compared with a --local run made
just before it. Every run's last checkpoint must be bitwise equal to the first
local one: the benchmark checks it and says so (and exits 1 from the command line if not).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import numpy as np  # noqa: E402

from benchmarks import serve_switched  # noqa: E402
from benchmarks.report import Row, verdict  # noqa: E402
from coordinator.training import project as projects  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TILEHIVE = [sys.executable, "-m", "coordinator.cli"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
BAR = 1.5  # the brief: a distributed step on loopback <= 1.5x the --local step


def step_seconds(directory: Path) -> list[float]:
    lines = (directory / "train.jsonl").read_text().splitlines()
    return [json.loads(line)["seconds"] for line in lines if line.strip()]


def typical(seconds: list[float]) -> float:
    """The median step, step 1 left out when there are others."""
    return statistics.median(seconds[1:] or seconds)


def checkpoint_bits(path: Path) -> dict[str, bytes]:
    with np.load(path) as data:
        return {name: data[name].tobytes() for name in data.files}


def train_local(directory: Path, timeout: float) -> None:
    done = subprocess.run(
        [*TILEHIVE, "train", str(directory), "--local", "--threads", "1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=ENV,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(f"tilehive train --local failed: {done.stderr[-2000:]}")


def train_distributed(directory: Path, volunteers: int, timeout: float) -> None:
    port = serve_switched.free_port()
    url = f"http://127.0.0.1:{port}"
    log = directory.parent / f"{directory.name}.log"
    with log.open("a") as out:
        coordinator = subprocess.Popen(
            [*TILEHIVE, "coordinator", str(directory), "--bind", f"127.0.0.1:{port}"],
            stdout=out,
            stderr=out,
            cwd=ROOT,
            env=ENV,
        )
    # The daemons retry until the coordinator answers; step 1 waits for them.
    states = directory.parent / f"{directory.name}-volunteers"
    crew = serve_switched.start_volunteers(url, states, volunteers)
    try:
        code = coordinator.wait(timeout)
    except subprocess.TimeoutExpired:
        coordinator.kill()
        coordinator.wait()
        raise
    finally:
        serve_switched.stop_all(crew)
        if coordinator.poll() is None:
            coordinator.kill()
            coordinator.wait()
    if code != 0:
        raise RuntimeError(f"tilehive coordinator exited with {code}: {log.read_text()[-2000:]}")


def run(quick: bool = False) -> list[Row]:
    steps = 3 if quick else 8
    settings = {"training.steps": steps, "training.checkpoint_every": steps, "corpus.max_mb": 1}
    runs = (
        [(1, "freivalds"), (2, "freivalds")]
        if quick
        else [
            (1, "freivalds"),
            (2, "freivalds"),
            (2, "quorum"),
        ]
    )
    last = f"checkpoints/step-{steps:06d}.npz"
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tilehive-training-") as tmp:
        workdir = Path(tmp)
        local = workdir / "local"
        projects.create(local, **settings)
        train_local(local, timeout=600)
        reference = checkpoint_bits(local / last)
        local_steps = [typical(step_seconds(local))]
        measured = []
        for volunteers, policy in runs:
            # A --local run right before each distributed one: the ratio is of neighbours,
            # in case something else keeps the machine busy for a while.
            again = workdir / f"local-{volunteers}v-{policy}"
            projects.create(again, **settings)
            train_local(again, timeout=600)
            local_step = typical(step_seconds(again))
            local_steps.append(local_step)
            directory = workdir / f"{volunteers}v-{policy}"
            projects.create(directory, **settings, **{"work.policy": policy})
            train_distributed(directory, volunteers, timeout=900)
            equal = checkpoint_bits(directory / last) == reference
            equal = equal and checkpoint_bits(again / last) == reference
            if not equal:
                print(f"CHECKPOINTS DIFFER: {directory.name} against --local", file=sys.stderr)
            seconds = typical(step_seconds(directory))
            measured.append((volunteers, policy, seconds, local_step, equal))
    elapsed = time.perf_counter() - started
    rows = [
        Row(
            "training",
            "seconds per step, `tilehive train --local --threads 1`",
            f"{statistics.median(local_steps):.3f}",
            note=f"tiny-gpt 2 layers, width 128, tile 128, batch 16x64; median of steps "
            f"2-{steps}; {len(local_steps)} runs: {', '.join(f'{x:.3f}' for x in local_steps)}",
        )
    ]
    for volunteers, policy, seconds, local_step, _ in measured:
        ratio = seconds / local_step
        rows.append(
            Row(
                "training",
                f"distributed step / --local step, {volunteers} volunteer"
                f"{'s' if volunteers > 1 else ''}, {policy}",
                f"{ratio:.1f}x",
                bar=f"<= {BAR}x",
                verdict=verdict(ratio <= BAR),
                note=f"{seconds:.2f} s per step on loopback against {local_step:.3f} s for the "
                "--local run just before it",
            )
        )
    equal = all(e for *_, e in measured)
    rows.append(
        Row(
            "training",
            "last checkpoint bitwise equal to --local",
            "yes" if equal else "NO",
            bar="bitwise equal",
            verdict=verdict(equal),
            note=f"{len(measured)} distributed runs of {steps} steps; {elapsed:.0f}s in all",
        )
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and runs")
    args = parser.parse_args()
    rows = run(args.quick)
    for row in rows:
        print(f"{row.area} {row.measure}: {row.value} {row.bar} {row.verdict}  ({row.note})")
    if rows[-1].value != "yes":
        sys.exit(1)


if __name__ == "__main__":
    main()
