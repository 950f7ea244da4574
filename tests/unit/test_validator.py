"""The validator: quorum, Freivalds and both policies, late results, and verdicts for trust."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest

from coordinator.rules.scheduler import wants_tile
from coordinator.rules.transitioner import transition
from coordinator.rules.validator import Decision, decide, quorum_group, tiles_to_check
from coordinator.work.records import (
    Outcome,
    Policy,
    Result,
    ServerState,
    ValidateState,
    WorkUnit,
    WuState,
)

NOW = 2_000.0
WU_ID = "wu-1"
A, B, C = "a" * 64, "b" * 64, "c" * 64  # output hashes


# ---- factories -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """Stand-in for a Freivalds outcome."""

    ok: bool
    reason: str


PASS = Check(True, "freivalds: 16 rounds within bound")
FAIL = Check(False, "freivalds: row 3 residual 4.1e+02 over bound 1.2e-03")


def make_wu(policy: Policy = Policy.QUORUM, **changes: object) -> WorkUnit:
    single = policy is Policy.FREIVALDS
    wu = WorkUnit(
        id=WU_ID,
        gemm_id="gemm-1",
        step=5,
        i0=0,
        i1=64,
        j0=64,
        j1=128,
        k=64,
        a_panel="panel-a",
        b_panel="panel-b",
        trans_a=False,
        trans_b=False,
        kernel_version=1,
        policy=policy,
        target_nresults=1 if single else 2,
        min_quorum=1 if single else 2,
        max_error_results=4,
        max_total_results=8,
        delay_bound=60.0,
        transition_time=math.inf,
    )
    return wu.evolve(**changes)


def decided_wu(state: WuState = WuState.VALIDATED, canonical_hash: str | None = A) -> WorkUnit:
    canonical = "r1" if canonical_hash else None
    return make_wu(state=state, canonical_result=canonical, canonical_hash=canonical_hash)


def returned(
    rid: str,
    output_hash: str,
    *,
    tile: bool = False,
    at: float = 0.0,
    validate: ValidateState = ValidateState.INIT,
) -> Result:
    """A successful result, reporting the full tile or its hash only, received at NOW + at."""
    host = int(rid.lstrip("r") or 0)
    return Result(
        id=rid,
        wu_id=WU_ID,
        host_id=host,
        server_state=ServerState.OVER,
        outcome=Outcome.SUCCESS,
        validate_state=validate,
        upload_tile=tile,
        sent_time=NOW - 30,
        received_time=NOW + at,
        report_deadline=NOW + 60,
        output_hash=output_hash,
        has_tile=tile,
    )


def in_flight(rid: str, *, upload: bool) -> Result:
    return Result(
        id=rid,
        wu_id=WU_ID,
        host_id=int(rid.lstrip("r")),
        server_state=ServerState.IN_PROGRESS,
        upload_tile=upload,
        sent_time=NOW - 1,
        report_deadline=NOW + 60,
    )


def states(decision: Decision) -> dict[str, ValidateState]:
    return {r.id: r.validate_state for r in decision.results}


def verdicts(decision: Decision) -> dict[str, bool]:
    found = {r.id: ok for r, ok in decision.verdicts}
    assert len(found) == len(decision.verdicts), "a result got two verdicts in one decision"
    return found


def messages(decision: Decision, result_id: str | None = None) -> list[str]:
    return [
        e.message
        for e in decision.events
        if result_id is None or (e.result_id == result_id and e.kind == "validation")
    ]


def apply(results: list[Result], decision: Decision) -> list[Result]:
    current = {r.id: r for r in results}
    current.update({r.id: r for r in decision.results})
    return list(current.values())


def run_checks(wu: WorkUnit, results: list[Result], outcome: Check) -> dict[str, Check]:
    """What the coordinator does: check exactly the tiles the validator asks for."""
    return {r.id: outcome for r in tiles_to_check(wu, results)}


# ---- quorum --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "results",
    [
        pytest.param([returned("r1", A, tile=True), returned("r2", A, at=1)], id="tile first"),
        pytest.param([returned("r1", A, tile=True, at=1), returned("r2", A)], id="hash first"),
        pytest.param(
            [returned("r1", A, tile=True), returned("r2", A, tile=True, at=1)], id="two tiles"
        ),
    ],
)
def test_two_agreeing_results_validate_the_wu_with_a_tile_as_canonical(results):
    wu = make_wu()
    assert tiles_to_check(wu, results) == []

    decision = decide(wu, results, {}, NOW)

    assert decision.decided
    assert decision.wu.state is WuState.VALIDATED
    assert decision.wu.canonical_result == "r1"
    assert decision.wu.canonical_hash == A
    assert states(decision) == {"r1": ValidateState.VALID, "r2": ValidateState.VALID}
    assert verdicts(decision) == {"r1": True, "r2": True}
    assert any("validated: 2 results agree" in m for m in messages(decision))


def test_one_result_is_not_a_quorum():
    decision = decide(make_wu(), [returned("r1", A, tile=True)], {}, NOW)

    assert not decision.decided
    assert decision.results == []
    assert decision.wu == make_wu()


def test_one_host_is_one_vote_even_with_two_results():
    """A host given a new replica after its first timed out may report both: the two agree,
    but they are one host, not a quorum."""
    first = returned("r1", A, tile=True)
    second = dataclasses.replace(returned("r2", A, at=1), host_id=1)

    decision = decide(make_wu(), [first, second], {}, NOW)

    assert not decision.decided


def test_two_disagreeing_results_are_inconclusive_and_the_target_is_raised():
    wu = make_wu()
    results = [returned("r1", A, tile=True), returned("r2", B, at=1)]

    decision = decide(wu, results, {}, NOW)

    assert not decision.decided
    assert decision.wu.state is WuState.ACTIVE
    assert states(decision) == {"r1": ValidateState.INCONCLUSIVE, "r2": ValidateState.INCONCLUSIVE}
    assert decision.verdicts == []
    assert decision.wu.target_nresults == 3
    (reason,) = [e.message for e in decision.events if e.state == "no_quorum"]
    assert reason.startswith("hash mismatch")
    assert "target raised to 3" in reason


@pytest.mark.parametrize(
    ("third", "canonical", "odd"),
    [
        pytest.param(returned("r3", A, at=2), "r1", "r2", id="agrees with the tile"),
        pytest.param(returned("r3", B, tile=True, at=2), "r3", "r1", id="agrees with the hash"),
    ],
)
def test_a_third_result_forms_a_majority_and_the_odd_one_is_invalid(third, canonical, odd):
    wu = make_wu()
    results = [returned("r1", A, tile=True), returned("r2", B, at=1)]
    first = decide(wu, results, {}, NOW)
    results = [*apply(results, first), third]

    decision = decide(first.wu, results, {}, NOW + 5)

    assert decision.decided
    assert decision.wu.canonical_result == canonical
    assert decision.wu.canonical_hash == third.output_hash
    assert states(decision)[odd] is ValidateState.INVALID
    assert messages(decision, odd) == ["hash mismatch: 2 agree, 1 differs"]
    assert verdicts(decision) == {r.id: r.id != odd for r in results}


def test_a_tie_of_two_against_two_is_decided_by_the_smallest_hash():
    results = [
        returned("r1", B, tile=True),
        returned("r2", A, tile=True, at=1),
        returned("r3", B, at=2),
        returned("r4", A, at=3),
    ]

    decision = decide(make_wu(target_nresults=4), results, {}, NOW)

    assert decision.wu.canonical_hash == A
    assert verdicts(decision) == {"r1": False, "r2": True, "r3": False, "r4": True}
    assert messages(decision, "r1") == ["hash mismatch: 2 agree, 2 differ"]


def test_invalid_results_never_count_towards_a_quorum():
    results = [returned("r1", A, tile=True, validate=ValidateState.INVALID), returned("r2", A)]

    assert quorum_group(make_wu(), results) == []
    decision = decide(make_wu(), results, {}, NOW)
    assert not decision.decided
    assert decision.verdicts == []


# ---- hash-only quorum ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "raised"),
    [
        pytest.param([], True, id="nothing in flight"),
        pytest.param([in_flight("r9", upload=True)], False, id="an upload in progress"),
        pytest.param([Result(id="r9", wu_id=WU_ID)], False, id="an unsent replica"),
        pytest.param([in_flight("r9", upload=False)], True, id="only a hash-only one in progress"),
    ],
)
def test_a_quorum_of_hashes_without_a_tile_asks_for_one_more_replica(extra, raised):
    wu = make_wu()
    results = [returned("r1", A), returned("r2", A, at=1), *extra]

    decision = decide(wu, results, {}, NOW)

    assert not decision.decided
    assert decision.wu.state is WuState.ACTIVE
    assert decision.wu.target_nresults == (3 if raised else 2)
    assert decision.verdicts == []


def test_after_a_mismatch_the_next_replica_uploads_its_tile():
    wu = make_wu()
    results = [returned("r1", A, tile=True), returned("r2", B, at=1)]
    assert not wants_tile(results[:1]), "the second replica reports its hash only"

    decision = decide(wu, results, {}, NOW)

    assert wants_tile(apply(results, decision)), "r1's tile may be the wrong one"


def test_hash_only_majority_against_the_tile_gets_exactly_one_upload_replica():
    """The tile's uploader is the odd one out (r3 was sent hash-only while an upload was in
    flight): one new replica, uploading, and nobody judged until the tile arrives."""
    wu = make_wu()
    results = [returned("r1", A, tile=True), returned("r2", B, at=1)]
    first = decide(wu, results, {}, NOW)
    wu, results = first.wu, [*apply(results, first), returned("r3", B, at=2)]

    second = decide(wu, results, {}, NOW + 1)
    wu, results = second.wu, apply(results, second)
    issued = transition(wu, results, NOW + 1, iter(["r4", "r5"]).__next__)

    assert not second.decided
    assert second.verdicts == [], "nobody is judged before a canonical tile exists"
    fresh = [r for r in issued.results if r.server_state is ServerState.UNSENT]
    assert [r.id for r in fresh] == ["r4"]
    assert wants_tile(apply(results, issued))

    results = [*apply(results, issued)]
    results = [r for r in results if r.id != "r4"] + [returned("r4", B, tile=True, at=3)]
    third = decide(issued.wu, results, {}, NOW + 2)

    assert third.decided
    assert third.wu.canonical_result == "r4"
    assert verdicts(third) == {"r1": False, "r2": True, "r3": True, "r4": True}
    assert messages(third, "r1") == ["hash mismatch: 3 agree, 1 differs"]


# ---- late results --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("wu", "late_hash", "expected", "verdict"),
    [
        pytest.param(decided_wu(), A, ValidateState.VALID, True, id="validated, matching"),
        pytest.param(decided_wu(), B, ValidateState.INVALID, False, id="validated, differing"),
        pytest.param(
            decided_wu(WuState.ASSIMILATED), A, ValidateState.VALID, True, id="assimilated"
        ),
        pytest.param(
            decided_wu(WuState.ASSIMILATED), C, ValidateState.INVALID, False, id="assim., differs"
        ),
        pytest.param(decided_wu(WuState.ERROR, None), A, ValidateState.TOO_LATE, None, id="error"),
    ],
)
def test_a_result_after_the_wu_is_decided_is_judged_against_the_canonical_tile(
    wu, late_hash, expected, verdict
):
    canonical = returned("r1", A, tile=True, validate=ValidateState.VALID)
    late = returned("r2", late_hash, tile=True, at=30)

    decision = decide(wu, [canonical, late], {}, NOW + 30)

    assert tiles_to_check(wu, [canonical, late]) == []
    assert states(decision) == {"r2": expected}
    assert verdicts(decision) == ({} if verdict is None else {"r2": verdict})
    assert decision.wu == wu
    assert not decision.decided


# ---- freivalds policy ----------------------------------------------------------------------


def test_freivalds_failing_tile_is_invalid_with_the_checks_reason():
    wu = make_wu(Policy.FREIVALDS)
    results = [returned("r1", A, tile=True)]
    checks = run_checks(wu, results, FAIL)
    assert list(checks) == ["r1"]

    decision = decide(wu, results, checks, NOW)

    assert not decision.decided
    assert decision.wu.state is WuState.ACTIVE
    assert states(decision) == {"r1": ValidateState.INVALID}
    assert messages(decision, "r1") == [FAIL.reason]
    assert verdicts(decision) == {"r1": False}


def test_freivalds_passing_tile_is_canonical():
    wu = make_wu(Policy.FREIVALDS)
    results = [returned("r1", A, tile=True)]

    decision = decide(wu, results, run_checks(wu, results, PASS), NOW)

    assert decision.decided
    assert decision.wu.state is WuState.VALIDATED
    assert (decision.wu.canonical_result, decision.wu.canonical_hash) == ("r1", A)
    assert verdicts(decision) == {"r1": True}
    assert any("tile passed Freivalds" in m for m in messages(decision))


def test_freivalds_first_passing_tile_wins_after_a_failing_one():
    wu = make_wu(Policy.FREIVALDS, target_nresults=2)
    results = [returned("r1", B, tile=True), returned("r2", A, tile=True, at=1)]
    checks = {"r1": FAIL, "r2": PASS}

    decision = decide(wu, results, checks, NOW)

    assert decision.wu.canonical_result == "r2"
    assert verdicts(decision) == {"r1": False, "r2": True}


def test_freivalds_without_a_check_decides_nothing():
    wu = make_wu(Policy.FREIVALDS)

    decision = decide(wu, [returned("r1", A, tile=True)], {}, NOW)

    assert decision.results == []
    assert decision.verdicts == []
    assert not decision.decided


@pytest.mark.parametrize(("spot_hash", "ok"), [(A, True), (B, False)])
def test_single_replica_hash_reports_are_spot_checked_against_the_canonical_tile(spot_hash, ok):
    wu = make_wu(Policy.QUORUM, target_nresults=1, min_quorum=1)  # adaptive replication
    results = [returned("r1", A, tile=True), returned("r2", spot_hash, at=1)]

    decision = decide(wu, results, run_checks(wu, results, PASS), NOW)

    assert decision.wu.canonical_result == "r1"
    assert verdicts(decision) == {"r1": True, "r2": ok}


# ---- which tiles are checked ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("wu", "results", "expected"),
    [
        pytest.param(
            make_wu(Policy.QUORUM),
            [returned("r1", A, tile=True), returned("r2", A)],
            [],
            id="quorum: never",
        ),
        pytest.param(
            make_wu(Policy.FREIVALDS), [returned("r1", A, tile=True)], ["r1"], id="freivalds"
        ),
        pytest.param(
            make_wu(Policy.FREIVALDS, target_nresults=2),
            [returned("r2", A, tile=True, at=1), returned("r1", B, tile=True)],
            ["r1", "r2"],
            id="freivalds: in arrival order",
        ),
        pytest.param(make_wu(Policy.FREIVALDS), [returned("r1", A)], [], id="freivalds: no tile"),
        pytest.param(
            make_wu(Policy.FREIVALDS),
            [returned("r1", A, tile=True, validate=ValidateState.INVALID)],
            [],
            id="freivalds: already invalid",
        ),
        pytest.param(
            make_wu(Policy.QUORUM, target_nresults=1, min_quorum=1),
            [returned("r1", A, tile=True)],
            ["r1"],
            id="adaptive replication",
        ),
        pytest.param(
            make_wu(Policy.BOTH),
            [returned("r1", A), returned("r2", A, tile=True, at=1), returned("r3", A, tile=True)],
            ["r3"],
            id="both: first tile of the quorum",
        ),
        pytest.param(
            make_wu(Policy.BOTH),
            [returned("r1", A, tile=True), returned("r2", B, tile=True)],
            [],
            id="both: no quorum yet",
        ),
        pytest.param(
            make_wu(Policy.BOTH),
            [returned("r1", A), returned("r2", A)],
            [],
            id="both: quorum without a tile",
        ),
        pytest.param(
            decided_wu(), [returned("r2", A, tile=True)], [], id="decided: never checked again"
        ),
    ],
)
def test_tiles_to_check_asks_only_where_a_check_decides(wu, results, expected):
    assert [r.id for r in tiles_to_check(wu, results)] == expected


# ---- both policy ---------------------------------------------------------------------------


def test_both_policy_quorum_on_a_tile_that_fails_freivalds_is_all_invalid():
    wu = make_wu(Policy.BOTH)
    results = [returned("r1", A, tile=True), returned("r2", A, at=1)]
    checks = run_checks(wu, results, FAIL)

    decision = decide(wu, results, checks, NOW)

    assert not decision.decided
    assert decision.wu.state is WuState.ACTIVE
    assert decision.wu.target_nresults == 3
    assert states(decision) == {"r1": ValidateState.INVALID, "r2": ValidateState.INVALID}
    assert verdicts(decision) == {"r1": False, "r2": False}
    for rid in ("r1", "r2"):
        (message,) = messages(decision, rid)
        assert message.startswith("quorum of 2 agreed on a tile that fails Freivalds")
        assert FAIL.reason in message


def test_both_policy_quorum_on_a_tile_that_passes_freivalds_is_validated():
    wu = make_wu(Policy.BOTH)
    results = [returned("r1", A, tile=True), returned("r2", A, at=1)]

    decision = decide(wu, results, run_checks(wu, results, PASS), NOW)

    assert decision.decided
    assert decision.wu.canonical_result == "r1"
    assert verdicts(decision) == {"r1": True, "r2": True}
    assert any("and the tile passed Freivalds" in m for m in messages(decision))


def test_both_policy_waits_for_the_check_before_judging_anyone():
    wu = make_wu(Policy.BOTH, target_nresults=3)
    results = [returned("r1", A, tile=True), returned("r2", A, at=1), returned("r3", B, at=2)]

    decision = decide(wu, results, {}, NOW)

    assert not decision.decided
    assert decision.verdicts == []


def test_both_policy_dissenter_is_not_punished_when_the_majority_fails_freivalds():
    """Two hosts agreeing on a wrong tile must not cost the honest third host its trust."""
    wu = make_wu(Policy.BOTH, target_nresults=3)
    results = [returned("r1", A, tile=True), returned("r2", A, at=1), returned("r3", B, at=2)]

    failed = decide(wu, results, run_checks(wu, results, FAIL), NOW)

    assert verdicts(failed) == {"r1": False, "r2": False}
    assert states(failed)["r3"] is ValidateState.INCONCLUSIVE
    results = apply(results, failed)
    assert wants_tile(results), "the next replica must bring a tile"

    results.append(returned("r4", B, tile=True, at=3))
    confirmed = decide(failed.wu, results, run_checks(failed.wu, results, PASS), NOW + 1)

    assert confirmed.decided
    assert (confirmed.wu.canonical_result, confirmed.wu.canonical_hash) == ("r4", B)
    assert verdicts(confirmed) == {"r3": True, "r4": True}


def test_both_policy_hash_majority_against_the_only_tile_judges_nobody_yet():
    wu = make_wu(Policy.BOTH, target_nresults=3)
    results = [returned("r1", A, tile=True), returned("r2", B, at=1), returned("r3", B, at=2)]

    decision = decide(wu, results, run_checks(wu, results, PASS), NOW)

    assert not decision.decided
    assert decision.verdicts == []
    assert states(decision) == {"r1": ValidateState.INCONCLUSIVE}
    assert decision.wu.target_nresults == 4
    assert wants_tile(apply(results, decision))


# ---- repeated passes -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("wu", "results", "checks"),
    [
        pytest.param(make_wu(), [returned("r1", A, tile=True), returned("r2", A)], {}, id="quorum"),
        pytest.param(
            make_wu(), [returned("r1", A, tile=True), returned("r2", B)], {}, id="mismatch"
        ),
        pytest.param(
            make_wu(Policy.FREIVALDS), [returned("r1", A, tile=True)], {"r1": FAIL}, id="fails"
        ),
        pytest.param(
            make_wu(Policy.BOTH),
            [returned("r1", A, tile=True), returned("r2", A)],
            {"r1": FAIL},
            id="both fails",
        ),
    ],
)
def test_deciding_again_gives_no_host_a_second_verdict(wu, results, checks):
    first = decide(wu, results, checks, NOW)
    assert first.verdicts or first.results

    again = decide(first.wu, apply(results, first), checks, NOW + 1)

    assert again.verdicts == []
    assert again.results == []
    assert again.wu.target_nresults == first.wu.target_nresults


def test_verdicts_name_the_hosts_whose_results_were_judged():
    wu = make_wu(target_nresults=3)
    results = [returned("r1", A, tile=True), returned("r2", B), returned("r3", A, at=1)]

    decision = decide(wu, results, {}, NOW)

    assert {(r.id, r.host_id, ok) for r, ok in decision.verdicts} == {
        ("r1", 1, True),
        ("r2", 2, False),
        ("r3", 3, True),
    }
    for r, ok in decision.verdicts:
        assert r.validate_state is (ValidateState.VALID if ok else ValidateState.INVALID)


def test_deciding_leaves_the_input_records_unchanged():
    results = [returned("r1", A, tile=True), returned("r2", A)]
    frozen = list(results)

    decide(make_wu(), results, {}, NOW)

    assert results == frozen
    assert all(r.validate_state is ValidateState.INIT for r in results)
