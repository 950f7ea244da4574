"""The background passes: validate what arrived, move due work units on, assimilate, commit.

BOINC runs these as separate daemons that hand off by flags on the rows; here they are one
loop over the ledger's hand-off sets (`to_validate`, `touched`, the due heap), one pass at a
time, so an operator's cancel never lands between a look at a work unit and its change."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable

import numpy as np

import kernels
from coordinator.engine.config import CoordinatorConfig
from coordinator.engine.metrics import Metrics
from coordinator.engine.offload import offload
from coordinator.engine.products import Products
from coordinator.engine.reports import quarantine_event
from coordinator.rules import sizing, trust, validator
from coordinator.rules.scheduler import queued_upload_bytes
from coordinator.rules.transitioner import transition
from coordinator.state.blobs import BlobStore
from coordinator.state.ledger import Ledger
from coordinator.work.events import Event
from coordinator.work.records import (
    Host,
    Outcome,
    Policy,
    Result,
    ServerState,
    ValidateState,
    WorkUnit,
    WuState,
    new_result_id,
    short_workunit_id,
)
from validation import freivalds

log = logging.getLogger(__name__)

# A pass's decisions (verdicts, assimilated tiles, finished products) promise nobody anything
# until a reply or a caller depends on them: they wait this long for the next reply's commit
# to take them along (one transaction a product, not three), and then go on their own.
COMMIT_WINDOW = 0.1  # seconds
# What a reply promised (Ledger.commit_soon) is committed this long after the first such
# reply, with what the replies leaving meanwhile promise: a tiny-gpt product's assignment,
# report and verdict then mostly share one transaction, and its rows are written once in
# it: 11 commits and 163 statements a step instead of 34 and 381. A kill loses what the
# replies of at most this window (and the rest of a pass under way) promised; before, it
# lost what the replies during one pass promised.
PROMISE_WINDOW = 0.01  # seconds
# How often the passes look for stragglers: a walk over the work units of every product in
# flight, which every pass would pay for nothing (a pass runs at least every second).
STRAGGLER_LOOK = 0.5  # seconds


class Passes:
    """One pass at a time over the work that changed: validator, transitioner, assimilator."""

    def __init__(
        self,
        config: CoordinatorConfig,
        ledger: Ledger,
        blobs: BlobStore,
        products: Products,
        key: bytes,
        metrics: Metrics,
        stats: dict,
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.blobs = blobs
        self.products = products
        self.key = key
        self.metrics = metrics
        self.stats = stats
        self.to_validate: set[str] = set()  # work units with a new success
        self.lock = asyncio.Lock()  # one pass or one operator's cancel at a time
        self._checks: dict[str, validator.Check] = {}
        self._wake = asyncio.Event()
        self.after_pass = lambda now: None  # the Coordinator's bookkeeping (tile rates)
        self._stragglers_seen = 0.0  # when the passes last looked for stragglers
        # When this coordinator started serving (the Coordinator sets it). Work restored at
        # a start was out while it was down: a host could not report to it then, nor until
        # it is heard from again, so that time is held against no host (it neither sat on
        # a tile nor missed a deadline).
        self.started = time.time()
        # A host sat on a tile that needed a straggler's spare (the Coordinator: no new work
        # for it a while, rules/cooling.py).
        self.sat_on: Callable[[int, float], None] = lambda host_id, now: None
        # Holders of spared tiles whose own uplink, or whose owner, might explain the wait,
        # and of the tiles a host on probation took: result id -> (host id, when it is
        # judged, the seconds it has once its pause ends; 0.0: not yet put off by a pause).
        # Still out then, the host sat on it after all. A paused host's is judged `math.inf`
        # until its first request after the pause (`resumed`).
        self._judging: dict[str, tuple[int, float, float]] = {}
        # Spared tiles out since before a restart whose holder has not been heard from since:
        # result id -> (host id, the seconds it has once it is, from then: `_judged`).
        self._unheard: dict[str, tuple[int, float]] = {}
        # Hosts paused for their owners (`paused`, through WorkRequests.on_paused) that may
        # hold work not yet spared: each pass spares it, once another host is at work.
        self._paused: set[int] = set()

    def wake(self) -> None:
        self._wake.set()

    def paused(self, host_id: int, now: float) -> None:
        """A host's owner needs its machine: spare what it holds, in a pass run now. What it
        was already to be judged for (a straggler's or a probation tile: spared already)
        waits for the pause's end, with the time it had left; once, or a host saying
        `paused` between its asks would never be judged."""
        self._paused.add(host_id)
        for result_id, (holder, judged_at, allowed) in list(self._judging.items()):
            if holder == host_id and not allowed and now < judged_at < math.inf:
                self._judging[result_id] = (holder, math.inf, judged_at - now)
        self.wake()

    def resumed(self, host_id: int, now: float) -> None:
        """A paused host asks or reports again: the tiles spared for its pause are judged
        from now, as a straggler's are from their spare, and those it was to be judged for
        before the pause with the time they had left. A later pause does not put that
        off: a host that said `paused` between taking tiles would never be judged."""
        self._paused.discard(host_id)
        for result_id, (holder, judged_at, allowed) in list(self._judging.items()):
            if holder == host_id and judged_at == math.inf:
                self._judging[result_id] = (holder, now + allowed, allowed)

    def arrived(self, wu_id: str) -> None:
        """A report brought a success for this work unit: validate it in the next pass."""
        self.to_validate.add(wu_id)

    async def run(self) -> None:
        """Pass after pass until cancelled; a pass that fails ends the loop (and training)."""
        while True:
            try:
                await self.step(time.time())
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("coordinator loop failed; stopping")
                raise
            delay = min(
                self.ledger.next_due() - time.time(),
                self.ledger.commit_due_in(COMMIT_WINDOW, PROMISE_WINDOW),
                1.0,
            )
            if self._wake.is_set() or self.ledger.touched or self.to_validate:
                delay = 0
            self._wake.clear()
            if delay > 0:
                # Not asyncio.wait_for: on Python 3.11 a wake and a cancel landing together
                # make it return instead of raising, and the loop would outlive its stop.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._wake.wait()
            else:
                await asyncio.sleep(0)

    async def step(self, now: float) -> None:
        """One pass: validate what arrived, move due work units on, assimilate; commit what
        has waited COMMIT_WINDOW, or was promised PROMISE_WINDOW ago."""
        # A pass awaits (Freivalds, reading tiles, commits) between looking at a work unit
        # and changing it; an operator's cancel must not land in between.
        async with self.lock:
            await self._step(now)

    async def _step(self, now: float) -> None:
        to_validate, self.to_validate = self.to_validate, set()
        try:
            await self._check_tiles(sorted(to_validate))
            for wu_id in sorted(to_validate):
                await self.validate(wu_id, now)
                await self._commit_if_due()  # a long pass holds nothing past the window
        finally:
            self.products.tiles.clear()
        exhausted = [
            wu_id for wu_id in sorted(self.ledger.pop_due(now)) if self._transition(wu_id, now)
        ]
        try:
            for wu_id in exhausted:
                await self._last_resort(wu_id, now)
        finally:
            self.products.tiles.clear()
        self._accelerate_tails(now)
        if self._paused:
            self._spare_paused(now)
        if now - self._stragglers_seen >= STRAGGLER_LOOK:
            self._stragglers_seen = now
            self._spare_stragglers(now)
        self.after_pass(now)
        await self._commit_if_due()

    async def _commit_if_due(self) -> None:
        if self.ledger.commit_due_in(COMMIT_WINDOW, PROMISE_WINDOW) == 0:
            await self.ledger.flush()

    def _transition(self, wu_id: str, now: float) -> bool:
        """Move a due work unit on; True when the crowd's budget for it just ran out."""
        wu = self.ledger.wus[wu_id]
        if wu.state in (WuState.ASSIMILATED, WuState.ERROR) and not any(
            r.server_state is ServerState.UNSENT for r in self.ledger.results_for(wu_id)
        ):
            return False
        change = transition(wu, self.ledger.results_for(wu_id), now, new_result_id)
        for result in change.results:
            if result.outcome is Outcome.NO_REPLY and result.host_id in self.ledger.hosts:
                host = self.ledger.hosts[result.host_id]
                missed_while_down = (result.report_deadline or now) < self.started
                if self.heard_from_since_start(host) and not missed_while_down:
                    self.ledger.put_host(trust.after_error(host, self.config.trust))
        for result in change.results:
            self.ledger.put_result(result)
        if change.wu != wu:
            self.ledger.put_wu(change.wu)
        self.ledger.log(change.events)
        if change.exhausted:
            log.warning(
                "step %d: work unit %s [%d:%d, %d:%d]: %s; the coordinator computes it",
                wu.step,
                short_workunit_id(wu.id),
                wu.i0,
                wu.i1,
                wu.j0,
                wu.j1,
                change.exhausted,
            )
        return change.exhausted is not None

    async def _last_resort(self, wu_id: str, now: float) -> None:
        """Compute the tile here, judge the results that came in against it (a liar among
        them loses its trust as usual), and assimilate it."""
        wu = self.ledger.wus[wu_id]

        def compute() -> str:
            tile = kernels.gemm(
                self.blobs.get_array(wu.a_panel),
                self.blobs.get_array(wu.b_panel),
                trans_a=wu.trans_a,
                trans_b=wu.trans_b,
            )
            blob = self.blobs.put(kernels.encode_array(tile), hold=True)
            self.products.tiles[blob] = tile
            return blob

        # The kernel's bits, which every honest host returns: the coordinator's own result.
        blob = await asyncio.to_thread(compute)
        self.products.hold(wu.gemm_id, [blob])
        mine = Result(
            id=new_result_id(),
            wu_id=wu.id,
            server_state=ServerState.OVER,
            outcome=Outcome.SUCCESS,
            validate_state=ValidateState.VALID,
            received_time=now,
            output_hash=blob,
            has_tile=True,
        )
        self.ledger.put_result(mine)
        wu = self.ledger.wus[wu.id].evolve(
            state=WuState.VALIDATED, canonical_result=mine.id, canonical_hash=blob
        )
        self.ledger.put_wu(wu)
        message = "validated: computed by the coordinator (last resort)"
        self.ledger.log([Event.about(wu, now, WuState.VALIDATED.value, message)])
        await self.validate(wu.id, now)
        await self.products.assimilate(self.ledger.wus[wu.id], now)

    async def validate(self, wu_id: str, now: float) -> None:
        wu = self.ledger.wus.get(wu_id)
        if wu is None:
            return
        results = self.ledger.results_for(wu_id)
        for result in validator.tiles_to_check(wu, results):
            if result.id not in self._checks:
                checks = await offload(
                    lambda r=result: self._freivalds_all([(wu, r)]), check_bytes([wu])
                )
                self._checks.update(checks)
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
                    self.ledger.log([quarantine_event(changed, now)])
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
            self.products.end_replicas(decision.wu, "not needed: the work unit is validated", now)
            await self.products.assimilate(decision.wu, now)

    async def judge_late(self, gemm_id: str, now: float) -> None:
        """Replicas that arrived after their tile was decided are compared with the canonical
        tile now: once the GEMM leaves memory, nothing would judge them (and a late liar
        would go unnoticed). Its checks leave memory with it."""
        for wu in self.ledger.workunits_for(gemm_id):
            if validator.awaiting_verdict(self.ledger.results_for(wu.id)):
                await self.validate(wu.id, now)
        for wu in self.ledger.workunits_for(gemm_id):
            for result_id in self.ledger.results_of.get(wu.id, ()):
                self._checks.pop(result_id, None)

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
            size = check_bytes([wu for wu, _ in wanted])
            self._checks.update(await offload(lambda: self._freivalds_all(wanted), size))

    def _freivalds_all(self, wanted: list[tuple[WorkUnit, Result]]) -> dict[str, validator.Check]:
        panels: dict[str, np.ndarray] = {}

        def panel(blob: str) -> np.ndarray:
            if blob not in panels:
                panels[blob] = self.blobs.get_array(blob)
            return panels[blob]

        checks = {}
        for wu, result in wanted:
            tile = self.blobs.get_array(result.output_hash)
            checks[result.id] = freivalds.verify(
                np.ascontiguousarray(panel(wu.a_panel)),
                np.ascontiguousarray(panel(wu.b_panel)),
                np.ascontiguousarray(tile),
                trans_a=wu.trans_a,
                trans_b=wu.trans_b,
                key=self.key,
                wu_id=wu.id,
                rounds=self.config.freivalds_rounds,
            )
            # The tile that passes is assimilated in this pass: no second read from disk.
            self.products.tiles[result.output_hash] = tile
        return checks

    def _spare_paused(self, now: float) -> None:
        """A spare replica for each work unit a paused host holds (an `--idle-only`
        volunteer whose owner uses the machine): held through the pause, it would hold up
        its product until its deadline. Once a work unit (`accelerated`), as a straggler's,
        and once another host is at work (till then the host stays queued). Its host keeps
        its replica, which it computes if its owner is done first; it is judged only from
        the end of its pause (`resumed`), not for the pause."""
        watch = self.products.crowd
        if watch is None:
            return
        for host_id in sorted(self._paused):
            if not watch.others_working(now, host_id):
                continue  # no one to take a spare: the paused host computes its tiles later
            self._paused.discard(host_id)
            uploads = queued_upload_bytes(self.ledger, host_id) * watch.uplinks.per_byte(host_id)
            for result_id in list(self.ledger.in_progress_of.get(host_id, ())):
                result = self.ledger.results.get(result_id)
                wu = self.ledger.wus.get(result.wu_id) if result is not None else None
                if wu is None or wu.state is not WuState.ACTIVE or wu.accelerated:
                    continue
                results = self.ledger.results_for(wu.id)
                if any(r.server_state is ServerState.UNSENT for r in results):
                    continue  # a replica already waits for another host
                message = (
                    f"host {host_id} holding it is paused while its owner uses the machine "
                    "(--idle-only); spare replica for another host"
                )
                self._spare_one(wu, now, message)
                expected = sizing.tile_seconds(*wu.shape, watch.crowd(now))
                lag = max(self.config.straggler_floor, self.config.straggler_factor * expected)
                allowed = lag + self.config.straggler_factor * uploads
                self._judging[result_id] = (host_id, math.inf, allowed)

    def probation(self, host_id: int, result_ids: list[str], now: float) -> int:
        """Tiles just given to a host on probation (it sat on a tile and has computed
        nothing since, rules/cooling.py): each gets a spare replica at once, so that its
        product does not wait a straggler's time to learn again what it learnt once. The
        host is judged for each as for a spared straggler's: still out in its hands a
        straggler's time from now, it sat on it too. A copy dropped because the spare
        decided its work unit first is not held against it, one at a time (WorkRequests
        counts them: PROBATION_TILES, none computed, are sat on).
        With no other host at work there is no one to take a spare: the straggler rule
        looks at those tiles as at any other's. Returns how many tiles were spared (or
        were already): those count towards its PROBATION_TILES (rules/cooling.py)."""
        watch = self.products.crowd
        if watch is None or not watch.others_working(now, host_id):
            return 0
        spared = 0
        factor = self.config.straggler_factor
        uploads = queued_upload_bytes(self.ledger, host_id) * watch.uplinks.per_byte(host_id)
        for result_id in result_ids:
            result = self.ledger.results.get(result_id)
            wu = self.ledger.wus.get(result.wu_id) if result is not None else None
            if wu is None or wu.state is not WuState.ACTIVE:
                continue
            expected = sizing.tile_seconds(*wu.shape, watch.crowd(now))
            lag = max(self.config.straggler_floor, factor * expected) + factor * uploads
            self._judging[result_id] = (host_id, now + lag, 0.0)
            spared += 1
            if wu.accelerated:
                continue  # spared already (a straggler's, the tail's, a paused host's)
            message = (
                f"probation: host {host_id} holding it sat on a tile and has computed "
                "nothing since; spare replica for another host"
            )
            self._spare_one(wu, now, message)
        self.wake()
        return spared

    def _spare_one(self, wu: WorkUnit, now: float, message: str) -> None:
        """One replica more of `wu` for another host (the transitioner makes it), once a
        work unit (`accelerated`), and why in the task log."""
        self.ledger.put_wu(wu.evolve(target_nresults=wu.target_nresults + 1, accelerated=True))
        self.ledger.touched.add(wu.id)
        self.ledger.log([Event.about(wu, now, "accelerated", message)])

    def _spare_stragglers(self, now: float) -> None:
        """A spare replica for each work unit whose replicas have all been out far longer
        than a tile takes the crowd: the tail rule spares only products nearly done, and a
        product of one tile, or one host sitting on its tiles, is never nearly done. Once a
        work unit (`accelerated`), and only with another host in service to take it."""
        sitting = set(self._judged(now))  # hosts that sat on a spared tile: once each
        self._spare(now, sitting)
        for host_id in sorted(sitting):
            self.sat_on(host_id, now)

    def _spare(self, now: float, sitting: set[int]) -> None:
        """The spares of _spare_stragglers; the hosts found sitting on their tiles (or to be
        judged later: _judge) go into `sitting`."""
        watch = self.products.crowd
        if watch is None:
            return
        floor = self.config.straggler_floor
        for output in list(self.products.outputs.values()):
            if output.gemm is None or now - output.gemm.created < floor:
                continue  # none of its tiles can have been out that long: most products
            for wu_id in list(output.remaining):
                wu = self.ledger.wus.get(wu_id)
                if wu is None or wu.state is not WuState.ACTIVE or wu.accelerated:
                    continue
                results = self.ledger.results_for(wu.id)
                if straggling(results, now, floor, self.started) is None:
                    continue  # the common case: no crowd looked at (its view is cached)
                crowd = watch.crowd(now)
                if crowd.hosts < 2:
                    return
                expected = sizing.tile_seconds(*wu.shape, crowd)
                lag = max(floor, self.config.straggler_factor * expected)
                age = straggling(results, now, lag, self.started)
                if age is None:
                    continue
                for r in results:
                    if r.server_state is ServerState.IN_PROGRESS and r.host_id is not None:
                        self._judge(r, lag, watch.uplinks.per_byte(r.host_id), now, sitting)
                message = (
                    f"straggler: out {age:.1f}s where a tile takes the crowd about "
                    f"{expected:.2f}s; spare replica for another host"
                )
                self._spare_one(wu, now, message)

    def _judge(
        self, result: Result, lag: float, per_byte: float, now: float, sitting: set[int]
    ) -> None:
        """A spare goes out beside the result: its host sat on the tile, unless its own
        uplink explains the wait (a slow home uplink among fast hosts is slow, not
        hoarding). Then it is judged once its uplink could have sent the uploads queued on
        it, this tile's included, `straggler_factor` times over: still out then, it sat on
        it after all."""
        host_id = result.host_id
        assert host_id is not None
        uploads = per_byte * queued_upload_bytes(self.ledger, host_id) if per_byte else 0.0
        allowed = lag + self.config.straggler_factor * uploads
        host = self.ledger.hosts.get(host_id)
        if host is not None and not self.heard_from_since_start(host):
            # Out since before a restart: judged from its return, as a paused host is from
            # its pause's end.
            self._unheard[result.id] = (host_id, allowed)
            return
        judged_at = max(result.sent_time or now, self.started) + allowed
        if judged_at <= now:
            sitting.add(host_id)
            self._judging.pop(result.id, None)  # judged now: not again for the same tile
        else:
            self._judging[result.id] = (host_id, judged_at, 0.0)

    def _judged(self, now: float) -> list[int]:
        """Hosts whose time to send a spared tile has run out with the tile still out."""
        for result_id, (host_id, allowed) in list(self._unheard.items()):
            result = self.ledger.results.get(result_id)
            host = self.ledger.hosts.get(host_id)
            if result is None or result.server_state is not ServerState.IN_PROGRESS:
                del self._unheard[result_id]  # reported, given back or timed out: done
            elif host is not None and self.heard_from_since_start(host):
                del self._unheard[result_id]  # back: its time runs from its return
                self._judging[result_id] = (host_id, host.last_contact + allowed, allowed)
        hosts = []
        for result_id, (host_id, judged_at, _) in list(self._judging.items()):
            result = self.ledger.results.get(result_id)
            if result is None or result.server_state is not ServerState.IN_PROGRESS:
                del self._judging[result_id]  # reported, given back or timed out: done
            elif judged_at <= now:
                del self._judging[result_id]
                hosts.append(host_id)
        return hosts

    def heard_from_since_start(self, host: Host) -> bool:
        """Whether the host has asked or reported since this coordinator started: one that
        has not could not have reported what it holds (it may not know of the restart yet)."""
        return host.last_contact >= self.started

    def _accelerate_tails(self, now: float) -> None:
        """Spare replicas for the last work units of a GEMM that is nearly done."""
        for output in list(self.products.outputs.values()):
            if output.gemm is None:
                continue
            # How far it is, from its own set of tiles not yet written in: a walk over every
            # work unit of every product each pass, only to count, was about 2% of the loop
            # in the throughput benchmark.
            gemm_id = output.gemm.id
            total = len(self.ledger.wus_of.get(gemm_id, ()))
            done = total - len(output.remaining)
            if not total or done == total or done < self.config.tail_fraction * total:
                continue
            wus = self.ledger.workunits_for(gemm_id)
            for wu in wus:
                if wu.state is not WuState.ACTIVE or wu.accelerated:
                    continue
                if not any(
                    r.server_state is ServerState.IN_PROGRESS
                    for r in self.ledger.results_for(wu.id)
                ):
                    continue
                message = f"tail: {done}/{len(wus)} tiles done; spare replica for a fast host"
                self._spare_one(wu, now, message)


def straggling(results: list[Result], now: float, lag: float, since: float) -> float | None:
    """How long the replicas in progress of a work unit have all been out, counted from
    `since` at the earliest, if each has been out `lag` seconds or more and none is waiting
    to be sent; else None."""
    out = [r for r in results if r.server_state is ServerState.IN_PROGRESS]
    if not out or any(r.server_state is ServerState.UNSENT for r in results):
        return None
    youngest = now - max(max(r.sent_time or now, since) for r in out)
    return youngest if youngest >= lag else None


def check_bytes(wus: list[WorkUnit]) -> int:
    """Bytes a Freivalds check of these work units' tiles reads: tile and both panels."""
    return sum(sizing.tile_bytes(*wu.shape) for wu in wus)


def validation_method(wu: WorkUnit) -> str:
    """How this work unit is decided: a single replica is always checked by Freivalds."""
    return Policy.FREIVALDS.value if wu.min_quorum <= 1 else wu.policy.value


def _with_data(event: Event, method: str, compared: int, cv: tuple[int, int] | None) -> Event:
    # What json.dumps would write for these fields, written out: two a work unit, and dumps
    # took a few percent of the loop in the throughput benchmark. `method` is a Policy value.
    data = f'{{"method": "{method}", "compared": {compared:d}'
    if cv is not None:
        data += f', "trust_before": {cv[0]:d}, "trust_after": {cv[1]:d}'
    return Event(*event[:-1], data + "}")
