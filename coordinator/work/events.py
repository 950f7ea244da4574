"""Log events: one line of the task and validation logs, as an immutable record."""

from __future__ import annotations

from typing import NamedTuple, Self


class Event(NamedTuple):
    """One line of the task and validation logs.

    A named tuple rather than a frozen dataclass like the other records: a work unit makes
    eight of them, and as a tuple an event is built in 0.42 us instead of 1.07 and is
    already the row its insert binds (`queries.values`; docs/performance-history.md,
    the twenty-first round)."""

    time: float
    kind: str  # "gemm", "wu", "result", "validation", "host"
    state: str
    message: str
    step: int | None = None
    gemm_id: str | None = None
    wu_id: str | None = None
    result_id: str | None = None
    host_id: int | None = None
    id: int | None = None  # assigned by the store
    data: str = ""  # JSON of structured fields (validation: method, trust before and after)

    def evolve(self, **changes: object) -> Self:
        return self._replace(**changes)

    @classmethod
    def about(cls, wu, now: float, state: str, message: str, result=None) -> Event:
        """A line about a work unit, or about one of its results."""
        if result is None:
            return cls(now, "wu", state, message, wu.step, wu.gemm_id, wu.id)
        return cls(
            now, "result", state, message, wu.step, wu.gemm_id, wu.id, result.id, result.host_id
        )
