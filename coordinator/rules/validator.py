"""The validator: decides which results of a work unit are right, and which tile is canonical.

Pure functions; the coordinator runs the Freivalds checks that `tiles_to_check` asks for and
passes their outcomes to `decide`. Policies (docs/validation.md):

- quorum: `min_quorum` results with bit-identical output hashes agree; the rest are invalid.
  Successes without a quorum raise the target by one (BOINC's rule) until one forms.
- freivalds: each full tile is checked against its operands; the first that passes wins.
- both: a quorum forms and its tile also passes Freivalds.

A work unit with min_quorum 1 (the freivalds policy, or adaptive replication to a trusted
host) is always decided by Freivalds, whatever the project policy.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from coordinator.work.events import Event
from coordinator.work.records import (
    WU_DECIDED,
    Outcome,
    Policy,
    Result,
    ServerState,
    ValidateState,
    WorkUnit,
    WuState,
)


class Check(Protocol):
    """The outcome of checking one tile (validation.freivalds.FreivaldsResult fits)."""

    ok: bool
    reason: str


@dataclass(slots=True)
class Decision:
    wu: WorkUnit
    results: list[Result] = field(default_factory=list)  # changed results
    events: list[Event] = field(default_factory=list)
    verdicts: list[tuple[Result, bool]] = field(default_factory=list)  # for host trust
    decided: bool = False  # the work unit got its canonical result just now


def awaiting_verdict(results: list[Result]) -> list[Result]:
    """Successful results not yet judged valid or invalid."""
    waiting = (ValidateState.INIT, ValidateState.INCONCLUSIVE)
    return [r for r in results if r.outcome is Outcome.SUCCESS and r.validate_state in waiting]


def single_replica(wu: WorkUnit) -> bool:
    return wu.min_quorum <= 1


def quorum_group(wu: WorkUnit, results: list[Result]) -> list[Result]:
    """The results whose hash at least min_quorum hosts share (ties: smallest hash). One
    vote per host: a host given a new replica after its first timed out may report both."""
    candidates = votes(results)
    tally = Counter(r.output_hash for r in candidates)
    if not tally:
        return []
    best = max(tally.values())
    if best < wu.min_quorum:
        return []
    winner = min(h for h, n in tally.items() if n == best)
    return sorted((r for r in candidates if r.output_hash == winner), key=_arrival)


def votes(results: list[Result]) -> list[Result]:
    """The successes not judged invalid, the first of each host only."""
    counted, voted = [], set()
    for r in sorted(results, key=_arrival):
        if r.outcome is not Outcome.SUCCESS or r.validate_state is ValidateState.INVALID:
            continue
        if r.host_id not in voted:
            voted.add(r.host_id)
            counted.append(r)
    return counted


def _arrival(r: Result) -> tuple[float, str]:
    return (r.received_time or 0.0, r.id)


def tiles_to_check(wu: WorkUnit, results: list[Result]) -> list[Result]:
    """Results whose full tile must pass Freivalds before `decide` can use them."""
    if wu.state in WU_DECIDED:
        return []
    if single_replica(wu):
        return [r for r in sorted(awaiting_verdict(results), key=_arrival) if r.has_tile]
    if wu.policy is Policy.BOTH:
        with_tile = [r for r in quorum_group(wu, results) if r.has_tile]
        return with_tile[:1]
    return []


def decide(wu: WorkUnit, results: list[Result], checks: dict[str, Check], now: float) -> Decision:
    """Validate what can be validated now."""
    out = Decision(wu=wu)

    def mark(r: Result, state: ValidateState, message: str) -> None:
        changed = r.evolve(validate_state=state)
        out.results.append(changed)
        out.events.append(
            Event(
                time=now,
                kind="validation",
                state=state.value,
                message=message,
                step=wu.step,
                gemm_id=wu.gemm_id,
                wu_id=wu.id,
                result_id=r.id,
                host_id=r.host_id,
            )
        )
        if state in (ValidateState.VALID, ValidateState.INVALID):
            out.verdicts.append((changed, state is ValidateState.VALID))

    if wu.state in WU_DECIDED:
        _late(wu, awaiting_verdict(results), mark)
    elif single_replica(wu):
        _decide_single(wu, results, checks, mark, out, now)
    else:
        _decide_quorum(wu, results, checks, mark, out, now)
    return out


def _late(wu: WorkUnit, pending: list[Result], mark) -> None:
    for r in pending:
        if wu.state is WuState.ERROR or wu.canonical_hash is None:
            mark(r, ValidateState.TOO_LATE, "arrived after the work unit failed")
        elif r.output_hash == wu.canonical_hash:
            mark(r, ValidateState.VALID, "late, but matches the canonical tile")
        else:
            mark(r, ValidateState.INVALID, "late, and differs from the canonical tile")


def _set_canonical(out: Decision, canonical: Result, now: float, why: str) -> None:
    wu = out.wu
    out.wu = wu.evolve(
        state=WuState.VALIDATED,
        canonical_result=canonical.id,
        canonical_hash=canonical.output_hash,
    )
    out.decided = True
    out.events.append(
        Event(
            time=now,
            kind="wu",
            state=WuState.VALIDATED.value,
            message=f"validated: {why}; canonical result {canonical.id}",
            step=wu.step,
            gemm_id=wu.gemm_id,
            wu_id=wu.id,
            result_id=canonical.id,
            host_id=canonical.host_id,
        )
    )


def _decide_single(wu, results, checks, mark, out: Decision, now: float) -> None:
    canonical = None
    for r in sorted(awaiting_verdict(results), key=_arrival):
        if not r.has_tile:
            continue
        check = checks.get(r.id)
        if check is None:
            continue
        if check.ok:
            mark(r, ValidateState.VALID, check.reason)
            canonical = canonical or r
        else:
            mark(r, ValidateState.INVALID, check.reason)
    if canonical is None:
        return
    _set_canonical(out, canonical, now, "tile passed Freivalds")
    for r in awaiting_verdict(results):
        if r.has_tile:
            continue
        if r.output_hash == canonical.output_hash:
            mark(r, ValidateState.VALID, "spot check: hash matches the canonical tile")
        else:
            mark(r, ValidateState.INVALID, "spot check: hash differs from the canonical tile")


def _decide_quorum(wu, results, checks, mark, out: Decision, now: float) -> None:
    pending = awaiting_verdict(results)
    group = quorum_group(wu, results)
    if not group:
        successes = votes(results)
        if len(successes) >= wu.min_quorum:
            sizes = sorted(Counter(r.output_hash for r in successes).values(), reverse=True)
            target = max(wu.target_nresults, len(successes) + 1)
            for r in pending:
                if r.validate_state is not ValidateState.INCONCLUSIVE:
                    mark(r, ValidateState.INCONCLUSIVE, "no quorum yet")
            out.wu = out.wu.evolve(target_nresults=target)
            out.events.append(
                Event(
                    time=now,
                    kind="validation",
                    state="no_quorum",
                    message=(
                        f"hash mismatch: {' vs '.join(map(str, sizes))} of {len(successes)} "
                        f"results agree, {wu.min_quorum} needed; target raised to {target}"
                    ),
                    step=wu.step,
                    gemm_id=wu.gemm_id,
                    wu_id=wu.id,
                )
            )
        return
    agreed = group[0].output_hash
    outliers = [r for r in pending if r.output_hash != agreed]

    def hold() -> None:
        # The quorum is not confirmed yet: outliers are not judged (an unconfirmed majority
        # may be the wrong side, as in BOINC), only kept from being taken for the tile.
        for r in outliers:
            if r.validate_state is not ValidateState.INCONCLUSIVE:
                mark(r, ValidateState.INCONCLUSIVE, "differs from an unconfirmed quorum")

    with_tile = [r for r in group if r.has_tile]
    if not with_tile:
        # The quorum reported hashes only; one more replica must upload the tile.
        hold()
        in_flight = any(r.upload_tile and r.server_state is not ServerState.OVER for r in results)
        if not in_flight:
            out.wu = out.wu.evolve(target_nresults=out.wu.target_nresults + 1)
        return
    if wu.policy is Policy.BOTH:
        check = checks.get(with_tile[0].id)
        if check is None:
            return
        if not check.ok:
            for r in group:
                mark(
                    r,
                    ValidateState.INVALID,
                    f"quorum of {len(group)} agreed on a tile that fails Freivalds: {check.reason}",
                )
            hold()
            out.wu = out.wu.evolve(target_nresults=out.wu.target_nresults + 1)
            return
    n_out = len(outliers) + sum(
        1 for r in results if r.validate_state is ValidateState.INVALID and r.output_hash
    )
    for r in outliers:
        mark(
            r,
            ValidateState.INVALID,
            f"hash mismatch: {len(group)} agree, {n_out} differ{'s' if n_out == 1 else ''}",
        )
    for r in group:
        if r.validate_state is not ValidateState.VALID:
            mark(r, ValidateState.VALID, f"quorum: {len(group)} bit-identical results agree")
    why = f"{len(group)} results agree"
    if wu.policy is Policy.BOTH:
        why += " and the tile passed Freivalds"
    _set_canonical(out, with_tile[0], now, why)
