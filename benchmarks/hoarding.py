"""Hoarding benchmark: training's pace while one host takes tiles and never reports them.

Run:  .venv/bin/python benchmarks/hoarding.py [--quick]

tiny-gpt's defaults (the quorum policy) train with two real volunteer daemons on loopback
(`tilehive coordinator DIR`, `tilehive volunteer start URL --threads 1`). Once steps flow,
the steps finished in a window of WINDOW seconds are counted; then a hoarder joins, a
host that claims to be fast, asks for tiles every half second, lists them as its own and
never computes or reports one (slow, stopped or hostile, the coordinator cannot tell), and
the steps of two more windows are counted beside it: its first, while its cooling is short
(rules/cooling.py: 2 s after the first tile it sat on, doubling), and the next. The rows
are those counts over the first. The brief: no set of hosts can stop training; before
straggler spares and cooling (docs/architecture.md, "Stragglers") a hoarder held a step
for its tiles' deadline, a minute (1 step in 90 s against 91 in 20 s without it, the
thirty-eighth round).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

from benchmarks import serve_switched  # noqa: E402
from benchmarks.report import Row, verdict  # noqa: E402
from coordinator.training import project as projects  # noqa: E402
from volunteer.client import CoordinatorClient, ServerRefused  # noqa: E402

WINDOW = 20.0  # seconds of steps counted, with and without the hoarder
WARM_STEPS = 5  # steps before the first window: the volunteers started and warm


def steps_done(directory: Path) -> int:
    try:
        with (directory / "train.jsonl").open() as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


async def steps_in(directory: Path, seconds: float) -> int:
    """The steps the project finishes in the next `seconds`."""
    before = steps_done(directory)
    await asyncio.sleep(seconds)  # the window measured, not a wait for anything
    return steps_done(directory) - before


class Hoarder:
    """A host that takes tiles and sits on them: it asks for work, never reports."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.held: set[str] = set()  # result ids it holds now
        self.taken = 0  # tiles it was given in all
        self.refused = ""  # the coordinator's last refusal, if any (cooling, quarantine)

    async def run(self, stop: asyncio.Event) -> None:
        async with CoordinatorClient(self.url) as client:
            await client.register("hoarder", gflops=1000.0)
            asks = 0
            while not stop.is_set():
                asks += 1
                try:
                    answer = await client.request_work(
                        f"hoard-{asks}",
                        capacity=8,
                        in_progress=sorted(self.held),
                        gflops=1000.0,
                        wait=False,
                    )
                    self.taken += len(answer["assignments"])
                    self.held |= {a["result_id"] for a in answer["assignments"]}
                    self.held -= set(answer.get("abort", []))
                except ServerRefused as exc:
                    self.refused = exc.message
                await asyncio.sleep(0.5)  # its pace of asking


async def measure(directory: Path, window: float, timeout: float) -> dict:
    log = directory.parent / "coordinator.log"
    coordinator, url, _ = serve_switched.start_training(directory, log)
    crew = serve_switched.start_volunteers(url, directory.parent / "volunteers", 2)
    stop = asyncio.Event()
    hoarder = Hoarder(url)
    hoarding = None
    try:
        deadline = time.monotonic() + timeout
        while steps_done(directory) < WARM_STEPS:
            if time.monotonic() > deadline or coordinator.poll() is not None:
                raise RuntimeError(f"training did not start: {log.read_text()[-2000:]}")
            await asyncio.sleep(0.2)  # polling with a deadline
        honest = await steps_in(directory, window)
        hoarding = asyncio.ensure_future(hoarder.run(stop))
        await asyncio.sleep(2.0)  # it has taken its first tiles
        hoarded = await steps_in(directory, window)
        later = await steps_in(directory, window)
        if hoarding.done():  # it failed: the windows measured no hoarder
            raise RuntimeError(f"the hoarder stopped: {hoarding.exception()!r}")
        if not hoarder.taken:
            raise RuntimeError("the hoarder was given no tile: nothing was measured")
    finally:
        stop.set()
        if hoarding is not None:
            await asyncio.gather(hoarding, return_exceptions=True)
        serve_switched.stop_all(crew)
        serve_switched.stop_all([coordinator])
    return {
        "honest": honest,
        "hoarded": hoarded,
        "later": later,
        "taken": hoarder.taken,
        "spares": spares(directory),
        "refused": hoarder.refused,
    }


def spares(directory: Path) -> int:
    """The spares the coordinator gave for tiles sat on, from its task log: a straggler's,
    and those beside each tile a host on probation takes (rules/cooling.py)."""
    with sqlite3.connect(f"file:{directory / 'state.db'}?mode=ro", uri=True) as db:
        query = (
            "SELECT COUNT(*) FROM events "
            "WHERE message LIKE 'straggler:%' OR message LIKE 'probation:%'"
        )
        return db.execute(query).fetchone()[0]


def run(quick: bool = False) -> list[Row]:
    window = 5.0 if quick else WINDOW
    with tempfile.TemporaryDirectory(prefix="tilehive-hoarding-") as tmp:
        directory = Path(tmp) / "project"
        projects.create(
            directory,
            **{
                "training.steps": 100_000,
                "training.checkpoint_every": 100_000,
                "training.eval_every": 100_000,
                "corpus.max_mb": 1,
            },
        )
        started = time.perf_counter()
        got = asyncio.run(measure(directory, window, timeout=120.0))
        elapsed = time.perf_counter() - started
    honest = got["honest"] or 1
    refused = f"; it was last told: {got['refused'][:120]}" if got["refused"] else ""
    setup = "tiny-gpt, quorum policy, two volunteer daemons of 1 thread"
    return [
        Row(
            "hoarding",
            f"steps in {window:g} s with a host that sits on its tiles / without, its first "
            f"{window:g} s",
            f"{got['hoarded'] / honest:.2f}",
            "training goes on (no set of hosts can stop it)",
            verdict(got["hoarded"] > 0),
            f"{got['hoarded']} steps beside it against {got['honest']} before it joined; {setup}",
        ),
        Row(
            "hoarding",
            f"the same, its next {window:g} s (its cooling grown: rules/cooling.py)",
            f"{got['later'] / honest:.2f}",
            note=f"{got['later']} steps; the hoarder took {got['taken']} tiles in both "
            f"windows and reported none, and the coordinator gave {got['spares']} spares "
            f"for tiles sat on (a straggler's, or on probation){refused}; {elapsed:.0f}s in all",
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    for row in run(args.quick):
        print(json.dumps(row.__dict__))


if __name__ == "__main__":
    main()
