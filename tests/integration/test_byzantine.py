"""Byzantine volunteers: every lie is refused at the edge or caught by the validator."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

import numpy as np
import pytest

import kernels
from coordinator.rules.scheduler import SchedulerConfig
from coordinator.work.records import Policy, Redundancy
from tests.factories import bits, operands, running, volunteers
from tests.liar import EDGE, WELL_FORMED, Lie, Registry, liars
from tests.volunteers import Behaviour, wait_until

TILE = 8
M, N, K = 32, 32, 16  # 16 work units of 8 x 8
TIMEOUT = 30
# What the edge says to each lie that carries its tile: (status, words in the message).
REFUSAL = {
    Lie.WRONG_SHAPE: (400, "tile must be float32 of shape"),
    Lie.BAD_HASH: (400, "blob hash mismatch"),
    Lie.FOREIGN: (403, "is not assigned to host"),
}
# (policy, lie, sent, caught), for the summary printed at the end (`pytest -s`).
TALLY: Counter = Counter()


@pytest.fixture(scope="module", autouse=True)
def summary():
    yield
    if TALLY:
        print("\nlies sent / caught, by policy and kind:")
        for (policy, lie, what), count in sorted(TALLY.items()):
            print(f"  {policy:9} {lie:12} {what:8} {count}")


def redundancy(**changes) -> Redundancy:
    """Short deadlines: a result the edge refused times out and is reissued in a second."""
    return Redundancy(**{"delay_bound": 1.0, **changes})


async def validations(co, host_id: int) -> dict[str, list]:
    """The validation events of one host, by result id."""
    by_result: dict[str, list] = {}
    for event in await co.store.events(kind="validation", host_id=host_id, limit=100_000):
        by_result.setdefault(event.result_id, []).append(event)
    return by_result


def api_warnings(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name == "coordinator.server.api")


async def liar_then_crew(co, queue, url, rng, lie: Lie, registry: Registry):
    """One liar alone first (so it surely gets work), then three honest volunteers finish.

    Returns the liar, the operands and the product. For STALE, a first product is computed
    with the liar honest, then a second one from slightly changed operands (as after an
    optimizer step): the liar replays its tiles of the first.
    """
    async with liars(url, [(lie, {})], registry) as (liar,):
        a, b = operands(rng, M, N, K, False, True)
        if lie is Lie.STALE:
            liar.lie = None
            first = asyncio.ensure_future(queue.matmul(a, b, trans_b=True, step=1))
            async with volunteers(url, [Behaviour()] * 2, prefix="early") as crew:
                await crew.finish(first)
            assert registry.computed, "the liar computed nothing in the first product"
            a = (a * (1 + 1e-3 * rng.standard_normal(a.shape))).astype(np.float32)
            registry.epoch, liar.lie = 1, Lie.STALE
        product = asyncio.ensure_future(queue.matmul(a, b, trans_b=True, step=2))
        if lie is Lie.FOREIGN:
            await wait_until(lambda: liar.taken, timeout=TIMEOUT)
        else:
            await wait_until(lambda: len(liar.sent) >= 3 or liar.refused, timeout=TIMEOUT)
        async with volunteers(url, [Behaviour()] * 3, prefix="honest") as crew:
            registry.peers[:] = crew
            if lie is Lie.FOREIGN:
                await wait_until(lambda: len(liar.sent) >= 3, timeout=TIMEOUT)
            if lie in WELL_FORMED:
                # It lies until the validator has seen enough, then it is quarantined (all
                # its lies reported, on work units still being decided).
                await wait_until(lambda: liar.refused is not None, timeout=TIMEOUT)
            got = await crew.finish(product, timeout=TIMEOUT)
    return liar, a, b, got


CASES = [(Policy.QUORUM, lie) for lie in Lie] + [
    (Policy.FREIVALDS, lie) for lie in Lie if lie not in (Lie.ONE_ULP, Lie.FOREIGN, Lie.REPLAY)
]


@pytest.mark.parametrize(
    ("policy", "lie"), CASES, ids=[f"{p.value}-{lie.value}" for p, lie in CASES]
)
async def test_one_liar_among_honest_volunteers_cannot_change_the_product(
    tmp_path, rng, caplog, policy, lie
):
    caplog.set_level(logging.WARNING, logger="coordinator.server.api")
    registry = Registry()
    async with running(tmp_path, policy=policy, tile=TILE, redundancy=redundancy()) as (
        co,
        queue,
        url,
    ):
        liar, a, b, got = await liar_then_crew(co, queue, url, rng, lie, registry)
        assert np.array_equal(bits(got), bits(kernels.gemm(a, b, trans_b=True)))
        judged = await validations(co, liar.host_id)
        host = co.ledger.hosts[liar.host_id]
        successes = Counter(
            e.result_id
            for e in await co.store.events(kind="result", state="success", host_id=host.id)
        )
    lies = liar.sent
    assert len(lies) >= 3, f"the liar sent only {len(lies)} lies"
    caught = 0
    for sent in lies:
        verdicts = {e.state for e in judged.get(sent.result_id, [])}
        if lie is Lie.REPLAY:
            # A replay changes nothing: it is listed as a duplicate, never accepted again.
            assert sent.status == 200 and sent.outcome in ("duplicate", "late"), sent
            caught += 1
        elif sent.status == 403 and "quarantined" in sent.outcome:
            # Sent once its lies had it quarantined: refused, never judged.
            assert not verdicts, sent
            caught += 1
        elif sent.upload == "tile" and lie in EDGE:
            status, words = REFUSAL[lie]
            assert (sent.status, words in sent.outcome) == (status, True), sent
            assert sent.outcome in api_warnings(caplog), "the refusal must be logged"
            caught += 1
        elif sent.outcome == "late" and not verdicts:
            # Reported after the product was complete and forgotten: never used (rare).
            TALLY[(policy.value, lie.value, "ignored")] += 1
        else:
            # Well-formed (or a hash-only replica): accepted at the edge, judged invalid.
            assert sent.status == 200, sent
            assert "invalid" in verdicts and "valid" not in verdicts, (sent, verdicts)
            caught += 1
    TALLY[(policy.value, lie.value, "sent")] += len(lies)
    TALLY[(policy.value, lie.value, "caught")] += caught
    reasons = " ".join(e.message for events in judged.values() for e in events)
    if lie in WELL_FORMED:
        assert host.quarantined and host.invalid_count >= 3
        assert liar.refused.status == 403 and "quarantined" in liar.refused.message
        assert ("hash mismatch" in reasons) or ("freivalds" in reasons.lower())
        if lie is Lie.NAN and policy is Policy.FREIVALDS:
            assert "non-finite values in c" in reasons
    if lie is Lie.REPLAY:
        # Each result counted once: one success in the log, one trust credit.
        assert successes and set(successes.values()) == {1}
        assert not host.quarantined and host.invalid_count == 0
        valid = [r for r, events in judged.items() if any(e.state == "valid" for e in events)]
        assert host.valid_count == len(valid)
    if lie is Lie.FOREIGN:
        # The stolen results stay their owners': never judged as the liar's; the forger's
        # refused reports cost it trust until it is quarantined.
        stolen = {s.result_id for s in lies}
        assert not stolen & set(judged)
        assert host.quarantined


async def test_one_ulp_passes_freivalds_by_design_and_quorum_catches_it(tmp_path, rng):
    """One element moved by one ulp is below the Freivalds bound (docs/validation.md): under
    the freivalds policy such a tile is accepted and the product differs from the kernel's
    in exactly the lied elements, by exactly one ulp. Bitwise determinism is what lets a
    quorum catch it: under quorum and both, the same lie is invalid (test above and below)."""
    registry = Registry()
    async with running(tmp_path, policy=Policy.FREIVALDS, tile=TILE, redundancy=redundancy()) as (
        co,
        queue,
        url,
    ):
        a, b = operands(rng, M, N, K, False, True)
        product = asyncio.ensure_future(queue.matmul(a, b, trans_b=True))
        async with liars(url, [(Lie.ONE_ULP, {})], registry) as (liar,):
            await wait_until(lambda: len(liar.sent) >= 3, timeout=TIMEOUT)
        # The liar has stopped, every lie reported; honest volunteers do the rest.
        async with volunteers(url, [Behaviour()] * 2) as crew:
            got = await crew.finish(product)
        judged = await validations(co, liar.host_id)
        host = co.ledger.hosts[liar.host_id]
    verdicts = [e.state for s in liar.sent for e in judged[s.result_id]]
    assert verdicts == ["valid"] * len(liar.sent)  # every lie passed Freivalds
    assert not host.quarantined and host.invalid_count == 0
    diff = bits(got).astype(np.int64) - bits(kernels.gemm(a, b, trans_b=True))
    assert sorted(set(np.abs(diff[diff != 0]).tolist())) == [1]  # one ulp, nothing more
    assert np.count_nonzero(diff) == len(liar.sent)  # one element per lied tile
    TALLY[("freivalds", "one_ulp", "sent")] += len(liar.sent)
    TALLY[("freivalds", "one_ulp", "passed")] += len(liar.sent)


async def test_one_ulp_is_caught_by_the_quorum_under_policy_both(tmp_path, rng):
    registry = Registry()
    async with running(tmp_path, policy=Policy.BOTH, tile=TILE, redundancy=redundancy()) as (
        co,
        queue,
        url,
    ):
        liar, a, b, got = await liar_then_crew(co, queue, url, rng, Lie.ONE_ULP, registry)
        assert np.array_equal(bits(got), bits(kernels.gemm(a, b, trans_b=True)))
        judged = await validations(co, liar.host_id)
        assert co.ledger.hosts[liar.host_id].quarantined
    for sent in liar.sent:
        if sent.status == 403:  # sent once its lies had it quarantined: refused, not judged
            assert "quarantined" in sent.outcome, sent
            continue
        assert [e.state for e in judged[sent.result_id]][-1] == "invalid"
        assert any("hash mismatch" in e.message for e in judged[sent.result_id])
    TALLY[("both", "one_ulp", "sent")] += len(liar.sent)
    TALLY[("both", "one_ulp", "caught")] += len(liar.sent)


async def test_two_colluding_liars_agreeing_on_a_wrong_tile_are_caught_by_freivalds(tmp_path, rng):
    """Under policy both with a quorum of two, two liars sending the same wrong tile form a
    quorum; Freivalds rejects its tile, both are invalid, honest hosts redo the work."""
    registry = Registry()  # the colluders' shared table of agreed wrong tiles
    red = redundancy(target_nresults=2, min_quorum=2)
    async with running(tmp_path, policy=Policy.BOTH, tile=TILE, redundancy=red) as (
        co,
        queue,
        url,
    ):
        a, b = operands(rng, M, N, K, False, False)
        product = asyncio.ensure_future(queue.matmul(a, b))
        collude = {"colluding": True, "capacity": 2}
        async with liars(url, [(Lie.BIG, collude), (Lie.BIG, collude)], registry) as pair:
            # Alone, they take both replicas of the same work units and agree on each.
            await wait_until(lambda: all(liar.refused for liar in pair), timeout=TIMEOUT)
        async with volunteers(url, [Behaviour()] * 3) as crew:
            got = await crew.finish(product)
        assert np.array_equal(bits(got), bits(kernels.gemm(a, b)))
        invalid = await co.store.events(kind="validation", state="invalid")
        ids = {liar.host_id for liar in pair}
        assert all(co.ledger.hosts[i].quarantined for i in ids)
    caught = [e for e in invalid if "fails Freivalds" in e.message]
    by_wu: dict[str, set[int]] = {}
    for event in caught:
        by_wu.setdefault(event.wu_id, set()).add(event.host_id)
    assert by_wu and all(hosts == ids for hosts in by_wu.values())
    assert "quorum of 2 agreed on a tile that fails Freivalds" in caught[0].message
    lies = [sent for liar in pair for sent in liar.sent]
    assert {s.result_id for s in lies} <= {e.result_id for e in invalid}  # every lie caught
    TALLY[("both", "collusion", "sent")] += len(lies)
    TALLY[("both", "collusion", "caught")] += len(lies)
    TALLY[("both", "collusion", "freivalds")] += len(caught)


@pytest.mark.parametrize("lie", sorted(EDGE, key=lambda lie: lie.value), ids=lambda x: x.value)
async def test_a_host_that_keeps_sending_refused_reports_ends_quarantined(tmp_path, rng, lie):
    """Three invalid results quarantine a host; three refused reports should too."""
    registry = Registry()
    async with running(
        tmp_path, policy=Policy.FREIVALDS, tile=TILE, redundancy=redundancy(delay_bound=0.3)
    ) as (co, queue, url):
        limit = co.config.trust.quarantine_after
        a, b = operands(rng, M, N, K, False, False)
        product = asyncio.ensure_future(queue.matmul(a, b))
        # Silent peers hold results for a FOREIGN liar to steal.
        async with (
            volunteers(url, [Behaviour(silent=True, capacity=4)] * 2, prefix="peer") as peers,
            liars(url, [(lie, {})], registry) as (liar,),
        ):
            registry.peers[:] = peers
            await wait_until(lambda: len(liar.lies(refused=True)) > limit or liar.refused, TIMEOUT)
            quarantined = co.ledger.hosts[liar.host_id].quarantined
        product.cancel()
    refused = liar.lies(refused=True)
    assert quarantined, f"{len(refused)} refused reports ({refused[0].outcome}), not quarantined"


async def trusted_then_one_ulp(tmp_path, rng, adaptive: bool | None):
    """A host earns trust honestly (16 valid results in a row), then lies by one ulp;
    `adaptive` None leaves adaptive replication at its default."""
    registry = Registry()
    scheduler = (
        SchedulerConfig() if adaptive is None else SchedulerConfig(adaptive_replication=adaptive)
    )
    async with running(tmp_path, policy=Policy.QUORUM, tile=TILE, seed=1, scheduler=scheduler) as (
        co,
        queue,
        url,
    ):
        async with liars(url, [(None, {})], registry) as (liar,):
            a, b = operands(rng, M, N, K, False, False)
            first = asyncio.ensure_future(queue.matmul(a, b, step=1))
            async with volunteers(url, [Behaviour()]) as crew:  # two hosts: one replica each
                await crew.finish(first)
            if co.ledger.hosts[liar.host_id].consecutive_valid < 10:
                raise RuntimeError("the liar did not earn adaptive replication")
            liar.lie = Lie.ONE_ULP
            a, b = operands(rng, M, N, K, False, False)
            product = asyncio.ensure_future(queue.matmul(a, b, step=2))
            await wait_until(lambda: len(liar.sent) >= 3, timeout=TIMEOUT)
            async with volunteers(url, [Behaviour()] * 2, prefix="late") as crew:
                got = await crew.finish(product)
        passed = await co.store.events(kind="validation", state="valid")
    lied = {s.result_id for s in liar.sent}
    slipped = sum(1 for e in passed if e.result_id in lied)
    wrong = np.count_nonzero(bits(got) != bits(kernels.gemm(a, b)))
    return len(lied), slipped, wrong


async def test_with_adaptive_replication_a_trusted_liar_below_the_bound_slips_through(
    tmp_path, rng
):
    """Why adaptive replication is off by default: a host with >= 10 consecutive valid
    results gets work units alone, decided by Freivalds only, and a one-ulp lie is below the
    Freivalds bound, so the product is no longer the bits --local computes."""
    lied, slipped, wrong = await trusted_then_one_ulp(tmp_path, rng, adaptive=True)
    TALLY[("quorum+ar", "one_ulp", "sent")] += lied
    TALLY[("quorum+ar", "one_ulp", "passed")] += slipped
    assert slipped > 0 and wrong > 0


async def test_under_the_default_policy_a_trusted_liar_cannot_change_the_product(tmp_path, rng):
    """The default (quorum, adaptive replication off): every tile gets its full quorum, so
    the host that earned trust and then lies by one ulp is caught like any other liar."""
    lied, slipped, wrong = await trusted_then_one_ulp(tmp_path, rng, adaptive=None)
    TALLY[("quorum-ar", "one_ulp", "sent")] += lied
    TALLY[("quorum-ar", "one_ulp", "caught")] += lied - slipped
    assert (slipped, wrong) == (0, 0)


async def test_a_replayed_report_with_a_changed_tile_stores_nothing(tmp_path, rng):
    """A replay is answered `duplicate` (or `late`, once the product is complete); its
    altered tile must not land in the blob store."""
    registry = Registry()
    async with running(tmp_path, policy=Policy.FREIVALDS, tile=TILE) as (co, queue, url):
        a, b = operands(rng, M, N, K, False, False)
        product = asyncio.ensure_future(queue.matmul(a, b))
        async with liars(url, [(Lie.REPLAY, {})], registry) as (liar,):
            got = await asyncio.wait_for(product, TIMEOUT)
        altered = [s for s in liar.sent if s.upload == "altered"]
        assert altered and all(s.outcome in ("duplicate", "late") for s in altered), altered
        stored = [s.output_hash for s in altered if co.blobs.has(s.output_hash)]
    assert np.array_equal(bits(got), bits(kernels.gemm(a, b)))
    assert stored == [], f"{len(stored)} of {len(altered)} replayed wrong tiles were stored"
