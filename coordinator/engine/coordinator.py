"""The Coordinator: builds the engine's parts around one ledger and runs their loops.

Each duty lives in its own module (hosts, requests, reports, passes, products, operator,
progress); this class only wires them and starts and stops the background tasks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from pathlib import Path

from coordinator.engine.config import CoordinatorConfig, load_secret
from coordinator.engine.crowd import CrowdWatch
from coordinator.engine.hosts import HostRegistry
from coordinator.engine.neighbours import Neighbours
from coordinator.engine.operator import Operator
from coordinator.engine.passes import Passes
from coordinator.engine.products import GemmFailed, GemmOutput, Products
from coordinator.engine.progress import Progress
from coordinator.engine.recovery import lost_products
from coordinator.engine.reports import Reports
from coordinator.engine.requests import WorkRequests
from coordinator.engine.retention import Retention
from coordinator.engine.uplinks import Uplinks
from coordinator.engine.waiting import QUIET_AFTER, Waiting
from coordinator.rules import trust
from coordinator.rules.access import Access, admin_token
from coordinator.rules.scheduler import (
    Scheduler,
    tile_upload_bytes,
    too_slow_to_upload,
    uploads_tile,
)
from coordinator.state.blobs import BlobStore
from coordinator.state.ledger import Ledger
from coordinator.state.store import Store
from coordinator.work.records import GemmState, Host, WorkUnit, WuState
from kernels import nn

__all__ = ["Coordinator", "CoordinatorConfig", "GemmFailed", "GemmOutput"]

log = logging.getLogger(__name__)

REPLY_PRUNE_EVERY = 60.0  # seconds between prunes of the stored work replies
WAIT_CHECK_EVERY = 1.0  # seconds between looks at why work waits
# Why a host that needed a straggler's spare sat on its tile, as its answers say it.
STRAGGLED = (
    "a tile this volunteer held was still out long after the others', and went to "
    "another volunteer too"
)


class Coordinator:
    """One project's coordinator: its store, ledger and blobs, and the parts that act on them.

    The server calls the parts (`hosts`, `requests`, `reports`, `operator`, `progress`); the
    training loop calls `products.matmul`; `passes` runs in the background."""

    def __init__(self, config: CoordinatorConfig, store: Store) -> None:
        self.config = config
        self.directory = Path(config.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.store = store
        self.blobs = BlobStore(
            self.directory / "blobs",
            config.max_blob_bytes,
            config.recent_blob_bytes,
            behind_bytes=config.unwritten_blob_bytes,
        )
        self.ledger = Ledger(store)
        self.key = load_secret(self.directory)
        self.access = Access(config.access, admin_token(self.directory))
        rng = random.Random(config.seed) if config.seed is not None else random.SystemRandom()
        self.scheduler = Scheduler(self.ledger, config.scheduler, rng)
        self.stats = {"bytes_saved": 0, "tiles_in": 0, "work_requests": 0, "invalid": 0}
        self.progress = Progress(self.ledger, self.stats)
        self.metrics = self.progress.metrics
        self.hosts = HostRegistry(self.ledger, self.access, config.trust)
        self.neighbours = Neighbours(nn.cpu_count())
        self.requests = WorkRequests(
            config, self.ledger, store, self.scheduler, self.stats, self.blobs
        )
        self.uplinks = Uplinks()
        self.crowd = CrowdWatch(self.ledger, self.uplinks)
        self.products = Products(config, self.ledger, store, self.blobs, self.crowd)
        self.retention = Retention(self.directory, self.ledger, store, self.blobs)
        self.passes = Passes(
            config, self.ledger, self.blobs, self.products, self.key, self.metrics, self.stats
        )
        self.reports = Reports(
            config,
            self.ledger,
            store,
            self.blobs,
            self.metrics,
            self.stats,
            arrived=self.passes.arrived,
            wake=self.passes.wake,
            crowd=self.crowd,
            uplinks=self.uplinks,
            hold=self.products.hold,
        )
        self.operator = Operator(self.ledger, self.requests, self.passes, self.products)
        self.products.judge_late = self.passes.judge_late
        self.products.published = self.passes.wake
        self.passes.after_pass = self.progress.sample_rate
        self.progress.paused = lambda: self.requests.paused
        self.waiting = Waiting(
            self.ledger,
            lambda: self.requests.paused,
            self._storage_failure,
            self._too_slow,
            self._quiet,
            self._owner_busy,
        )
        self.progress.waiting = lambda: self.waiting.current
        self.requests.why_waiting = self.waiting.note
        self.requests.between_products = lambda: self.products.between
        self.requests.crowd = self.crowd.hosts
        self.crowd.away = self.requests.owner_busy.__contains__
        self.progress.owner_busy = self.requests.owner_busy.__contains__
        self.requests.on_paused = self.passes.paused
        self.requests.on_resumed = self.passes.resumed
        self.requests.on_probation = self.passes.probation
        self.requests.sat_on = self._sat_on
        self.requests.upload_per_byte = self.uplinks.per_byte
        self.requests.uplinks_too_slow = lambda: self.waiting.reason == "hosts_too_slow"
        self.reports.reported = self.requests.reported
        self.ledger.on_unsent = self.requests.signal_work
        self.ledger.on_quarantined = self._take_back
        self.passes.sat_on = self._sat_on
        self.ledger.on_promise = self.passes.wake
        # The background passes (validate, transition, assimilate, commit): they run until
        # stop() and end early only by failing, which whoever waits on the work must see.
        self.loop: asyncio.Task | None = None
        self._tasks: list[asyncio.Task] = []

    def _too_slow(self, host: Host, wu: WorkUnit) -> float:
        """Seconds the host's uplink would take to send the work unit's tile, when that is
        more than a deadline allows (engine/waiting.py); 0.0 when it may take it, or would
        send only the tile's hash (a quorum's later replica)."""
        per_byte = self.uplinks.per_byte(host.id)
        if not per_byte or not too_slow_to_upload(wu, per_byte, self.config.scheduler):
            return 0.0
        if not uploads_tile(wu, self.ledger.results_for(wu.id), self.config.scheduler):
            return 0.0
        return tile_upload_bytes(wu) * per_byte

    def _quiet(self, host: Host, now: float) -> float:
        """Seconds since the host was last heard from, when it holds no work and is long
        past due to ask again (engine/waiting.py): a volunteer killed, asleep or cut off,
        which counts as connected for a minute yet. 0.0 otherwise."""
        if self.ledger.in_progress_of.get(host.id):
            return 0.0  # due by its results' deadlines, which the passes watch
        late = now > self.requests.due_back(host) + QUIET_AFTER
        return now - host.last_contact if late else 0.0

    def _owner_busy(self, host: Host) -> bool:
        """Whether the host's last request said its owner uses the machine (`paused`)."""
        return host.id in self.requests.owner_busy

    def _sat_on(self, host_id: int, now: float, why: str = STRAGGLED) -> None:
        """A host sat on tiles (a straggler's, or on probation): a missed deadline for its
        standing (no trust, half the quota), and no new work for a while, longer each time
        in a row."""
        host = self.ledger.hosts.get(host_id)
        if host is None:
            return
        self.ledger.put_host(trust.after_error(host, self.config.trust))
        seconds = self.requests.cooling.sat_on(host_id, now, why)
        log.info(
            "host %d %r sat on its work (%s): it gets no new work for %.0fs",
            host_id,
            host.name,
            why,
            seconds,
        )

    def _take_back(self, host_id: int) -> None:
        taken = self.products.take_back(
            host_id, f"taken back: host {host_id} is quarantined", time.time()
        )
        if taken:
            log.info(
                "host %d is quarantined: %d result(s) it held go to other hosts", host_id, taken
            )
        self.passes.wake()

    async def start(self) -> None:
        swept = await asyncio.to_thread(self.blobs.sweep_temporary)
        if swept:
            log.info(
                "removed %d unfinished blob file(s) left in %s by a stop", swept, self.blobs.root
            )
        await self.store.open()
        snapshot = await self.store.load()
        self.ledger.restore(snapshot)
        # The steps of the panels of every work unit still stored, finished ones too: the
        # hosts hold them from before the restart, and are told to drop those of steps
        # before the products in flight (rules/scheduler.stale_panels).
        self.ledger.panel_step.update(await self.store.panel_steps())
        for wu in snapshot.workunits:
            if wu.state is WuState.ACTIVE:
                self.passes.to_validate.add(wu.id)
            for panel in (wu.a_panel, wu.b_panel):
                size = self.ledger.panel_bytes.get(panel)
                if size is None and self.blobs.has(panel):
                    size = self.blobs.size(panel)
                if size is not None:
                    self.ledger.add_panel(panel, size, wu.step)
        lost = list(lost_products(self.ledger, self.blobs))
        for gemm in lost:
            # Failed as in an earlier run: the training loop runs it again when it gets there.
            message = "its panels or tiles, held in memory, were lost at a stop"
            log.debug("%s of step %d: %s", gemm.label or gemm.id[:12], gemm.step, message)
            self.products.drop(gemm, message, time.time())
        if lost:
            log.info(
                "%d product(s) in flight at the stop lost their panels or tiles, held in "
                "memory and not written (expected after a kill): the training loop runs them "
                "again",
                len(lost),
            )
        active = [g for g in self.ledger.gemms.values() if g.state is GemmState.ACTIVE]
        for gemm in active:
            self.products.hold_restored(gemm)
        await self._restore_pause()
        if snapshot.gemms:  # a restart: said even when none of its products survived
            log.info(
                "resuming %d product(s) in flight with %d work units",
                len(active),
                sum(len(self.ledger.wus_of.get(g.id, ())) for g in active),
            )
        # From now on a host can reach it: what it held from before is judged from here.
        self.passes.started = self.requests.started = time.time()
        self.loop = asyncio.create_task(self.passes.run(), name="tilehive-passes")
        self._tasks = [
            self.loop,
            asyncio.create_task(self._housekeeping(), name="tilehive-housekeeping"),
            asyncio.create_task(self._watch_waiting(), name="tilehive-waiting"),
        ]

    async def _restore_pause(self) -> None:
        """A pause outlasts a restart: the operator paused for a reason only they can undo."""
        paused = await self.store.recent_events("project", "paused", 1)
        resumed = await self.store.recent_events("project", "resumed", 1)
        if paused and (not resumed or paused[0].time >= resumed[0].time):
            self.requests.paused = True
            log.warning(
                "the project is paused, as its operator left it: no new work goes out "
                "(tilehive admin resume URL --project DIR)"
            )

    async def stop(self) -> None:
        self.products.recomputed.flush()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                # Logged where it failed; the store must still be closed.
                await task
        self._tasks.clear()
        self.neighbours.close()
        try:
            await self.ledger.flush()
            await asyncio.to_thread(self.blobs.close)
        finally:
            # Always: an open database keeps its worker thread, and so the process, alive.
            await self.store.close()

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(REPLY_PRUNE_EVERY)
            await self.requests.prune_replies(time.time())

    async def _watch_waiting(self) -> None:
        while True:
            await asyncio.sleep(WAIT_CHECK_EVERY)
            now = time.time()
            self.neighbours.update(now)  # a volunteer on this machine gone quiet frees its cores
            if self.waiting.check(now):
                await self.ledger.flush()

    def finish(self, now: float) -> None:
        """Training is done: every work request is answered `finished` from now on."""
        self.requests.finish()
        self.waiting.end(now)
        self.products.recomputed.flush()

    def _storage_failure(self) -> str | None:
        failure = self.blobs.failure
        if failure is None:
            return None
        return f"{self.blobs.root} cannot be written ({failure.strerror or failure})"

    # The parts' state that the server, the command line and the tests read.

    @property
    def paused(self) -> bool:
        return self.requests.paused

    @property
    def outputs(self) -> dict[str, GemmOutput]:
        return self.products.outputs
