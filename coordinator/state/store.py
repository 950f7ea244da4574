"""The coordinator's durable state, behind one interface so another database can replace SQLite.

The coordinator keeps the live state of its work in memory and writes every change through
`commit(batch)`: one transaction per batch, finished before any reply that depends on it
leaves the server. On restart, `load()` returns what was committed.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field

from coordinator.work.events import Event
from coordinator.work.records import Gemm, Host, Result, WorkUnit


@dataclass(frozen=True, slots=True)
class Reply:
    """The stored answer to one idempotent work request."""

    host_id: int
    request_id: str
    time: float
    body: bytes


@dataclass(slots=True)
class Batch:
    """Changes to commit together: the latest version of each record, and new log lines."""

    gemms: dict[str, Gemm] = field(default_factory=dict)
    workunits: dict[str, WorkUnit] = field(default_factory=dict)
    results: dict[str, Result] = field(default_factory=dict)
    hosts: dict[int, Host] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    replies: list[Reply] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.gemms
            or self.workunits
            or self.results
            or self.hosts
            or self.events
            or self.replies
        )


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything the coordinator needs in memory after a restart."""

    hosts: list[Host]
    gemms: list[Gemm]  # the active ones
    workunits: list[WorkUnit]  # of the active GEMMs
    results: list[Result]  # of those work units
    workunit_counts: dict[str, int] = field(default_factory=dict)  # of the whole project
    invalid_count: int = 0  # results ever judged invalid
    last_gemm_step: int = -1  # the newest step of any GEMM stored, finished ones too


class Store(abc.ABC):
    """Durable state: GEMMs, work units, results, hosts, the event log and work replies."""

    @abc.abstractmethod
    async def open(self) -> None:
        """Connect and bring the schema up to date."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    async def commit(self, batch: Batch) -> None:
        """Write a batch atomically: all of it or, if the process dies, none of it.

        A result is first written when it is assigned (or when it ends unsent, or is the
        coordinator's own, hostless both), and its host_id is kept from that first write
        on: a result is one assignment to one host."""

    @abc.abstractmethod
    async def load(self) -> Snapshot: ...

    @abc.abstractmethod
    async def gemm(self, gemm_id: str) -> Gemm | None: ...

    @abc.abstractmethod
    async def gemm_work(self, gemm_id: str) -> tuple[list[WorkUnit], list[Result]]:
        """All work units of a GEMM and all their results."""

    @abc.abstractmethod
    async def result(self, result_id: str) -> Result | None:
        """One result, also of a GEMM that is no longer in memory."""

    @abc.abstractmethod
    async def reply(self, host_id: int, request_id: str) -> bytes | None:
        """The stored answer to a work request, if this host sent it before."""

    @abc.abstractmethod
    async def prune_replies(self, before: float, keep: int) -> None:
        """Forget replies stored before `before`, and all but each host's `keep` newest."""

    @abc.abstractmethod
    async def reply_count(self) -> int:
        """How many work replies are stored."""

    @abc.abstractmethod
    async def events(
        self,
        *,
        after: int = 0,
        kind: str | None = None,
        step: int | None = None,
        state: str | None = None,
        host_id: int | None = None,
        limit: int = 1000,
    ) -> list[Event]: ...

    @abc.abstractmethod
    async def prunable_blobs(self, through_step: int) -> set[str]:
        """Blobs used only by GEMMs of steps <= through_step that ended (done or failed)."""

    @abc.abstractmethod
    async def mark_pruned(self, through_step: int) -> None:
        """Mark the done GEMMs of steps <= through_step pruned, once their blobs are deleted
        (their records stay for the logs): marked before, a kill in between would leave
        the files on disk with nothing to delete them."""

    @abc.abstractmethod
    async def events_through(self, step: int, before: float = math.inf) -> list[Event]:
        """The events of steps <= step logged before `before`, oldest first (what a purge
        with those bounds would delete)."""

    @abc.abstractmethod
    async def workunits_through(self, step: int) -> list[WorkUnit]:
        """The work units of steps <= step (what a purge would delete)."""

    @abc.abstractmethod
    async def panel_steps(self) -> dict[str, int]:
        """The newest step of the work units it holds that uses each operand panel."""

    @abc.abstractmethod
    async def purge(self, through_step: int, events_before: float = math.inf) -> None:
        """Delete the GEMMs, work units, results and events of steps <= through_step (a
        checkpoint made them useless), keeping the project's totals; events logged since
        `events_before` stay for a later purge. All of it or, if the process dies, none."""

    @abc.abstractmethod
    async def recent_events(self, kind: str, state: str, limit: int) -> list[Event]:
        """The newest events of a kind and state, newest first."""

    @abc.abstractmethod
    async def workunit_counts(self) -> dict[str, int]:
        """How many work units are in each state."""

    @abc.abstractmethod
    async def invalid_count(self) -> int:
        """How many results were judged invalid, ever."""
