"""Store benchmark: what the database costs per work unit, committed as the coordinator
commits it, with today's schema against the same schema plus the events_wu index that
schema 4 dropped.

Run:  .venv/bin/python benchmarks/store_commits.py [--workunits N] [--rounds N]

Each round drives N work units of one product (quorum 2) through `SqliteStore.commit` in a
fresh state.db, in the commits a coordinator makes: the publication; then for every four
work units one host's assignment, its report, and the pass that judges and assimilates them,
each with its events. Rounds alternate the two schemas; the figures are the medians of the
rounds' microseconds per work unit, by commit, and the work units per second the store alone
allows.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

from coordinator.state.sqlite import SqliteStore  # noqa: E402
from coordinator.state.store import Batch  # noqa: E402
from coordinator.work.events import Event  # noqa: E402
from coordinator.work.records import (  # noqa: E402
    Gemm,
    Host,
    Outcome,
    Policy,
    Redundancy,
    Result,
    ServerState,
    ValidateState,
    WorkUnit,
    WuState,
    tile_bounds,
    tile_workunit,
)
from kernels import KERNEL_VERSION  # noqa: E402

PER_REQUEST = 4  # work units a host takes, reports and gets judged at a time
PHASES = ("publish", "assign", "report", "judge")


def product(n: int) -> tuple[Gemm, list[WorkUnit], dict[str, list[Result]]]:
    gemm = Gemm(
        id=f"{1:064x}",
        step=1,
        label="bench",
        m=4 * n,
        n=4,
        k=8,
        trans_a=False,
        trans_b=False,
        tile=4,
        a_id="a" * 64,
        b_id="b" * 64,
        policy=Policy.QUORUM,
    )
    redundancy = Redundancy(target_nresults=2, min_quorum=2)
    wus = [
        tile_workunit(gemm, bounds, "a" * 64, "b" * 64, redundancy, KERNEL_VERSION)
        for bounds in tile_bounds(gemm.m, gemm.n, gemm.tile)
    ]
    results = {
        wu.id: [Result(id=os.urandom(16).hex(), wu_id=wu.id) for _ in range(2)] for wu in wus
    }
    return gemm, wus, results


async def lifecycle(path: Path, n: int, events_wu_index: bool) -> dict[str, float]:
    """Seconds spent committing each phase of n work units' lives."""
    if events_wu_index:  # schema 3's index, put back into a migrated database
        created = SqliteStore(path)
        await created.open()
        await created.close()
        with contextlib.closing(sqlite3.connect(path)) as db:
            db.execute("CREATE INDEX events_wu ON events(wu_id)")
    store = SqliteStore(path)
    await store.open()
    try:
        host = Host(id=1, name="h", token_hash="t" * 64, created=0.0, last_contact=0.0)
        gemm, wus, results = product(n)
        spent = dict.fromkeys(PHASES, 0.0)

        async def commit(phase: str, batch: Batch) -> None:
            started = time.perf_counter()
            await store.commit(batch)
            spent[phase] += time.perf_counter() - started

        batch = Batch(gemms={gemm.id: gemm}, hosts={host.id: host})
        for wu in wus:
            batch.workunits[wu.id] = wu
            batch.results.update((r.id, r) for r in results[wu.id])
        await commit("publish", batch)
        for start in range(0, n, PER_REQUEST):
            chunk = wus[start : start + PER_REQUEST]
            sent, got, judged = (Batch(hosts={host.id: host}) for _ in range(3))
            for wu in chunk:
                sent.workunits[wu.id] = wu.evolve(transition_time=100.0)
                for r in results[wu.id]:
                    r = r.evolve(
                        host_id=host.id,
                        server_state=ServerState.IN_PROGRESS,
                        sent_time=1.0,
                        report_deadline=100.0,
                    )
                    sent.results[r.id] = r
                    sent.events.append(Event.about(wu, 1.0, "in_progress", "sent to host 1", r))
                    r = r.evolve(
                        server_state=ServerState.OVER,
                        outcome=Outcome.SUCCESS,
                        received_time=2.0,
                        output_hash="c" * 64,
                        has_tile=True,
                    )
                    got.results[r.id] = r
                    got.events.append(Event.about(wu, 2.0, "success", "tile cccc in 0.01s", r))
                    r = r.evolve(validate_state=ValidateState.VALID)
                    judged.results[r.id] = r
                    judged.events.append(
                        Event(2.0, "validation", "valid", "quorum", 1, gemm.id, wu.id, r.id, 1)
                    )
                judged.workunits[wu.id] = wu.evolve(
                    state=WuState.ASSIMILATED,
                    canonical_result=results[wu.id][0].id,
                    canonical_hash="c" * 64,
                )
                judged.events.append(Event.about(wu, 2.0, "validated", "quorum of 2"))
                judged.events.append(Event.about(wu, 2.0, "assimilated", "tile written"))
            await commit("assign", sent)
            await commit("report", got)
            await commit("judge", judged)
        return spent
    finally:
        await store.close()


def measure(n: int, rounds: int) -> dict[bool, dict[str, float]]:
    """Median microseconds per work unit of each phase, for each schema."""
    spent: dict[bool, dict[str, list[float]]] = {
        index: {phase: [] for phase in (*PHASES, "total")} for index in (False, True)
    }
    for _ in range(rounds):
        for index in (False, True):
            folder = tempfile.mkdtemp(prefix="tilehive-store-commits-")
            try:
                phases = asyncio.run(lifecycle(Path(folder) / "state.db", n, index))
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            for phase, seconds in phases.items():
                spent[index][phase].append(1e6 * seconds / n)
            spent[index]["total"].append(1e6 * sum(phases.values()) / n)
    return {
        index: {phase: statistics.median(v) for phase, v in by_phase.items()}
        for index, by_phase in spent.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workunits", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    figures = measure(args.workunits, args.rounds)
    for index, label in ((False, "schema 4 (no events_wu)"), (True, "with events_wu index")):
        f = figures[index]
        split = ", ".join(f"{phase} {f[phase]:.0f}" for phase in PHASES)
        print(
            f"{label:26s} {f['total']:6.0f} us a work unit ({split}): "
            f"{1e6 / f['total']:,.0f} WU/s for the store alone"
        )
    ratio = figures[False]["total"] / figures[True]["total"]
    print(f"store time per work unit without the index / with it: {ratio:.2f}x")


if __name__ == "__main__":
    main()
