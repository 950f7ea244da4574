"""Host trust: how valid, invalid and failed results change a host's record and its quota."""

from __future__ import annotations

import pytest

from coordinator.rules.trust import TrustConfig, after_error, after_invalid, after_valid, full_quota
from coordinator.work.records import Host

CONFIG = TrustConfig(quota_per_thread=4, quarantine_after=3)


# ---- factories -----------------------------------------------------------------------------


def make_host(*, threads: int = 1, quota: int | None = None, cv: int = 0, **changes) -> Host:
    host = Host(
        id=1,
        name="host-1",
        token_hash="token-1",
        created=0.0,
        last_contact=0.0,
        threads=threads,
        consecutive_valid=cv,
    )
    full = full_quota(host, CONFIG)
    return host.evolve(max_in_progress=full if quota is None else quota, **changes)


def repeat(update, host: Host, times: int) -> list[Host]:
    """The host after each of `times` applications of `update`."""
    seen = []
    for _ in range(times):
        host = update(host, CONFIG)
        seen.append(host)
    return seen


# ---- full quota ----------------------------------------------------------------------------


@pytest.mark.parametrize(("threads", "expected"), [(1, 4), (2, 8), (16, 64), (0, 4), (-3, 4)])
def test_full_quota_is_quota_per_thread_times_threads(threads, expected):
    assert full_quota(make_host(threads=threads), CONFIG) == expected


# ---- valid ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("threads", "quota", "cv", "expected_quota"),
    [
        pytest.param(1, 4, 0, 4, id="full stays full"),
        pytest.param(1, 1, 5, 2, id="one step up"),
        pytest.param(2, 7, 5, 8, id="reaches full"),
        pytest.param(2, 8, 9, 8, id="never above full"),
        pytest.param(1, 9, 1, 4, id="above full (threads went down) is cut to full"),
    ],
)
def test_valid_result_raises_consecutive_valid_and_restores_quota_one_step(
    threads, quota, cv, expected_quota
):
    host = make_host(threads=threads, quota=quota, cv=cv, valid_count=20)

    after = after_valid(host, CONFIG)

    assert after.consecutive_valid == cv + 1
    assert after.valid_count == 21
    assert after.max_in_progress == expected_quota
    assert (after.invalid_count, after.error_count, after.quarantined) == (0, 0, False)


def test_quota_recovers_step_by_step_up_to_quota_per_thread_times_threads():
    host = make_host(threads=2, quota=1)

    quotas = [h.max_in_progress for h in repeat(after_valid, host, 10)]

    assert quotas == [2, 3, 4, 5, 6, 7, 8, 8, 8, 8]


# ---- invalid -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("quota", "expected_quota"), [(8, 4), (5, 2), (3, 1), (2, 1), (1, 1), (0, 1)]
)
def test_invalid_result_resets_trust_and_halves_quota_to_at_least_one(quota, expected_quota):
    host = make_host(threads=2, quota=quota, cv=50, valid_count=50)

    after = after_invalid(host, CONFIG)

    assert after.consecutive_valid == 0
    assert after.max_in_progress == expected_quota
    assert after.invalid_count == 1
    assert after.valid_count == 50
    assert not after.quarantined


def test_host_is_quarantined_at_its_quarantine_after_th_invalid_result():
    host = make_host(cv=30)

    seen = repeat(after_invalid, host, 4)

    assert [h.invalid_count for h in seen] == [1, 2, 3, 4]
    assert [h.quarantined for h in seen] == [False, False, True, True]


def test_valid_results_in_between_do_not_save_a_repeat_offender():
    host = make_host()
    for _ in range(CONFIG.quarantine_after):
        host = after_invalid(host, CONFIG)
        host = repeat(after_valid, host, 20)[-1]

    assert host.quarantined
    assert host.invalid_count == CONFIG.quarantine_after


def test_quarantine_is_not_lifted_by_valid_results():
    host = make_host(quarantined=True, invalid_count=3)

    assert repeat(after_valid, host, 50)[-1].quarantined


@pytest.mark.parametrize("quarantine_after", [1, 2, 5])
def test_quarantine_threshold_comes_from_the_config(quarantine_after):
    config = TrustConfig(quota_per_thread=4, quarantine_after=quarantine_after)
    host = make_host()
    for n in range(1, quarantine_after + 1):
        host = after_invalid(host, config)
        assert host.quarantined is (n >= quarantine_after)


# ---- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(("quota", "expected_quota"), [(8, 4), (4, 2), (3, 1), (1, 1)])
def test_error_halves_quota_to_at_least_one(quota, expected_quota):
    host = make_host(threads=2, quota=quota, cv=12, valid_count=12)

    after = after_error(host, CONFIG)

    assert after.max_in_progress == expected_quota
    assert after.error_count == 1
    assert after.consecutive_valid == 0  # BOINC: no adaptive replication right after a failure
    assert after.valid_count == 12
    assert after.invalid_count == 0


def test_errors_never_quarantine_a_host():
    seen = repeat(after_error, make_host(), 25)

    assert not any(h.quarantined for h in seen)
    assert seen[-1].error_count == 25
    assert seen[-1].max_in_progress == 1


def test_quota_cut_by_errors_recovers_with_valid_results():
    host = repeat(after_error, make_host(threads=1), 3)[-1]
    assert host.max_in_progress == 1

    recovered = [h.max_in_progress for h in repeat(after_valid, host, 5)]

    assert recovered == [2, 3, 4, 4, 4]
