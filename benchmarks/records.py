"""Records benchmark: what the coordinator pays for each record it builds or changes, against
the plain ways of doing the same (docs/performance.md).

Run:  .venv/bin/python benchmarks/records.py [--rounds N]

- Building a work unit (26 fields) and a result (13): `@drafted` records (work/records.py)
  against a frozen, slotted dataclass of the same fields, as the records were before.
- Changing two fields of a work unit and of a result: `evolve` against
  `dataclasses.replace` on that dataclass.

Each round times both sides in turn, a few hundred thousand calls each; the figures are
the medians of the rounds. For scale: in the suite's coordinator throughput row, a work
unit's life builds a work unit and two results and changes records several times.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

from benchmarks.report import Row, run_alone  # noqa: E402
from coordinator.work.records import (  # noqa: E402
    Outcome,
    Policy,
    Result,
    ServerState,
    WorkUnit,
    WuState,
)

CALLS = 200_000


def frozen_twin(cls: type) -> type:
    """A frozen, slotted dataclass with `cls`'s fields and defaults, built the stock way."""
    fields = [
        (f.name, f.type, dataclasses.field(default=f.default))
        if f.default is not dataclasses.MISSING
        else (f.name, f.type)
        for f in dataclasses.fields(cls)
    ]
    return dataclasses.make_dataclass(f"Frozen{cls.__name__}", fields, frozen=True, slots=True)


WU_FIELDS = {
    "id": "0" * 64,
    "gemm_id": "g" * 64,
    "step": 3,
    "i0": 0,
    "i1": 64,
    "j0": 0,
    "j1": 64,
    "k": 64,
    "a_panel": "a" * 64,
    "b_panel": "b" * 64,
    "trans_a": False,
    "trans_b": True,
    "kernel_version": 1,
    "policy": Policy.QUORUM,
    "target_nresults": 2,
    "min_quorum": 2,
    "max_error_results": 4,
    "max_total_results": 24,
    "delay_bound": 60.0,
}
RESULT_FIELDS = {"id": "r" * 32, "wu_id": "0" * 64, "host_id": 7}


def per_call(work: Callable[[], object]) -> float:
    """Seconds a call, over CALLS calls."""
    start = time.perf_counter()
    for _ in range(CALLS):
        work()
    return (time.perf_counter() - start) / CALLS


def pairs() -> list[tuple[str, Callable[[], object], Callable[[], object]]]:
    """(what, ours, the plain way) for each row."""
    frozen_wu, frozen_result = frozen_twin(WorkUnit), frozen_twin(Result)
    wu, plain_wu = WorkUnit(**WU_FIELDS), frozen_wu(**WU_FIELDS)
    result, plain_result = Result(**RESULT_FIELDS), frozen_result(**RESULT_FIELDS)
    replace = dataclasses.replace
    decided = {"state": WuState.VALIDATED, "canonical_hash": "c" * 64}
    reported = {"server_state": ServerState.OVER, "outcome": Outcome.SUCCESS}
    return [
        (
            "building a work unit: drafted / a frozen dataclass",
            lambda: WorkUnit(**WU_FIELDS),
            lambda: frozen_wu(**WU_FIELDS),
        ),
        (
            "building a result: drafted / a frozen dataclass",
            lambda: Result(**RESULT_FIELDS),
            lambda: frozen_result(**RESULT_FIELDS),
        ),
        (
            "changing two fields of a work unit: evolve / dataclasses.replace",
            lambda: wu.evolve(**decided),
            lambda: replace(plain_wu, **decided),
        ),
        (
            "changing two fields of a result: evolve / dataclasses.replace",
            lambda: result.evolve(**reported),
            lambda: replace(plain_result, **reported),
        ),
    ]


def run(rounds: int = 5) -> list[Row]:
    rows = []
    for what, ours, plain in pairs():
        times: dict[str, list[float]] = {"ours": [], "plain": []}
        for _ in range(rounds):
            times["ours"].append(per_call(ours))
            times["plain"].append(per_call(plain))
        mine, theirs = (statistics.median(times[side]) for side in ("ours", "plain"))
        rows.append(
            Row(
                "records",
                what,
                f"{mine / theirs:.2f}x",
                note=f"{mine * 1e9:,.0f} against {theirs * 1e9:,.0f} ns a call; medians of "
                f"{rounds} rounds of {CALLS:,} calls each side",
            )
        )
    return rows


def main() -> None:
    run_alone(__doc__, run, rounds=5)


if __name__ == "__main__":
    main()
