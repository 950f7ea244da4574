"""The Coordinator: live work state, the host-facing operations, and the background loops
(transitioner, validator, assimilator) that move work units to completion."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import random
import secrets
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from blake3 import blake3

import kernels
from coordinator.engine.metrics import Metrics
from coordinator.engine.waiters import Waiters
from coordinator.rules import trust, validator
from coordinator.rules.access import Access, AccessConfig, admin_token
from coordinator.rules.scheduler import Scheduler, SchedulerConfig
from coordinator.rules.transitioner import transition
from coordinator.state.blobs import BlobStore
from coordinator.state.ledger import Ledger
from coordinator.state.sqlite import SqliteStore
from coordinator.state.store import Reply, Store
from coordinator.work.events import Event
from coordinator.work.protocol import (
    BadRequest,
    Forbidden,
    NotFound,
    RegisterRequest,
    ReportRequest,
    StorageUnavailable,
    Unauthorized,
    WorkRequest,
    encode,
)
from coordinator.work.records import (
    WU_DECIDED,
    Gemm,
    GemmState,
    Host,
    Outcome,
    Policy,
    Redundancy,
    Result,
    ServerState,
    WorkUnit,
    WuError,
    WuState,
)
from validation import freivalds

log = logging.getLogger(__name__)

STORAGE_RETRY = 5.0  # seconds a volunteer waits before resending a report the store refused

REPLIES_KEPT_PER_HOST = 16
PAUSED_DELAY = 5.0  # seconds a host waits before asking a paused project again
ACTIVE_WITHIN = 300.0  # seconds since its last contact for a host to count as active


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    """Every setting of a coordinator; project.toml and the command line map onto these."""

    directory: Path
    policy: Policy = Policy.QUORUM
    redundancy: Redundancy = field(default_factory=Redundancy)
    tile: int = 128
    freivalds_rounds: int = 8
    tail_fraction: float = 0.9  # share of a GEMM's tiles done before spares are issued
    max_blob_bytes: int = 64 << 20
    blob_memory_bytes: int = 64 << 20  # recent blobs served from memory, not from disk
    max_report_bytes: int = 96 << 20
    max_request_bytes: int = 1 << 20
    reply_ttl: float = 3600.0
    long_poll: float = 2.0  # seconds a work request may wait for work to appear
    no_work_delay: float = 1.0  # seconds a host is asked to wait when there is no work
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    trust: trust.TrustConfig = field(default_factory=trust.TrustConfig)
    seed: int | None = None  # scheduler randomness (adaptive replication); None: from the OS
    access: AccessConfig = field(default_factory=AccessConfig)
    body_timeout: float = 60.0  # seconds a client may take to send a request body
    # Seconds a connection may go without a complete request line and headers, from its
    # start or the end of the previous reply (slowloris); it is also the idle keep-alive.
    header_timeout: float = 20.0


class GemmFailed(RuntimeError):
    """A work unit of this GEMM failed for good; the message says which and why."""


def redundancy_for(policy: Policy, base: Redundancy) -> Redundancy:
    """Freivalds alone needs one replica; the quorum policies need min_quorum of them."""
    if policy is Policy.FREIVALDS:
        return Redundancy(1, 1, base.max_error_results, base.max_total_results, base.delay_bound)
    return base


def load_secret(directory: Path) -> bytes:
    """The verifier's Freivalds key: 32 random bytes in DIR/secret.key, readable only by us."""
    path = directory / "secret.key"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
            f.flush()
            os.fsync(f.fileno())
    key = path.read_bytes()
    if len(key) != 32:
        raise RuntimeError(f"{path} must hold 32 bytes; delete it to make a new key")
    return key


def token_hash(token: str) -> str:
    return blake3(token.encode()).hexdigest()


@dataclass(slots=True)
class GemmOutput:
    """An awaited product being filled tile by tile."""

    gemm: Gemm | None  # None while its work is being published
    out: np.ndarray
    remaining: set[str]
    done: asyncio.Future


class Coordinator:
    def __init__(self, config: CoordinatorConfig, store: Store | None = None) -> None:
        self.config = config
        self.directory = Path(config.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.store = store or SqliteStore(self.directory / "state.db")
        self.blobs = BlobStore(
            self.directory / "blobs", config.max_blob_bytes, config.blob_memory_bytes
        )
        self.ledger = Ledger(self.store)
        rng = random.Random(config.seed) if config.seed is not None else random.SystemRandom()
        self.scheduler = Scheduler(self.ledger, config.scheduler, rng)
        self.key = load_secret(self.directory)
        self.access = Access(config.access, admin_token(self.directory))
        self.paused = False  # set by the operator: no new work goes out
        self.outputs: dict[str, GemmOutput] = {}
        self.failed_here: set[str] = set()  # GEMMs that failed in this run: not retried
        self._replies: dict[int, OrderedDict[str, bytes]] = {}
        self._checks: dict[str, validator.Check] = {}
        self._to_validate: set[str] = set()
        self._checked_tiles: dict[str, np.ndarray] = {}  # tiles this pass has checked, by hash
        self._wake = asyncio.Event()
        self._pass_lock = asyncio.Lock()  # one background pass or one cancel at a time
        self._inflight: dict[tuple[int, str], asyncio.Future] = {}
        self.waiters = Waiters()  # long-polling work requests
        self.ledger.on_unsent = self._signal_work
        self._tasks: list[asyncio.Task] = []
        # The background passes (validate, transition, assimilate, commit): they run until
        # stop() and end early only by failing, which whoever waits on the work must see.
        self.passes: asyncio.Task | None = None
        self.stats = {"bytes_saved": 0, "tiles_in": 0, "work_requests": 0, "invalid": 0}
        self.training: dict = {}  # step, steps, loss: set by the training loop
        self.history: list[dict] = []  # one entry per step: loss, val_loss, seconds
        self.rates: deque[tuple[float, int]] = deque(maxlen=600)  # (time, tiles_in) samples
        self.metrics = Metrics(self.status)

    # ---- life cycle ----------------------------------------------------------------------

    def _signal_work(self) -> None:
        self.waiters.wake(len(self.ledger.unsent))

    async def start(self) -> None:
        await self.store.open()
        snapshot = await self.store.load()
        self.ledger.restore(snapshot)
        for wu in snapshot.workunits:
            if wu.state is WuState.ACTIVE:
                self._to_validate.add(wu.id)
            for panel in (wu.a_panel, wu.b_panel):
                if panel not in self.ledger.panel_bytes and self.blobs.has(panel):
                    self.ledger.panel_bytes[panel] = self.blobs.size(panel)
        if snapshot.gemms:
            log.info(
                "resuming %d GEMMs with %d work units",
                len(snapshot.gemms),
                len(snapshot.workunits),
            )
        self.passes = asyncio.create_task(self._run_loop(), name="tilehive-transitioner")
        self._tasks.append(self.passes)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:  # logged where it failed; the store must still be closed
                pass
        self._tasks.clear()
        try:
            await self.ledger.flush()
        finally:
            # Always: an open database keeps its worker thread, and so the process, alive.
            await self.store.close()

    def wake(self) -> None:
        self._wake.set()

    # ---- hosts ---------------------------------------------------------------------------

    async def register(
        self, request: RegisterRequest, now: float, address: str = "?"
    ) -> tuple[Host, str]:
        self.access.check_registration(address, request.invite, now)
        token = secrets.token_hex(32)
        host_id = max(self.ledger.hosts, default=0) + 1
        host = Host(
            id=host_id,
            name=request.name,
            token_hash=token_hash(token),
            created=now,
            last_contact=now,
            gflops=request.gflops,
            threads=request.threads,
            max_memory_mb=request.max_memory_mb,
        )
        host = host.evolve(max_in_progress=trust.full_quota(host, self.config.trust))
        self.ledger.put_host(host)
        self.ledger.log(
            [Event(now, "host", "registered", f"host {host_id} {request.name!r}", host_id=host_id)]
        )
        await self.ledger.flush()
        return host, token

    def authenticate(self, token: str | None) -> Host:
        if not token:
            raise Unauthorized("missing 'Authorization: Bearer <token>' header")
        host_id = self.ledger.host_by_token.get(token_hash(token))
        if host_id is None:
            raise Unauthorized("unknown token: register again")
        return self.ledger.hosts[host_id]

    async def request_work(self, host: Host, request: WorkRequest, now: float) -> bytes:
        """The answer to a work request; a repeated request id gets the same bytes back.

        With no work to give, the request waits (long poll) up to `long_poll` seconds for
        work to appear, so volunteers pick up the next product of a step at once instead of
        sleeping through it."""
        self.stats["work_requests"] += 1
        key = (host.id, request.request_id)
        stored = self._replies.get(host.id, {}).get(request.request_id)
        if stored is None and key in self._inflight:
            return await asyncio.shield(self._inflight[key])
        if stored is None and host.id not in self._replies:
            # Only a host's first request since this coordinator started can be a retry of a
            # reply it lost before a restart; every later one is found in memory.
            stored = await self.store.reply(host.id, request.request_id)
        if stored is not None:
            return stored
        if host.quarantined:
            raise Forbidden(
                f"host {host.id} is quarantined after {host.invalid_count} invalid results"
            )
        answer = asyncio.get_running_loop().create_future()
        self._inflight[key] = answer
        try:
            body = await self._answer(host, request, now)
            answer.set_result(body)
            return body
        except BaseException as exc:
            answer.set_exception(exc)
            answer.exception()  # retrieved: the caller re-raises it
            raise
        finally:
            del self._inflight[key]

    async def _answer(self, host: Host, request: WorkRequest, now: float) -> bytes:
        # Re-read: the record may have changed while this request awaited the store.
        host = self.ledger.hosts[host.id].evolve(last_contact=now)
        if request.gflops:
            host = host.evolve(gflops=request.gflops)
        self.ledger.put_host(host)
        if self.paused:
            return encode(
                {
                    "assignments": [],
                    "abort": [],
                    "bytes_saved": 0,
                    "delay": PAUSED_DELAY,
                    "note": "the project is paused by its operator",
                }
            )
        plan = self.scheduler.plan(host, request, now)
        deadline = time.monotonic() + self.config.long_poll
        while not plan.assignments and plan.room > 0 and request.wait:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not await self.waiters.wait(remaining):
                break
            now = time.time()
            host = self.ledger.hosts[host.id]
            plan = self.scheduler.plan(host, request, now)
            if not plan.assignments and self.ledger.unsent:
                # Work is there, but none this host may take (it holds a replica, or lacks
                # the memory): answer now rather than be woken again and again for it. The
                # wake-up is not passed on: a chain through every waiter is the herd again.
                break
        self.ledger.log(plan.events)
        self.stats["bytes_saved"] += plan.bytes_saved
        assignments = [self._assignment_message(a.wu, a.result, now) for a in plan.assignments]
        message = {
            "assignments": assignments,
            "abort": plan.abort,
            "bytes_saved": plan.bytes_saved,
            "delay": 0.0 if assignments else self.config.no_work_delay,
        }
        if plan.too_big and not assignments:
            message["note"] = (
                f"{plan.too_big} work unit(s) need more memory than this host offers "
                f"({host.max_memory_mb} MB); the smallest needs "
                f"{plan.smallest_need / (1 << 20):.1f} MB: raise --max-memory"
            )
        body = encode(message)
        # A reply that assigns or aborts nothing changes nothing: a retry may be planned
        # afresh, so only memory keeps it (10,000 idle hosts would write 5,000 rows/s).
        durable = bool(assignments or plan.abort)
        self._remember_reply(host.id, request.request_id, body, now, durable)
        await self.ledger.flush()
        return body

    def _assignment_message(self, wu: WorkUnit, result: Result, now: float) -> dict:
        m, n, k = wu.shape
        return {
            "result_id": result.id,
            "wu_id": wu.id,
            "a": wu.a_panel,
            "b": wu.b_panel,
            "a_bytes": self.ledger.panel_bytes.get(wu.a_panel, 0),
            "b_bytes": self.ledger.panel_bytes.get(wu.b_panel, 0),
            "trans_a": wu.trans_a,
            "trans_b": wu.trans_b,
            "m": m,
            "n": n,
            "k": k,
            "upload": "tile" if result.upload_tile else "hash",
            "deadline_in": max(0.0, (result.report_deadline or now) - now),
            "kernel_version": wu.kernel_version,
        }

    def _remember_reply(
        self, host_id: int, request_id: str, body: bytes, now: float, durable: bool
    ) -> None:
        recent = self._replies.setdefault(host_id, OrderedDict())
        recent[request_id] = body
        while len(recent) > REPLIES_KEPT_PER_HOST:
            recent.popitem(last=False)
        if durable:
            self.ledger.remember_reply(Reply(host_id, request_id, now, body))

    async def report(self, host: Host, request: ReportRequest, now: float) -> dict:
        """Accept a batch of results: all entries are checked before any is applied.

        A batch refused for a forged or malformed result costs the host as an invalid result
        would: an honest client never sends one, and a liar must not lie for free."""
        try:
            return await self._report(host, request, now)
        except (BadRequest, Forbidden) as exc:
            current = self.ledger.hosts[host.id]
            changed = trust.after_invalid(current, self.config.trust)
            self.ledger.put_host(changed)
            self.stats["invalid"] += 1
            self.ledger.log(
                [
                    Event(
                        now,
                        "validation",
                        "invalid",
                        f"refused report: {exc.message}",
                        host_id=host.id,
                        data=json.dumps(
                            {
                                "method": "protocol",
                                "trust_before": current.consecutive_valid,
                                "trust_after": 0,
                            }
                        ),
                    ),
                ]
            )
            if changed.quarantined and not current.quarantined:
                self.ledger.log(
                    [
                        Event(
                            now,
                            "host",
                            "quarantined",
                            f"host {host.id} quarantined after {changed.invalid_count} invalid "
                            "results",
                            host_id=host.id,
                        )
                    ]
                )
            await self.ledger.flush()
            raise

    async def _report(self, host: Host, request: ReportRequest, now: float) -> dict:
        checked = []
        finished = []  # results of GEMMs already done and out of memory: nothing to apply
        for entry in request.results:
            result = self.ledger.results.get(entry.result_id)
            if result is None:
                result = await self.store.result(entry.result_id)
                if result is None:
                    raise NotFound(f"unknown result {entry.result_id}")
                if result.host_id != host.id:
                    raise Forbidden(f"result {entry.result_id} is not assigned to host {host.id}")
                finished.append(entry.result_id)
                continue
            if result.host_id != host.id:
                raise Forbidden(f"result {entry.result_id} is not assigned to host {host.id}")
            wu = self.ledger.wus[result.wu_id]
            tile = None
            if entry.tile is not None:
                tile = self._check_tile(wu, entry.result_id, entry.output_hash, entry.tile)
            elif (
                entry.error is None
                and not entry.abandoned
                and result.upload_tile
                and wu.state not in WU_DECIDED
            ):
                raise BadRequest(f"result {entry.result_id}: the assignment asked for the tile")
            checked.append((entry, result, wu, tile))
        # Every tile is stored before any report is applied: when the blob store fails, the
        # whole report is refused and none of it is half-done.
        await self._store_tiles(
            [
                (entry.output_hash, tile)
                for entry, result, _, tile in checked
                if tile is not None and not self._reported(result)  # a replay stores nothing
            ]
        )
        summary: dict[str, list[str]] = {"accepted": [], "late": finished, "duplicate": []}
        for entry, result, wu, tile in checked:
            summary[self._apply_report(host, entry, result, wu, tile is not None, now)].append(
                entry.result_id
            )
        self.ledger.put_host(self.ledger.hosts[host.id].evolve(last_contact=now))
        await self.ledger.flush()
        self.wake()
        return summary

    def _reported(self, result: Result) -> bool:
        current = self.ledger.results.get(result.id, result)
        return current.outcome in (Outcome.SUCCESS, Outcome.CLIENT_ERROR)

    async def _store_tiles(self, tiles: list[tuple[str, bytes]]) -> None:
        def store() -> None:
            self.blobs.put_many([(tile, output_hash) for output_hash, tile in tiles])

        try:
            await asyncio.to_thread(store)
        except OSError as exc:
            log.error("blob store %s cannot be written: %s", self.blobs.root, exc)
            raise StorageUnavailable(
                f"the coordinator cannot store tiles just now (blob store: {exc.strerror}); "
                f"send the report again in {STORAGE_RETRY:.0f} s",
                retry_after=STORAGE_RETRY,
            ) from exc

    def _check_tile(self, wu: WorkUnit, result_id: str, claimed: str, tile: bytes) -> bytes:
        m, n, _ = wu.shape
        if len(tile) > self.config.max_blob_bytes:
            raise BadRequest(f"result {result_id}: tile of {len(tile)} bytes is over the limit")
        try:
            kernels.verify_blob(tile, claimed)
            array = kernels.decode_array(tile)
        except ValueError as exc:
            raise BadRequest(f"result {result_id}: {exc}") from exc
        if array.dtype != np.float32 or array.shape != (m, n):
            raise BadRequest(
                f"result {result_id}: tile must be float32 of shape {(m, n)}, "
                f"got {array.dtype} {array.shape}"
            )
        return tile

    def _apply_report(self, host, entry, result: Result, wu: WorkUnit, has_tile, now) -> str:
        # Re-read: a deadline or a concurrent retry of this report may have changed it since,
        # or its GEMM finished and left memory while the tiles were being stored.
        current = self.ledger.results.get(result.id)
        if current is None:
            return "late"
        result = current
        if result.outcome in (Outcome.SUCCESS, Outcome.CLIENT_ERROR):
            return "duplicate"
        late = result.server_state is ServerState.OVER
        event = Event(now, "result", "", "", wu.step, wu.gemm_id, wu.id, result.id, host.id)
        if entry.abandoned:
            if late:
                return "late"
            # As if its deadline had passed now: a replacement goes out at once, and the
            # host, which said so honestly, keeps its standing.
            self.ledger.put_result(
                result.evolve(
                    server_state=ServerState.OVER, outcome=Outcome.NO_REPLY, received_time=now
                )
            )
            self.ledger.log([_with(event, "abandoned", "given back uncomputed by the host")])
            self.metrics.results.labels("abandoned").inc()
        elif entry.error is not None:
            if late:
                return "late"
            self.ledger.put_result(
                result.evolve(
                    server_state=ServerState.OVER,
                    outcome=Outcome.CLIENT_ERROR,
                    received_time=now,
                    error=entry.error,
                )
            )
            self.ledger.put_host(trust.after_error(self.ledger.hosts[host.id], self.config.trust))
            self.ledger.log([_with(event, "client_error", f"host error: {entry.error}")])
            self.metrics.results.labels("client_error").inc()
        else:
            self.ledger.put_result(
                result.evolve(
                    server_state=ServerState.OVER,
                    outcome=Outcome.SUCCESS,
                    received_time=now,
                    output_hash=entry.output_hash,
                    has_tile=has_tile,
                )
            )
            self.stats["tiles_in"] += 1
            self.metrics.results.labels("success").inc()
            what = "tile" if has_tile else "hash"
            message = f"{what} {entry.output_hash[:16]} in {entry.seconds:.2f}s"
            self.ledger.log([_with(event, "success", ("late " if late else "") + message)])
            self._to_validate.add(wu.id)
        self.ledger.touched.add(wu.id)
        return "late" if late else "accepted"

    async def prune(self, through_step: int) -> int:
        """Delete the blobs of GEMMs a checkpoint made useless; returns how many."""
        await self.ledger.flush()
        blobs = await self.store.prunable_blobs(through_step)

        def delete() -> None:
            for blob in blobs:
                self.blobs.delete(blob)
                self.ledger.panel_bytes.pop(blob, None)

        await asyncio.to_thread(delete)
        return len(blobs)

    def record_step(self, step: int, steps: int, loss: float, val_loss, seconds: float) -> None:
        """What the training loop reports after each step (status, dashboard, metrics)."""
        self.training = {"step": step, "steps": steps, "loss": loss, "seconds": seconds}
        if val_loss is not None:
            self.training["val_loss"] = val_loss
        self.history.append(dict(self.training, time=time.time()))
        self.metrics.loss.set(loss)
        self.metrics.step.set(step)
        self.metrics.steps.observe(seconds)

    def tiles_per_second(self, window: float = 60.0) -> float:
        """Tiles received per second over the last `window` seconds."""
        now = time.time()
        recent = [(t, n) for t, n in self.rates if t >= now - window]
        recent.append((now, self.stats["tiles_in"]))
        (t0, n0), (t1, n1) = recent[0], recent[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def host_states(self, now: float | None = None) -> dict[str, int]:
        now = time.time() if now is None else now
        states = {"active": 0, "idle": 0, "quarantined": 0}
        for host in self.ledger.hosts.values():
            if host.quarantined:
                states["quarantined"] += 1
            elif now - host.last_contact < ACTIVE_WITHIN:
                states["active"] += 1
            else:
                states["idle"] += 1
        return states

    # ---- the operator -------------------------------------------------------------------

    async def set_paused(self, paused: bool, now: float) -> None:
        """Hand out no new work (results in progress are still accepted), or resume."""
        self.paused = paused
        state = "paused" if paused else "resumed"
        self.ledger.log([Event(now, "project", state, f"project {state} by the operator")])
        await self.ledger.flush()
        if not paused:
            self._signal_work()

    async def set_quarantined(self, host_id: int, quarantined: bool, now: float) -> Host:
        host = self.ledger.hosts.get(host_id)
        if host is None:
            raise NotFound(f"no host {host_id}")
        changed = host.evolve(quarantined=quarantined)
        if not quarantined:
            # A released host starts over: no trust, a small quota, and a clean invalid count.
            changed = changed.evolve(invalid_count=0, consecutive_valid=0, max_in_progress=1)
        self.ledger.put_host(changed)
        state = "quarantined" if quarantined else "released"
        self.ledger.log(
            [Event(now, "host", state, f"host {host_id} {state} by the operator", host_id=host_id)]
        )
        await self.ledger.flush()
        return changed

    async def full_status(self) -> dict:
        """status() with the counts of the whole project, finished products included."""
        await self.ledger.flush()
        summary = self.status()
        summary["workunits"] = await self.store.workunit_counts()
        summary["invalid"] = await self.store.invalid_count()
        return summary

    def status(self) -> dict:
        """A summary of what is in memory, for /metrics and the dashboard."""
        ledger = self.ledger
        training = dict(self.training)
        if training.get("step") and self.history:
            per_step = sum(h["seconds"] for h in self.history[-10:]) / len(self.history[-10:])
            training["eta_seconds"] = per_step * (training["steps"] - training["step"])
        return {
            "gemms_active": sum(1 for g in ledger.gemms.values() if g.state is GemmState.ACTIVE),
            "workunits": _count(wu.state.value for wu in ledger.wus.values()),
            "results": _count(r.server_state.value for r in ledger.results.values()),
            "hosts": len(ledger.hosts),
            "host_states": self.host_states(),
            "hosts_quarantined": sum(1 for h in ledger.hosts.values() if h.quarantined),
            "tiles_per_second": round(self.tiles_per_second(), 2),
            "training": training,
            "paused": self.paused,
            **self.stats,
        }

    # ---- background: transitioner, validator, assimilator ----------------------------------

    async def _run_loop(self) -> None:
        while True:
            try:
                await self.step(time.time())
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("coordinator loop failed; stopping")
                raise
            delay = min(self.ledger.next_due() - time.time(), 1.0)
            if self._wake.is_set() or self.ledger.touched or self._to_validate:
                delay = 0
            self._wake.clear()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=delay)
            else:
                await asyncio.sleep(0)

    async def step(self, now: float) -> None:
        """One pass: validate what arrived, move due work units on, assimilate, commit."""
        # A pass awaits (Freivalds, reading tiles, commits) between looking at a work unit
        # and changing it; an operator's cancel must not land in between.
        async with self._pass_lock:
            await self._step(now)

    async def _step(self, now: float) -> None:
        to_validate, self._to_validate = self._to_validate, set()
        try:
            await self._check_tiles(sorted(to_validate))
            for wu_id in sorted(to_validate):
                await self._validate(wu_id, now)
        finally:
            self._checked_tiles.clear()
        for wu_id in sorted(self.ledger.pop_due(now)):
            self._transition(wu_id, now)
        self._accelerate_tails(now)
        if not self.rates or now - self.rates[-1][0] >= 1.0:
            self.rates.append((now, self.stats["tiles_in"]))
        await self.ledger.flush()

    def _transition(self, wu_id: str, now: float) -> None:
        wu = self.ledger.wus[wu_id]
        if wu.state in (WuState.ASSIMILATED, WuState.ERROR) and not any(
            r.server_state is ServerState.UNSENT for r in self.ledger.results_for(wu_id)
        ):
            return
        change = transition(wu, self.ledger.results_for(wu_id), now, new_result_id)
        for result in change.results:
            if result.outcome is Outcome.NO_REPLY and result.host_id in self.ledger.hosts:
                host = self.ledger.hosts[result.host_id]
                self.ledger.put_host(trust.after_error(host, self.config.trust))
        for result in change.results:
            self.ledger.put_result(result)
        if change.wu != wu:
            self.ledger.put_wu(change.wu)
        self.ledger.log(change.events)
        if change.failed:
            self._fail_gemm(change.wu, change.failed, now)

    async def _validate(self, wu_id: str, now: float) -> None:
        wu = self.ledger.wus.get(wu_id)
        if wu is None:
            return
        results = self.ledger.results_for(wu_id)
        for result in validator.tiles_to_check(wu, results):
            if result.id not in self._checks:
                self._checks.update(await asyncio.to_thread(self._freivalds_all, [(wu, result)]))
        decision = validator.decide(wu, results, self._checks, now)
        method = validation_method(wu)
        trust_change: dict[str, tuple[int, int]] = {}
        for result, valid in decision.verdicts:
            host = self.ledger.hosts.get(result.host_id)
            if not valid:
                self.stats["invalid"] += 1
            self.metrics.validation(method, "valid" if valid else "invalid")
            if host is not None:
                update = trust.after_valid if valid else trust.after_invalid
                changed = update(host, self.config.trust)
                trust_change[result.id] = (host.consecutive_valid, changed.consecutive_valid)
                if changed.quarantined and not host.quarantined:
                    self.ledger.log(
                        [
                            Event(
                                now,
                                "host",
                                "quarantined",
                                f"host {host.id} quarantined after {changed.invalid_count} "
                                "invalid results",
                                host_id=host.id,
                            )
                        ]
                    )
                self.ledger.put_host(changed)
        for result in decision.results:
            self.ledger.put_result(result)
        if decision.wu != wu:
            self.ledger.put_wu(decision.wu)
        compared = sum(1 for r in results if r.outcome is Outcome.SUCCESS)
        self.ledger.log(
            [
                _with_data(e, method, compared, trust_change.get(e.result_id))
                if e.kind == "validation"
                else e
                for e in decision.events
            ]
        )
        self.ledger.touched.add(wu_id)
        if decision.decided:
            self._cancel_rest(decision.wu, now)
            await self._assimilate(decision.wu, now)

    async def _check_tiles(self, wu_ids: list[str]) -> None:
        """The Freivalds checks a pass needs, all in one trip to a worker thread, so that a
        report of many small tiles does not cost a thread hand-off and three blob reads for
        each: a panel shared by several tiles is read once."""
        wanted = []
        for wu_id in wu_ids:
            wu = self.ledger.wus.get(wu_id)
            if wu is None:
                continue
            for result in validator.tiles_to_check(wu, self.ledger.results_for(wu_id)):
                if result.id not in self._checks:
                    wanted.append((wu, result))
        if wanted:
            self._checks.update(await asyncio.to_thread(self._freivalds_all, wanted))

    def _freivalds_all(self, wanted: list[tuple[WorkUnit, Result]]) -> dict[str, validator.Check]:
        panels: dict[str, np.ndarray] = {}

        def panel(blob: str) -> np.ndarray:
            if blob not in panels:
                panels[blob] = self.blobs.get_array(blob)
            return panels[blob]

        checks = {}
        for wu, result in wanted:
            tile = self.blobs.get_array(result.output_hash)
            checks[result.id] = self._freivalds(wu, panel(wu.a_panel), panel(wu.b_panel), tile)
            # The tile that passes is assimilated in this pass: no second read from disk.
            self._checked_tiles[result.output_hash] = tile
        return checks

    def _freivalds(
        self, wu: WorkUnit, a: np.ndarray, b: np.ndarray, c: np.ndarray
    ) -> validator.Check:

        return freivalds.verify(
            np.ascontiguousarray(a),
            np.ascontiguousarray(b),
            np.ascontiguousarray(c),
            trans_a=wu.trans_a,
            trans_b=wu.trans_b,
            key=self.key,
            wu_id=wu.id,
            rounds=self.config.freivalds_rounds,
        )

    def _cancel_rest(self, wu: WorkUnit, now: float) -> None:
        """The first valid result won: in-progress replicas are aborted, unsent ones dropped."""
        self._end_replicas(wu, "not needed: the work unit is validated", now)

    def _end_replicas(self, wu: WorkUnit, message: str, now: float) -> int:
        """Unsent results become didnt_need, those in progress aborted (their hosts are told
        in their next work reply); returns how many were aborted."""
        aborted = 0
        for r in self.ledger.results_for(wu.id):
            if r.server_state is ServerState.UNSENT:
                outcome = Outcome.DIDNT_NEED
            elif r.server_state is ServerState.IN_PROGRESS:
                outcome = Outcome.ABORTED
                aborted += 1
            else:
                continue
            self.ledger.put_result(r.evolve(server_state=ServerState.OVER, outcome=outcome))
            self.ledger.log(
                [
                    Event(
                        now,
                        "result",
                        outcome.value,
                        message,
                        wu.step,
                        wu.gemm_id,
                        wu.id,
                        r.id,
                        r.host_id,
                    )
                ]
            )
        return aborted

    async def _assimilate(self, wu: WorkUnit, now: float) -> None:
        output = self.outputs.get(wu.gemm_id)
        if output is None or wu.id not in output.remaining:
            return
        tile = self._checked_tiles.get(wu.canonical_hash)
        if tile is None:
            tile = await asyncio.to_thread(self.blobs.get_array, wu.canonical_hash)
        output.out[wu.i0 : wu.i1, wu.j0 : wu.j1] = tile
        output.remaining.discard(wu.id)
        if wu.state is not WuState.ASSIMILATED:
            self.ledger.put_wu(wu.evolve(state=WuState.ASSIMILATED))
            self.ledger.log(
                [
                    Event(
                        now,
                        "wu",
                        "assimilated",
                        f"tile [{wu.i0}:{wu.i1}, {wu.j0}:{wu.j1}] written",
                        wu.step,
                        wu.gemm_id,
                        wu.id,
                    )
                ]
            )
        if not output.remaining:
            await self.finish_gemm(output, now)

    async def finish_gemm(self, output: GemmOutput, now: float) -> None:
        current = self.ledger.gemms.get(output.gemm.id)
        if self.outputs.get(output.gemm.id) is not output or (
            current is not None and current.state is not GemmState.ACTIVE
        ):
            return  # failed or cancelled while its last tile was being read: it stays so
        await self._judge_late(output.gemm.id, now)
        gemm = output.gemm.evolve(state=GemmState.DONE)
        self.ledger.put_gemm(gemm)
        self.ledger.log(
            [
                Event(
                    now,
                    "gemm",
                    "done",
                    f"{gemm.label or 'gemm'} {gemm.m}x{gemm.n}x{gemm.k} complete",
                    gemm.step,
                    gemm.id,
                )
            ]
        )
        # Forgotten before the commit, with no await since the late replicas were judged: a
        # report that arrives while the commit runs finds the GEMM gone and is answered
        # "late", rather than applied to records that are about to leave memory unjudged.
        self.outputs.pop(gemm.id, None)
        self.ledger.forget_gemm(gemm.id)
        for result_id in [r for r in self._checks if r not in self.ledger.results]:
            del self._checks[result_id]
        await self.ledger.flush()
        if not output.done.done():
            output.done.set_result(output.out)

    async def _judge_late(self, gemm_id: str, now: float) -> None:
        """Replicas that arrived after their tile was decided are compared with the canonical
        tile now: once the GEMM leaves memory, nothing would judge them (and a late liar
        would go unnoticed)."""
        for wu in self.ledger.workunits_for(gemm_id):
            if validator.awaiting_verdict(self.ledger.results_for(wu.id)):
                await self._validate(wu.id, now)

    def _fail_gemm(self, wu: WorkUnit, reason: str, now: float) -> None:
        gemm = self.ledger.gemms.get(wu.gemm_id)
        if gemm is None or gemm.state is not GemmState.ACTIVE:
            return
        message = (
            f"GEMM {gemm.label or gemm.id[:12]} of step {gemm.step} failed: work unit "
            f"{wu.id[:12]} [{wu.i0}:{wu.i1}, {wu.j0}:{wu.j1}]: {reason}"
        )
        log.error(message)
        self.ledger.log([Event(now, "gemm", "failed", message, gemm.step, gemm.id, wu.id)])
        self._mark_failed(gemm, message)

    def _mark_failed(self, gemm: Gemm, message: str) -> None:
        self.ledger.put_gemm(gemm.evolve(state=GemmState.FAILED, error=message))
        self.failed_here.add(gemm.id)
        output = self.outputs.pop(gemm.id, None)
        if output is not None and not output.done.done():
            output.done.set_exception(GemmFailed(message))

    async def cancel_step(self, step: int, now: float) -> dict[str, int]:
        """Stop every product of `step` still being computed: its unsent work is dropped, the
        volunteers holding its work are told to abort it, and whoever waits for a product
        (the training loop) gets GemmFailed. A restarted coordinator runs the step again."""
        async with self._pass_lock:
            return await self._cancel_step(step, now)

    async def _cancel_step(self, step: int, now: float) -> dict[str, int]:
        gemms = [
            g for g in self.ledger.gemms.values() if g.step == step and g.state is GemmState.ACTIVE
        ]
        if not gemms:
            raise NotFound(f"step {step} has no products being computed")
        message = f"step {step} cancelled by the operator"
        counts = {"gemms": len(gemms), "workunits": 0, "aborted": 0}
        for gemm in gemms:
            for wu in self.ledger.workunits_for(gemm.id):
                if wu.state in WU_DECIDED:
                    continue
                counts["workunits"] += 1
                counts["aborted"] += self._cancel_workunit(wu, message, now)
            self.ledger.log([Event(now, "gemm", "cancelled", message, gemm.step, gemm.id)])
            self._mark_failed(gemm, message)
        log.warning(
            "%s: %d products, %d work units dropped, %d results in progress aborted",
            message,
            *counts.values(),
        )
        await self.ledger.flush()
        return counts

    def _cancel_workunit(self, wu: WorkUnit, message: str, now: float) -> int:
        """Returns how many results in progress were aborted."""
        aborted = self._end_replicas(wu, message, now)
        self.ledger.put_wu(
            wu.evolve(state=WuState.ERROR, error_mask=wu.error_mask | WuError.CANCELLED)
        )
        self.ledger.log([Event(now, "wu", "cancelled", message, wu.step, wu.gemm_id, wu.id)])
        return aborted

    def _accelerate_tails(self, now: float) -> None:
        """Spare replicas for the last work units of a GEMM that is nearly done."""
        for output in list(self.outputs.values()):
            if output.gemm is None:
                continue
            wus = self.ledger.workunits_for(output.gemm.id)
            if not wus:
                continue
            done = sum(1 for wu in wus if wu.state in WU_DECIDED)
            if done == len(wus) or done < self.config.tail_fraction * len(wus):
                continue
            for wu in wus:
                if wu.state is not WuState.ACTIVE or wu.accelerated:
                    continue
                if not any(
                    r.server_state is ServerState.IN_PROGRESS
                    for r in self.ledger.results_for(wu.id)
                ):
                    continue
                spare = wu.evolve(target_nresults=wu.target_nresults + 1, accelerated=True)
                self.ledger.put_wu(spare)
                self.ledger.touched.add(wu.id)
                self.ledger.log(
                    [
                        Event(
                            now,
                            "wu",
                            "accelerated",
                            f"tail: {done}/{len(wus)} tiles done; spare replica for a fast host",
                            wu.step,
                            wu.gemm_id,
                            wu.id,
                        )
                    ]
                )


def validation_method(wu: WorkUnit) -> str:
    """How this work unit is decided: a single replica is always checked by Freivalds."""
    return Policy.FREIVALDS.value if wu.min_quorum <= 1 else wu.policy.value


def _with_data(event: Event, method: str, compared: int, cv: tuple[int, int] | None) -> Event:
    fields: dict = {"method": method, "compared": compared}
    if cv is not None:
        fields["trust_before"], fields["trust_after"] = cv
    return dataclasses.replace(event, data=json.dumps(fields))


def new_result_id() -> str:
    return secrets.token_hex(16)


def _with(event: Event, state: str, message: str) -> Event:
    return Event(
        event.time,
        event.kind,
        state,
        message,
        event.step,
        event.gemm_id,
        event.wu_id,
        event.result_id,
        event.host_id,
    )


def _count(values) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return counts
