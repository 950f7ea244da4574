"""The scheduler: which replicas a host gets, with which deadline, and what it must abort."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterable

import pytest

from coordinator.rules import trust
from coordinator.rules.scheduler import (
    UPLOAD_MARGIN,
    Plan,
    Scheduler,
    SchedulerConfig,
    idle_delay,
    report_deadline,
    stale_panels,
    too_slow_to_upload,
    upload_budget,
    waits_for_the_loop,
    wants_tile,
)
from coordinator.state.ledger import Ledger
from coordinator.work.protocol import WorkRequest
from coordinator.work.records import (
    Host,
    Outcome,
    Policy,
    Result,
    ServerState,
    ValidateState,
    WorkUnit,
)

NOW = 5_000.0
CONFIG = SchedulerConfig(
    deadline_floor=5.0, deadline_slack=20.0, trust_threshold=10, adaptive_replication=True
)


# ---- factories -----------------------------------------------------------------------------


def make_host(
    host_id: int = 1,
    *,
    gflops: float = 10.0,
    cv: int = 0,
    max_in_progress: int = 64,
    quarantined: bool = False,
) -> Host:
    return Host(
        id=host_id,
        name=f"host-{host_id}",
        token_hash=f"token-{host_id}",
        created=0.0,
        last_contact=0.0,
        gflops=gflops,
        consecutive_valid=cv,
        max_in_progress=max_in_progress,
        quarantined=quarantined,
    )


def make_wu(
    n: int,
    *,
    panels: tuple[str, str] | None = None,
    size: tuple[int, int, int] = (64, 64, 64),
    **changes: object,
) -> WorkUnit:
    m, nn, k = size
    a_panel, b_panel = panels or (f"a{n}", f"b{n}")
    wu = WorkUnit(
        id=f"wu-{n}",
        gemm_id="gemm-1",
        step=1,
        i0=0,
        i1=m,
        j0=0,
        j1=nn,
        k=k,
        a_panel=a_panel,
        b_panel=b_panel,
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


def replica(wu: WorkUnit, i: int = 0, **changes: object) -> Result:
    return Result(id=f"{wu.id}-r{i}", wu_id=wu.id).evolve(**changes)


def sent_to(wu: WorkUnit, host_id: int, i: int = 0, **changes: object) -> Result:
    return replica(
        wu,
        i,
        host_id=host_id,
        server_state=ServerState.IN_PROGRESS,
        sent_time=NOW - 10,
        report_deadline=NOW + 50,
    ).evolve(**changes)


def make_ledger(
    wus: Iterable[WorkUnit] = (), *, replicas: int = 2, hosts: Iterable[Host] = ()
) -> Ledger:
    """A ledger (never flushed) holding hosts and work units, each with unsent replicas."""
    ledger = Ledger(store=None)
    for host in hosts:
        ledger.put_host(host)
    for wu in wus:
        ledger.put_wu(wu)
        for i in range(replicas):
            ledger.put_result(replica(wu, i))
    return ledger


def request(
    *, in_progress: Iterable[str] = (), cached: Iterable[str] = (), capacity: int = 64
) -> WorkRequest:
    return WorkRequest(
        request_id="req-1",
        capacity=capacity,
        cached=tuple(cached),
        in_progress=tuple(in_progress),
        gflops=None,
    )


def scheduler(ledger: Ledger, seed: int = 7, config: SchedulerConfig = CONFIG) -> Scheduler:
    return Scheduler(ledger, config, random.Random(seed))


def assigned(plan: Plan) -> list[str]:
    return [a.result.id for a in plan.assignments]


def assigned_wus(plan: Plan) -> list[str]:
    return [a.wu.id for a in plan.assignments]


# ---- one host, one replica per work unit ---------------------------------------------------


def test_a_host_never_gets_two_replicas_of_one_work_unit():
    ledger = make_ledger([make_wu(1)], replicas=3)
    sched = scheduler(ledger)

    first = sched.plan(make_host(1), request(), NOW)
    again = sched.plan(make_host(1), request(in_progress=assigned(first)), NOW + 1)
    other = sched.plan(make_host(2), request(), NOW + 2)

    assert assigned(first) == ["wu-1-r0"]
    assert assigned(again) == []
    assert assigned(other) == ["wu-1-r1"]


def test_a_host_takes_only_its_share_of_a_product_while_others_wait_for_work():
    """Eight single-replica tiles of one product; three other hosts are waiting: this one
    gets two, not all eight (sized work cut the product for the crowd). Alone, it gets all."""
    wus = [make_wu(i, target_nresults=1, min_quorum=1) for i in range(8)]
    ledger = make_ledger(wus, replicas=1)
    sched = scheduler(ledger)
    shared = sched.plan(make_host(1), request(), NOW, others=3)
    alone = sched.plan(make_host(2), request(), NOW)
    assert len(shared.assignments) == 2
    assert len(alone.assignments) == 6
    assert ledger.unsent_of_gemm["gemm-1"] == 0


def test_a_host_takes_only_its_share_of_all_the_work_while_others_wait_for_it():
    """Two products of four tiles published together (the micro-batches' products, which
    use the same weight panel); seven other hosts are waiting: this host gets one tile, not
    one of each product while the rest idle."""
    wus = [
        make_wu(i, panels=(f"x{i}", "w"), target_nresults=1, min_quorum=1, gemm_id=f"gemm-{i % 2}")
        for i in range(8)
    ]
    ledger = make_ledger(wus, replicas=1)
    sched = scheduler(ledger)
    cached = request(cached=["w"])
    assert len(sched.plan(make_host(1), cached, NOW, others=7).assignments) == 1
    assert len(sched.plan(make_host(2), cached, NOW, others=1).assignments) == 4
    assert len(sched.plan(make_host(3), cached, NOW).assignments) == 3


def test_a_host_holds_only_its_share_of_a_product_over_the_crowd_asking_or_not():
    """Twelve single-replica tiles of one product, a crowd of ten hosts, none but this one
    asking just now (the rest are uploading their last tiles): it gets two, not all twelve,
    which it would upload one after another while the others came back to nothing. Holding
    them, it gets no more of that product, but all it may of another; once it has reported
    them, two more. A crowd of one gets everything."""
    product = [make_wu(i, target_nresults=1, min_quorum=1) for i in range(12)]
    other = [make_wu(20 + i, target_nresults=1, min_quorum=1, gemm_id="gemm-2") for i in range(2)]
    ledger = make_ledger(product, replicas=1)
    sched = scheduler(ledger)

    first = sched.plan(make_host(1), request(), NOW, crowd=10)
    assert assigned(first) == ["wu-0-r0", "wu-1-r0"]

    for wu in other:
        ledger.put_wu(wu)
        ledger.put_result(replica(wu))
    holding = sched.plan(make_host(1), request(in_progress=assigned(first)), NOW + 1, crowd=10)
    assert assigned(holding) == ["wu-20-r0"]  # its share of gemm-2: one of two

    for result in [a.result for a in first.assignments + holding.assignments]:
        ledger.put_result(
            result.evolve(
                server_state=ServerState.OVER, outcome=Outcome.SUCCESS, received_time=NOW + 2
            )
        )
    again = sched.plan(make_host(1), request(), NOW + 3, crowd=10)
    assert assigned(again) == ["wu-2-r0", "wu-3-r0", "wu-21-r0"]

    alone = sched.plan(make_host(2), request(), NOW + 4, crowd=1)
    assert len(alone.assignments) == 8  # the rest of the product
    assert ledger.unsent_of_gemm["gemm-1"] == 0


def test_the_tighter_of_the_two_shares_holds():
    """Twelve tiles, a crowd of three: alone a host may hold four. With five others asking
    just now, it takes two (twelve unsent over six askers); with one other asking, four, not
    six."""
    wus = [make_wu(i, target_nresults=1, min_quorum=1) for i in range(12)]
    ledger = make_ledger(wus, replicas=1)
    sched = scheduler(ledger)
    assert len(sched.plan(make_host(1), request(), NOW, others=5, crowd=3).assignments) == 2
    assert len(sched.plan(make_host(2), request(), NOW, others=1, crowd=3).assignments) == 4


def test_a_host_holding_its_share_of_every_product_is_told_how_much_waits_for_others():
    """A product of 4,000 tiles, a crowd of 4,000: a host holding its one is answered with
    nothing, and the plan says how many results it held back (the answer's note). Each
    product's share is looked at once, not result by result."""
    wus = [make_wu(i, target_nresults=1, min_quorum=1) for i in range(4000)]
    ledger = make_ledger(wus, replicas=1)
    sched = scheduler(ledger)
    first = sched.plan(make_host(1), request(), NOW, crowd=4000)
    assert assigned(first) == ["wu-0-r0"]
    again = sched.plan(make_host(1), request(in_progress=assigned(first)), NOW + 1, crowd=4000)
    assert again.assignments == []
    assert again.held_back == 3999
    assert again.room > 0  # it may wait for new work meanwhile


def test_a_quorum_products_share_counts_its_replicas():
    """Four work units of two replicas each, a crowd of four: each host may hold two of the
    eight results, one replica each of two work units."""
    ledger = make_ledger([make_wu(i) for i in range(4)], replicas=2)
    sched = scheduler(ledger)
    plans = [sched.plan(make_host(h), request(), NOW, crowd=4) for h in range(1, 5)]
    assert [len(p.assignments) for p in plans] == [2, 2, 2, 2]
    assert not ledger.unsent


@pytest.mark.parametrize(
    ("outcome", "received"),
    [
        (Outcome.CLIENT_ERROR, NOW),
        (Outcome.NO_REPLY, NOW),  # given back: it would take it back, again and again
        (Outcome.SUCCESS, NOW),
        (Outcome.ABORTED, None),
    ],
)
def test_a_host_does_not_get_another_replica_after_its_first_one_ended(outcome, received):
    wu = make_wu(1)
    ledger = make_ledger([wu], replicas=0)
    ledger.put_result(
        sent_to(wu, 1, 0).evolve(
            server_state=ServerState.OVER, outcome=outcome, received_time=received
        )
    )
    ledger.put_result(replica(wu, 1))
    sched = scheduler(ledger)

    assert assigned(sched.plan(make_host(1), request(), NOW)) == []
    assert assigned(sched.plan(make_host(2), request(), NOW)) == ["wu-1-r1"]


def test_a_host_gets_the_replacement_of_its_timed_out_quorum_replica():
    """With two volunteers and a quorum of two, a replica that timed out must be able to go
    back to a host that had one (the validator counts one vote per host), or the work unit
    waits for a third host for ever."""
    wu = make_wu(1)
    ledger = make_ledger([wu], replicas=0)
    ledger.put_result(
        sent_to(wu, 1, 0).evolve(server_state=ServerState.OVER, outcome=Outcome.NO_REPLY)
    )
    ledger.put_result(replica(wu, 1))

    assert assigned(scheduler(ledger).plan(make_host(1), request(), NOW)) == ["wu-1-r1"]


def freivalds_wu(n: int) -> WorkUnit:
    return make_wu(n, policy=Policy.FREIVALDS, target_nresults=1, min_quorum=1)


def test_a_lone_volunteer_gets_the_replacement_of_its_timed_out_freivalds_tile():
    """With one volunteer there is no other host: a single-replica work unit whose replica
    missed its deadline must go back to it, or training stops for good."""
    wu = freivalds_wu(1)
    ledger = make_ledger([wu], replicas=0)
    ledger.put_result(
        sent_to(wu, 1, 0).evolve(server_state=ServerState.OVER, outcome=Outcome.NO_REPLY)
    )
    ledger.put_result(replica(wu, 1))

    assert assigned(scheduler(ledger).plan(make_host(1), request(), NOW)) == ["wu-1-r1"]


@pytest.mark.parametrize(
    ("mine", "gets_it"),
    [
        pytest.param({"outcome": Outcome.NO_REPLY}, True, id="timed out"),
        pytest.param({"outcome": Outcome.CLIENT_ERROR}, False, id="erred on it"),
        pytest.param({"outcome": Outcome.SUCCESS}, False, id="already returned it"),
        pytest.param({"server_state": ServerState.IN_PROGRESS}, False, id="still holds it"),
    ],
)
def test_a_freivalds_replacement_goes_back_only_to_a_host_that_timed_out(mine, gets_it):
    wu = freivalds_wu(1)
    ledger = make_ledger([wu], replicas=0)
    ended = {"server_state": ServerState.OVER, **mine}
    ledger.put_result(sent_to(wu, 1, 0).evolve(**ended))
    ledger.put_result(replica(wu, 1))

    plan = scheduler(ledger).plan(make_host(1), request(in_progress=["wu-1-r0"]), NOW)
    assert ("wu-1-r1" in assigned(plan)) is gets_it


# ---- quota ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("quota", "already", "capacity", "expected"),
    [
        pytest.param(4, 0, 64, 4, id="quota limits"),
        pytest.param(4, 1, 64, 3, id="in progress counts"),
        pytest.param(4, 4, 64, 0, id="quota full"),
        pytest.param(2, 3, 64, 0, id="over quota after a cut"),
        pytest.param(1, 0, 64, 1, id="cut to one"),
        pytest.param(8, 0, 2, 2, id="capacity limits"),
        pytest.param(8, 2, 0, 0, id="no capacity"),
    ],
)
def test_in_progress_quota_is_respected(quota, already, capacity, expected):
    busy = [make_wu(100 + i) for i in range(already)]
    ledger = make_ledger([make_wu(i) for i in range(10)], hosts=[make_host(1)])
    for wu in busy:
        ledger.put_wu(wu)
        ledger.put_result(sent_to(wu, 1))
    host = make_host(1, max_in_progress=quota)

    listed = [f"{w.id}-r0" for w in busy]
    plan = scheduler(ledger).plan(host, request(in_progress=listed, capacity=capacity), NOW)

    assert len(plan.assignments) == expected
    assert len(ledger.in_progress_of[1]) == already + expected


@pytest.mark.parametrize(
    ("cv", "gflops", "size", "expected"),
    [
        # 64^3 tiles are 0.5 MFLOP: 2 s at 10 GFLOPS is far more than max_quota of them.
        pytest.param(10, 10.0, (64, 64, 64), 40, id="trusted, small tiles: max_quota"),
        pytest.param(9, 10.0, (64, 64, 64), 4, id="not yet trusted: its count"),
        # 512^3 tiles are 268 MFLOP: 2 s at 1 GFLOPS is 7 of them.
        pytest.param(10, 1.0, (512, 512, 512), 7, id="trusted, large tiles: 2 s of work"),
        pytest.param(10, 0.1, (512, 512, 512), 4, id="trusted but slow: never below its count"),
    ],
)
def test_a_trusted_host_may_hold_seconds_of_work_not_a_few_tiles(cv, gflops, size, expected):
    # Tiles of a millisecond each, four at a time, cost a round trip each: a product of
    # small tiles waited on the network, not on its volunteers.
    config = dataclasses.replace(CONFIG, quota_seconds=2.0, max_quota=40)
    ledger = make_ledger([make_wu(i, size=size) for i in range(60)], hosts=[make_host(1)])
    host = make_host(1, cv=cv, gflops=gflops, max_in_progress=4)
    plan = scheduler(ledger, config=config).plan(host, request(capacity=64), NOW)
    assert len(plan.assignments) == expected
    # Every one is due in time even if the host computes them one after another.
    assert all(a.result.report_deadline >= NOW + config.quota_seconds for a in plan.assignments)


def test_a_trusted_host_that_errs_falls_back_to_its_cut_count():
    config = dataclasses.replace(CONFIG, quota_seconds=2.0, max_quota=40)
    ledger = make_ledger([make_wu(i) for i in range(60)], hosts=[make_host(1)])
    host = trust.after_error(make_host(1, cv=50, max_in_progress=4), trust.TrustConfig())
    plan = scheduler(ledger, config=config).plan(host, request(capacity=64), NOW)
    assert len(plan.assignments) == 2


# ---- cached panels -------------------------------------------------------------------------


PANEL_BYTES = {"a1": 1_000, "b1": 2_000, "a2": 30_000, "b2": 40_000, "a3": 500, "b3": 600}


@pytest.mark.parametrize(
    ("cached", "capacity", "expected_wus", "saved"),
    [
        pytest.param([], 2, ["wu-1", "wu-2"], 0, id="nothing cached: oldest first"),
        pytest.param(["a3", "b3"], 1, ["wu-3"], 1_100, id="both panels cached"),
        pytest.param(["b2"], 1, ["wu-2"], 40_000, id="one panel cached"),
        pytest.param(["a1", "b2"], 2, ["wu-2", "wu-1"], 41_000, id="most bytes first"),
        pytest.param(["zz"], 1, ["wu-1"], 0, id="unknown panel"),
        pytest.param(["a3"], 3, ["wu-3", "wu-1", "wu-2"], 500, id="then the rest"),
    ],
)
def test_cached_panels_are_preferred_and_the_bytes_saved_counted(
    cached, capacity, expected_wus, saved
):
    ledger = make_ledger([make_wu(1), make_wu(2), make_wu(3)], replicas=1)
    ledger.panel_bytes.update(PANEL_BYTES)

    plan = scheduler(ledger).plan(make_host(1), request(cached=cached, capacity=capacity), NOW)

    assert assigned_wus(plan) == expected_wus
    assert plan.bytes_saved == saved


# ---- lost replies and aborts ---------------------------------------------------------------


def test_an_assignment_whose_reply_was_lost_is_resent_unchanged():
    ledger = make_ledger([make_wu(1)], replicas=3)
    sched = scheduler(ledger)
    first = sched.plan(make_host(1), request(capacity=1), NOW)
    (sent,) = [a.result for a in first.assignments]

    retry = sched.plan(make_host(1), request(in_progress=()), NOW + 3)

    assert assigned(retry) == [sent.id]
    assert retry.assignments[0].result == sent  # same deadline, same upload flag
    assert [e.state for e in retry.events] == ["resent"]


def test_an_expired_assignment_is_not_resent_but_left_to_time_out():
    # Resent past its deadline, a volunteer skips it and asks again at once: a spin that
    # hit the rate limit after a coordinator restart.
    ledger = make_ledger([make_wu(1)], replicas=3)
    sched = scheduler(ledger)
    (sent,) = [a.result for a in sched.plan(make_host(1), request(capacity=1), NOW).assignments]
    later = sent.report_deadline + 0.1
    retry = sched.plan(make_host(1), request(in_progress=(), capacity=0), later)
    assert retry.assignments == [] and retry.events == []
    assert sent.wu_id in ledger.pop_due(later)  # the transitioner looks at it now
    assert sorted(r.id for r in ledger.results.values() if r.host_id == 1) == [sent.id]
    assert len(ledger.unsent) == 2


def test_a_resent_assignment_counts_against_the_quota():
    ledger = make_ledger([make_wu(1), make_wu(2), make_wu(3)])
    sched = scheduler(ledger)
    host = make_host(1, max_in_progress=2)
    lost = assigned(sched.plan(host, request(capacity=1), NOW))

    retry = sched.plan(host, request(in_progress=()), NOW + 1)

    assert assigned(retry)[0] == lost[0]
    assert len(retry.assignments) == 2
    assert len(ledger.in_progress_of[1]) == 2


def _abort_ledger() -> Ledger:
    wus = [make_wu(i) for i in range(1, 6)]
    ledger = make_ledger(wus, replicas=0)
    ledger.put_result(sent_to(wus[0], 1))
    ledger.put_result(sent_to(wus[1], 2))
    over = {"server_state": ServerState.OVER}
    ledger.put_result(sent_to(wus[2], 1, outcome=Outcome.ABORTED, **over))
    ledger.put_result(sent_to(wus[3], 1, outcome=Outcome.NO_REPLY, **over))
    ledger.put_result(sent_to(wus[4], 1, outcome=Outcome.SUCCESS, output_hash="h", **over))
    return ledger


@pytest.mark.parametrize(
    ("listed", "aborted"),
    [
        pytest.param("wu-1-r0", False, id="in progress for this host"),
        pytest.param("wu-2-r0", True, id="another host's"),
        pytest.param("wu-3-r0", True, id="aborted: work unit decided"),
        pytest.param("wu-4-r0", True, id="timed out"),
        pytest.param("wu-5-r0", True, id="already reported"),
        pytest.param("f" * 32, True, id="unknown"),
    ],
)
def test_listed_results_not_in_progress_for_the_host_are_aborted(listed, aborted):
    ledger = _abort_ledger()
    others = [] if listed == "wu-1-r0" else ["wu-1-r0"]

    plan = scheduler(ledger).plan(make_host(1), request(in_progress=[listed, *others]), NOW)

    assert (listed in plan.abort) is aborted
    assert "wu-1-r0" not in plan.abort
    assert assigned(plan) == []  # nothing to resend, nothing unsent


# ---- deadlines -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gflops", "size", "delay_bound", "expected"),
    [
        pytest.param(1_000.0, (64, 64, 64), 60.0, 5.0 + 20 * 524_288 / 1e12, id="fast: floor"),
        pytest.param(1.0, (1024, 1024, 1024), 60.0, 5.0 + 20 * 2.147483648, id="by speed"),
        pytest.param(1.0, (1024, 1024, 1024), 30.0, 30.0, id="capped by delay_bound"),
        pytest.param(0.001, (64, 64, 64), 60.0, 5.0 + 20 * 0.524288, id="very slow, small"),
        pytest.param(0.001, (256, 256, 256), 60.0, 60.0, id="very slow: delay_bound"),
        pytest.param(0.0, (256, 256, 256), 60.0, 60.0, id="unknown speed"),
        pytest.param(10.0, (1024, 1024, 1024), 60.0, 5.0 + 2 * 2.147483648, id="10x faster"),
    ],
)
def test_report_deadline_follows_host_speed_and_never_exceeds_delay_bound(
    gflops, size, delay_bound, expected
):
    wu = make_wu(1, size=size, delay_bound=delay_bound)

    deadline = report_deadline(wu, make_host(1, gflops=gflops), NOW, CONFIG)

    assert deadline - NOW == pytest.approx(expected)
    assert deadline - NOW <= delay_bound


@pytest.mark.parametrize("gflops", [0.01, 1.0, 100.0])
def test_an_assignment_carries_its_deadline_and_the_wu_is_due_by_then(gflops):
    wu = make_wu(1, size=(512, 512, 512))
    ledger = make_ledger([wu])
    host = make_host(1, gflops=gflops)

    (assignment,) = scheduler(ledger).plan(host, request(), NOW).assignments

    expected = report_deadline(wu, host, NOW, CONFIG)
    assert assignment.result.report_deadline == expected
    assert assignment.result.sent_time == NOW
    assert assignment.result.server_state is ServerState.IN_PROGRESS
    assert ledger.wus["wu-1"].transition_time == expected
    assert ledger.next_due() == expected


# ---- a slow uplink ---------------------------------------------------------------------------

UPLINK = 1e-5  # seconds a byte: 100 KB/s, a home uplink


def freivalds_tiles(count: int, size: int) -> list[WorkUnit]:
    """Work units of one replica each, every replica uploading its tile of size x size."""
    return [
        make_wu(i, size=(size, size, 64), policy=Policy.FREIVALDS, target_nresults=1, min_quorum=1)
        for i in range(count)
    ]


def test_a_slow_uplinks_deadlines_wait_for_the_uploads_queued_before_them():
    """Each tile of 256 KB takes 2.6 s to upload at 100 KB/s, one after another: the n-th
    tile's deadline allows twice the n uploads on top of its compute's, not the compute's
    alone (5 s, which every tile of a queue would miss)."""
    wus = freivalds_tiles(4, 256)
    host = make_host(1, gflops=1_000.0)
    ledger = make_ledger(wus, replicas=1, hosts=[host])

    plan = scheduler(ledger).plan(host, request(), NOW, upload_per_byte=UPLINK)

    upload = 4 * 256 * 256 * UPLINK
    deadlines = sorted(a.result.report_deadline - NOW for a in plan.assignments)
    compute = report_deadline(wus[0], host, NOW, CONFIG) - NOW
    assert deadlines == pytest.approx([compute + UPLOAD_MARGIN * n * upload for n in (1, 2, 3, 4)])


def test_a_slow_uplink_holds_no_more_tiles_than_it_can_send_in_time():
    """delay_bound 60 s leaves (60 - 5) / 2 = 27.5 s of uploads queued: tiles of 1 MB take
    10.5 s each at 100 KB/s, so the host holds two, and a third once it reported one."""
    wus = freivalds_tiles(5, 512)
    host = make_host(1, gflops=1_000.0)
    ledger = make_ledger(wus, replicas=1, hosts=[host])
    budget = upload_budget(60.0, CONFIG)
    assert budget == pytest.approx(27.5)

    plan = scheduler(ledger).plan(host, request(), NOW, upload_per_byte=UPLINK)

    assert len(plan.assignments) == 2
    assert plan.too_slow == 0  # held back by its queue, not refused
    # One reported: its place on the uplink is free again.
    done = plan.assignments[0].result
    ledger.put_result(done.evolve(server_state=ServerState.OVER, outcome=Outcome.SUCCESS))
    held = [a.result.id for a in plan.assignments[1:]]
    again = scheduler(ledger).plan(host, request(in_progress=held), NOW, upload_per_byte=UPLINK)
    assert len(again.assignments) == 1


def test_a_tile_the_uplink_cannot_send_before_any_deadline_is_refused_and_counted():
    """A 4 MB tile takes 42 s at 100 KB/s, past the 27.5 s a deadline within delay_bound
    leaves: the host is not given it (it would time out, be sent again, and time out)."""
    wus = freivalds_tiles(1, 1024)
    host = make_host(1, gflops=1_000.0)
    ledger = make_ledger(wus, replicas=1, hosts=[host])

    plan = scheduler(ledger).plan(host, request(), NOW, upload_per_byte=UPLINK)

    assert plan.assignments == []
    assert plan.too_slow == 1
    assert plan.slowest_upload == pytest.approx(4 * 1024 * 1024 * UPLINK)
    assert too_slow_to_upload(wus[0], UPLINK, CONFIG)
    assert not too_slow_to_upload(wus[0], UPLINK / 2, CONFIG)  # 21 s: it fits


def test_a_slow_uplink_still_takes_replicas_that_upload_only_a_hash():
    """Under quorum, the second replica of a tile uploads its hash alone: the uplink does
    not limit it, nor lengthen its deadline."""
    wu = make_wu(1, size=(1024, 1024, 64))
    uploader = make_host(2, gflops=1_000.0)
    host = make_host(1, gflops=1_000.0)
    ledger = make_ledger([wu], hosts=[host, uploader])
    ledger.put_result(sent_to(wu, 2, 0, upload_tile=True))

    plan = scheduler(ledger).plan(host, request(), NOW, upload_per_byte=UPLINK)

    (assignment,) = plan.assignments
    assert not assignment.result.upload_tile
    assert assignment.result.report_deadline == report_deadline(wu, host, NOW, CONFIG)


def test_an_unmeasured_uplink_changes_nothing():
    wus = freivalds_tiles(4, 1024)
    host = make_host(1, gflops=1_000.0)
    ledger = make_ledger(wus, replicas=1, hosts=[host])

    plan = scheduler(ledger).plan(host, request(), NOW)

    assert len(plan.assignments) == 4
    assert {a.result.report_deadline for a in plan.assignments} == {
        report_deadline(wus[0], host, NOW, CONFIG)
    }


# ---- adaptive replication ------------------------------------------------------------------

N_WUS = 200


def _adaptive_run(cv: int, seed: int = 7) -> tuple[Ledger, Plan]:
    ledger = make_ledger([make_wu(i) for i in range(N_WUS)])
    host = make_host(1, cv=cv, max_in_progress=N_WUS)
    plan = scheduler(ledger, seed).plan(host, request(capacity=N_WUS), NOW)
    assert len(plan.assignments) == N_WUS
    return ledger, plan


def _singles(ledger: Ledger) -> set[str]:
    return {wu.id for wu in ledger.wus.values() if wu.min_quorum == 1}


@pytest.mark.parametrize("cv", [10, 20, 100])
def test_trusted_host_gets_single_replica_work_units_for_some_draws(cv):
    ledger, plan = _adaptive_run(cv)

    singles = _singles(ledger)
    assert 0 < len(singles) <= N_WUS
    assert len(singles) / N_WUS == pytest.approx(1 - 1 / cv, abs=0.06)
    for a in plan.assignments:
        spare = ledger.results[f"{a.wu.id}-r1"]
        if a.wu.id in singles:
            assert (a.wu.target_nresults, a.wu.min_quorum) == (1, 1)
            assert ledger.wus[a.wu.id] == a.wu
            assert a.result.upload_tile, "a lone replica's tile is Freivalds-checked"
            assert (spare.server_state, spare.outcome) == (ServerState.OVER, Outcome.DIDNT_NEED)
            assert spare.id not in ledger.unsent
        else:
            assert (a.wu.target_nresults, a.wu.min_quorum) == (2, 2)
            assert spare.server_state is ServerState.UNSENT
        assert ledger.results[a.result.id].server_state is ServerState.IN_PROGRESS
    assert sum(e.state == "single_replica" for e in plan.events) == len(singles)


@pytest.mark.parametrize("cv", [0, 1, 5, 9])
def test_host_below_the_trust_threshold_never_gets_a_work_unit_alone(cv):
    ledger, _ = _adaptive_run(cv)

    assert _singles(ledger) == set()
    assert len(ledger.unsent) == N_WUS


def test_adaptive_replication_draws_are_reproducible_from_the_seed():
    assert _singles(_adaptive_run(10, seed=3)[0]) == _singles(_adaptive_run(10, seed=3)[0])
    assert _singles(_adaptive_run(10, seed=3)[0]) != _singles(_adaptive_run(10, seed=4)[0])


def test_adaptive_replication_only_when_the_first_replica_is_sent():
    wus = [make_wu(i) for i in range(20)]
    ledger = make_ledger(wus)
    sched = scheduler(ledger)
    sched.plan(make_host(1, cv=0), request(), NOW)  # first replicas to an unproven host

    plan = sched.plan(make_host(2, cv=10_000), request(), NOW)

    assert len(plan.assignments) == 20
    assert _singles(ledger) == set()


def test_freivalds_work_units_are_left_as_they_are():
    wus = [make_wu(i, policy=Policy.FREIVALDS, target_nresults=1, min_quorum=1) for i in range(5)]
    ledger = make_ledger(wus, replicas=1)

    plan = scheduler(ledger).plan(make_host(1, cv=10_000), request(), NOW)

    assert [(a.wu.id, a.wu.target_nresults, a.wu.min_quorum) for a in plan.assignments] == [
        (wu.id, 1, 1) for wu in wus
    ]
    assert all(a.result.upload_tile for a in plan.assignments)
    assert not any(e.state == "single_replica" for e in plan.events)


# ---- tail acceleration ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gflops", "cv", "quarantined", "gets_spare"),
    [
        pytest.param(5.0, 3, False, True, id="fast and proven"),
        pytest.param(3.0, 1, False, True, id="median speed"),
        pytest.param(1.0, 3, False, True, id="half the median"),
        pytest.param(0.5, 3, False, False, id="under half the median"),
        pytest.param(5.0, 0, False, False, id="fast but unproven"),
        pytest.param(5.0, 3, True, False, id="quarantined"),
    ],
)
def test_accelerated_work_units_go_only_to_fast_reliable_hosts(gflops, cv, quarantined, gets_spare):
    others = [make_host(i, gflops=g, cv=5) for i, g in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 5.0)]]
    host = make_host(10, gflops=gflops, cv=cv, quarantined=quarantined)
    spare_wu, plain_wu = make_wu(1, accelerated=True, target_nresults=3), make_wu(2)
    ledger = make_ledger(hosts=[*others, host])
    ledger.put_wu(spare_wu)
    ledger.put_result(sent_to(spare_wu, 1, 0))
    ledger.put_result(sent_to(spare_wu, 2, 1))
    ledger.put_result(replica(spare_wu, 2))
    ledger.put_wu(plain_wu)
    ledger.put_result(replica(plain_wu))

    plan = scheduler(ledger).plan(host, request(), NOW)

    assert ("wu-1" in assigned_wus(plan)) is gets_spare
    assert "wu-2" in assigned_wus(plan), "ordinary work still goes to any host"
    for a in plan.assignments:
        if a.wu.accelerated:
            assert a.result.upload_tile


def test_hosts_that_claim_great_speed_and_prove_nothing_do_not_keep_spares_from_honest_ones():
    """Liars claiming a thousand GFLOPS each raised the median speed above every honest
    host, so a straggler's spare waited, unsent, for the liar's own deadline."""
    honest = [make_host(1, gflops=92.0, cv=5), make_host(2, gflops=88.0, cv=5)]
    liars = [make_host(10 + i, gflops=1000.0, cv=0) for i in range(5)]
    spare_wu = make_wu(1, accelerated=True, target_nresults=3)
    ledger = make_ledger(hosts=[*honest, *liars])
    ledger.put_wu(spare_wu)
    ledger.put_result(sent_to(spare_wu, 1, 0))  # the honest replica
    ledger.put_result(sent_to(spare_wu, 10, 1))  # a liar's, sat on
    ledger.put_result(replica(spare_wu, 2))  # the spare

    plan = scheduler(ledger).plan(honest[1], request(), NOW)

    assert "wu-1" in assigned_wus(plan)


# ---- tile or hash --------------------------------------------------------------------------


def test_first_replica_uploads_the_tile_and_later_ones_report_the_hash_only():
    ledger = make_ledger([make_wu(1)], replicas=3)
    sched = scheduler(ledger)

    uploads = [
        sched.plan(make_host(h), request(), NOW).assignments[0].result.upload_tile
        for h in (1, 2, 3)
    ]

    assert uploads == [True, False, False]


def _returned(wu: WorkUnit, i: int, *, tile: bool, state: ValidateState) -> Result:
    return sent_to(wu, i + 1, i, upload_tile=tile).evolve(
        server_state=ServerState.OVER,
        outcome=Outcome.SUCCESS,
        output_hash="h",
        has_tile=tile,
        validate_state=state,
    )


W = make_wu(1)


@pytest.mark.parametrize(
    ("siblings", "expected"),
    [
        pytest.param([], True, id="first replica"),
        pytest.param([replica(W, 0)], True, id="only unsent siblings"),
        pytest.param([sent_to(W, 1, upload_tile=True)], False, id="an upload in progress"),
        pytest.param([sent_to(W, 1, upload_tile=False)], True, id="hash-only in progress"),
        pytest.param(
            [_returned(W, 0, tile=True, state=ValidateState.INIT)], False, id="tile returned"
        ),
        pytest.param(
            [_returned(W, 0, tile=True, state=ValidateState.INVALID)], True, id="tile invalid"
        ),
        pytest.param(
            [_returned(W, 0, tile=True, state=ValidateState.INCONCLUSIVE)],
            True,
            id="tile inconclusive",
        ),
        pytest.param(
            [_returned(W, 0, tile=False, state=ValidateState.INIT)], True, id="hash returned"
        ),
        pytest.param(
            [
                sent_to(W, 1, upload_tile=True).evolve(
                    server_state=ServerState.OVER, outcome=Outcome.CLIENT_ERROR
                )
            ],
            True,
            id="uploader errored",
        ),
    ],
)
def test_wants_tile_unless_a_live_replica_brings_one(siblings, expected):
    assert wants_tile(siblings) is expected


def test_with_adaptive_replication_off_even_a_trusted_host_never_works_alone():
    """The project setting for bitwise results even against a trusted host turned liar."""
    ledger = make_ledger([make_wu(i) for i in range(N_WUS)])
    host = make_host(1, cv=1000, max_in_progress=N_WUS)
    config = dataclasses.replace(CONFIG, adaptive_replication=False)
    scheduler(ledger, 7, config).plan(host, request(capacity=N_WUS), NOW)
    assert _singles(ledger) == set()
    assert len(ledger.unsent) == N_WUS


# ---- switches for the communication benchmark ------------------------------------------------


def test_without_cache_preference_work_goes_oldest_first_and_the_bytes_saved_are_counted():
    ledger = make_ledger([make_wu(1), make_wu(2), make_wu(3)], replicas=1)
    ledger.panel_bytes.update(PANEL_BYTES)
    config = dataclasses.replace(CONFIG, cache_preference=False)

    plan = scheduler(ledger, config=config).plan(
        make_host(1), request(cached=["a3", "b3"], capacity=3), NOW
    )

    assert assigned_wus(plan) == ["wu-1", "wu-2", "wu-3"]
    assert plan.bytes_saved == 1_100


def test_without_hash_only_replicas_every_replica_uploads_its_tile():
    ledger = make_ledger([make_wu(1)], replicas=3)
    sched = scheduler(ledger, config=dataclasses.replace(CONFIG, hash_only_replicas=False))

    uploads = [
        sched.plan(make_host(h), request(), NOW).assignments[0].result.upload_tile
        for h in (1, 2, 3)
    ]

    assert uploads == [True, True, True]


# ---- idle hosts --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "idle, waited, expected",
    [
        (1, 0.0, 0.25),  # a few idle hosts ask again soon
        (100, 0.0, 0.25),
        (5_000, 0.0, 10.0),  # together about 500 asks a second
        (5_000, 2.0, 8.0),  # a long poll's wait counts
        (5_000, 30.0, 0.25),
        (100_000, 0.0, 25.0),  # never longer than the cap between two asks
        (100_000, 2.0, 23.0),
    ],
)
def test_many_idle_hosts_are_asked_to_spread_their_asks(idle, waited, expected):
    assert idle_delay(idle, waited, base=0.25, asks_per_s=500.0, cap=25.0) == expected


def test_stale_panels_are_those_last_used_before_every_product_in_flight():
    steps = {"p1": 1, "p2": 2, "p3": 3}
    cached = ("p1", "p2", "p3", "unknown")
    assert stale_panels(cached, steps, 3) == ["p1", "p2"]
    assert stale_panels(cached, steps, 2) == ["p1"]
    # Between products (none in flight), the next may use any of them.
    assert stale_panels(cached, steps, None) == []


def test_a_panel_published_again_by_a_later_step_is_of_that_step():
    """A weight that did not change, or a batch seen again: the same content is the same
    panel, and a host holding it must not be told to drop it while the later step runs."""
    ledger = Ledger(store=None)  # type: ignore[arg-type]
    ledger.add_panel("w", 100, step=1)
    ledger.add_panel("w", 100, step=2)
    ledger.add_panel("w", 100, step=1)  # an older product published late does not undo it
    assert stale_panels(("w",), ledger.panel_step, 2) == []


def test_a_panel_whose_blob_a_checkpoint_deleted_is_named_until_its_step_is_let_go():
    ledger = Ledger(store=None)  # type: ignore[arg-type]
    ledger.add_panel("old", 100, step=1)
    ledger.add_panel("new", 100, step=5)
    ledger.drop_panel("old")  # a checkpoint deleted its blob; hosts may still hold it
    assert "old" not in ledger.panel_bytes
    assert stale_panels(("old", "new"), ledger.panel_step, 5) == ["old"]
    ledger.forget_panel_steps(1)  # one checkpoint later, with the rows of its steps
    assert ledger.panel_step == {"new": 5}


@pytest.mark.parametrize(
    ("round_trip", "between", "waits"),
    [
        (0.0009, 0.0014, False),  # loopback: a round trip is shorter than the loop's work
        (0.030, 0.0014, True),  # a laptop 30 ms away, tiny-gpt's products
        (0.030, 0.200, False),  # the same laptop, a model whose loop takes 200 ms between
        (None, 0.0014, False),  # a host that does not say: answered at once, as always
        (0.030, None, False),  # nothing measured yet
    ],
)
def test_only_a_far_host_waits_for_the_training_loops_next_product(round_trip, between, waits):
    assert waits_for_the_loop(round_trip, between) is waits
