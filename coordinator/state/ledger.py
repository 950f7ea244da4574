"""The live state of the work in memory, with the indexes the scheduler needs, written
through to the store in batches."""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable

from coordinator.state.store import Batch, Reply, Snapshot, Store
from coordinator.work.events import Event
from coordinator.work.records import (
    Gemm,
    GemmState,
    Host,
    Result,
    ServerState,
    ValidateState,
    WorkUnit,
    counted_state,
)

REPORTED_KEPT = 4000  # results remembered for the dashboard's task stream


class Ledger:
    """Latest version of every live record; every change is queued for the next commit.

    The coordinator is one asyncio task set: records change only between awaits, and
    `flush` commits queued changes in order. A reply that promises something (assignments,
    a report accepted) asks for its commit with `commit_soon`, and the passes make it within
    a few milliseconds, with the promises of the replies that left meanwhile: what the
    database holds is never ahead of what was decided, and lags what was promised by at
    most that window and the rest of a pass under way when it ends.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self.gemms: dict[str, Gemm] = {}
        self.wus: dict[str, WorkUnit] = {}
        self.results: dict[str, Result] = {}
        self.hosts: dict[int, Host] = {}
        self.results_of: dict[str, dict[str, None]] = defaultdict(dict)
        self.wus_of: dict[str, dict[str, None]] = defaultdict(dict)
        self.hosts_of_wu: dict[str, set[int]] = defaultdict(set)
        self.in_progress_of: dict[int, dict[str, None]] = defaultdict(dict)
        self.host_by_token: dict[str, int] = {}
        # Unsent results, oldest first, and the same indexed by operand panel.
        self.unsent: dict[str, None] = {}
        self.unsent_by_panel: dict[str, dict[str, None]] = defaultdict(dict)
        self.unsent_of_gemm: Counter[str] = Counter()
        self.panel_bytes: dict[str, int] = {}
        # The newest step whose products use each panel: what tells a host which of the
        # panels it holds no product will use again (rules/scheduler.py stale_panels).
        self.panel_step: dict[str, int] = {}
        # (transition_time, wu id): work units the transitioner must look at by then.
        self.due: list[tuple[float, str]] = []
        # Work units changed by a report or a decision, for the transitioner's next pass.
        self.touched: set[str] = set()
        # Of the whole project, finished products included, so status never reads the store.
        self.workunit_counts: Counter[str] = Counter()
        self.invalid_count = 0
        # What tells a product new to this run from one the store may hold (may_be_stored):
        # the newest step the store had a GEMM of at start (or purged since), and the GEMMs
        # this run forgot, by step: ids of the steps the store still keeps rows of, let go
        # as they are purged (Retention.prune), about two checkpoint intervals' worth.
        self.stored_through = -1
        self.forgotten: dict[int, set[str]] = defaultdict(set)
        self._batch = Batch()
        self._queued_since: float | None = None  # monotonic time of the oldest queued change
        # Monotonic time of the first reply since the last commit that promised what is
        # queued (commit_soon), or None.
        self._promised: float | None = None
        self._committing = Batch()  # the batch of the commit under way (empty if none)
        self._lock = asyncio.Lock()
        self.on_unsent: Callable[[], None] | None = None  # new work for waiting hosts
        # A host was just quarantined (by its results, its reports or the operator): what
        # it holds goes to others (Products.take_back).
        self.on_quarantined: Callable[[int], None] | None = None
        self.on_promise: Callable[[], None] | None = None  # the passes: a commit is due soon
        # The latest results reported (host, sent, received, outcome): the dashboard's task
        # stream. Bounded: it is a view, not a record (the store has every result).
        self.reported: deque[tuple[int, float, float, str]] = deque(maxlen=REPORTED_KEPT)

    # ---- reading -------------------------------------------------------------------------

    def results_for(self, wu_id: str) -> list[Result]:
        return [self.results[r] for r in self.results_of.get(wu_id, ())]

    def workunits_for(self, gemm_id: str) -> list[WorkUnit]:
        return [self.wus[w] for w in self.wus_of.get(gemm_id, ())]

    def oldest_active_step(self) -> int | None:
        """The step of the oldest product in flight (None: none is)."""
        steps = [g.step for g in self.gemms.values() if g.state is GemmState.ACTIVE]
        return min(steps, default=None)

    # ---- changing ------------------------------------------------------------------------

    def add_panel(self, panel_id: str, size: int, step: int) -> None:
        """A published operand panel: its size, and the newest step that uses it."""
        self.panel_bytes[panel_id] = size
        self.panel_step[panel_id] = max(step, self.panel_step.get(panel_id, step))

    def drop_panel(self, panel_id: str) -> None:
        """A panel's blob is deleted. Its step stays, so that the hosts that still hold it
        are told to drop it too (forget_panel_steps lets it go later)."""
        self.panel_bytes.pop(panel_id, None)

    def forget_panel_steps(self, through_step: int) -> None:
        """Let go of the steps of panels of steps <= through_step: every host in contact
        since has been told to drop them."""
        self.panel_step = {p: s for p, s in self.panel_step.items() if s > through_step}

    def forget_steps(self, through_step: int) -> None:
        """Let go of the GEMMs this run forgot of steps <= through_step: a product of those
        steps is looked up in the store from now on (may_be_stored)."""
        self.stored_through = max(self.stored_through, through_step)
        for step in [s for s in self.forgotten if s <= through_step]:
            del self.forgotten[step]

    def may_be_stored(self, gemm_id: str, step: int) -> bool:
        """False when a GEMM not in memory cannot be in the store either: its step is newer
        than any the store had at start, and this run has not forgotten it. Only the
        coordinator writes GEMMs, and it holds each one in memory until it forgets it; so
        a product new to this run costs no lookup (a trip to the store per product)."""
        return step <= self.stored_through or gemm_id in self.forgotten.get(step, ())

    def put_gemm(self, gemm: Gemm) -> None:
        self.gemms[gemm.id] = gemm
        self._batch.gemms[gemm.id] = gemm
        self._queued()

    def put_host(self, host: Host) -> None:
        old = self.hosts.get(host.id)
        self.hosts[host.id] = host
        self.host_by_token[host.token_hash] = host.id
        self._batch.hosts[host.id] = host
        self._queued()
        if host.quarantined and old is not None and not old.quarantined and self.on_quarantined:
            self.on_quarantined(host.id)

    def put_wu(self, wu: WorkUnit) -> None:
        old = self.wus.get(wu.id)
        if old is not None:
            self.workunit_counts[counted_state(old)] -= 1
        self.workunit_counts[counted_state(wu)] += 1
        self.wus[wu.id] = wu
        self.wus_of[wu.gemm_id][wu.id] = None
        self._batch.workunits[wu.id] = wu
        self._queued()
        self._schedule(wu)

    def reschedule(self, wu: WorkUnit) -> None:
        """A work unit whose only change is an earlier transition time (a replica went out
        with an earlier deadline): in memory and in the due queue, but not written. After a
        restart every work unit passes through the transitioner first (`restore`), which
        sets the time again from its results' deadlines. Not writing it took a work
        unit's own rows from 2.4-2.5 to 2.15 in the throughput row (docs/performance-history.md,
        the twenty-first round)."""
        self.wus[wu.id] = wu
        if wu.id in self._batch.workunits:  # a change queued before: it goes with this time
            self._batch.workunits[wu.id] = wu
        self._schedule(wu)

    def _schedule(self, wu: WorkUnit) -> None:
        if math.isfinite(wu.transition_time):
            heapq.heappush(self.due, (wu.transition_time, wu.id))

    def pop_due(self, now: float) -> set[str]:
        """Work units whose transition time has come, plus the touched ones."""
        ready, self.touched = self.touched, set()
        while self.due and self.due[0][0] <= now:
            ready.add(heapq.heappop(self.due)[1])
        return {w for w in ready if w in self.wus}

    def next_due(self) -> float:
        return self.due[0][0] if self.due else math.inf

    def put_result(self, result: Result) -> None:
        old = self.results.get(result.id)
        if result.validate_state is ValidateState.INVALID and (
            old is None or old.validate_state is not ValidateState.INVALID
        ):
            self.invalid_count += 1
        if old is not None:
            self._unindex(old)
            if (
                old.server_state is ServerState.IN_PROGRESS
                and result.received_time is not None
                and result.host_id is not None
            ):
                self.reported.append(
                    (
                        result.host_id,
                        old.sent_time or 0.0,
                        result.received_time,
                        result.outcome.value,
                    )
                )
        self.results[result.id] = result
        self._index(result)
        if result.server_state is ServerState.UNSENT:
            # A replica not yet sent promises nothing to anyone: it is written when it is
            # sent (or ends unsent; no result goes back to unsent). After a restart the
            # transitioner issues the replicas a work unit lacks again, so nothing is lost,
            # and a work unit's life is one row in nine shorter (docs/architecture.md).
            return
        self._batch.results[result.id] = result
        self._queued()

    def log(self, events: list[Event]) -> None:
        self._batch.events.extend(events)
        self._queued()

    def remember_reply(self, reply: Reply) -> None:
        self._batch.replies.append(reply)
        self._queued()

    def _queued(self) -> None:
        if self._queued_since is None:
            self._queued_since = time.monotonic()

    def _index(self, r: Result) -> None:
        self.results_of[r.wu_id][r.id] = None
        if r.host_id is not None:
            self.hosts_of_wu[r.wu_id].add(r.host_id)
        if r.server_state is ServerState.UNSENT:
            self.unsent[r.id] = None
            wu = self.wus[r.wu_id]
            self.unsent_of_gemm[wu.gemm_id] += 1
            self.unsent_by_panel[wu.a_panel][r.id] = None
            self.unsent_by_panel[wu.b_panel][r.id] = None
            if self.on_unsent is not None:
                self.on_unsent()
        elif r.server_state is ServerState.IN_PROGRESS and r.host_id is not None:
            self.in_progress_of[r.host_id][r.id] = None

    def _unindex(self, r: Result) -> None:
        if r.server_state is ServerState.UNSENT:
            self.unsent.pop(r.id, None)
            wu = self.wus[r.wu_id]
            self.unsent_of_gemm[wu.gemm_id] -= 1
            if not self.unsent_of_gemm[wu.gemm_id]:
                del self.unsent_of_gemm[wu.gemm_id]
            for panel in (wu.a_panel, wu.b_panel):
                index = self.unsent_by_panel.get(panel)
                if index is not None:
                    index.pop(r.id, None)
                    if not index:
                        del self.unsent_by_panel[panel]
        elif r.server_state is ServerState.IN_PROGRESS and r.host_id is not None:
            self.in_progress_of[r.host_id].pop(r.id, None)

    def forget_gemm(self, gemm_id: str) -> None:
        """Drop a finished GEMM's records from memory (they stay in the store)."""
        for wu_id in list(self.wus_of.pop(gemm_id, ())):
            for result_id in list(self.results_of.pop(wu_id, ())):
                result = self.results.pop(result_id)
                self._unindex(result)
            self.hosts_of_wu.pop(wu_id, None)
            self.wus.pop(wu_id, None)
        gemm = self.gemms.pop(gemm_id, None)
        if gemm is not None and gemm.state is GemmState.ACTIVE:
            raise RuntimeError(f"forgetting active GEMM {gemm_id}")
        if gemm is not None:
            self.forgotten[gemm.step].add(gemm_id)

    def forget_through(self, step: int) -> None:
        """Let go of the GEMMs of steps <= `step` still in memory: a failed or cancelled
        one stays there after it ends (a finished one leaves at once). Their rows are about
        to be purged, and a late report must then find nothing to apply: a result written
        back for a work unit purged from the store breaks the commit that holds it."""
        for gemm in [g for g in self.gemms.values() if g.step <= step]:
            if gemm.state is not GemmState.ACTIVE:
                self.forget_gemm(gemm.id)

    def restore(self, snapshot: Snapshot) -> None:
        """Fill memory from committed state (at start, nothing is queued)."""
        self.workunit_counts = Counter(snapshot.workunit_counts)
        self.invalid_count = snapshot.invalid_count
        self.stored_through = snapshot.last_gemm_step
        for host in snapshot.hosts:
            self.hosts[host.id] = host
            self.host_by_token[host.token_hash] = host.id
        for gemm in snapshot.gemms:
            self.gemms[gemm.id] = gemm
        for wu in snapshot.workunits:
            self.wus[wu.id] = wu
            self.wus_of[wu.gemm_id][wu.id] = None
            self.touched.add(wu.id)
            # Due again at its transition time: the first pass may leave a work unit as it
            # is (no deadline passed yet), and then nothing else would ever look at it.
            self._schedule(wu)
        for result in snapshot.results:
            self.results[result.id] = result
            self._index(result)

    # ---- committing ----------------------------------------------------------------------

    def unwritten_result(self, result_id: str) -> Result | None:
        """A result whose latest change is not in the store yet (queued, or in the commit
        under way), though its GEMM may have left memory."""
        return self._batch.results.get(result_id) or self._committing.results.get(result_id)

    def is_queued(self, gemm_id: str) -> bool:
        """True when a change to this GEMM is not in the store yet: queued, or in the
        commit under way."""
        return gemm_id in self._batch.gemms or gemm_id in self._committing.gemms

    def commit_due_in(self, window: float, promised_window: float) -> float:
        """Seconds until the oldest queued change has waited `window`, or the first promise
        of what is queued `promised_window` (0: overdue; inf: nothing is queued)."""
        if self._queued_since is None:
            return math.inf
        due = self._queued_since + window
        if self._promised is not None:
            due = min(due, self._promised + promised_window)
        return max(0.0, due - time.monotonic())

    def commit_soon(self) -> None:
        """A reply is leaving that promises what is queued (assignments, reports accepted):
        the passes commit it shortly after the reply instead of before it, so a host waits
        for its work on nobody's commit, together with what the replies leaving in the next
        few milliseconds promise (engine/passes.py, PROMISE_WINDOW). A kill in between
        loses those promises and nothing committed (docs/architecture.md, "Durability")."""
        if self._queued_since is None or self._promised is not None:
            return  # nothing to commit, or the commit is already due at the first promise
        self._promised = time.monotonic()
        if self.on_promise is not None:
            self.on_promise()

    async def flush(self) -> None:
        """Commit everything queued so far (group commit: one transaction for many changes)."""
        async with self._lock:
            batch, self._batch = self._batch, Batch()
            self._queued_since = None
            self._promised = None
            if not batch:
                return
            self._committing = batch
            commit = asyncio.ensure_future(self.store.commit(batch))
            try:
                await asyncio.shield(commit)
            except asyncio.CancelledError:
                # Cancelled while committing (a stop): what was decided must not be lost
                # with the task, and the next commit must not start inside this one.
                await commit
                raise
            finally:
                self._committing = Batch()
