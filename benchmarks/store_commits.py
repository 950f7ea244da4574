"""Store benchmark: what the database costs per work unit, committed as the coordinator
commits it: today's store against five of its past decisions undone, the events_wu index
that schema 4 dropped, the events' kind and step indexes that schema 6 dropped, events
inserted one statement run a row (today's bind up to 256 a statement), SQLite's default page
cache of 2 MB (the store's holds 64 MB), and result ids of random digits only (today's start
with the time).

Run:  .venv/bin/python benchmarks/store_commits.py [--workunits N] [--rounds N] [--per-commit N]

Each round drives N work units of one product (quorum 2) through `SqliteStore.commit` in a
fresh state.db, in the commits a coordinator makes: the publication (the work units; a
result is first written when it is sent); then for every --per-commit work units (4: one
host's request) their assignment, their report, and the pass that judges and assimilates
them, each with its events. Rounds alternate the stores;
the figures are the medians of the rounds' microseconds per work unit, by commit, and the
work units per second the store alone allows. The page cache matters once the state holds
tens of thousands of work units: try --workunits 20000 --per-commit 400.
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

from coordinator.state.sqlite import PAGE_CACHE_KIB, SqliteStore  # noqa: E402
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
    new_result_id,
    tile_bounds,
    tile_workunit,
)
from kernels import KERNEL_VERSION  # noqa: E402

PHASES = ("publish", "assign", "report", "judge")
DEFAULT_CACHE_KIB = 2000  # SQLite's own default (PRAGMA cache_size=-2000)

# Not statements: results named by 32 random hex digits, as before the eighteenth round
# (today's ids start with the time, so the results in flight are neighbours in the index);
# events inserted by running the statement once a row, as before the twenty-first.
RANDOM_IDS = "-- random result ids"
EVENT_A_RUN = "-- an event a statement run"

# Each store as today's schema and connection, then changed by these statements.
STORES = {
    "today's store": [],
    "with events_wu index": ["CREATE INDEX events_wu ON events(wu_id)"],
    "with events_kind, _step": [
        "CREATE INDEX events_kind ON events(kind, id)",
        "CREATE INDEX events_step ON events(step)",
    ],
    "an event a statement run": [EVENT_A_RUN],
    "SQLite's 2 MB page cache": [f"PRAGMA cache_size=-{DEFAULT_CACHE_KIB}"],
    "random result ids": [RANDOM_IDS],
}


class ChangedStore(SqliteStore):
    """Today's store with `changes` run on its connection as it opens."""

    def __init__(self, path: Path, changes: list[str]) -> None:
        super().__init__(path)
        self.changes = changes
        if EVENT_A_RUN in changes:
            self.appends = frozenset()

    def _connect(self) -> sqlite3.Connection:
        db = super()._connect()
        for change in self.changes:
            if change.startswith("PRAGMA"):
                db.execute(change)
        return db


def product(n: int, random_ids: bool) -> tuple[Gemm, list[WorkUnit], dict[str, list[Result]]]:
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
    name = (lambda: os.urandom(16).hex()) if random_ids else new_result_id
    results = {wu.id: [Result(id=name(), wu_id=wu.id) for _ in range(2)] for wu in wus}
    return gemm, wus, results


async def lifecycle(path: Path, n: int, per_commit: int, changes: list[str]) -> dict[str, float]:
    """Seconds spent committing each phase of n work units' lives."""
    schema = [c for c in changes if not c.startswith(("PRAGMA", "--"))]
    if schema:  # put into a migrated database
        created = SqliteStore(path)
        await created.open()
        await created.close()
        with contextlib.closing(sqlite3.connect(path)) as db:
            for change in schema:
                db.execute(change)
    store = ChangedStore(path, changes)
    await store.open()
    try:
        host = Host(id=1, name="h", token_hash="t" * 64, created=0.0, last_contact=0.0)
        gemm, wus, results = product(n, RANDOM_IDS in changes)
        spent = dict.fromkeys(PHASES, 0.0)

        async def commit(phase: str, batch: Batch) -> None:
            started = time.perf_counter()
            await store.commit(batch)
            spent[phase] += time.perf_counter() - started

        # Results are not written unsent (Ledger.put_result): a result's first row is the
        # one that sends it, with its host.
        batch = Batch(gemms={gemm.id: gemm}, hosts={host.id: host})
        for wu in wus:
            batch.workunits[wu.id] = wu
        await commit("publish", batch)
        for start in range(0, n, per_commit):
            chunk = wus[start : start + per_commit]
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


def measure(n: int, rounds: int, per_commit: int) -> dict[str, dict[str, float]]:
    """Median microseconds per work unit of each phase, for each store."""
    spent: dict[str, dict[str, list[float]]] = {
        store: {phase: [] for phase in (*PHASES, "total")} for store in STORES
    }
    for _ in range(rounds):
        for store, changes in STORES.items():
            folder = tempfile.mkdtemp(prefix="tilehive-store-commits-")
            try:
                phases = asyncio.run(lifecycle(Path(folder) / "state.db", n, per_commit, changes))
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            for phase, seconds in phases.items():
                spent[store][phase].append(1e6 * seconds / n)
            spent[store]["total"].append(1e6 * sum(phases.values()) / n)
    return {
        store: {phase: statistics.median(v) for phase, v in by_phase.items()}
        for store, by_phase in spent.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workunits", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-commit", type=int, default=4, help="work units a commit moves on")
    args = parser.parse_args()
    if min(args.workunits, args.rounds, args.per_commit) < 1:
        parser.error("--workunits, --rounds and --per-commit must be at least 1")
    figures = measure(args.workunits, args.rounds, args.per_commit)
    today = figures["today's store"]["total"]
    print(f"(today's store: a page cache of {PAGE_CACHE_KIB >> 10} MB, no index on events)")
    for store, f in figures.items():
        split = ", ".join(f"{phase} {f[phase]:.0f}" for phase in PHASES)
        print(
            f"{store:26s} {f['total']:6.0f} us a work unit ({split}): "
            f"{1e6 / f['total']:,.0f} WU/s for the store alone; today's / this: "
            f"{today / f['total']:.2f}x"
        )


if __name__ == "__main__":
    main()
