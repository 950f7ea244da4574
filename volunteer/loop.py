"""The volunteer's pull loop: ask for work, fetch and verify operands, compute, report.

One state machine for every volunteer tilehive runs: the daemon (volunteer/daemon.py: real
threads, sockets and memory), the emulator's hosts (volunteer/emulator.py: modelled time,
network and lies) and the test volunteers (tests/volunteers.py). As in saq's queue, the
base classes do the bookkeeping: volunteer/session.py the identity, backoff and refusals,
this one the queue, reports, request ids, aborts, hysteresis, the memory limit, counters
and logging. A backend overrides only primitives: `_request` (one call on the wire),
`_fetch` (one operand), `_kernel` (one tile), `_outcome` (what to report for it), and the
hooks `_identify`, `_forget`, `_paused`, `_heard`, `_failed`, `_quarantined`.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import secrets
import time
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import kernels
from kernels.frames import Buffer
from volunteer.backoff import Backoff
from volunteer.cache import Downloads
from volunteer.client import NOT_TILEHIVE, CoordinatorClient, ServerRefused
from volunteer.policy import (
    CORRUPT_FETCHES,
    MAX_CACHED_IDS,
    MAX_CAPACITY,
    UNSIZED_BLOB,
    UPLOAD_SAMPLE_BYTES,
    ask_ahead,
    capacity,
    memory_refusal,
    report_batch,
    report_bytes,
    report_due,
    room_to_compute,
    time_to_ask,
    work_budget_mb,
)
from volunteer.session import (
    NETWORK,
    TRANSIENT,
    CoordinatorSession,
    ProjectFinished,
    Stopping,
    no_route,
    wait,
)

log = logging.getLogger(__name__)

ROUND_TRIPS_KEPT = 16  # calls whose duration estimates the round trip (their minimum)
# Seconds between two words to the coordinator while paused: at least this, or the delay it
# last told, up to PAUSED_HEARTBEAT_MAX. It counts a host that holds nothing quiet 15 s after
# it was due to ask again, and gone after 60 s of silence (coordinator/engine/waiting.py).
PAUSED_HEARTBEAT = 10.0
PAUSED_HEARTBEAT_MAX = 30.0


class OperandCache(Protocol):
    """Where a loop keeps verified operands: volunteer.cache.BlobCache, or a model of one."""

    def get(self, blob_id: str, *, count: bool = True) -> bytes | None: ...
    def count(self, hit: bool) -> None: ...
    def put(self, blob_id: str, data: bytes) -> None: ...
    def drop(self, blob_id: str) -> None: ...
    def ids(self) -> list[str]: ...
    def pin(self, sizes: dict[str, int]) -> bool: ...
    def unpin(self, blob_ids: tuple[str, ...]) -> None: ...


@dataclass
class Stats:
    """What loops count; the emulator gives all its hosts one, so it holds their sum."""

    assigned: int = 0  # assignments received
    tiles: int = 0  # tiles computed
    flops: float = 0.0
    compute_seconds: float = 0.0
    bytes_down: int = 0
    bytes_up: int = 0
    errors: int = 0
    refused: int = 0  # assignments refused for want of memory
    aborted: int = 0  # results the coordinator told us to drop
    skipped: int = 0  # results whose deadline passed before we got to them
    reported: int = 0  # tiles the coordinator accepted
    late: int = 0
    duplicate: int = 0
    abandoned: int = 0  # results given back when a session ended
    vanished: int = 0  # results dropped unreported when a session ended

    def gflops(self) -> float:
        return self.flops / self.compute_seconds / 1e9 if self.compute_seconds else 0.0


@dataclass
class Job:
    """An assignment and the task fetching its operands: started while the tile is queued
    when they fit the cache beside those of the tiles before it (pinned there until its
    turn has come and they are in hand), else when its turn comes."""

    assignment: dict[str, Any]
    deadline: float
    operands: asyncio.Future | None = None
    pinned: tuple[str, ...] = ()
    corrupt: int = 0  # its operands' downloads that did not match their names


class PullLoop(CoordinatorSession):
    """One volunteer's sessions with one coordinator through `client`.

    `budget` is the memory for work and cached operands, half each (None: no limit);
    `gflops` sizes the requests (about two seconds of work), `max_capacity` caps them.
    `stats` may be shared between loops."""

    def __init__(
        self,
        client: CoordinatorClient,
        *,
        name: str,
        cache: OperandCache,
        gflops: float = 0.0,
        threads: int = 1,
        budget: int | None = None,
        invite: str | None = None,
        stats: Stats | None = None,
        backoff: Backoff | None = None,
        idle: Backoff | None = None,
        long_poll: bool = True,
        max_capacity: int = MAX_CAPACITY,
        logger: logging.Logger = log,
    ) -> None:
        super().__init__(client, backoff=backoff, logger=logger)
        self.name = name
        self.cache = cache
        self.gflops = gflops
        self.threads = threads
        self.budget = budget
        self.invite = invite
        self.stats = stats or Stats()
        # While it has no work: its long poll already waited, so this stays short.
        self.idle = idle or Backoff(base=0.25, cap=10.0)
        self.long_poll = long_poll
        self.max_capacity = max_capacity
        self.limit_name = "the memory limit"  # how a refusal names it to the user
        self.queue: deque[Job] = deque()
        self.pending: list[dict[str, Any]] = []  # reports not yet sent
        self.sending: list[dict[str, Any]] = []  # reports on their way
        self.upload_rate: float | None = None  # bytes a second up, from large reports
        self.computing: str | None = None
        # The tile whose turn has come, while its operands arrive: in progress all the same.
        self.fetching: str | None = None
        self.aborted: set[str] = set()  # told to drop while computing: not reported
        self.downloads = Downloads()
        self.short = False  # the last work request brought fewer tiles than it asked for
        self.tile_flops = 0.0
        # The next work is asked for while the last queued tile computes, when that tile
        # takes longer than the round trips the answer needs (policy.ask_ahead): the
        # volunteer then never waits for the network between tiles.
        self.asking: asyncio.Future | None = None  # the work request in flight, if any
        self.asked_busy = False  # the last work request went out with tiles still queued
        self.round_trips: deque[float] = deque(maxlen=ROUND_TRIPS_KEPT)
        self.flops_per_second = 0.0  # measured on the tiles computed so far
        self.leaving = False  # set when the session ends: no more asking ahead
        self.paused_said_until = 0.0  # monotonic time until which a pause needs no word
        # Each work request has its own id: the coordinator keeps its reply under it, so
        # one request delivered twice is answered, and assigns work, once.
        self._session_id = secrets.token_hex(4)
        self._requests = itertools.count()

    # ---- primitives and hooks: what a backend overrides ---------------------------------

    async def _fetch(self, blob_id: str, limit: int) -> Buffer:
        """An operand's verified bytes from the coordinator."""
        return await self._call("blob", lambda: self.client.fetch_blob(blob_id, max_bytes=limit))

    async def _kernel(
        self, assignment: dict[str, Any], a: bytes, b: bytes
    ) -> tuple[str | None, bytes, float]:
        """The tile as (hash, blob, seconds it took); ValueError if the operands do not fit.
        The hash may be None when the tile is uploaded (the coordinator hashes it)."""
        raise NotImplementedError

    def _outcome(
        self, assignment: dict[str, Any], output_hash: str | None, tile: bytes
    ) -> dict | None:
        """The report's fields for a computed tile (the truth, unless a backend lies);
        None keeps the result unreported."""
        return {"hash": output_hash, "tile": tile}

    async def _identify(self) -> None:
        """Get a token: register as a new host."""
        self.host_id = await self._call(
            "register",
            lambda: self.client.register(
                self.name,
                gflops=self.gflops,
                threads=self.threads,
                max_memory_mb=work_budget_mb(self.budget, self.threads),
                invite=self.invite,
            ),
        )

    def _paused(self) -> float:
        """Seconds to wait before the next cycle (0: work now)."""
        return 0.0

    def _heard(self, reply: dict[str, Any], wait: bool) -> None:
        """A work request was answered (after long-polling, if `wait`)."""

    def _failed(self, endpoint: str, exc: BaseException) -> None:
        self.stats.errors += 1

    # ---- the work cycle ------------------------------------------------------------------------

    async def _cycle(self, stop: asyncio.Event) -> None:
        pause = self._paused()
        if pause:
            if self.asking is not None:
                await self._answer()
            await self._flush()  # finished tiles are not held back by a pause
            await self._say_paused()
            self._resting()
            await wait(stop, pause)
            return
        resumed, self.paused_said_until = self.paused_said_until > 0, 0.0
        reply = None
        if self.asking is not None and (not self.queue or self.asking.done()):
            reply = await self._answer()
        room = self._capacity()
        # With nothing queued it always asks, for no work if it has no room: a heartbeat
        # that lists what it holds (and is where aborts come back), never a spin. Back from
        # a pause it asks first too: other hosts may have computed its queued tiles meanwhile
        # (the coordinator spares a paused host's work), and the answer drops those.
        if reply is None and (not self.queue or (resumed and self.asking is None)):
            reply = await self._ask(room)
        elif (
            reply is None and self.asking is None and time_to_ask(len(self.queue), room, self.short)
        ):
            if self._outlasts_round_trips([job.assignment for job in self.queue]):
                # The queue outlasts the answer: ask while it computes, not before.
                self.asking = asyncio.ensure_future(self._ask(room))
            else:
                reply = await self._ask(room)
        if self.queue:
            if self.state != "working":
                self.note = ""  # what it waited for (the network, work) is over
            self.state = "working"
            self.backoff.reset()
            self.idle.reset()
            await self._compute_next()
            if self.asking is not None and self.asking.done():
                # Answered while the tile computed, its assignments already queued: taken
                # now, so that the tile just finished is reported at once below rather than
                # waiting in `pending` for the next ask, a whole tile later.
                await self._answer()
            if self.asking is not None:
                if not self.queue and self.pending:
                    # The coordinator may be waiting for this tile before it has more
                    # work: the ask in flight would wait for what this report brings.
                    await self._flush()
            # With the queue empty the next cycle asks for work at once, and the reports
            # ride on that request.
            elif self.queue and self.pending:
                if self._outlasts_round_trips([job.assignment for job in self.queue]):
                    # Sent while the queue computes, with an ask for more riding on it: it
                    # costs the kernel nothing, and the coordinator may be waiting for this
                    # very tile before its training loop can go on.
                    self.asking = asyncio.ensure_future(self._ask(self._capacity()))
                elif report_due(self.pending, len(self.queue), self._report_bytes()):
                    await self._flush()
        elif reply is not None and not reply["assignments"]:
            if self.pending or self.asked_busy:
                # No work *then*, to an ask sent while tiles were still queued: the
                # coordinator may be waiting for those very tiles before it has more. Ask
                # again now, with the reports riding and waiting for work, not after a rest.
                return
            self.state = "idle"
            delay = self.idle.next_delay(at_least=float(reply.get("delay", 0.0)))
            self.note = f"no work; next ask in {delay:.1f}s"
            self._resting()
            await wait(stop, delay)

    def _report_bytes(self) -> int:
        """Tile bytes per report at this host's measured uplink (policy.report_bytes)."""
        return report_bytes(self.upload_rate)

    def _measured_upload(self, size: int, seconds: float) -> None:
        """A report of `size` bytes took `seconds`, the coordinator's answer included:
        the uplink's rate, smoothed."""
        rate = size / max(seconds, 1e-6)
        self.upload_rate = rate if self.upload_rate is None else (self.upload_rate + rate) / 2

    def _capacity(self) -> int:
        """How many more tiles to ask for."""
        return capacity(len(self.queue), self.gflops, self.tile_flops, self.max_capacity)

    async def _say_paused(self) -> None:
        """Paused, say so now and then, asking for nothing: the coordinator then says that
        work waits for volunteers whose owners use their machines, rather than taking this
        one for gone."""
        now = time.monotonic()
        if now < self.paused_said_until:
            return
        reply = await self._ask(0, paused=True)
        delay = max(float(reply.get("delay", 0.0)), PAUSED_HEARTBEAT)
        self.paused_said_until = now + min(delay, PAUSED_HEARTBEAT_MAX)

    async def _ask(self, room: int, paused: bool = False) -> dict[str, Any]:
        wait_for_work = self.long_poll and not self.queue and not paused
        self.asked_busy = bool(self.queue)
        request_id = f"{self._session_id}-{next(self._requests)}"
        # Reports beyond one batch go first; the last batch carries the request, and the
        # answer to it comes back with the report's: one round trip per product, not two.
        while len(report_batch(self.pending, self._report_bytes())) < len(self.pending):
            await self._flush()
        riding = {r["result_id"] for r in self.pending}  # reported by the same request
        message = {
            "capacity": room,
            "cached": self.cache.ids()[:MAX_CACHED_IDS],
            "in_progress": [r for r in self._in_progress() if r not in riding],
            "gflops": self.gflops,
            "max_memory_mb": work_budget_mb(self.budget, self.threads),
            "wait": wait_for_work,
        }
        if paused:
            message["paused"] = True
        if (round_trip := self.round_trip()) is not None:
            # A host far away gets the training loop's next products together, not one
            # round trip each (coordinator/rules/scheduler.py, waits_for_the_loop).
            message["round_trip"] = round_trip
        reply = None
        if self.pending:
            answer = await self._flush({"request_id": request_id, **message})
            reply = None if answer is None else answer.get("work")
        if not isinstance(reply, dict):  # nothing to report, or refused with its report
            message["in_progress"] = self._in_progress()
            reply = await self._timed(
                self._call("work", lambda: self.client.request_work(request_id, **message))
            )
        self._heard(reply, wait_for_work)
        if reply.get("finished"):
            raise ProjectFinished(reply.get("note") or "no more work will come")
        self.short = len(reply["assignments"]) < room
        self._keep_inline(reply.get("blobs") or {})
        self._take(reply)
        return reply

    async def _answer(self) -> dict[str, Any]:
        """The answer to the work request in flight, taken into the queue."""
        asking, self.asking = self.asking, None
        return await asking

    def _ask_ahead(self, assignment: dict[str, Any]) -> None:
        """Before computing the last queued tile: ask for the next work now if it can
        arrive before this tile is done."""
        if self.queue or self.asking is not None or self.leaving:
            return
        if self._outlasts_round_trips([assignment]):
            self.asking = asyncio.ensure_future(self._ask(self._capacity()))

    def _outlasts_round_trips(self, assignments: list[dict[str, Any]]) -> bool:
        """These tiles take longer to compute than an answer takes to come (policy.ask_ahead)."""
        return ask_ahead(self.expected_seconds(assignments) or 0.0, self.round_trip())

    def expected_seconds(self, assignments: list[dict[str, Any]]) -> float | None:
        """Seconds these tiles should take at this host's speed (None: not yet known)."""
        flops = sum(2.0 * a["m"] * a["n"] * a["k"] for a in assignments)
        rate = self.flops_per_second or self.gflops * 1e9
        return flops / rate if rate else None

    def round_trip(self) -> float | None:
        """Seconds a call takes at the least, lately: a long poll that waited is never
        the least, so the minimum is the network and the coordinator's answer alone."""
        return min(self.round_trips) if self.round_trips else None

    async def _timed(self, call: Awaitable[Any]) -> Any:
        started = time.monotonic()
        reply = await call
        self.round_trips.append(time.monotonic() - started)
        return reply

    def _keep_inline(self, blobs: dict[str, bytes | memoryview]) -> None:
        """Operand panels sent inside the answer: checked against their names like any
        download, then cached, so the assignments that use them fetch nothing. Each is
        cached as it came when it is memory of its own (client.read_framed reads every
        binary of a framed answer apart) and copied when it is a view of a larger body
        (a framed answer of no announced length), so that the cache holds what it counts."""
        for blob_id, data in blobs.items():
            if not isinstance(data, bytes | memoryview):
                continue
            if self.cache.get(blob_id, count=False) is not None:
                continue
            try:
                kernels.verify_blob(data, blob_id)
            except ValueError as exc:
                self._failed("blob", exc)
                self.log.error("ignoring an inline operand %s: %s", blob_id[:16], exc)
                continue
            self.stats.bytes_down += len(data)
            if isinstance(data, memoryview) and memoryview(data.obj).nbytes > data.nbytes:
                data = bytes(data)
            self.cache.put(blob_id, data)

    def _in_progress(self) -> list[str]:
        ids = [job.assignment["result_id"] for job in self.queue]
        ids += [result_id for result_id in (self.fetching, self.computing) if result_id]
        return ids + [r["result_id"] for r in (*self.sending, *self.pending)]

    def _take(self, reply: dict[str, Any]) -> None:
        for result_id in reply.get("abort", []):
            self._abort(result_id)
        now = time.monotonic()
        known = {job.assignment["result_id"] for job in self.queue}
        known |= {self.fetching, self.computing}
        for assignment in reply.get("assignments", []):
            if assignment["result_id"] in known:
                continue
            self.stats.assigned += 1
            refusal = memory_refusal(assignment, self.threads, self.budget, self.limit_name)
            if refusal:
                self.stats.refused += 1
                self.log.warning("refusing %s: %s", assignment["result_id"], refusal)
                self.note = refusal
                self.pending.append({"result_id": assignment["result_id"], "error": refusal})
                continue
            self.tile_flops = 2.0 * assignment["m"] * assignment["n"] * assignment["k"]
            self.queue.append(Job(assignment, now + float(assignment["deadline_in"])))
        self._prefetch()
        self._drop_stale(reply.get("forget"))  # after the queue took this answer's tiles

    def _prefetch(self) -> None:
        """Start fetching the operands of queued tiles, in queue order, while they fit the
        cache beside those already pinned there. An operand of unknown size waits for its
        tile's turn, when the work half of the budget counts it (policy.memory_refusal).
        The tiles fetching form the queue's head, so a queue whose last tile is fetching
        has nothing to start, and is not walked. (A turn cancelled mid-download puts its
        tile back unfetched ahead of fetching ones: it fetches when its turn comes again.)"""
        if not self.queue or self.queue[-1].operands is not None:
            return
        for job in self.queue:
            if job.operands is not None:
                continue
            assignment = job.assignment
            sizes = {assignment["a"]: assignment["a_bytes"], assignment["b"]: assignment["b_bytes"]}
            if 0 in sizes.values() or not self.cache.pin(sizes):
                return
            job.pinned = tuple(sizes)
            job.operands = asyncio.create_task(self._operands(assignment))

    def _unpin(self, job: Job) -> None:
        """A job leaves the queue: its operands no longer count against the cache."""
        if job.pinned:
            self.cache.unpin(job.pinned)
            job.pinned = ()

    def _drop_stale(self, panels: Any) -> None:
        """Drop the cached panels the coordinator says no product will use again, so that
        memory and every request's list of the cache hold current work. A panel that a
        queued tile still takes is kept whatever the answer says: dropping it would only
        cost that tile a download."""
        if not isinstance(panels, list):
            return
        queued = {job.assignment[side] for job in self.queue for side in ("a", "b")}
        for blob_id in panels:
            if isinstance(blob_id, str) and blob_id not in queued:
                self.cache.drop(blob_id)

    def _abort(self, result_id: str) -> None:
        for job in list(self.queue):
            if job.assignment["result_id"] == result_id:
                if job.operands is not None:
                    job.operands.cancel()
                self._unpin(job)
                self.queue.remove(job)
                self.stats.aborted += 1
                self.log.info("dropped %s: the coordinator no longer needs it", result_id)
        if result_id in (self.fetching, self.computing):
            self.aborted.add(result_id)
        self.pending = [r for r in self.pending if r["result_id"] != result_id]

    # ---- operands, compute, reports -------------------------------------------------------

    async def _operands(self, assignment: dict[str, Any]) -> list[bytes]:
        blobs = []
        for key in ("a", "b"):
            blob_id = assignment[key]
            data = self.cache.get(blob_id, count=False)
            # A panel another queued tile is already downloading costs this one nothing.
            self.cache.count(hit=data is not None or self.downloads.running(blob_id))
            if data is None:
                limit = assignment[f"{key}_bytes"] or self.budget or UNSIZED_BLOB
                data = await self.downloads.get(
                    blob_id, functools.partial(self._download, blob_id, limit)
                )
            blobs.append(data)
        return blobs

    async def _download(self, blob_id: str, limit: int) -> Buffer:
        data = await self._fetch(blob_id, limit)
        self.stats.bytes_down += len(data)
        self.cache.put(blob_id, data)
        return data

    async def _make_room(self) -> None:
        """Deliver reports before computing the next tile while their tiles and it would
        overflow the work half of the budget (policy.room_to_compute). The batch riding
        on a work request in flight is not waited for: that answer may be a long poll.
        It is one batch, and the three shares of a tile (policy.tile_memory) that sized
        the work leave room for it."""
        while (
            self.queue
            and self.pending
            and not room_to_compute(
                self.queue[0].assignment, self.threads, self.budget, [*self.sending, *self.pending]
            )
        ):
            await self._flush()

    async def _operands_in_hand(self, job: Job) -> list[Buffer] | None:
        """The operands of the tile whose turn has come; None when it is not to be computed
        (aborted meanwhile, its product done, or its operands refused: reported as such).
        It is listed in progress while they arrive, and its pins keep them in the cache
        until they are in hand; from then on the work half of the budget counts them."""
        result_id = job.assignment["result_id"]
        if job.operands is None:
            job.operands = asyncio.create_task(self._operands(job.assignment))
        self.fetching = result_id
        cancelled = False
        try:
            operands = await job.operands
        except asyncio.CancelledError:
            cancelled = True
            if result_id in self.aborted:
                self.aborted.discard(result_id)
            else:
                # The session is ending: given back with the queue (or, should the loop go
                # on, fetched again at its turn).
                if job.operands.cancelled():
                    job.operands = None
                self.queue.appendleft(job)
            raise
        except Stopping:
            # Its download was cut off by a stop: given back with the queue as the session
            # ends (fetched again at its turn, should it go on).
            self.queue.appendleft(replace(job, operands=None, pinned=()))
            raise
        except Exception as exc:
            if result_id in self.aborted:  # nothing to report, retry or keep
                self.aborted.discard(result_id)
                return None
            mangled = isinstance(exc, kernels.BlobMismatchError) or (
                isinstance(exc, ServerRefused) and exc.code == NOT_TILEHIVE
            )
            if mangled and job.corrupt + 1 < CORRUPT_FETCHES:
                # Bytes mangled on the way (a proxy's page, a broken link) say nothing of
                # this host: fetched again after the session's backoff. Its pins are let
                # go below, by this job; the copy holds none.
                self.queue.appendleft(
                    replace(job, operands=None, pinned=(), corrupt=job.corrupt + 1)
                )
                raise
            if isinstance(exc, kernels.BlobMismatchError):
                self._failed("blob", exc)
                self.log.error("refusing %s: operand blob is corrupt: %s", result_id, exc)
                self.pending.append({"result_id": result_id, "error": f"corrupt blob: {exc}"})
                return None
            if isinstance(exc, ServerRefused) and exc.status == 410:
                # Its product is done: the coordinator needs no report of it.
                self.stats.aborted += 1
                self.log.info("dropped %s: %s", result_id, exc.message)
                return None
            if isinstance(exc, ServerRefused) and (
                mangled or not (exc.retriable or exc.status == 401)
            ):
                self._failed("blob", exc)
                self.log.error("cannot fetch operands of %s: %s", result_id, exc)
                self.pending.append({"result_id": result_id, "error": f"fetch failed: {exc}"})
                return None
            if isinstance(exc, (ServerRefused, *NETWORK)):
                self._retry(job)
            raise
        finally:
            self.fetching = None
            self._unpin(job)
            if not cancelled:
                self._prefetch()
        if result_id in self.aborted:
            self.aborted.discard(result_id)
            return None
        return operands

    async def _compute_next(self) -> None:
        await self._make_room()
        if not self.queue:  # the answer to an ask in flight aborted what was queued
            return
        job = self.queue.popleft()
        operands = await self._operands_in_hand(job)
        if operands is None:
            return
        a, b = operands
        assignment = job.assignment
        result_id = assignment["result_id"]
        if time.monotonic() > job.deadline:
            self.stats.skipped += 1
            self.log.info("skipped %s: its deadline passed before we got to it", result_id)
            return
        self.computing = result_id  # left set if cancelled: leave() gives it back
        self._ask_ahead(assignment)
        try:
            output_hash, tile, seconds = await self._kernel(assignment, a, b)
        except ValueError as exc:
            self.computing = None
            self.pending.append({"result_id": result_id, "error": f"bad operands: {exc}"})
            return
        self.computing = None
        if result_id in self.aborted:
            self.aborted.discard(result_id)
            return
        flops = 2.0 * assignment["m"] * assignment["n"] * assignment["k"]
        self.stats.tiles += 1
        self.stats.flops += flops
        self.stats.compute_seconds += seconds
        if seconds > 0:
            rate = flops / seconds
            self.flops_per_second = (
                rate if not self.flops_per_second else (0.75 * self.flops_per_second + 0.25 * rate)
            )
        report = self.report_of(assignment, output_hash, tile, seconds)
        if report is not None:
            self.pending.append(report)

    def _retry(self, job: Job) -> None:
        """Busy or cut off, not wrong: keep the assignment at the queue's head and fetch its
        operands again at once; it is computed after the session's backoff."""
        retry = asyncio.create_task(self._operands(job.assignment))
        self.queue.appendleft(Job(job.assignment, job.deadline, retry))  # next: not pinned

    def report_of(
        self, assignment: dict[str, Any], output_hash: str | None, tile: bytes, seconds: float
    ) -> dict[str, Any] | None:
        """The report on a computed tile, as `_outcome` would have it (None: no report)."""
        fields = self._outcome(assignment, output_hash, tile)
        if fields is None:
            return None
        report: dict[str, Any] = {"result_id": assignment["result_id"]}
        if "error" in fields:
            report["error"] = fields["error"]
            return report
        report["seconds"] = seconds
        if fields["hash"] is not None:
            report["hash"] = fields["hash"]
        if assignment["upload"] == "tile":
            report["tile"] = fields["tile"]
        return report

    async def _flush(self, work: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Send one batch of reports, with a work request (`work`) if given; returns the
        reply, or None if the coordinator refused the batch for good."""
        if not self.pending:
            return None
        batch = report_batch(self.pending, self._report_bytes())
        size = sum(len(r.get("tile", b"")) + 64 for r in batch)
        # Out of `pending` while on the way (still listed as in progress), so a report sent
        # beside a work request in flight does not send them twice.
        del self.pending[: len(batch)]
        self.sending += batch
        reply = None
        started = time.monotonic()
        try:
            reply = await self._timed(
                self._call("report", lambda: self.client.report(batch, work), up=size)
            )
            if size >= UPLOAD_SAMPLE_BYTES and not (work and work.get("wait")):
                # (An answer that waited for work would make the uplink look slow.)
                self._measured_upload(size, time.monotonic() - started)
        except ServerRefused as exc:
            # A 404 for the path itself is no word on these results: a proxy's passing
            # mistake once the coordinator has answered here (the session retries it) or no
            # coordinator at this path (the session ends, and they go as unreported).
            if exc.retriable or exc.status == 401 or no_route(exc):
                self.pending[:0] = batch  # sent again after the backoff (or registering)
                raise
            # Any other 4xx names a report the coordinator will never take: never resend it.
            if exc.status == 404:
                # Work it no longer knows: sent before it restarted, or of a step it has
                # let go since. Nothing is wrong with this host or its tiles.
                self.log.warning(
                    "the coordinator no longer knows %d result(s) we computed (it restarted, "
                    "or their step is over): dropped (%s)",
                    len(batch),
                    exc.message,
                )
            else:
                self.log.error("the coordinator refused %d report(s): %s", len(batch), exc.message)
            self._failed("report", exc)
        except BaseException:
            self.pending[:0] = batch  # cut off or cancelled: sent again
            raise
        else:
            accepted = set(reply.get("accepted", []))
            self.stats.reported += sum(
                1
                for r in batch
                if r["result_id"] in accepted and "error" not in r and "abandoned" not in r
            )
            self.stats.late += len(reply.get("late", []))
            self.stats.duplicate += len(reply.get("duplicate", []))
        finally:
            sent = {id(r) for r in batch}
            self.sending = [r for r in self.sending if id(r) not in sent]
        self.stats.bytes_up += size
        return reply

    # ---- the end of a session ---------------------------------------------------------------

    async def leave(self, graceful: bool, timeout: float) -> None:
        """End a session: report what is done and give back the rest, so the coordinator
        reissues it now, within `timeout`; or (not `graceful`) just vanish."""
        self.leaving = True
        if self.asking is not None:
            await self._settle_ask(graceful, timeout)
        if self.computing:  # cancelled mid-tile: given back with the queue
            self.queue.appendleft(Job({"result_id": self.computing}, 0.0, _done()))
            self.computing = None
        self.cancel()
        if graceful:
            self.stats.abandoned += len(self.queue)
            self.pending += [
                {"result_id": job.assignment["result_id"], "abandoned": True} for job in self.queue
            ]
            self.queue.clear()
            try:
                async with asyncio.timeout(max(1.0, timeout)):
                    while self.pending:
                        await self._flush()
                    await self._say_goodbye()
            except (ServerRefused, *TRANSIENT) as exc:
                self._failed("report", exc)
                if self.pending:
                    self.log.warning(
                        "leaving with %d result(s) the coordinator did not hear of in %.0fs "
                        "(%s): it gives them to other hosts at their deadlines, or sooner if "
                        "others are idle",
                        len(self.pending),
                        max(1.0, timeout),
                        type(exc).__name__,
                    )
                else:  # all was said but the goodbye: "0 result(s)" read as a loss
                    self.log.info(
                        "leaving without a goodbye (%s): the coordinator counts this host "
                        "gone once it has not heard from it for a while",
                        type(exc).__name__,
                    )
        self.stats.vanished += len(self.queue) + len(self.pending)
        self.queue.clear()
        self.pending.clear()

    async def _say_goodbye(self) -> None:
        """Tell the coordinator this host stops, holding nothing: it then waits for other
        volunteers at once, rather than for this one until its silence is long enough."""
        if self.client.token is None or self.state in ("refused", "finished"):
            return
        request_id = f"{self._session_id}-{next(self._requests)}"
        await self.client.request_work(request_id, capacity=0, wait=False, leaving=True)

    def cancel(self) -> None:
        """Stop the downloads of queued work and the work request in flight (a loop
        dropped without leaving)."""
        for job in self.queue:
            if job.operands is not None:
                job.operands.cancel()
                if job.operands.done() and not job.operands.cancelled():
                    job.operands.exception()  # retrieved: a download a stop cut off
            self._unpin(job)
        if self.asking is not None:
            self.asking.cancel()

    async def _settle_ask(self, graceful: bool, timeout: float) -> None:
        """The work request in flight at the end of a session: leaving gracefully, its
        answer is awaited, so what it assigns is given back with the rest of the queue;
        otherwise it is dropped (the coordinator reissues what it assigned at its
        deadline, as for a host that vanished)."""
        asking, self.asking = self.asking, None
        if not graceful:
            asking.cancel()
        try:
            async with asyncio.timeout(max(1.0, timeout) if graceful else None):
                await asking
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise  # leave() itself is being cancelled, not just the request
        except (ProjectFinished, Stopping):
            pass  # nothing more was assigned, or nothing this host will ever know of
        except Exception as exc:  # failed on the way: nothing to give back
            if graceful:
                self._failed("work", exc)


def _done() -> asyncio.Future:
    """A finished future: the operands of a job that will only be given back."""
    future = asyncio.get_running_loop().create_future()
    future.set_result(None)
    return future
