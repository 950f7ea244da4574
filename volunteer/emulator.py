"""The device emulator: many volunteers in one process, each speaking the real protocol.

Every emulated host runs the daemon's own pull loop (volunteer/loop.py): it registers, asks
for work, fetches and verifies operands, and reports tiles over real HTTP through one shared
connection pool. What a host's hardware and network would take (compute time, transfer time,
round trips, sessions) is modelled with asyncio sleeps drawn from its profile, injected in
the loop's primitives, as are its errors and lies; what goes over the wire is real.
docs/emulator.md says which is which.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import math
import random
import resource
import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import aiohttp
import numpy as np

import kernels
from volunteer.address import status_problem
from volunteer.backoff import Backoff
from volunteer.cache import BlobCache
from volunteer.client import CoordinatorClient, ServerRefused, compute_tile
from volunteer.loop import PullLoop, Stats
from volunteer.policy import MB, budget_for
from volunteer.profile import HostTraits, Profile
from volunteer.profile import load as load_profile
from volunteer.session import NETWORK, ProjectFinished, Quarantined, Stopping, wait

log = logging.getLogger(__name__)

DEFAULT_REAL_FLOPS = 64e6  # tiles up to this many flops are computed by each host itself
# Tiles up to this many flops compute on the event loop (tens of microseconds at most): the
# hop to a pool thread and back would cost more, as in the daemon (policy.computes_inline).
INLINE_FLOPS = 1e6
SHARED_BLOB_BYTES = 256 * MB  # operand bytes kept for all hosts together
SHARED_TILE_BYTES = 256 * MB  # modelled tiles kept for their replicas
UNLIMITED_CACHE = 256 * MB  # the operand cache of a host without a memory limit
LIES = ("big", "one_ulp", "zero", "nan")  # well-formed wrong tiles: only a validator sees them
CALL_TIMEOUT = 120.0  # seconds a host's call may take, waiting for a pooled connection too
PROBE_SECONDS = 15.0  # seconds the first look at the coordinator may take

T = TypeVar("T")

# The connector queue time of the current host's request (see _trace_config).
_queued: contextvars.ContextVar[list[float]] = contextvars.ContextVar("queued")
UNPACED_MBPS = 1e5  # megabits a second: an uplink this fast or faster is not modelled


STATUS_BODY = 1 << 20  # bytes of a status reply read: a coordinator's is a few KB


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
    # Calls the emulation's end cut off: every host stops at once and has `stop_timeout` to
    # report; those a swamped coordinator answers too late are the emulation's own doing.
    cut_off: int = 0
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
            f"{self.skipped} skipped; {self.cut_off} calls cut off by the emulation's end",
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

    stats: Stats = field(default_factory=Stats)  # what the hosts' loops count
    counts: Counter = field(default_factory=Counter)
    requests: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)  # the first message of each kind
    latencies: Latencies = field(default_factory=Latencies)
    queued: array = field(default_factory=lambda: array("d"))
    overrun: float = 0.0
    online: int = 0


# ---- one emulated host ---------------------------------------------------------------------

# Emulated hosts log nothing of their own: the report counts what thousands of them would
# each have logged.
_host_log = logging.getLogger(__name__ + ".hosts")
_host_log.setLevel(logging.CRITICAL)


class HeldBlobs(BlobCache):
    """An emulated host's operand cache as the coordinator's scheduler sees it: the ids it
    holds, bounded in bytes by its memory. It keeps only their sizes; the bytes live once in
    the emulation's shared store, so a blob evicted there is fetched again for real (but
    costs the host no modelled transfer time)."""

    def __init__(self, shared: BlobCache, max_bytes: int) -> None:
        super().__init__(max(max_bytes, 1))
        self.shared = shared

    def _size(self, value: Any) -> int:
        return value

    def get(self, blob_id: str, *, count: bool = True) -> bytes | None:
        if super().get(blob_id, count=False) is None:
            return None
        return self.shared.get(blob_id, count=False)

    def count(self, hit: bool) -> None:
        """Hit rates are the daemon's status line, not the emulation's report."""

    def put(self, blob_id: str, data: bytes) -> None:
        self.shared.put(blob_id, data)
        super().put(blob_id, len(data))


def _inline_bytes(reply: object) -> int:
    if not isinstance(reply, dict) or not isinstance(reply.get("blobs"), dict):
        return 0
    blobs = reply["blobs"].values()
    return sum(len(data) for data in blobs if isinstance(data, bytes | memoryview))


class EmulatedHost(PullLoop):
    """One volunteer: the pull loop (volunteer/loop.py) on modelled hardware and network.

    What goes over the wire is real; the time a real host would spend on the network and
    computing is slept, drawn from its traits; its errors and lies are drawn too."""

    def __init__(self, emulation: Emulation, name: str, traits: HostTraits) -> None:
        self.em = emulation
        self.traits = traits
        self.rng = random.Random(emulation.rng.random())
        budget = budget_for(traits.max_memory_mb, traits.threads) if traits.max_memory_mb else None
        super().__init__(
            CoordinatorClient(emulation.url, session=emulation.session, timeout=CALL_TIMEOUT),
            name=name,
            cache=HeldBlobs(emulation.blobs, budget // 2 if budget else UNLIMITED_CACHE),
            gflops=traits.gflops,
            threads=traits.threads,
            budget=budget,
            invite=emulation.invite,
            stats=emulation.totals.stats,
            backoff=Backoff(cap=60.0, rng=self.rng),
            idle=Backoff(base=0.25, cap=10.0, rng=self.rng),
            long_poll=emulation.long_poll,
            logger=_host_log,
        )
        self.lied = False
        # Leaving at the emulation's end, with the whole crowd: by when (monotonic).
        self.ending_by = math.inf
        self.last_seconds = 0.0  # the latency of the last request
        # A modelled uplink: request bodies go at its pace, so the coordinator times it as
        # it would a real one's (engine/uplinks.py). A link of a terabit is not modelled.
        self.paced = traits.upload_mbps < UNPACED_MBPS
        self._uplink_free = 0.0  # monotonic time the modelled uplink is through with its bytes
        if self.paced:
            self.client.pace = self._pace

    async def _request(self, endpoint: str, call: Callable[[], Awaitable[T]], up: int) -> T:
        """The real call after the modelled round trip and upload time; its latency is
        recorded here (a work request's by _heard, which knows whether it waited)."""
        t = self.traits
        upload = 0.0 if self.paced else up * 8 / (t.upload_mbps * 1e6)  # else in the call
        await asyncio.sleep(t.latency_ms / 1000 + upload)
        totals = self.em.totals
        totals.requests[endpoint] += 1
        clock = [0.0, 0.0, 0.0]  # seconds queued for a connection, when queued, paced
        _queued.set(clock)  # this task's context only: see _trace_config
        started = time.perf_counter()
        reply = None
        try:
            reply = await call()
        finally:
            self.last_seconds = time.perf_counter() - started - clock[0] - clock[2]
            if clock[0]:
                totals.queued.append(clock[0])
            if endpoint != "work" or reply is None:
                totals.latencies.add(endpoint, self.last_seconds)
        # Operand panels inside the answer (its own, or that of the work request riding on
        # a report) come down at the host's bandwidth, as fetched ones do.
        work = reply.get("work") if isinstance(reply, dict) else None
        inline = _inline_bytes(reply) + _inline_bytes(work)
        if inline:
            await asyncio.sleep(inline * 8 / (t.download_mbps * 1e6))
        return reply

    async def _pace(self, nbytes: int) -> None:
        """A piece of a request body crosses the modelled uplink (CoordinatorClient.pace),
        which the host's calls share, after the pieces before it: each piece waits until
        the link is through with them, so a sleep that overshoots is taken out of the next
        rather than added up (64 KB every 26 ms at 20 Mbit/s). The time is the link's, not
        the call's latency."""
        now = time.monotonic()
        self._uplink_free = max(now, self._uplink_free) + nbytes * 8 / (
            self.traits.upload_mbps * 1e6
        )
        await asyncio.sleep(self._uplink_free - now)
        clock = _queued.get(None)
        if clock is not None:
            clock[2] += time.monotonic() - now

    def _heard(self, reply: dict[str, Any], wait: bool) -> None:
        held = "work_poll" if reply["assignments"] else "work_empty"
        self.em.totals.latencies.add(held if wait else "work", self.last_seconds)

    def _failed(self, endpoint: str, exc: BaseException) -> None:
        if isinstance(exc, TimeoutError) and time.monotonic() >= self.ending_by:
            # Every host stopping at once, out of `stop_timeout`: the crowd's doing, not the
            # coordinator's failing. Counted as errors, they made 10,000 hosts read thousands
            # of them whenever the machine ran slow, all in the last seconds of the run. (A
            # call's own timeout before then, a connect's, is still an error.)
            self.em.totals.counts["cut_off"] += 1
            return
        super()._failed(endpoint, exc)
        endpoint = getattr(exc, "endpoint", endpoint)
        if isinstance(exc, ServerRefused) and exc.status == 403 and self.lied:
            return  # a quarantine its lies earned (reports are refused too): not an error
        if isinstance(exc, ServerRefused):
            kind = f"{endpoint} {exc.status} {exc.code}"
        else:
            kind = f"{endpoint} {type(exc).__name__}"
        self.em.totals.errors[kind] += 1
        self.em.totals.examples.setdefault(kind, str(exc)[:200])

    def _quarantined(self, endpoint: str, exc: ServerRefused) -> None:
        if endpoint == "work" and self.lied:
            self.em.totals.counts["quarantined_liars"] += 1  # earned: not an error
            return
        super()._quarantined(endpoint, exc)
        log.warning("%s refused: %s", self.name, exc.message)

    async def _identify(self) -> None:
        await super()._identify()
        self.em.totals.counts["registered"] += 1

    async def _fetch(self, blob_id: str, limit: int) -> bytes:
        held = blob_id in self.cache
        data = await super()._fetch(blob_id, limit)
        if not held:  # modelled: a blob the host holds costs no transfer time
            await asyncio.sleep(len(data) * 8 / (self.traits.download_mbps * 1e6))
        return data

    async def _kernel(
        self, assignment: dict[str, Any], a: bytes, b: bytes
    ) -> tuple[str, bytes, float]:
        flops = 2.0 * assignment["m"] * assignment["n"] * assignment["k"]
        modelled = flops / (self.traits.gflops * 1e9)
        started = time.monotonic()
        output_hash, tile, ran = await self.em.compute(assignment, a, b, flops)
        elapsed = time.monotonic() - started
        if elapsed < modelled:
            await asyncio.sleep(modelled - elapsed)
        else:
            self.em.totals.overrun += elapsed - modelled
        # The host's own speed is its model's, or the kernel's where the kernel is slower;
        # never the time its tile queued for the emulation's shared compute pool, which no
        # real host waits for. Taken as its own, that queue made fast hosts of a saturated
        # emulation think themselves slow and ask ahead after every few tiles: five times
        # the requests of real ones, on the coordinator whose cost the emulation measures.
        return output_hash, tile, max(ran, modelled)

    def _outcome(self, assignment: dict[str, Any], output_hash: str | None, tile: bytes) -> dict:
        draw = self.rng.random()
        t = self.traits
        if draw < t.error_rate:
            self.em.totals.counts["client_errors"] += 1
            return {"error": "emulated client error"}
        # The tile is computed once for every replica (Emulation.compute), so it comes
        # hashed; the report leaves the hash out where the daemon's would.
        hashed = assignment.get("hash_needed", True)
        if draw < t.error_rate + t.lie_rate:
            tile = falsify(tile, self.rng.choice(LIES), self.rng)
            self.em.totals.counts["lies"] += 1
            self.lied = True
            return {"hash": kernels.blob_id(tile) if hashed else None, "tile": tile}
        return {"hash": output_hash if hashed else None, "tile": tile}

    async def leave(self, graceful: bool, timeout: float, *, drain: bool = False) -> None:
        """End a session (PullLoop.leave). `drain` (the end of the emulation) first finishes
        the queued work, within `timeout`, so that a whole crowd stopping at once does not
        hand back every tile it was just given."""
        deadline = time.monotonic() + timeout
        self.leaving = True
        if graceful and drain:
            self.ending_by = deadline
            try:
                async with asyncio.timeout(timeout):
                    while self.queue:
                        await self._compute_next()
                    while self.pending:
                        await self._flush()
            except (ServerRefused, Stopping, *NETWORK) as exc:
                self._failed("report", exc)  # _failed tells a cut-off from an error
        await super().leave(graceful, deadline - time.monotonic())


def timed_tile(assignment: dict[str, Any], a: bytes, b: bytes) -> tuple[str, bytes, float]:
    """compute_tile, and the seconds it ran (on the pool's thread, from its start)."""
    started = time.monotonic()
    output_hash, tile = compute_tile(assignment, a, b)
    return output_hash, tile, time.monotonic() - started


def falsify(tile: bytes, lie: str, rng: random.Random) -> bytes:
    """A wrong tile of the right shape and dtype (tests/liar.py's well-formed lies).

    Each lie is drawn from the host's own generator: emulated liars are independent faulty
    hosts, and two of them almost never send the same wrong tile (a quorum of two would
    accept it; two one-ulp lies agree only at the same element, one chance in the tile's
    size). Colluding liars are tests/integration/test_byzantine.py's subject, not the emulator's."""
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
        self.pool = ThreadPoolExecutor(compute_threads, thread_name_prefix="emulate-kernel")
        self.tiles: OrderedDict[str, tuple[str, bytes, float]] = OrderedDict()
        self.tile_bytes = 0
        self.computing: dict[str, asyncio.Future] = {}
        self.started = time.monotonic()

    async def compute(
        self, assignment: dict[str, Any], a: bytes, b: bytes, flops: float
    ) -> tuple[str, bytes, float]:
        """The tile's (hash, blob, seconds the kernel ran), always computed by the real
        kernel: by this host when it is small, else once per work unit and shared by its
        replicas (bit-identical, as honest hosts' tiles are). The seconds leave out the
        wait for a thread of the pool."""
        loop = asyncio.get_running_loop()
        if flops <= self.real_flops:
            self.totals.counts["tiles_real"] += 1
            if flops <= INLINE_FLOPS:
                return timed_tile(assignment, a, b)
            return await loop.run_in_executor(self.pool, timed_tile, assignment, a, b)
        self.totals.counts["tiles_modelled"] += 1
        wu = assignment["wu_id"]
        if wu in self.tiles:
            self.tiles.move_to_end(wu)
            return self.tiles[wu]
        if wu not in self.computing:
            # One computation shared by every replica; shielded, so a host that gives up
            # (its session ends) cancels only its own wait, never the others' result.
            shared = loop.run_in_executor(self.pool, timed_tile, assignment, a, b)
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
            _, (_, old, _) = self.tiles.popitem(last=False)
            self.tile_bytes -= len(old)

    def new_host(self, slot: int, generation: int) -> EmulatedHost:
        traits = self.profile.draw(self.rng)
        return EmulatedHost(self, f"{self.name_prefix}-{slot}.{generation}-{traits.group}", traits)

    async def slot(self, index: int, start_after: float, stop: asyncio.Event) -> None:
        """One host after another, session after session, until `stop`."""
        if await wait(stop, start_after):
            return
        generation = 0
        host = self.new_host(index, generation)
        try:
            while not stop.is_set():
                self.totals.online += 1
                self.totals.counts["sessions"] += 1
                quarantined = False
                try:
                    await host.session(stop, time.monotonic() + host.traits.session_s)
                except Quarantined:
                    quarantined = True
                except ProjectFinished:
                    return  # no more work will come: this host is done for good
                finally:
                    self.totals.online -= 1
                graceful = stop.is_set() or host.rng.random() < host.traits.graceful
                await host.leave(
                    graceful and not quarantined, self.stop_timeout, drain=stop.is_set()
                )
                if stop.is_set():
                    return
                churn = quarantined or host.rng.random() < host.traits.churn
                if await wait(stop, host.traits.offline_s):
                    return
                if churn:
                    self.totals.counts["churned"] += 1
                    generation += 1
                    host = self.new_host(index, generation)
        finally:
            host.cancel()

    def report(self) -> EmulationReport:
        t = self.totals
        c, st = t.counts, t.stats
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
            assigned=st.assigned,
            reported=st.reported,
            late=st.late,
            duplicate=st.duplicate,
            client_errors=c["client_errors"],
            lies=c["lies"],
            abandoned=st.abandoned,
            vanished=st.vanished,
            aborted=st.aborted,
            skipped=st.skipped,
            tiles_real=c["tiles_real"],
            tiles_modelled=c["tiles_modelled"],
            compute_overrun_s=round(t.overrun, 3),
            bytes_down=st.bytes_down,
            bytes_up=st.bytes_up,
            errors=dict(t.errors),
            error_examples=dict(t.examples),
            quarantined_liars=c["quarantined_liars"],
            cut_off=c["cut_off"],
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


async def _coordinator_status(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """GET URL/v1/status, or CoordinatorUnreachable saying what answered instead."""
    async with session.get(url.rstrip("/") + "/v1/status") as resp:
        body = await _at_most(resp.content, STATUS_BODY)
        problem, summary = status_problem(url, resp.status, resp.content_type, body)
        if problem:
            raise CoordinatorUnreachable(problem)
        return summary


async def _at_most(stream: aiohttp.StreamReader, limit: int) -> bytes:
    """The body, or its first `limit` bytes: another server's answer may be anything."""
    body = bytearray()
    while len(body) < limit and (chunk := await stream.read(limit - len(body))):
        body += chunk
    return bytes(body)


async def _watch_done(
    session: aiohttp.ClientSession, url: str, stop: asyncio.Event, every: float = 1.0
) -> None:
    """Set `stop` once the coordinator says its training is done."""
    while not stop.is_set():
        errors = (aiohttp.ClientError, TimeoutError, OSError, CoordinatorUnreachable)
        with contextlib.suppress(*errors):  # a moment's: it looks again
            status = await _coordinator_status(session, url)
            if (status.get("training") or {}).get("done"):
                stop.set()
                return
        await wait(stop, every)


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
    # A call waits for one of the shared pool's connections first: at 10,000 hosts that
    # wait is most of the time a host sees (seconds), so calls get minutes.
    timeout = aiohttp.ClientTimeout(total=CALL_TIMEOUT, sock_connect=30)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, trace_configs=[_trace_config()]
    ) as session:
        try:
            async with asyncio.timeout(PROBE_SECONDS):
                await _coordinator_status(session, url)
        except TimeoutError:
            # An address that takes connections and says nothing: seconds, not the minutes
            # a host's call may take.
            raise CoordinatorUnreachable(
                f"cannot reach a coordinator at {url}: no answer in {PROBE_SECONDS:.0f}s"
            ) from None
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            said = f": {exc}" if str(exc) else ""
            raise CoordinatorUnreachable(
                f"cannot reach a coordinator at {url}: {type(exc).__name__}{said}"
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
    await wait(stop, seconds)
    stop.set()


async def _progress(
    emulation: Emulation,
    progress: Callable[[EmulationReport], None],
    interval: float,
    stop: asyncio.Event,
) -> None:
    while not await wait(stop, interval):
        progress(emulation.report())
