"""The device emulator: many volunteers in one process, each speaking the real protocol.

Every emulated host registers, asks for work, fetches and verifies operands, and reports
tiles over real HTTP through one shared connection pool. What a host's hardware and network
would take (compute time, transfer time, round trips, sessions) is modelled with asyncio
sleeps drawn from its profile; what goes over the wire is real. docs/emulator.md says which
is which.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import itertools
import logging
import math
import random
import resource
import secrets
import time
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import numpy as np

import kernels
from volunteer.backoff import Backoff
from volunteer.cache import BlobCache, Downloads
from volunteer.client import CoordinatorClient, ServerRefused, compute_tile
from volunteer.daemon import MAX_CAPACITY, report_batch, report_due, time_to_ask
from volunteer.profile import HostTraits, Profile
from volunteer.profile import load as load_profile

log = logging.getLogger(__name__)

MB = 1 << 20
MAX_CACHED_IDS = 4096  # the protocol's limit on `cached`
DEFAULT_REAL_FLOPS = 64e6  # tiles up to this many flops are computed by each host itself
SHARED_BLOB_BYTES = 256 * MB  # operand bytes kept for all hosts together
SHARED_TILE_BYTES = 256 * MB  # modelled tiles kept for their replicas
LIES = ("big", "one_ulp", "zero", "nan")  # well-formed wrong tiles: only a validator sees them

# The connector queue time of the current host's request (see _trace_config).
_queued: contextvars.ContextVar[list[float]] = contextvars.ContextVar("queued")


class CoordinatorUnreachable(RuntimeError):
    """The coordinator did not answer GET /v1/status before the emulation started."""


# ---- what the emulation reports ------------------------------------------------------------


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1)]


@dataclass
class Latencies:
    """Client-side request latencies by endpoint, in seconds, as seen after the connection
    pool handed the request a connection (the pool's own queue is measured as `queued`)."""

    samples: dict[str, array] = field(default_factory=dict)

    def add(self, endpoint: str, seconds: float) -> None:
        self.samples.setdefault(endpoint, array("d")).append(seconds)

    def summary(self) -> dict[str, dict[str, float]]:
        out = {}
        for endpoint, values in sorted(self.samples.items()):
            ordered = sorted(values)
            out[endpoint] = {
                "count": len(ordered),
                "p50_ms": round(1000 * _percentile(ordered, 0.50), 2),
                "p99_ms": round(1000 * _percentile(ordered, 0.99), 2),
                "max_ms": round(1000 * ordered[-1], 2),
            }
        return out


@dataclass
class EmulationReport:
    """What happened: counts, errors by kind, and latencies. `errors` holds everything that
    went wrong on the wire; a quarantine earned by the emulation's own lies is not an error
    but is counted in `quarantined_liars`."""

    url: str
    profile: str
    hosts: int
    seconds: float
    online: int = 0  # hosts in a session when the report was made
    registered: int = 0  # registrations, replacements of churned hosts included
    sessions: int = 0
    churned: int = 0  # hosts that left for good (and were replaced by new ones)
    requests: dict[str, int] = field(default_factory=dict)
    assigned: int = 0  # assignments received (work units handed to emulated hosts)
    reported: int = 0  # tiles reported and accepted (lies included)
    late: int = 0
    duplicate: int = 0
    client_errors: int = 0  # results reported as errors (the profile's error_rate)
    lies: int = 0  # results reported with a wrong tile (the profile's lie_rate)
    abandoned: int = 0  # results given back ("volunteer stopped") at a graceful session end
    vanished: int = 0  # results dropped silently at an abrupt session end: they time out
    aborted: int = 0  # results the coordinator told a host to drop
    skipped: int = 0  # results whose deadline passed before the host got to them
    tiles_real: int = 0  # tiles computed by the host itself
    tiles_modelled: int = 0  # tiles computed once per work unit for all its replicas
    compute_overrun_s: float = 0.0  # real compute beyond the modelled time (emulator CPU-bound)
    bytes_down: int = 0
    bytes_up: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    error_examples: dict[str, str] = field(default_factory=dict)
    quarantined_liars: int = 0
    latency: dict[str, dict[str, float]] = field(default_factory=dict)
    queued: dict[str, float] = field(default_factory=dict)  # waits for a pooled connection

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def wu_per_second(self) -> float:
        return self.reported / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "error_count": self.error_count,
            "wu_per_second": round(self.wu_per_second, 2),
        }

    def lines(self) -> list[str]:
        """The summary for people, one fact a line."""
        work = self.latency.get("work", {})
        poll = self.latency.get("work_poll", {})
        empty = self.latency.get("work_empty", {})
        out = [
            f"{self.hosts} hosts ({self.profile}) for {self.seconds:.1f}s against {self.url}: "
            f"{self.registered} registered, {self.online} online at the end, "
            f"{self.sessions} sessions, {self.churned} churned",
            "requests: " + ", ".join(f"{k} {v}" for k, v in sorted(self.requests.items())),
            f"work units: {self.assigned} received, {self.reported} reported "
            f"({self.wu_per_second:.1f}/s; {self.late} late, {self.duplicate} duplicate), "
            f"{self.client_errors} client errors, {self.lies} lies, "
            f"{self.abandoned} abandoned, {self.vanished} vanished, {self.aborted} aborted, "
            f"{self.skipped} skipped",
            f"tiles: {self.tiles_real} computed per host, {self.tiles_modelled} modelled; "
            f"compute overrun {self.compute_overrun_s:.1f}s; "
            f"{self.bytes_down / MB:.1f} MB down, {self.bytes_up / MB:.1f} MB up",
        ]
        waits = []
        if work:
            waits.append(
                f"p50 {work['p50_ms']:.1f} ms, p99 {work['p99_ms']:.1f} ms over "
                f"{work['count']} requests that did not wait"
            )
        if poll:
            waits.append(
                f"long polls answered with work p50 {poll['p50_ms']:.0f} ms, "
                f"p99 {poll['p99_ms']:.0f} ms ({poll['count']})"
            )
        if empty:
            waits.append(f"empty long polls p50 {empty['p50_ms']:.0f} ms ({empty['count']})")
        out.append("work-request latency: " + ("; ".join(waits) or "no requests"))
        for endpoint, s in self.latency.items():
            if not endpoint.startswith("work"):
                out.append(
                    f"  {endpoint}: p50 {s['p50_ms']:.1f} ms, p99 {s['p99_ms']:.1f} ms "
                    f"({s['count']})"
                )
        if self.queued.get("count"):
            out.append(
                f"  connection pool waits: {self.queued['count']}, "
                f"p99 {self.queued['p99_ms']:.1f} ms (raise --connections to avoid them)"
            )
        if self.errors:
            out.append(
                f"errors: {self.error_count}: "
                + ", ".join(f"{k} x{v}" for k, v in sorted(self.errors.items()))
            )
            for kind, example in sorted(self.error_examples.items()):
                out.append(f"  {kind}, e.g.: {example}")
        else:
            out.append("errors: none")
        if self.quarantined_liars:
            out.append(f"lying hosts quarantined by the coordinator: {self.quarantined_liars}")
        return out


@dataclass
class Totals:
    """The emulation's running counters, shared by every host."""

    counts: Counter = field(default_factory=Counter)
    requests: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)  # the first message of each kind
    latencies: Latencies = field(default_factory=Latencies)
    queued: array = field(default_factory=lambda: array("d"))
    overrun: float = 0.0
    online: int = 0


# ---- one emulated host ---------------------------------------------------------------------


@dataclass
class Job:
    assignment: dict[str, Any]
    deadline: float
    operands: asyncio.Task


class Quarantined(Exception):
    """The coordinator refuses this host (403): it stops, as a real volunteer does."""


class EmulatedHost:
    """One volunteer: the daemon's pull loop (volunteer/daemon.py) with modelled hardware."""

    def __init__(self, emulation: Emulation, name: str, traits: HostTraits) -> None:
        self.em = emulation
        self.name = name
        self.traits = traits
        self.rng = random.Random(emulation.rng.random())
        self.client = CoordinatorClient(emulation.url, session=emulation.session)
        self.requests = itertools.count()
        self.short = False  # the last work request brought fewer tiles than it asked for
        self.downloads = Downloads()
        self.session_id = secrets.token_hex(4)
        self.backoff = Backoff(cap=60.0, rng=self.rng)
        self.idle = Backoff(base=0.25, cap=10.0, rng=self.rng)
        budget = traits.max_memory_mb * MB // 2 if traits.max_memory_mb else 256 * MB
        self.cache_budget = max(budget, 1)
        self.cached: OrderedDict[str, int] = OrderedDict()  # operand ids the host holds
        self.cached_bytes = 0
        self.queue: deque[Job] = deque()
        self.pending: list[dict[str, Any]] = []
        self.computing: str | None = None
        self.aborted: set[str] = set()
        self.tile_flops = 0.0
        self.lied = False

    # ---- requests, with the modelled network around the real call ----------------------

    async def _call(self, endpoint: str, make, *, up: int = 0) -> tuple[Any, float]:
        """The real request `make()` after the modelled round trip and upload time; returns
        its reply and its latency (recorded here, except a work request's: see _cycle)."""
        t = self.traits
        await asyncio.sleep(t.latency_ms / 1000 + up * 8 / (t.upload_mbps * 1e6))
        totals = self.em.totals
        totals.requests[endpoint] += 1
        clock = [0.0, 0.0]
        _queued.set(clock)  # this task's context only: see _trace_config
        started = time.perf_counter()
        reply = None
        try:
            reply = await make()
        except Exception as exc:
            exc.endpoint = endpoint  # for _error: the call that failed, wherever it surfaces
            raise
        finally:
            seconds = time.perf_counter() - started - clock[0]
            if clock[0]:
                totals.queued.append(clock[0])
            if endpoint != "work" or reply is None:
                totals.latencies.add(endpoint, seconds)
        return reply, seconds

    def _error(self, endpoint: str, exc: BaseException) -> None:
        endpoint = getattr(exc, "endpoint", endpoint)
        if isinstance(exc, ServerRefused):
            kind = f"{endpoint} {exc.status} {exc.code}"
        else:
            kind = f"{endpoint} {type(exc).__name__}"
        self.em.totals.errors[kind] += 1
        self.em.totals.examples.setdefault(kind, str(exc)[:200])

    async def register(self) -> None:
        t = self.traits
        await self._call(
            "register",
            lambda: self.client.register(
                self.name,
                gflops=t.gflops,
                threads=t.threads,
                max_memory_mb=t.max_memory_mb,
                invite=self.em.invite,
            ),
        )
        self.em.totals.counts["registered"] += 1

    # ---- a session ------------------------------------------------------------------------

    async def session(self, until: float, stop: asyncio.Event) -> None:
        """Work until the monotonic time `until` or `stop`. Raises Quarantined."""
        self.em.totals.counts["sessions"] += 1
        while not stop.is_set() and time.monotonic() < until:
            endpoint = "register"
            try:
                if self.client.token is None:
                    await self.register()
                endpoint = "work"
                await self._cycle(stop)
            except ServerRefused as exc:
                await self._refused(endpoint, exc, stop)
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                self._error(endpoint, exc)
                await _wait(stop, self.backoff.next_delay())

    async def _refused(self, endpoint: str, exc: ServerRefused, stop: asyncio.Event) -> None:
        endpoint = getattr(exc, "endpoint", endpoint)
        if exc.status == 403 and endpoint == "work" and self.lied:
            self.em.totals.counts["quarantined_liars"] += 1
            raise Quarantined(exc.message)
        self._error(endpoint, exc)
        if exc.status == 401:
            self.client.token = None  # the coordinator forgot us: register again
            return
        if exc.status == 403:
            log.warning("%s refused: %s", self.name, exc.message)
            raise Quarantined(exc.message)
        await _wait(stop, self.backoff.next_delay(at_least=exc.retry_after))

    async def _cycle(self, stop: asyncio.Event) -> None:
        capacity = self._capacity()
        reply = None
        if time_to_ask(len(self.queue), capacity, self.short) or (self.pending and not self.queue):
            await self._flush()
            wait = self.em.long_poll and not self.queue
            message = {
                "capacity": capacity,
                "cached": list(reversed(self.cached))[:MAX_CACHED_IDS],
                "in_progress": self._in_progress(),
                "gflops": self.traits.gflops,
                "wait": wait,
            }
            request_id = f"{self.session_id}-{next(self.requests)}"
            reply, seconds = await self._call(
                "work", lambda: self.client.request_work(request_id, **message)
            )
            if not wait:
                self.em.totals.latencies.add("work", seconds)
            else:
                held = "work_poll" if reply["assignments"] else "work_empty"
                self.em.totals.latencies.add(held, seconds)
            self.short = len(reply["assignments"]) < capacity
            self._take(reply)
        if self.queue:
            self.backoff.reset()
            self.idle.reset()
            await self._compute_next()
            if report_due(self.pending, len(self.queue)):
                await self._flush()
        elif reply is not None and not reply["assignments"]:
            await _wait(stop, self.idle.next_delay(at_least=float(reply.get("delay", 0.0))))

    def _capacity(self) -> int:
        if self.tile_flops:
            wanted = int(2.0 * self.traits.gflops * 1e9 / self.tile_flops) + 1
        else:
            wanted = 2
        return max(0, min(MAX_CAPACITY, wanted) - len(self.queue))

    def _in_progress(self) -> list[str]:
        ids = [job.assignment["result_id"] for job in self.queue]
        if self.computing:
            ids.append(self.computing)
        return ids + [r["result_id"] for r in self.pending]

    def _take(self, reply: dict[str, Any]) -> None:
        for result_id in reply.get("abort", []):
            self._abort(result_id)
        now = time.monotonic()
        known = {job.assignment["result_id"] for job in self.queue} | {self.computing}
        for assignment in reply.get("assignments", []):
            if assignment["result_id"] in known:
                continue
            self.em.totals.counts["assigned"] += 1
            self.tile_flops = 2.0 * assignment["m"] * assignment["n"] * assignment["k"]
            operands = asyncio.create_task(self._operands(assignment))
            self.queue.append(Job(assignment, now + float(assignment["deadline_in"]), operands))

    def _abort(self, result_id: str) -> None:
        for job in list(self.queue):
            if job.assignment["result_id"] == result_id:
                job.operands.cancel()
                self.queue.remove(job)
                self.em.totals.counts["aborted"] += 1
        if self.computing == result_id:
            self.aborted.add(result_id)
        self.pending = [r for r in self.pending if r["result_id"] != result_id]

    # ---- operands, compute, reports -----------------------------------------------------

    async def _operands(self, assignment: dict[str, Any]) -> list[bytes]:
        blobs = []
        for key in ("a", "b"):
            blob_id = assignment[key]
            held = blob_id in self.cached
            data = self.em.blobs.get(blob_id)
            if data is None or not held:
                limit = assignment[f"{key}_bytes"] or self.em.max_blob_bytes
                data = await self.downloads.get(
                    blob_id, functools.partial(self._download, blob_id, limit, held)
                )
            else:
                self.cached.move_to_end(blob_id)
            blobs.append(data)
        return blobs

    async def _download(self, blob_id: str, limit: int, held: bool) -> bytes:
        data, _ = await self._call("blob", lambda: self.client.fetch_blob(blob_id, max_bytes=limit))
        self.em.totals.counts["bytes_down"] += len(data)
        if not held:  # modelled: a blob the host holds costs no transfer time
            await asyncio.sleep(len(data) * 8 / (self.traits.download_mbps * 1e6))
        self.em.blobs.put(blob_id, data)
        self._hold(blob_id, len(data))
        return data

    def _hold(self, blob_id: str, size: int) -> None:
        if blob_id in self.cached or size > self.cache_budget:
            return
        self.cached[blob_id] = size
        self.cached_bytes += size
        while self.cached_bytes > self.cache_budget:
            _, evicted = self.cached.popitem(last=False)
            self.cached_bytes -= evicted

    async def _compute_next(self) -> None:
        job = self.queue.popleft()
        assignment = job.assignment
        result_id = assignment["result_id"]
        try:
            a, b = await job.operands
        except kernels.BlobMismatchError as exc:
            self.em.totals.errors["blob corrupt"] += 1
            self.pending.append({"result_id": result_id, "error": f"corrupt blob: {exc}"})
            return
        except ServerRefused as exc:
            if exc.retriable or exc.status == 401:
                retry = asyncio.create_task(self._operands(assignment))
                self.queue.appendleft(Job(assignment, job.deadline, retry))
                raise
            self._error("blob", exc)
            self.pending.append({"result_id": result_id, "error": f"fetch failed: {exc}"})
            return
        except (aiohttp.ClientError, TimeoutError, OSError):
            retry = asyncio.create_task(self._operands(assignment))
            self.queue.appendleft(Job(assignment, job.deadline, retry))
            raise
        if time.monotonic() > job.deadline:
            self.em.totals.counts["skipped"] += 1
            return
        self.computing = result_id
        flops = 2.0 * assignment["m"] * assignment["n"] * assignment["k"]
        modelled = flops / (self.traits.gflops * 1e9)
        started = time.monotonic()
        try:
            output_hash, tile = await self.em.compute(assignment, a, b, flops)
        except ValueError as exc:
            self.computing = None
            self.pending.append({"result_id": result_id, "error": f"bad operands: {exc}"})
            return
        elapsed = time.monotonic() - started
        if elapsed < modelled:
            await asyncio.sleep(modelled - elapsed)
        else:
            self.em.totals.overrun += elapsed - modelled
        self.computing = None
        if result_id in self.aborted:
            self.aborted.discard(result_id)
            return
        draw = self.rng.random()
        if draw < self.traits.error_rate:
            self.em.totals.counts["client_errors"] += 1
            self.pending.append({"result_id": result_id, "error": "emulated client error"})
            return
        if draw < self.traits.error_rate + self.traits.lie_rate:
            tile = falsify(tile, self.rng.choice(LIES), self.rng)
            output_hash = kernels.blob_id(tile)
            self.em.totals.counts["lies"] += 1
            self.lied = True
        report: dict[str, Any] = {
            "result_id": result_id,
            "hash": output_hash,
            "seconds": max(elapsed, modelled),
        }
        if assignment["upload"] == "tile":
            report["tile"] = tile
        self.pending.append(report)

    async def _flush(self) -> None:
        if not self.pending:
            return
        batch = report_batch(self.pending)
        size = sum(len(r.get("tile", b"")) + 64 for r in batch)
        try:
            reply, _ = await self._call("report", lambda: self.client.report(batch), up=size)
        except ServerRefused as exc:
            if exc.retriable or exc.status == 401:
                raise
            self._error("report", exc)  # refused for good: never resent, as the daemon does
        else:
            c = self.em.totals.counts
            accepted = set(reply.get("accepted", []))
            c["reported"] += sum(1 for r in batch if r["result_id"] in accepted and "hash" in r)
            c["late"] += len(reply.get("late", []))
            c["duplicate"] += len(reply.get("duplicate", []))
            c["bytes_up"] += size
        self.pending = self.pending[len(batch) :]

    async def leave(self, graceful: bool, timeout: float, *, drain: bool = False) -> None:
        """End a session: report what is done and give back the rest, or just vanish.
        `drain` (the end of the emulation) first finishes the queued work, within
        `timeout`, so that a whole crowd stopping at once does not hand back every tile
        it was just given."""
        counts = self.em.totals.counts
        deadline = time.monotonic() + timeout
        if graceful and drain:
            try:
                async with asyncio.timeout(timeout):
                    while self.queue:
                        await self._compute_next()
                    while self.pending:
                        await self._flush()
            except (ServerRefused, aiohttp.ClientError, TimeoutError, OSError) as exc:
                if not isinstance(exc, TimeoutError) or time.monotonic() < deadline:
                    self._error("report", exc)
            if self.computing:
                self.queue.appendleft(Job({"result_id": self.computing}, 0.0, _done()))
                self.computing = None
        for job in self.queue:
            job.operands.cancel()
        if graceful:
            counts["abandoned"] += len(self.queue)
            self.pending += [
                {"result_id": job.assignment["result_id"], "abandoned": True} for job in self.queue
            ]
            self.queue.clear()
            try:
                async with asyncio.timeout(max(1.0, deadline - time.monotonic())):
                    while self.pending:
                        await self._flush()
            except (ServerRefused, aiohttp.ClientError, TimeoutError, OSError) as exc:
                self._error("report", exc)
        counts["vanished"] += len(self.queue) + len(self.pending)
        self.queue.clear()
        self.pending.clear()
        self.computing = None


def _done() -> asyncio.Future:
    """A finished future: the operands of a job that will only be given back."""
    future = asyncio.get_running_loop().create_future()
    future.set_result(None)
    return future


def falsify(tile: bytes, lie: str, rng: random.Random) -> bytes:
    """A wrong tile of the right shape and dtype (tests/liar.py's well-formed lies).

    Each lie is drawn from the host's own generator: emulated liars are independent faulty
    hosts, and two of them almost never send the same wrong tile (a quorum of two would
    accept it; two one-ulp lies agree only at the same element, one chance in the tile's
    size). Colluding liars are tests/test_byzantine.py's subject, not the emulator's."""
    wrong = kernels.decode_array(tile).copy()
    where = rng.randrange(wrong.size)
    if lie == "big":
        wrong.flat[where] += np.float32(1000.0 + rng.random() * 1000.0)
    elif lie == "one_ulp":
        wrong.flat[where] = np.nextafter(wrong.flat[where], np.float32(np.inf))
    elif lie == "zero":
        # A computation that stopped part-way: the rows from a random one on are zeros.
        wrong[where // wrong.shape[1] :] = 0
        wrong.flat[where] = np.float32(1.0 + rng.random())  # and one stray value of its own
    else:
        wrong.flat[where] = np.nan
    return kernels.encode_array(wrong)


# ---- the emulation -----------------------------------------------------------------------


class Emulation:
    """N host slots sharing one connection pool, one operand store and one compute pool.

    A slot runs one host after another: when a host churns away for good, a new one
    (newly drawn traits, a new registration) takes its place after the offline time, so
    N hosts stay in play."""

    def __init__(
        self,
        url: str,
        hosts: int,
        profile: Profile,
        session: aiohttp.ClientSession,
        *,
        real_flops: float,
        compute_threads: int,
        seed: int | None,
        invite: str | None,
        name_prefix: str,
        stop_timeout: float,
        long_poll: bool,
    ) -> None:
        self.url = url.rstrip("/")
        self.long_poll = long_poll
        self.hosts = hosts
        self.profile = profile
        self.session = session
        self.real_flops = real_flops
        self.rng = random.Random(seed)
        self.invite = invite
        self.name_prefix = name_prefix
        self.stop_timeout = stop_timeout
        self.totals = Totals()
        self.blobs = BlobCache(SHARED_BLOB_BYTES)
        self.max_blob_bytes = 64 * MB
        self.pool = ThreadPoolExecutor(compute_threads, thread_name_prefix="emulate-kernel")
        self.tiles: OrderedDict[str, tuple[str, bytes]] = OrderedDict()
        self.tile_bytes = 0
        self.computing: dict[str, asyncio.Future] = {}
        self.started = time.monotonic()

    async def compute(
        self, assignment: dict[str, Any], a: bytes, b: bytes, flops: float
    ) -> tuple[str, bytes]:
        """The tile's (hash, blob), always computed by the real kernel: by this host when
        it is small, else once per work unit and shared by its replicas (bit-identical,
        as honest hosts' tiles are)."""
        loop = asyncio.get_running_loop()
        if flops <= self.real_flops:
            self.totals.counts["tiles_real"] += 1
            return await loop.run_in_executor(self.pool, compute_tile, assignment, a, b)
        self.totals.counts["tiles_modelled"] += 1
        wu = assignment["wu_id"]
        if wu in self.tiles:
            self.tiles.move_to_end(wu)
            return self.tiles[wu]
        if wu not in self.computing:
            # One computation shared by every replica; shielded, so a host that gives up
            # (its session ends) cancels only its own wait, never the others' result.
            shared = loop.run_in_executor(self.pool, compute_tile, assignment, a, b)
            self.computing[wu] = shared
            shared.add_done_callback(functools.partial(self._computed, wu))
        return await asyncio.shield(self.computing[wu])

    def _computed(self, wu: str, shared: asyncio.Future) -> None:
        del self.computing[wu]
        if shared.cancelled() or shared.exception() is not None:
            return  # the waiters get the error; nothing is kept
        done = shared.result()
        self.tiles[wu] = done
        self.tile_bytes += len(done[1])
        while self.tile_bytes > SHARED_TILE_BYTES and self.tiles:
            _, (_, old) = self.tiles.popitem(last=False)
            self.tile_bytes -= len(old)

    def new_host(self, slot: int, generation: int) -> EmulatedHost:
        traits = self.profile.draw(self.rng)
        return EmulatedHost(self, f"{self.name_prefix}-{slot}.{generation}-{traits.group}", traits)

    async def slot(self, index: int, start_after: float, stop: asyncio.Event) -> None:
        """One host after another, session after session, until `stop`."""
        if await _wait(stop, start_after):
            return
        generation = 0
        host = self.new_host(index, generation)
        try:
            while not stop.is_set():
                self.totals.online += 1
                quarantined = False
                try:
                    await host.session(time.monotonic() + host.traits.session_s, stop)
                except Quarantined:
                    quarantined = True
                finally:
                    self.totals.online -= 1
                graceful = stop.is_set() or host.rng.random() < host.traits.graceful
                await host.leave(
                    graceful and not quarantined, self.stop_timeout, drain=stop.is_set()
                )
                if stop.is_set():
                    return
                churn = quarantined or host.rng.random() < host.traits.churn
                if await _wait(stop, host.traits.offline_s):
                    return
                if churn:
                    self.totals.counts["churned"] += 1
                    generation += 1
                    host = self.new_host(index, generation)
        finally:
            for job in host.queue:
                job.operands.cancel()

    def report(self) -> EmulationReport:
        t = self.totals
        c = t.counts
        queued = sorted(t.queued)
        return EmulationReport(
            url=self.url,
            profile=self.profile.name,
            hosts=self.hosts,
            seconds=round(time.monotonic() - self.started, 3),
            online=t.online,
            registered=c["registered"],
            sessions=c["sessions"],
            churned=c["churned"],
            requests=dict(t.requests),
            assigned=c["assigned"],
            reported=c["reported"],
            late=c["late"],
            duplicate=c["duplicate"],
            client_errors=c["client_errors"],
            lies=c["lies"],
            abandoned=c["abandoned"],
            vanished=c["vanished"],
            aborted=c["aborted"],
            skipped=c["skipped"],
            tiles_real=c["tiles_real"],
            tiles_modelled=c["tiles_modelled"],
            compute_overrun_s=round(t.overrun, 3),
            bytes_down=c["bytes_down"],
            bytes_up=c["bytes_up"],
            errors=dict(t.errors),
            error_examples=dict(t.examples),
            quarantined_liars=c["quarantined_liars"],
            latency=t.latencies.summary(),
            queued={
                "count": len(queued),
                "p50_ms": round(1000 * _percentile(queued, 0.5), 2),
                "p99_ms": round(1000 * _percentile(queued, 0.99), 2),
            },
        )


def _trace_config() -> aiohttp.TraceConfig:
    """Time spent waiting for a pooled connection, charged to the host whose task waits
    (a ContextVar per slot task), so latencies measure the coordinator, not our pool."""
    trace = aiohttp.TraceConfig()

    async def queued_start(session, ctx, params) -> None:
        clock = _queued.get(None)
        if clock is not None:
            clock[1] = time.perf_counter()

    async def queued_end(session, ctx, params) -> None:
        clock = _queued.get(None)
        if clock is not None:
            clock[0] += time.perf_counter() - clock[1]

    trace.on_connection_queued_start.append(queued_start)
    trace.on_connection_queued_end.append(queued_end)
    return trace


async def _wait(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep up to `seconds`; True if `stop` was set."""
    if seconds <= 0:
        return stop.is_set()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    return stop.is_set()


async def _coordinator_status(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url.rstrip("/") + "/v1/status") as resp:
        if resp.status != 200:
            raise CoordinatorUnreachable(f"{url}/v1/status answered {resp.status}")
        return await resp.json()


async def _watch_done(
    session: aiohttp.ClientSession, url: str, stop: asyncio.Event, every: float = 1.0
) -> None:
    """Set `stop` once the coordinator says its training is done."""
    while not stop.is_set():
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError, OSError):
            status = await _coordinator_status(session, url)
            if (status.get("training") or {}).get("done"):
                stop.set()
                return
        await _wait(stop, every)


async def run_emulation(
    url: str,
    hosts: int,
    profile: Profile | str = "mixed",
    *,
    duration: float | None = None,
    stop: asyncio.Event | None = None,
    until_done: bool = False,
    ramp: float | None = None,
    connections: int | None = None,
    real_flops: float = DEFAULT_REAL_FLOPS,
    compute_threads: int = 1,
    seed: int | None = None,
    invite: str | None = None,
    name_prefix: str = "emu",
    progress: Callable[[EmulationReport], None] | None = None,
    interval: float = 10.0,
    stop_timeout: float = 10.0,
    long_poll: bool = True,
) -> EmulationReport:
    """Run `hosts` emulated volunteers against the coordinator at `url` and report.

    It ends after `duration` seconds, when `stop` is set, or (`until_done`) when the
    coordinator's /v1/status says training is done, whichever comes first; then every host
    online reports what it finished and gives back the rest, within `stop_timeout`.
    Hosts start spread over `ramp` seconds (default: 1 s per 500 hosts) and share one pool
    of `connections` (default: two per host, as far as the open-file limit allows; fewer
    make hosts queue for a connection, which is measured apart). `progress`, if
    given, gets a report every `interval` seconds. Raises CoordinatorUnreachable if the
    coordinator does not answer at the start.

    Latencies are split: `work` for work requests that did not wait (`long_poll=False`
    makes every request one: the coordinator's service time), `work_poll` for long polls
    answered with work (the hold until work appeared included), `work_empty` for long polls
    that ended empty."""
    if hosts < 1:
        raise ValueError("hosts must be at least 1")
    if duration is None and stop is None and not until_done:
        raise ValueError("give a duration, a stop event, or until_done")
    if isinstance(profile, str):
        profile = load_profile(profile)
    stop = stop or asyncio.Event()
    ramp = hosts / 500 if ramp is None else ramp
    connections = connections or default_connections(hosts)
    raise_file_limit(connections + 256)
    connector = aiohttp.TCPConnector(limit=connections, limit_per_host=0, ttl_dns_cache=300)
    timeout = aiohttp.ClientTimeout(total=120, sock_connect=30)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, trace_configs=[_trace_config()]
    ) as session:
        try:
            await _coordinator_status(session, url)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            raise CoordinatorUnreachable(
                f"cannot reach a coordinator at {url}: {type(exc).__name__}: {exc}"
            ) from None
        emulation = Emulation(
            url,
            hosts,
            profile,
            session,
            real_flops=real_flops,
            compute_threads=compute_threads,
            seed=seed,
            invite=invite,
            name_prefix=name_prefix,
            stop_timeout=stop_timeout,
            long_poll=long_poll,
        )
        helpers = []
        if duration is not None:
            helpers.append(asyncio.create_task(_stop_after(stop, duration)))
        if until_done:
            helpers.append(asyncio.create_task(_watch_done(session, url, stop)))
        if progress is not None:
            helpers.append(asyncio.create_task(_progress(emulation, progress, interval, stop)))
        slots = [
            asyncio.create_task(emulation.slot(i, emulation.rng.uniform(0, ramp), stop))
            for i in range(hosts)
        ]
        try:
            await stop.wait()
            _, late = await asyncio.wait(slots, timeout=2 * stop_timeout + 5)
            for task in late:
                task.cancel()
            await asyncio.gather(*slots, return_exceptions=True)
            failed = [t.exception() for t in slots if not t.cancelled() and t.exception()]
            for exc in failed:
                emulation.totals.errors[f"emulator {type(exc).__name__}"] += 1
                log.error("an emulated host failed: %r", exc)
        finally:
            for task in [*helpers, *slots]:
                task.cancel()
            await asyncio.gather(*helpers, *slots, return_exceptions=True)
            emulation.pool.shutdown(wait=True, cancel_futures=True)
        return emulation.report()


def check_url(url: str) -> None:
    """ValueError unless `url` is an http(s) URL with a host (and a valid port, if any)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{url!r} is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http:// or https:// URL with a host")
    if port == 0:
        raise ValueError(f"{url!r} has port 0")


def default_connections(hosts: int) -> int:
    """Two connections per host (a host fetches operands while it asks for work), as far
    as the hard limit on open files allows."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = (1 << 20) if hard == resource.RLIM_INFINITY else hard - 256
    return max(1, min(2 * hosts, room))


def raise_file_limit(needed: int) -> None:
    """Raise the soft limit on open files to `needed` if the hard limit allows (one
    socket per pooled connection); ValueError if it does not."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise ValueError(
            f"{needed} open files needed but the hard limit is {hard}: "
            "lower --connections or raise `ulimit -Hn`"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def hints(report: EmulationReport) -> list[str]:
    """What an operator can change when a run went wrong for a known reason."""
    out = []
    kinds = " | ".join(report.errors)
    if "register 429" in kinds:
        out.append(
            "the coordinator refused registrations from this address: set [access] "
            "registrations_per_hour in the project's project.toml to at least the number of "
            "hosts (and their replacements) and restart it (docs/emulator.md)"
        )
    if "register 403" in kinds:
        out.append("the project needs an invite code: pass --invite CODE")
    limited = [k for k in report.errors if k.endswith(" 429 too_many_requests")]
    if any(not k.startswith("register") for k in limited):
        out.append("hosts went over [access] host_rate requests per second")
    if report.queued.get("count"):
        out.append(
            f"{report.queued['count']} requests waited for a pooled connection: raise --connections"
        )
    if report.compute_overrun_s > 0.1 * report.seconds:
        out.append(
            "real compute ran behind the modelled time: raise --compute-threads or lower "
            "--real-mflops"
        )
    return out


async def _stop_after(stop: asyncio.Event, seconds: float) -> None:
    await _wait(stop, seconds)
    stop.set()


async def _progress(
    emulation: Emulation,
    progress: Callable[[EmulationReport], None],
    interval: float,
    stop: asyncio.Event,
) -> None:
    while not await _wait(stop, interval):
        progress(emulation.report())
