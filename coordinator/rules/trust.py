"""Host trust: how a host's record changes with valid, invalid and missing results."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.work.records import Host


@dataclass(frozen=True, slots=True)
class TrustConfig:
    quota_per_thread: int = 4  # in-progress results a clean host may hold per thread
    quarantine_after: int = 3  # invalid results before a host gets no more work


def full_quota(host: Host, config: TrustConfig) -> int:
    return config.quota_per_thread * max(1, host.threads)


def after_valid(host: Host, config: TrustConfig) -> Host:
    """One more valid result: trust grows, the quota recovers one step at a time."""
    return host.evolve(
        consecutive_valid=host.consecutive_valid + 1,
        valid_count=host.valid_count + 1,
        max_in_progress=min(full_quota(host, config), host.max_in_progress + 1),
    )


def after_invalid(host: Host, config: TrustConfig) -> Host:
    """A wrong result: trust is gone, the quota halves, repeated ones quarantine the host."""
    invalid = host.invalid_count + 1
    return host.evolve(
        consecutive_valid=0,
        invalid_count=invalid,
        max_in_progress=max(1, host.max_in_progress // 2),
        quarantined=host.quarantined or invalid >= config.quarantine_after,
    )


def after_error(host: Host, config: TrustConfig) -> Host:
    """A client error or a missed deadline: no trust lost to a lie, but the quota halves."""
    return host.evolve(
        consecutive_valid=0,
        error_count=host.error_count + 1,
        max_in_progress=max(1, host.max_in_progress // 2),
    )


def why_quarantined(host: Host, config: TrustConfig) -> str:
    """Why a quarantined host gets no work, for the host itself: its invalid results, or,
    with fewer than quarantine_after of them, the operator's decision."""
    if host.invalid_count >= config.quarantine_after:
        return f"host {host.id} is quarantined after {host.invalid_count} invalid results"
    return f"host {host.id} is quarantined by the project's operator"
