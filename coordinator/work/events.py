"""Log events: one line of the task and validation logs, as a frozen record."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self

from coordinator.work.records import evolve_record


@dataclass(frozen=True, slots=True)
class Event:
    """One line of the task and validation logs."""

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
        return evolve_record(self, changes)

    @classmethod
    def about(cls, wu, now: float, state: str, message: str, result=None) -> Event:
        """A line about a work unit, or about one of its results."""
        return cls(
            time=now,
            kind="result" if result else "wu",
            state=state,
            message=message,
            step=wu.step,
            gemm_id=wu.gemm_id,
            wu_id=wu.id,
            result_id=result.id if result else None,
            host_id=result.host_id if result else None,
        )
