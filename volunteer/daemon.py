"""The volunteer: pulls work, fetches and verifies operands, computes, reports, politely."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import resource
import secrets
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

import kernels
from volunteer.backoff import Backoff
from volunteer.cache import BlobCache, Downloads
from volunteer.client import CoordinatorClient, ServerRefused, compute_tile
from volunteer.state import StateDir

log = logging.getLogger(__name__)

MB = 1 << 20
WORKSPACE_PER_THREAD = 2 * MB  # the kernel's packing buffers, with room to spare
MAX_CAPACITY = 64  # tiles queued at most: as many as a trusted host may hold
REPORT_BATCH = 64  # results per report at most
REPORT_BYTES = 8 * MB  # tile bytes per report: a report is sent once this much is waiting


def default_threads() -> int:
    """All cores but one, so the machine stays responsive."""
    return max(1, (os.cpu_count() or 2) - 1)


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (VmHWM: unlike ru_maxrss, it does not
    inherit the high-water mark of whatever process forked us)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB
    except OSError:
        return peak_rss_mb()


def report_batch(pending: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The reports to send next: the oldest, up to REPORT_BATCH of them and REPORT_BYTES of
    tiles (at least one). One report per product share rather than per few tiles: each
    report is a round trip, and the coordinator commits it to disk before it answers."""
    size = 0
    for count, report in enumerate(pending[:REPORT_BATCH]):
        size += len(report.get("tile", b""))
        if size > REPORT_BYTES and count:
            return pending[:count]
    return pending[:REPORT_BATCH]


def report_due(pending: list[dict[str, Any]], queued: int) -> bool:
    """Send reports when nothing is left to compute, or when a full batch is waiting."""
    if not pending:
        return False
    waiting = sum(len(r.get("tile", b"")) for r in pending)
    return not queued or len(pending) >= REPORT_BATCH or waiting >= REPORT_BYTES


def time_to_ask(queued: int, capacity: int, short: bool = False) -> bool:
    """Ask for work once the queue is down to half of what we want (BOINC's work-fetch
    hysteresis): one request then brings several tiles, not one request per tile.

    `short`: the last answer brought fewer tiles than asked for. Then the coordinator has
    nothing more for now, and asking again after every tile would be a spin (hundreds of
    requests a second with small tiles); the next ask waits for an empty queue, as a long
    poll."""
    if capacity <= 0 or (short and queued > 0):
        return False
    return queued <= (queued + capacity) // 2


@dataclass(frozen=True)
class VolunteerConfig:
    url: str
    state_dir: Path
    name: str = field(default_factory=socket.gethostname)
    threads: int = field(default_factory=default_threads)
    max_memory_mb: int = 200
    idle_only: bool = False
    low_priority: bool = True
    max_backoff: float = 60.0
    stop_timeout: float = 10.0  # seconds a stop waits for the tile being computed
    invite: str | None = None  # the project's invite code, if it asks for one


class NotEnoughMemory(RuntimeError):
    """--max-memory leaves no room for any work."""


def tile_memory(assignment: dict[str, Any], threads: int) -> int:
    """Bytes one assignment needs beyond the operand cache: the tile, its encoded blob and
    its copy in the report body, and the kernel's per-thread packing workspace."""
    tile = 4 * assignment["m"] * assignment["n"]
    return 3 * tile + threads * WORKSPACE_PER_THREAD


@dataclass
class Stats:
    tiles: int = 0
    flops: float = 0.0
    compute_seconds: float = 0.0
    bytes_down: int = 0
    bytes_up: int = 0
    errors: int = 0
    refused: int = 0
    aborted: int = 0
    state: str = "starting"
    note: str = ""  # what the volunteer is doing or waiting for
    server_note: str = ""  # the coordinator's last word on why there is no work for us

    def gflops(self) -> float:
        return self.flops / self.compute_seconds / 1e9 if self.compute_seconds else 0.0


@dataclass
class Job:
    """An assignment and the task prefetching its operands."""

    assignment: dict[str, Any]
    deadline: float
    operands: asyncio.Task


class Volunteer:
    def __init__(self, config: VolunteerConfig) -> None:
        self.config = config
        self.state = StateDir(config.state_dir)
        self.stats = Stats()
        self.backoff = Backoff(cap=config.max_backoff)  # while the coordinator fails us
        # While it has no work: its long poll already waited, so this stays short.
        self.idle = Backoff(base=0.25, cap=min(config.max_backoff, 10.0))
        self.gflops = 0.0
        self.budget = 0  # bytes for work and cache under --max-memory
        self.cache = BlobCache(0)
        self.queue: deque[Job] = deque()
        self.aborted: set[str] = set()
        self.pending_reports: list[dict[str, Any]] = []
        self.downloads = Downloads()
        self.computing: str | None = None
        self._requests = itertools.count()
        self._short = False  # the last work request brought fewer tiles than it asked for
        self._session_id = secrets.token_hex(4)
        self._tile_flops = 0.0
        self.started = time.monotonic()

    # ---- start -------------------------------------------------------------------------

    def prepare(self) -> None:
        """Measure speed, fix the memory budget, lower our priority. Raises NotEnoughMemory."""
        if self.config.low_priority:
            with contextlib.suppress(OSError):
                os.nice(19)
        self.gflops = measure_gflops(self.config.threads)
        footprint = current_rss_mb()
        spare = self.config.max_memory_mb - footprint
        minimum = self.config.threads * WORKSPACE_PER_THREAD / MB + 8
        if spare < minimum:
            raise NotEnoughMemory(
                f"--max-memory {self.config.max_memory_mb} MB is too small: this process "
                f"already uses {footprint:.0f} MB and needs at least {minimum:.0f} MB more "
                f"for work; use --max-memory {int(footprint + minimum) + 1} or more"
            )
        self.budget = int(spare * MB)
        # Half for cached operands, half for the tiles being computed and reported.
        self.cache = BlobCache(self.budget // 2)
        log.info(
            "kernel %s: %.1f GFLOPS on %d threads; memory budget %.0f MB of %d MB",
            kernels.kernel_name(),
            self.gflops,
            self.config.threads,
            self.budget / MB,
            self.config.max_memory_mb,
            extra={"gflops": self.gflops},
        )

    def work_budget_mb(self) -> int:
        """What we tell the coordinator we can hold for one work unit: half the budget (the
        other half caches operands), less the kernel's workspace."""
        return max(1, int((self.budget // 2 - self.config.threads * WORKSPACE_PER_THREAD) / MB))

    # ---- the pull loop -----------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Work until `stop` is set; then finish or abandon the current tile and report."""
        async with CoordinatorClient(self.config.url, timeout=120) as client:
            while not stop.is_set():
                try:
                    await self._identify(client)
                    await self._cycle(client, stop)
                except ServerRefused as exc:
                    await self._refused(client, exc, stop)
                except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                    delay = self.backoff.next_delay()
                    self.stats.state = "offline"
                    self.stats.note = (
                        f"cannot reach coordinator ({type(exc).__name__}); retry in {delay:.1f}s"
                    )
                    log.warning(self.stats.note)
                    await _wait(stop, delay)
            await self._shutdown(client)

    async def _identify(self, client: CoordinatorClient) -> None:
        if client.token:
            return
        saved = self.state.identity(self.config.url)
        if saved:
            client.token = saved["token"]
            return
        host_id = await client.register(
            self.config.name,
            gflops=self.gflops,
            threads=self.config.threads,
            max_memory_mb=self.work_budget_mb(),
            invite=self.config.invite,
        )
        self.state.save_identity(self.config.url, host_id, client.token, self.config.name)
        log.info("registered with %s as host %d", self.config.url, host_id)

    async def _refused(
        self, client: CoordinatorClient, exc: ServerRefused, stop: asyncio.Event
    ) -> None:
        self.stats.errors += 1
        if exc.status == 401:
            log.warning(
                "the coordinator does not know our token (%s); registering again", exc.message
            )
            self.state.identity_file.unlink(missing_ok=True)
            client.token = None
            return
        if exc.status == 403:
            self.stats.state = "refused"
            self.stats.note = exc.message
            log.error("the coordinator refuses this host: %s", exc.message)
            stop.set()
            return
        delay = self.backoff.next_delay(at_least=exc.retry_after)
        self.stats.note = f"coordinator said {exc.status} {exc.code}: {exc.message}"
        log.warning("%s; retry in %.1fs", self.stats.note, delay)
        await _wait(stop, delay)

    async def _cycle(self, client: CoordinatorClient, stop: asyncio.Event) -> None:
        if self.config.idle_only and machine_busy():
            self.stats.state = "paused"
            self.stats.note = "machine busy (--idle-only)"
            await _wait(stop, 2.0)
            return
        capacity = self._capacity()
        reply = None
        if time_to_ask(len(self.queue), capacity, self._short) or (
            self.pending_reports and not self.queue
        ):
            await self._flush_reports(client)
            reply = await client.request_work(
                f"{self._session_id}-{next(self._requests)}",
                capacity=capacity,
                cached=self.cache.ids()[:4096],
                in_progress=self._in_progress(),
                gflops=self.gflops,
                wait=not self.queue,
            )
            self._short = len(reply["assignments"]) < capacity
            self._take(client, reply)
            note = reply.get("note", "")
            if note != self.stats.server_note:
                self.stats.server_note = note
                if note:
                    log.warning("coordinator: %s", note)
        if self.queue:
            self.stats.state = "working"
            self.backoff.reset()
            self.idle.reset()
            await self._compute_next(client)
            if report_due(self.pending_reports, len(self.queue)):
                await self._flush_reports(client)
        elif reply is not None and not reply["assignments"]:
            self.stats.state = "idle"
            delay = self.idle.next_delay(at_least=float(reply.get("delay", 0.0)))
            self.stats.note = f"no work; next ask in {delay:.1f}s"
            await _wait(stop, delay)

    def _capacity(self) -> int:
        """How many more tiles to ask for: about two seconds of work, within memory."""
        queued = len(self.queue)
        if self._tile_flops and self.gflops:
            wanted = int(2.0 * self.gflops * 1e9 / self._tile_flops) + 1
        else:
            wanted = 2
        return max(0, min(MAX_CAPACITY, wanted) - queued)

    def _in_progress(self) -> list[str]:
        ids = [job.assignment["result_id"] for job in self.queue]
        if self.computing:
            ids.append(self.computing)
        return ids + [r["result_id"] for r in self.pending_reports]

    def _take(self, client: CoordinatorClient, reply: dict[str, Any]) -> None:
        for result_id in reply.get("abort", []):
            self._abort(result_id)
        now = time.monotonic()
        known = {job.assignment["result_id"] for job in self.queue} | {self.computing}
        for assignment in reply.get("assignments", []):
            if assignment["result_id"] in known:
                continue
            need = tile_memory(assignment, self.config.threads)
            panels = assignment["a_bytes"] + assignment["b_bytes"]
            if need + panels > self.budget // 2:
                self.stats.refused += 1
                message = (
                    f"insufficient memory: the tile needs {(need + panels) / MB:.1f} MB, "
                    f"--max-memory {self.config.max_memory_mb} MB leaves "
                    f"{self.budget / 2 / MB:.1f} MB for work"
                )
                log.warning("refusing %s: %s", assignment["result_id"], message)
                self.stats.note = message
                self.pending_reports.append(
                    {"result_id": assignment["result_id"], "error": message}
                )
                continue
            self._tile_flops = 2.0 * assignment["m"] * assignment["n"] * assignment["k"]
            operands = asyncio.create_task(self._operands(client, assignment))
            self.queue.append(Job(assignment, now + float(assignment["deadline_in"]), operands))

    def _abort(self, result_id: str) -> None:
        for job in list(self.queue):
            if job.assignment["result_id"] == result_id:
                job.operands.cancel()
                self.queue.remove(job)
                self.stats.aborted += 1
                log.info("dropped %s: the coordinator no longer needs it", result_id)
        if self.computing == result_id:
            self.aborted.add(result_id)
        self.pending_reports = [r for r in self.pending_reports if r["result_id"] != result_id]

    async def _operands(self, client: CoordinatorClient, assignment: dict[str, Any]) -> list[bytes]:
        blobs = []
        for key in ("a", "b"):
            blob_id = assignment[key]
            data = self.cache.get(blob_id, count=False)
            # A panel another queued tile is already downloading costs this one nothing.
            self.cache.count(hit=data is not None or self.downloads.running(blob_id))
            if data is None:
                limit = assignment[f"{key}_bytes"] or self.budget
                data = await self.downloads.get(
                    blob_id, functools.partial(self._download, client, blob_id, limit)
                )
            blobs.append(data)
        return blobs

    async def _download(self, client: CoordinatorClient, blob_id: str, limit: int) -> bytes:
        data = await client.fetch_blob(blob_id, max_bytes=limit)
        self.stats.bytes_down += len(data)
        self.cache.put(blob_id, data)
        return data

    async def _compute_next(self, client: CoordinatorClient) -> None:
        job = self.queue.popleft()
        assignment = job.assignment
        result_id = assignment["result_id"]
        try:
            a, b = await job.operands
        except kernels.BlobMismatchError as exc:
            self.stats.errors += 1
            log.error("refusing %s: operand blob is corrupt: %s", result_id, exc)
            self.pending_reports.append({"result_id": result_id, "error": f"corrupt blob: {exc}"})
            return
        except ServerRefused as exc:
            if exc.retriable:
                # Busy, not wrong: keep the assignment and fetch again after the backoff.
                retry = asyncio.create_task(self._operands(client, assignment))
                self.queue.appendleft(Job(assignment, job.deadline, retry))
                raise
            log.error("cannot fetch operands of %s: %s", result_id, exc)
            self.pending_reports.append({"result_id": result_id, "error": f"fetch failed: {exc}"})
            return
        if time.monotonic() > job.deadline:
            log.info("skipped %s: its deadline passed before we got to it", result_id)
            return
        self.computing = result_id
        started = time.perf_counter()
        try:
            output_hash, tile = await asyncio.to_thread(
                compute_tile, assignment, a, b, threads=self.config.threads
            )
        except ValueError as exc:
            self.computing = None
            self.pending_reports.append({"result_id": result_id, "error": f"bad operands: {exc}"})
            return
        seconds = time.perf_counter() - started
        self.computing = None
        if result_id in self.aborted:
            self.aborted.discard(result_id)
            return
        self.stats.tiles += 1
        self.stats.flops += 2.0 * assignment["m"] * assignment["n"] * assignment["k"]
        self.stats.compute_seconds += seconds
        report: dict[str, Any] = {"result_id": result_id, "hash": output_hash, "seconds": seconds}
        if assignment["upload"] == "tile":
            report["tile"] = tile
        self.pending_reports.append(report)

    async def _flush_reports(self, client: CoordinatorClient) -> None:
        if not self.pending_reports:
            return
        batch = report_batch(self.pending_reports)
        try:
            await client.report(batch)
        except ServerRefused as exc:
            if exc.retriable or exc.status == 401:
                raise  # kept: sent again after the backoff (or after registering again)
            # Any other 4xx names a report the coordinator will never take: never resend it.
            log.error("the coordinator refused %d report(s): %s", len(batch), exc.message)
            self.stats.errors += 1
        self.stats.bytes_up += sum(len(r.get("tile", b"")) + 64 for r in batch)
        self.pending_reports = self.pending_reports[len(batch) :]

    async def _shutdown(self, client: CoordinatorClient) -> None:
        """Report what is done and abandon the rest, so the coordinator reissues it now."""
        for job in self.queue:
            job.operands.cancel()
            self.pending_reports.append(
                {"result_id": job.assignment["result_id"], "abandoned": True}
            )
        self.queue.clear()
        with contextlib.suppress(Exception):
            while self.pending_reports:
                await asyncio.wait_for(self._flush_reports(client), self.config.stop_timeout)
        self.stats.state = "stopped"

    def status(self) -> dict[str, Any]:
        s = self.stats
        return {
            "pid": os.getpid(),
            "url": self.config.url,
            "state": s.state,
            "note": s.server_note or s.note,
            "tiles": s.tiles,
            "gflops": round(s.gflops(), 2),
            "benchmark_gflops": round(self.gflops, 2),
            "mb_down": round(s.bytes_down / MB, 2),
            "mb_up": round(s.bytes_up / MB, 2),
            "cache_hit_rate": round(self.cache.hit_rate, 3),
            "cache_mb": round(self.cache.bytes / MB, 2),
            "backoff": round(max(self.backoff.current, self.idle.current), 2),
            "errors": s.errors,
            "refused": s.refused,
            "aborted": s.aborted,
            "compute_seconds": round(s.compute_seconds, 3),
            "uptime": round(time.monotonic() - self.started, 3),
            "peak_rss_mb": round(peak_rss_mb(), 1),
            "max_memory_mb": self.config.max_memory_mb,
            "threads": self.config.threads,
            "time": time.time(),
        }


def measure_gflops(threads: int, size: int = 192) -> float:
    """A short kernel benchmark, as BOINC's client runs at start: best of a few products."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size)).astype(np.float32)
    out = np.empty_like(a)
    kernels.gemm(a, a, out=out, threads=threads)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        kernels.gemm(a, a, out=out, threads=threads)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


_last_cpu: tuple[float, float] | None = None


def machine_busy(threshold: float = 0.5) -> bool:
    """True when other processes used more than `threshold` of one core since the last call."""
    global _last_cpu
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    ticks = os.sysconf("SC_CLK_TCK")
    busy = (sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)) / ticks
    mine = (float(own[11]) + float(own[12])) / ticks
    now = time.monotonic()
    sample = (busy - mine, now)
    previous, _last_cpu = _last_cpu, sample
    if previous is None:
        return False
    others, elapsed = sample[0] - previous[0], now - previous[1]
    return elapsed > 0 and others / elapsed > threshold


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)
