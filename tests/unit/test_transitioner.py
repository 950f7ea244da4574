"""The transitioner: timeouts, reissues, error and total caps, and cancelling unneeded replicas."""

from __future__ import annotations

import itertools
import math

import pytest

from coordinator.rules.transitioner import Transition, transition
from coordinator.work.records import (
    Outcome,
    Policy,
    Result,
    ServerState,
    ValidateState,
    WorkUnit,
    WuError,
    WuState,
)

NOW = 1_000.0
WU_ID = "wu-1"


# ---- factories -----------------------------------------------------------------------------


def make_wu(**changes: object) -> WorkUnit:
    wu = WorkUnit(
        id=WU_ID,
        gemm_id="gemm-1",
        step=3,
        i0=0,
        i1=64,
        j0=0,
        j1=64,
        k=64,
        a_panel="panel-a",
        b_panel="panel-b",
        trans_a=False,
        trans_b=False,
        kernel_version=1,
        policy=Policy.QUORUM,
        target_nresults=2,
        min_quorum=2,
        max_error_results=4,
        max_total_results=8,
        delay_bound=60.0,
        transition_time=math.inf,
    )
    return wu.evolve(**changes)


def unsent(rid: str) -> Result:
    return Result(id=rid, wu_id=WU_ID)


def in_progress(rid: str, host: int = 1, deadline: float = NOW + 30) -> Result:
    return Result(
        id=rid,
        wu_id=WU_ID,
        host_id=host,
        server_state=ServerState.IN_PROGRESS,
        sent_time=NOW - 10,
        report_deadline=deadline,
    )


def over(rid: str, outcome: Outcome, host: int = 1, **changes: object) -> Result:
    return Result(
        id=rid,
        wu_id=WU_ID,
        host_id=host,
        server_state=ServerState.OVER,
        outcome=outcome,
        sent_time=NOW - 10,
        report_deadline=NOW - 1,
        **changes,
    )


def success(rid: str, host: int = 1, validate: ValidateState = ValidateState.INIT) -> Result:
    return over(rid, Outcome.SUCCESS, host, validate_state=validate, output_hash="h" * 64)


def invalid(rid: str, host: int = 1) -> Result:
    return success(rid, host, ValidateState.INVALID)


def client_error(rid: str, host: int = 1) -> Result:
    return over(rid, Outcome.CLIENT_ERROR, host, error="out of memory")


def no_reply(rid: str, host: int = 1) -> Result:
    return over(rid, Outcome.NO_REPLY, host)


def id_source():
    """A `new_result_id` that names new replicas new-1, new-2, ..."""
    counter = itertools.count(1)
    return lambda: f"new-{next(counter)}"


def run(wu: WorkUnit, results: list[Result], now: float = NOW) -> Transition:
    return transition(wu, results, now, id_source())


def apply(results: list[Result], change: Transition) -> list[Result]:
    """The results after a transition: changed ones replaced, new ones appended."""
    current = {r.id: r for r in results}
    current.update({r.id: r for r in change.results})
    return list(current.values())


def new_replicas(change: Transition, before: list[Result]) -> list[Result]:
    known = {r.id for r in before}
    return [r for r in change.results if r.id not in known]


def changed(change: Transition) -> dict[str, Result]:
    return {r.id: r for r in change.results}


# ---- timeouts --------------------------------------------------------------------------------


@pytest.mark.parametrize("late_by", [0.0, 0.001, 1.0, 3600.0])
def test_result_past_its_deadline_becomes_no_reply_and_a_replica_is_issued(late_by):
    results = [in_progress("r1", host=7, deadline=NOW - late_by), in_progress("r2", host=8)]

    change = run(make_wu(), results)

    timed_out = changed(change)["r1"]
    assert timed_out.server_state is ServerState.OVER
    assert timed_out.outcome is Outcome.NO_REPLY
    assert timed_out.host_id == 7
    fresh = new_replicas(change, results)
    assert len(fresh) == 1
    assert fresh[0].server_state is ServerState.UNSENT
    assert fresh[0].host_id is None
    assert fresh[0].wu_id == WU_ID
    assert change.wu.state is WuState.ACTIVE
    assert change.exhausted is None
    messages = [(e.state, e.result_id, e.host_id) for e in change.events]
    assert ("no_reply", "r1", 7) in messages
    assert ("unsent", fresh[0].id, None) in messages


def test_result_before_its_deadline_is_left_alone():
    results = [in_progress("r1", deadline=NOW + 0.001), in_progress("r2")]

    change = run(make_wu(), results)

    assert change.results == []
    assert change.wu.transition_time == NOW + 0.001


def test_timeouts_are_charged_even_after_the_wu_is_decided():
    wu = make_wu(state=WuState.VALIDATED, canonical_result="r2", canonical_hash="h" * 64)
    results = [in_progress("r1", host=5, deadline=NOW - 1), success("r2", 6, ValidateState.VALID)]

    change = run(wu, results)

    assert changed(change)["r1"].outcome is Outcome.NO_REPLY
    assert new_replicas(change, results) == []


# ---- how many replicas ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "results", "expected"),
    [
        pytest.param(2, [], 2, id="nothing yet"),
        pytest.param(2, [unsent("a")], 1, id="one unsent"),
        pytest.param(2, [unsent("a"), unsent("b")], 0, id="enough unsent"),
        pytest.param(2, [in_progress("a"), in_progress("b", 2)], 0, id="enough in progress"),
        pytest.param(2, [in_progress("a"), unsent("b"), unsent("c")], 0, id="more than enough"),
        pytest.param(2, [success("a"), in_progress("b", 2)], 0, id="success and in progress"),
        pytest.param(2, [success("a"), success("b", 2)], 0, id="two successes"),
        pytest.param(2, [client_error("a"), in_progress("b", 2)], 1, id="error replaced"),
        pytest.param(2, [no_reply("a"), in_progress("b", 2)], 1, id="no reply replaced"),
        pytest.param(2, [invalid("a"), success("b", 2)], 1, id="invalid replaced"),
        pytest.param(
            2,
            [over("a", Outcome.ABORTED), over("b", Outcome.DIDNT_NEED), in_progress("c")],
            1,
            id="cancelled ones do not count",
        ),
        pytest.param(
            3,
            [
                success("a", 1, ValidateState.INCONCLUSIVE),
                success("b", 2, ValidateState.INCONCLUSIVE),
            ],
            1,
            id="target raised after a mismatch",
        ),
        pytest.param(1, [in_progress("a")], 0, id="single replica in flight"),
        pytest.param(1, [invalid("a")], 1, id="single replica invalid"),
    ],
)
def test_replicas_issued_are_target_minus_unsent_in_progress_and_successes(
    target, results, expected
):
    change = run(make_wu(target_nresults=target), results)

    fresh = new_replicas(change, results)
    assert len(fresh) == expected
    assert len({r.id for r in fresh}) == expected
    for r in fresh:
        assert (r.wu_id, r.server_state, r.outcome, r.host_id) == (
            WU_ID,
            ServerState.UNSENT,
            Outcome.INIT,
            None,
        )
    assert change.wu.state is WuState.ACTIVE


def test_second_pass_at_the_same_time_issues_nothing_more():
    wu, results = make_wu(), [in_progress("r1", deadline=NOW - 1), client_error("r2", 2)]

    first = run(wu, results)
    second = run(first.wu, apply(results, first))

    assert len(new_replicas(first, results)) == 2
    assert second.results == []
    assert second.events == []
    assert second.wu == first.wu


# ---- error cap -----------------------------------------------------------------------------


def _errors(n_error: int, n_no_reply: int, n_invalid: int) -> list[Result]:
    hosts = itertools.count(10)
    return (
        [client_error(f"e{i}", next(hosts)) for i in range(n_error)]
        + [no_reply(f"t{i}", next(hosts)) for i in range(n_no_reply)]
        + [invalid(f"x{i}", next(hosts)) for i in range(n_invalid)]
    )


@pytest.mark.parametrize(
    ("max_errors", "n_error", "n_no_reply", "n_invalid", "fails"),
    [
        pytest.param(4, 4, 0, 0, False, id="at the cap: still reissued"),
        pytest.param(4, 5, 0, 0, True, id="client errors over the cap"),
        pytest.param(4, 0, 5, 0, False, id="no replies never count"),
        pytest.param(4, 3, 1, 2, True, id="invalid results count as errors"),
        pytest.param(4, 2, 1, 2, False, id="mixed, at the cap"),
        pytest.param(0, 0, 0, 1, True, id="no errors allowed"),
        pytest.param(0, 0, 0, 0, False, id="no errors at all"),
    ],
)
def test_more_errors_than_max_error_results_ends_the_crowds_share(
    max_errors, n_error, n_no_reply, n_invalid, fails
):
    """The work unit is not failed (a training step is no volunteer's hostage): it stays
    active with the reason in its error mask, and the coordinator computes it."""
    wu = make_wu(max_error_results=max_errors, max_total_results=100)
    results = [*_errors(n_error, n_no_reply, n_invalid), unsent("spare")]

    change = run(wu, results)

    if not fails:
        assert change.wu.state is WuState.ACTIVE
        assert change.exhausted is None
        assert len(new_replicas(change, results)) == 1  # target 2 minus the spare
        return
    assert change.wu.state is WuState.ACTIVE
    assert change.wu.error_mask & WuError.TOO_MANY_ERRORS
    assert not change.wu.error_mask & WuError.TOO_MANY_TOTAL
    n = n_error + n_invalid
    assert change.exhausted is not None
    assert f"too many errors: {n} failed or invalid results" in change.exhausted
    assert f"max_error_results={max_errors}" in change.exhausted
    assert new_replicas(change, results) == []
    spare = changed(change)["spare"]
    assert (spare.server_state, spare.outcome) == (ServerState.OVER, Outcome.DIDNT_NEED)
    assert change.wu.transition_time == math.inf
    (event,) = [e for e in change.events if e.kind == "wu"]
    assert event.state == "exhausted"
    assert event.message == f"{change.exhausted}: the coordinator computes the tile itself"


def test_errors_of_one_host_count_once():
    """One host erring again and again must not spend the work unit's budget alone."""
    wu = make_wu(max_error_results=1, max_total_results=100)
    results = [client_error(f"e{i}", host=7) for i in range(5)]

    change = run(wu, results)

    assert change.exhausted is None
    assert len(new_replicas(change, results)) == 2


def test_successes_of_one_host_count_once():
    """A host whose replica timed out took the replacement, then reported both: the
    validator counts it once, so the quorum needs another host's replica, not none."""
    results = [success("late", host=7), success("again", host=7)]

    change = run(make_wu(), results)

    assert len(new_replicas(change, results)) == 1


def test_timeouts_are_no_evidence_against_the_work_and_never_reach_the_error_cap():
    """Churn must not fail a training step: only max_total_results bounds timeouts."""
    wu = make_wu(max_error_results=1, max_total_results=5)
    results = [client_error("e1", 2), no_reply("e2", 3), in_progress("r3", 4, deadline=NOW - 1)]

    change = run(wu, results)

    assert changed(change)["r3"].outcome is Outcome.NO_REPLY
    assert change.wu.state is WuState.ACTIVE
    assert len(new_replicas(change, results)) == 2  # target 2, none in progress

    more = [*results, no_reply("e4", 5), no_reply("e5", 6), in_progress("r6", 7, NOW - 1)]
    change = run(wu, more)
    assert change.exhausted is not None
    assert change.wu.error_mask == WuError.TOO_MANY_TOTAL


def test_failing_keeps_earlier_error_bits():
    wu = make_wu(max_error_results=0, error_mask=int(WuError.COULDNT_SEND))

    change = run(wu, [client_error("e1")])

    assert change.wu.error_mask == WuError.COULDNT_SEND | WuError.TOO_MANY_ERRORS


# ---- total cap -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_total", "results", "fails"),
    [
        pytest.param(4, [*_errors(3, 0, 0), in_progress("r")], True, id="one more would be 5"),
        pytest.param(5, [*_errors(3, 0, 0), in_progress("r")], False, id="one more is 5"),
        pytest.param(
            4, [*_errors(2, 0, 0), in_progress("r"), unsent("u")], False, id="none needed"
        ),
        pytest.param(
            3, [*_errors(1, 1, 0), success("s", 9)], True, id="success and errors at the cap"
        ),
        pytest.param(2, [*_errors(2, 0, 0)], True, id="two more needed, none allowed"),
    ],
)
def test_more_results_than_max_total_results_ends_the_crowds_share(max_total, results, fails):
    wu = make_wu(max_total_results=max_total, max_error_results=10)

    change = run(wu, results)

    if not fails:
        assert change.wu.state is WuState.ACTIVE
        assert change.exhausted is None
        assert len(results) + len(new_replicas(change, results)) <= max_total
        return
    assert change.wu.state is WuState.ACTIVE
    assert change.wu.error_mask == WuError.TOO_MANY_TOTAL
    assert f"too many results: {len(results)} issued" in change.exhausted
    assert f"max_total_results={max_total}" in change.exhausted
    assert new_replicas(change, results) == []
    assert change.wu.transition_time == math.inf


def test_total_cap_cancels_unsent_replicas():
    wu = make_wu(target_nresults=3, max_total_results=3, max_error_results=10)
    results = [client_error("e1"), client_error("e2", 2), unsent("u")]

    change = run(wu, results)

    assert change.wu.error_mask == WuError.TOO_MANY_TOTAL
    assert changed(change)["u"].outcome is Outcome.DIDNT_NEED
    assert changed(change)["u"].server_state is ServerState.OVER


# ---- decided work units --------------------------------------------------------------------


@pytest.mark.parametrize("state", [WuState.VALIDATED, WuState.ASSIMILATED, WuState.ERROR])
def test_decided_wu_cancels_unsent_replicas_and_issues_nothing(state):
    wu = make_wu(state=state, target_nresults=4, canonical_result="s", canonical_hash="h" * 64)
    results = [success("s", 1, ValidateState.VALID), unsent("u1"), unsent("u2"), in_progress("p")]

    change = run(wu, results)

    assert new_replicas(change, results) == []
    cancelled = changed(change)
    assert set(cancelled) == {"u1", "u2"}
    for r in cancelled.values():
        assert (r.server_state, r.outcome) == (ServerState.OVER, Outcome.DIDNT_NEED)
    assert change.wu.state is state
    assert change.wu.transition_time == math.inf
    assert change.exhausted is None


# ---- transition time -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("results", "expected"),
    [
        pytest.param([in_progress("a", deadline=NOW + 30)], NOW + 30, id="one"),
        pytest.param(
            [in_progress("a", deadline=NOW + 30), in_progress("b", 2, deadline=NOW + 5)],
            NOW + 5,
            id="earliest of two",
        ),
        pytest.param(
            [in_progress("a", deadline=NOW - 5), in_progress("b", 2, deadline=NOW + 9)],
            NOW + 9,
            id="timed-out one skipped",
        ),
        pytest.param([unsent("a"), unsent("b")], math.inf, id="nothing in progress"),
        pytest.param([success("a"), in_progress("b", 2, deadline=NOW + 7)], NOW + 7, id="mixed"),
    ],
)
def test_transition_time_is_the_earliest_in_progress_deadline(results, expected):
    change = run(make_wu(), results)

    assert change.wu.transition_time == expected


@pytest.mark.parametrize("deadline", [NOW - 1, NOW, NOW + 1])
def test_transition_time_is_never_a_moment_already_handled(deadline):
    """A pass at `now` leaves nothing due at `now`: otherwise the due queue can lose it."""
    change = run(make_wu(), [in_progress("a", deadline=deadline), in_progress("b", 2)])

    assert change.wu.transition_time > NOW


def test_an_exhausted_wu_aborts_its_in_progress_replicas_so_their_hosts_drop_them():
    errors = [over(f"e{i}", Outcome.CLIENT_ERROR, host=i) for i in range(5)]
    out = transition(make_wu(), [*errors, in_progress("busy", host=9)], NOW, iter(["x"]).__next__)
    assert out.exhausted is not None
    (busy,) = [r for r in out.results if r.id == "busy"]
    assert busy.server_state is ServerState.OVER and busy.outcome is Outcome.ABORTED


def test_a_restored_work_unit_comes_due_at_its_transition_time():
    # A coordinator restarted before any deadline of a work unit passed must still time its
    # results out later: it once never did, and a volunteer that had skipped the expired
    # work was resent it (expired) over and over.
    from coordinator.state.ledger import Ledger
    from coordinator.state.store import Snapshot

    wu = make_wu(transition_time=NOW + 30)
    ledger = Ledger(store=None)
    ledger.restore(Snapshot(hosts=[], gemms=[], workunits=[wu], results=[in_progress("r1")]))
    assert ledger.pop_due(NOW) == {wu.id}  # the first pass looks at every restored one
    assert ledger.next_due() == NOW + 30
    assert ledger.pop_due(NOW + 30) == {wu.id}
