"""The transitioner: moves a work unit and its results on as time passes and results arrive.

`transition` is pure: given a work unit, its results and the time, it returns the new
versions and the log lines, following BOINC's transitioner (sched/transitioner.cpp):
timeouts become NO_REPLY; replicas needed = target - unsent - in progress - success. Unlike
BOINC, too many errors or too many results do not fail the work unit (a training step must
not be hostage to its volunteers): the crowd's share of it is over, and the coordinator
computes the tile itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from coordinator.work.events import Event
from coordinator.work.records import (
    WU_DECIDED,
    Outcome,
    Result,
    ServerState,
    ValidateState,
    WorkUnit,
    WuError,
)


@dataclass(slots=True)
class Transition:
    """What changed: the work unit, changed or new results, and why."""

    wu: WorkUnit
    results: list[Result] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    # Set when the crowd's budget for the work unit ran out just now: why. The coordinator
    # then computes the tile itself.
    exhausted: str | None = None


def _event(wu: WorkUnit, now: float, state: str, message: str, result: Result | None = None):
    return Event.about(wu, now, state, message, result)


def counts(results: list[Result]) -> dict[str, int]:
    """BOINC's tallies of a work unit's results; errors count once per host, so that one
    host cannot spend the work unit's error budget alone, and successes too, as the
    validator counts one vote per host: a host that took a replacement after its first
    replica timed out (or was taken back, and forgiven on its release) and then reported
    both would otherwise fill the quorum alone, and no replica would go to another host."""
    tally = {"unsent": 0, "in_progress": 0, "success": 0, "errors": 0, "total": len(results)}
    erred: set[int | None] = set()
    succeeded: set[int | None] = set()
    for r in results:
        if r.server_state is ServerState.UNSENT:
            tally["unsent"] += 1
        elif r.server_state is ServerState.IN_PROGRESS:
            tally["in_progress"] += 1
        elif r.outcome is Outcome.SUCCESS and r.validate_state is not ValidateState.INVALID:
            succeeded.add(r.host_id)
        elif r.outcome is Outcome.CLIENT_ERROR or (
            r.outcome is Outcome.SUCCESS and r.validate_state is ValidateState.INVALID
        ):
            # Evidence against the work itself. A timeout or a hand-back is not (BOINC
            # counts it; a training step would then die of churn): those are bounded by
            # max_total_results alone.
            erred.add(r.host_id)
    tally["errors"] = len(erred)
    tally["success"] = len(succeeded)
    return tally


def transition(
    wu: WorkUnit, results: list[Result], now: float, new_result_id: Callable[[], str]
) -> Transition:
    """Advance one work unit to `now`."""
    out = Transition(wu=wu)
    current: dict[str, Result] = {r.id: r for r in results}

    def change(result: Result, message: str) -> None:
        current[result.id] = result
        out.results.append(result)
        out.events.append(_event(wu, now, result.outcome.value, message, result))

    for r in results:
        # <=: a deadline of exactly `now` is missed; the returned transition_time is then
        # always after `now`, so the due queue never drops a work unit it just popped.
        if r.server_state is ServerState.IN_PROGRESS and (r.report_deadline or math.inf) <= now:
            change(
                r.evolve(server_state=ServerState.OVER, outcome=Outcome.NO_REPLY),
                f"no reply from host {r.host_id} by the deadline",
            )

    if wu.state in WU_DECIDED:
        for r in list(current.values()):
            if r.server_state is ServerState.UNSENT:
                change(
                    r.evolve(server_state=ServerState.OVER, outcome=Outcome.DIDNT_NEED),
                    "not needed: the work unit is decided",
                )
        out.wu = wu.evolve(transition_time=math.inf)
        return out

    tally = counts(list(current.values()))
    reason = None
    if tally["errors"] > wu.max_error_results:
        mask, reason = (
            WuError.TOO_MANY_ERRORS,
            (
                f"too many errors: {tally['errors']} failed or invalid results "
                f"(max_error_results={wu.max_error_results})"
            ),
        )
    needed = wu.target_nresults - tally["unsent"] - tally["in_progress"] - tally["success"]
    if reason is None and needed > 0 and tally["total"] + needed > wu.max_total_results:
        mask, reason = (
            WuError.TOO_MANY_TOTAL,
            (
                f"too many results: {tally['total']} issued, {needed} more needed "
                f"(max_total_results={wu.max_total_results})"
            ),
        )
    if reason is not None:
        for r in list(current.values()):
            if r.server_state is ServerState.UNSENT:
                change(
                    r.evolve(server_state=ServerState.OVER, outcome=Outcome.DIDNT_NEED),
                    "not needed: the coordinator computes the tile",
                )
            elif r.server_state is ServerState.IN_PROGRESS:
                # Its host is told to drop it in its next work reply.
                change(
                    r.evolve(server_state=ServerState.OVER, outcome=Outcome.ABORTED),
                    "aborted: the coordinator computes the tile",
                )
        out.wu = wu.evolve(error_mask=wu.error_mask | mask, transition_time=math.inf)
        out.events.append(
            _event(wu, now, "exhausted", f"{reason}: the coordinator computes the tile itself")
        )
        out.exhausted = reason
        return out

    for _ in range(max(0, needed)):
        fresh = Result(id=new_result_id(), wu_id=wu.id)
        current[fresh.id] = fresh
        out.results.append(fresh)
        out.events.append(_event(wu, now, ServerState.UNSENT.value, "new replica issued", fresh))

    deadlines = [
        r.report_deadline
        for r in current.values()
        if r.server_state is ServerState.IN_PROGRESS and r.report_deadline is not None
    ]
    out.wu = wu.evolve(transition_time=min(deadlines, default=math.inf))
    return out
