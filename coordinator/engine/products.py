"""Products: a GEMM's whole life, from `await products.matmul(a, b)` to its filled output.

A product is published (operand panels as blobs, one work unit per output tile), its tiles
are assimilated as the validator decides them, and it finishes, fails or is cancelled here.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import numpy as np

import kernels
from coordinator.engine.config import CoordinatorConfig
from coordinator.engine.crowd import CrowdWatch
from coordinator.engine.offload import copy_in_pieces, offload
from coordinator.engine.operands import OperandIds
from coordinator.engine.recovery import (
    Recomputed,
    canonical_tile,
    panel_ids,
    panels,
    restore_panels,
)
from coordinator.rules import scheduler, sizing
from coordinator.state.blobs import BlobStore
from coordinator.state.ledger import Ledger
from coordinator.state.store import Store
from coordinator.work.events import Event
from coordinator.work.records import (
    WU_DECIDED,
    Gemm,
    GemmState,
    Outcome,
    Result,
    ServerState,
    WorkUnit,
    WuError,
    WuState,
    gemm_id,
    new_result_id,
    tile_bounds,
    tile_workunit,
)
from kernels.checks import check_gemm_args

log = logging.getLogger(__name__)

STORAGE_RETRY_MAX = 30.0  # seconds between attempts to store operand panels, at most

FILLED = (WuState.VALIDATED, WuState.ASSIMILATED)


def upload_capped(config: CoordinatorConfig) -> sizing.SizingConfig:
    """The sizing settings, with the longest upload a tile may cost the typical host from
    the project's delay_bound (unless they give one)."""
    if config.sizing.max_upload_seconds != math.inf:
        return config.sizing
    delay_bound = config.redundancy.for_policy(config.policy).delay_bound
    budget = scheduler.upload_budget(delay_bound, config.scheduler)
    return replace(config.sizing, max_upload_seconds=UPLOAD_SHARE * budget)


class GemmFailed(RuntimeError):
    """A work unit of this GEMM failed for good; the message says which and why."""


def attempts_said(earlier: list[Gemm], now: Gemm | None) -> str:
    """One log line for a product whose earlier attempts ended before this run (a restart
    walks them all: it said a line for each, for each micro-batch): why the last ended, and
    whether the next is run anew or resumed."""
    last = earlier[-1]
    attempt = len(earlier) + 1
    if last.state is GemmState.PRUNED:
        # Its step's checkpoint was written, and is gone now (moved aside as damaged):
        # training went back to the one before, and runs the step again, bit for bit.
        why = "was let go after a checkpoint that is gone"
    else:
        # Pruned attempts finished (their checkpoint is what went): not counted here.
        failed = sum(1 for gemm in earlier if gemm.state is GemmState.FAILED)
        runs = "an earlier run" if failed == 1 else f"{failed} earlier runs"
        why = f"did not finish in {runs} ({last.error or 'no reason recorded'})"
    if now is None:
        then = f"running it again (attempt {attempt})"
    elif now.state is GemmState.ACTIVE:
        then = f"resuming attempt {attempt}, in flight at the stop"
    else:
        then = f"attempt {attempt} is {now.state.value} already"
    return f"step {last.step}: {last.label or f'GEMM {last.id[:12]}'} {why}; {then}"


@dataclass(slots=True)
class GemmOutput:
    """An awaited product being filled tile by tile."""

    gemm: Gemm | None  # None while its work is being published
    out: np.ndarray
    remaining: set[str]
    done: asyncio.Future


# Turns of the loop from a product's future being set to its matmul() running again: the
# future's callback, then the shield's (Products.matmul).
HAND_OVER_TURNS = 2
# A tile's upload takes the crowd's typical uplink at most this share of what the scheduler
# lets a host queue (rules/scheduler.py, upload_budget): that host then holds a few tiles.
UPLOAD_SHARE = 0.25
BETWEEN_WEIGHT = 0.2  # of each new sample in Products.between, a moving average


async def hand_over() -> None:
    """Let the training loop take a finished product before the caller goes on.

    When one pass validates both micro-batches' products, the first one's next product is
    published, and the host long-polling for it answered, before the second's element-wise
    work runs: the volunteer computes while the coordinator works, rather than both
    micro-batches going out together, computed one after the other and reported together
    (docs/architecture.md, "The micro-batches take turns")."""
    for _ in range(HAND_OVER_TURNS):
        await asyncio.sleep(0)


class Products:
    """Cuts products into work units and returns exactly the kernel's bits for the whole.

    A product is named by its content (operands, flags, tile size, step, label), so calling
    matmul again after a coordinator restart finds the tiles already validated and reuses
    them; many matmul calls may be in flight at once. Operands that own their memory are
    made read-only when handed in: their ids are remembered (engine/operands.py).
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        ledger: Ledger,
        store: Store,
        blobs: BlobStore,
        crowd: CrowdWatch | None = None,
    ) -> None:
        self.config = config
        self.crowd = crowd
        self.ledger = ledger
        self.store = store
        self.blobs = blobs
        self.outputs: dict[str, GemmOutput] = {}
        self.failed_here: set[str] = set()  # GEMMs that failed in this run: not retried
        self.tiles: dict[str, np.ndarray] = {}  # tiles just checked, by hash: no second read
        self.recomputed = Recomputed()  # tiles a kill took, made again (engine/recovery.py)
        # Operands are frozen when hashed, and each array is hashed once (engine/operands.py).
        self.operand_ids = OperandIds()
        # The blobs each product in memory holds in the blob store (its panels, the tiles
        # reported for it): let go when it is done, so they leave memory with it.
        self.held: dict[str, list[str]] = defaultdict(list)
        # Set by the Coordinator: judge a GEMM's late replicas before it leaves memory, and
        # tell the passes that new work is out.
        self.judge_late: Callable[[str, float], Awaitable[None]] | None = None
        self.published: Callable[[], None] = lambda: None
        # Seconds the training loop takes from a product handed over to its next product
        # published, lately (None: not yet seen): its work between products, which a
        # volunteer's tile can hide (engine/requests.py, a host far away).
        self.between: float | None = None
        self._handed_at: float | None = None
        self.sizing = upload_capped(config)

    # ---- the training loop's API ---------------------------------------------------------

    async def matmul(
        self,
        a: np.ndarray,
        b: np.ndarray,
        *,
        trans_a: bool = False,
        trans_b: bool = False,
        step: int = 0,
        label: str = "",
    ) -> np.ndarray:
        a, b, _ = check_gemm_args(a, b, trans_a, trans_b, None, 1)
        trans_a, trans_b = bool(trans_a), bool(trans_b)
        config = self.config
        m = a.shape[1] if trans_a else a.shape[0]
        n = b.shape[0] if trans_b else b.shape[1]
        k = a.shape[0] if trans_a else a.shape[1]
        if m == 0 or n == 0 or k == 0:
            return kernels.gemm(a, b, trans_a=trans_a, trans_b=trans_b)
        ids = self.operand_ids
        unknown = sum(x.nbytes for x in (a, b) if ids.known(x) is None)
        a_id, b_id = await offload(lambda: (ids.hash(a), ids.hash(b)), unknown)
        describe = functools.partial(
            gemm_id,
            step=step,
            label=label,
            a_id=a_id,
            b_id=b_id,
            trans_a=trans_a,
            trans_b=trans_b,
            policy=config.policy,
            kernel_version=kernels.KERNEL_VERSION,
        )
        gid, stored = await self._attempt(describe, step)
        if gid in self.outputs:
            result = await asyncio.shield(self.outputs[gid].done)
            return result.copy()
        # Registered before the first await, so a concurrent call with the same operands
        # waits for this one instead of publishing the work twice.
        output = GemmOutput(
            gemm=None,
            out=np.empty((m, n), np.float32),
            remaining=set(),
            done=asyncio.get_running_loop().create_future(),
        )
        self.outputs[gid] = output
        try:
            gemm = self.ledger.gemms.get(gid) or stored
            now = time.time()
            if gemm is None:
                gemm = Gemm(
                    id=gid,
                    step=step,
                    label=label,
                    m=m,
                    n=n,
                    k=k,
                    trans_a=trans_a,
                    trans_b=trans_b,
                    tile=self.tile_for(m, n, k, now),
                    a_id=a_id,
                    b_id=b_id,
                    policy=config.policy,
                    created=now,
                )
                await self._publish(gemm, a, b)
                self._sample_between()
            elif gemm.state is GemmState.FAILED:
                raise GemmFailed(gemm.error)
            else:
                # Made before a restart. Blobs are not synced (docs/architecture.md): after
                # a kill or a power cut, panels that are gone are stored again from the operands.
                self.held[gid] += await restore_panels(
                    self.blobs, self.ledger, self.store, gemm, a, b, self.recomputed
                )
            if gemm.state is GemmState.DONE:
                # Finished before a restart: the tiles are committed blobs.
                wus, _ = await self.store.gemm_work(gid)
                await asyncio.to_thread(self._fill, output.out, wus)
                self.recomputed.product_done(gemm)
                self._let_go(gid)
                del self.outputs[gid]
                output.done.set_result(output.out)
                return output.out
            output.gemm = gemm
            # Tiles validated earlier (before a restart, or while we were publishing) are
            # copied in; no await separates the last look from setting `remaining`, so the
            # assimilator takes over every tile not copied here.
            copied: set[str] = set()
            while todo := [
                wu
                for wu in self.ledger.workunits_for(gid)
                if wu.state in FILLED and wu.id not in copied
            ]:
                await asyncio.to_thread(self._fill, output.out, todo)
                copied.update(wu.id for wu in todo)
            output.remaining = {wu.id for wu in self.ledger.workunits_for(gid)} - copied
        except BaseException as exc:
            self.outputs.pop(gid, None)
            if gid not in self.ledger.gemms:
                self._let_go(gid)  # panels stored or held for it; none of its work is live
            if not output.done.done():
                output.done.set_exception(exc)
                output.done.exception()  # retrieved: the caller gets it raised below
            raise
        if not output.remaining:
            await self.finish(output, now)
        self.published()
        return await asyncio.shield(output.done)

    def tile_for(self, m: int, n: int, k: int, now: float) -> int:
        """The project's tile, or one fitted to the hosts at hand (rules/sizing.py); the
        bits of the product are the same either way."""
        config = self.config
        if not config.tile_sizing or self.crowd is None:
            return config.tile
        replicas = config.redundancy.for_policy(config.policy).target_nresults
        crowd = self.crowd.crowd(now)
        return sizing.choose_tile(m, n, k, config.tile, crowd, replicas, self.sizing)

    async def _attempt(self, describe: Callable[..., str], step: int) -> tuple[str, Gemm | None]:
        """The id of this product's current attempt, with its record if the store has one
        (looked up only when it may: Ledger.may_be_stored).

        A product that failed (or whose step was cancelled) in an earlier run of the
        coordinator is run again as a new GEMM, as is one let go (pruned) after a checkpoint
        that has gone since; one that failed in this run stays failed, so its caller hears
        why instead of the work starting over behind its back."""
        earlier: list[Gemm] = []  # this product's attempts that ended before this run
        while True:
            gid = describe(attempt=len(earlier))
            if gid in self.outputs:
                return gid, None
            gemm = self.ledger.gemms.get(gid)
            if gemm is None and self.ledger.may_be_stored(gid, step):
                if self.ledger.is_queued(gid):
                    # Finished and forgotten a moment ago, its end not yet committed: the
                    # store must say "done" before its tiles are read from it.
                    await self.ledger.flush()
                gemm = await self.store.gemm(gid)
            again = (GemmState.FAILED, GemmState.PRUNED)
            if gemm is None or gemm.state not in again or gid in self.failed_here:
                if earlier:
                    log.info("%s", attempts_said(earlier, gemm))
                return gid, gemm
            earlier.append(gemm)

    def _fill(self, out: np.ndarray, wus: list[WorkUnit]) -> None:
        for wu in wus:
            out[wu.i0 : wu.i1, wu.j0 : wu.j1] = canonical_tile(self.blobs, wu, self.recomputed)

    async def _publish(self, gemm: Gemm, a: np.ndarray, b: np.ndarray) -> None:
        """Store the operand panels as blobs, then commit the GEMM and its work units."""

        def store_panels() -> tuple[list[str], list[int], int]:
            # Off the event loop when large (offload): cutting an operand copies all of it.
            rows, cols = panels(a, b, gemm.trans_a, gemm.trans_b, gemm.tile, gemm.m, gemm.n)
            # A panel that is its whole operand (a product in one tile row or column) is
            # named by the operand's id, already hashed: each blob is hashed once.
            named = [gemm.a_id if len(rows) == 1 else None] * len(rows)
            named += [gemm.b_id if len(cols) == 1 else None] * len(cols)
            # A whole operand already in memory (a weight both micro-batches multiply, an
            # output gradient both products of its layer take) is not encoded again.
            encoded = [
                (name and self.blobs.in_memory(name)) or kernels.array_blob(p)
                for p, name in zip((*rows, *cols), named, strict=True)
            ]
            ids = self.blobs.put_many(
                list(zip(encoded, named, strict=True)),
                keep=True,
                verified=True,
                behind=True,
                hold=True,
            )
            return ids, [len(data) for data in encoded], len(rows)

        delay = 1.0
        while True:
            try:
                ids, sizes, row_count = await offload(store_panels, a.nbytes + b.nbytes)
                break
            except OSError as exc:
                # Nothing of this GEMM is committed yet: waiting loses nothing, and the step
                # goes on by itself once the operator has fixed the disk.
                log.error(
                    "blob store %s cannot be written (%s): step %d waits; retrying in %.0f s",
                    self.blobs.root,
                    exc,
                    gemm.step,
                    delay,
                )
                await asyncio.sleep(delay)
                delay = min(2 * delay, STORAGE_RETRY_MAX)
        for panel_id, size in zip(ids, sizes, strict=True):
            self.ledger.add_panel(panel_id, size, gemm.step)
        row_ids, col_ids = ids[:row_count], ids[row_count:]
        self.held[gemm.id] += ids
        red = self.config.redundancy.for_policy(self.config.policy)
        self.ledger.put_gemm(gemm)
        for bounds in tile_bounds(gemm.m, gemm.n, gemm.tile):
            a_panel = row_ids[bounds[0] // gemm.tile]
            b_panel = col_ids[bounds[2] // gemm.tile]
            wu = tile_workunit(gemm, bounds, a_panel, b_panel, red, kernels.KERNEL_VERSION)
            self.ledger.put_wu(wu)
            for _ in range(red.target_nresults):
                self.ledger.put_result(Result(id=new_result_id(), wu_id=wu.id))
        tiles = len(self.ledger.wus_of[gemm.id])
        self.ledger.log(
            [
                Event(
                    gemm.created,
                    "gemm",
                    "created",
                    f"{gemm.label or 'gemm'} {gemm.m}x{gemm.n}x{gemm.k} "
                    f"(trans_a={gemm.trans_a}, trans_b={gemm.trans_b}) in "
                    f"{tiles} tiles of {gemm.tile}",
                    gemm.step,
                    gemm.id,
                )
            ]
        )
        # Not committed here: nothing is promised to anyone yet. The answer that first
        # assigns one of these work units commits them with it, in the same transaction.

    # ---- tiles in, products out ----------------------------------------------------------

    def hold(self, gemm_id: str, blobs: list[str]) -> None:
        """Blobs put with `hold` for this product (tiles reported for it): let go with it,
        or now if it is done already."""
        gemm = self.ledger.gemms.get(gemm_id)
        if gemm is not None and gemm.state is GemmState.ACTIVE:
            self.held[gemm_id] += blobs
        else:
            self.blobs.release(blobs)

    def hold_restored(self, gemm: Gemm) -> None:
        """Hold the panels and reported tiles of a product in flight restored from the
        store, as when they were stored: volunteers and the validator read them before the
        training loop asks for the product again, and a new product sharing one (a panel of
        the same weight, a tile of the same bits) must not delete it when it lets go."""
        workunits = self.ledger.workunits_for(gemm.id)
        blobs = panel_ids(workunits) + sorted(
            {
                r.output_hash
                for wu in workunits
                for r in self.ledger.results_for(wu.id)
                if r.has_tile
            }
        )
        self.blobs.hold(blobs)
        self.held[gemm.id] += blobs

    def _let_go(self, gemm_id: str) -> None:
        self.blobs.release(self.held.pop(gemm_id, ()))

    async def assimilate(self, wu: WorkUnit, now: float) -> None:
        """Copy a validated tile into its product's output; finish the product at the last."""
        output = self.outputs.get(wu.gemm_id)
        if output is None or wu.id not in output.remaining:
            return
        tile = self.tiles.get(wu.canonical_hash)
        if tile is None and self.blobs.in_memory(wu.canonical_hash) is not None:
            # A small tile in memory is decoded on the loop: a hop to a thread costs more.
            tile = await offload(
                lambda: canonical_tile(self.blobs, wu, self.recomputed),
                sizing.tile_bytes(*wu.shape),
            )
        elif tile is None:
            # From the disk, or recomputed after a kill (engine/recovery.py): on a thread.
            tile = await asyncio.to_thread(canonical_tile, self.blobs, wu, self.recomputed)
        # In pieces, the loop answering requests in between: a 16 MB tile copied into a fresh
        # output at once (page faults and all) kept the server from answering for several
        # milliseconds, and a hop to a thread per tile slows the product down.
        await copy_in_pieces(output.out[wu.i0 : wu.i1, wu.j0 : wu.j1], tile)
        output.remaining.discard(wu.id)
        if wu.state is not WuState.ASSIMILATED:
            self.ledger.put_wu(wu.evolve(state=WuState.ASSIMILATED))
            where = f"tile [{wu.i0}:{wu.i1}, {wu.j0}:{wu.j1}] written"
            self.ledger.log([Event.about(wu, now, "assimilated", where)])
        if not output.remaining:
            await self.finish(output, now)

    async def finish(self, output: GemmOutput, now: float) -> None:
        current = self.ledger.gemms.get(output.gemm.id)
        if self.outputs.get(output.gemm.id) is not output or (
            current is not None and current.state is not GemmState.ACTIVE
        ):
            return  # failed or cancelled while its last tile was being read: it stays so
        if self.judge_late is not None:
            await self.judge_late(output.gemm.id, now)
        gemm = output.gemm.evolve(state=GemmState.DONE)
        self.recomputed.product_done(gemm)
        self.ledger.put_gemm(gemm)
        what = f"{gemm.label or 'gemm'} {gemm.m}x{gemm.n}x{gemm.k} complete"
        self.ledger.log([Event(now, "gemm", "done", what, gemm.step, gemm.id)])
        # Forgotten before the commit, with no await since the late replicas were judged: a
        # report that arrives while the commit runs finds the GEMM gone and is answered
        # "late", rather than applied to records that are about to leave memory unjudged.
        self.outputs.pop(gemm.id, None)
        self.ledger.forget_gemm(gemm.id)
        # Its tiles are in its output: they and the panels no other product holds leave
        # memory now, unwritten, rather than fill it until the next checkpoint and spill to
        # disk (a later product with the same panel stores it again; a restart makes them
        # again: engine/recovery.py).
        self._let_go(gemm.id)
        # The training loop goes on at once; the commit follows with the next reply's, or
        # the passes' (COMMIT_WINDOW). A crash in between loses nothing committed: the step
        # is recomputed from the last checkpoint.
        if not output.done.done():
            output.done.set_result(output.out)
            self._handed_at = time.monotonic()
            await hand_over()

    def _sample_between(self) -> None:
        if self._handed_at is None:
            return
        sample, self._handed_at = time.monotonic() - self._handed_at, None
        last = self.between
        self.between = sample if last is None else last + BETWEEN_WEIGHT * (sample - last)

    def end_replicas(self, wu: WorkUnit, message: str, now: float) -> int:
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
            self.ledger.log([Event.about(wu, now, outcome.value, message, r)])
        return aborted

    def take_back(self, host_id: int, message: str, now: float) -> int:
        """End the results a host holds as given back (outcome no_reply, received now), so
        that their work units go to other hosts at once rather than wait out deadlines of
        up to a minute: for a quarantined host, which may never report them. Returns how
        many."""
        taken = 0
        for result_id in list(self.ledger.in_progress_of.get(host_id, ())):
            result = self.ledger.results[result_id]
            wu = self.ledger.wus[result.wu_id]
            self.ledger.put_result(
                result.evolve(
                    server_state=ServerState.OVER, outcome=Outcome.NO_REPLY, received_time=now
                )
            )
            self.ledger.log([Event.about(wu, now, "no_reply", message, result)])
            self.ledger.touched.add(wu.id)
            taken += 1
        return taken

    def drop_unasked(self, through_step: int, now: float) -> int:
        """End the products in flight of steps up to `through_step` that nothing awaits:
        restored after a restart, but not asked for again once training passed their step
        (a version that names products otherwise, `mb0.` before each micro-batch's, gives
        them other ids). Their work would otherwise go to volunteers until a checkpoint
        purged their step. Returns how many."""
        unasked = [
            gemm
            for gemm in self.ledger.gemms.values()
            if gemm.state is GemmState.ACTIVE
            and gemm.step <= through_step
            and gemm.id not in self.outputs
        ]
        for gemm in unasked:
            self.drop(gemm, "not asked for by the training loop after a restart", now)
        if unasked:
            log.info(
                "let go of %d product(s) of step %d or before, in flight at the last stop, "
                "that training did not ask for again",
                len(unasked),
                through_step,
            )
        return len(unasked)

    def drop(self, gemm: Gemm, message: str, now: float) -> tuple[int, int]:
        """End an active GEMM as failed: its undecided work units stop, their hosts are told.
        Returns (work units dropped, results in progress aborted)."""
        workunits = aborted = 0
        for wu in self.ledger.workunits_for(gemm.id):
            if wu.state in WU_DECIDED:
                continue
            workunits += 1
            aborted += self.end_replicas(wu, message, now)
            mask = wu.error_mask | WuError.CANCELLED
            self.ledger.put_wu(wu.evolve(state=WuState.ERROR, error_mask=mask))
            self.ledger.log([Event.about(wu, now, "cancelled", message)])
        self.ledger.log([Event(now, "gemm", "cancelled", message, gemm.step, gemm.id)])
        self.ledger.put_gemm(gemm.evolve(state=GemmState.FAILED, error=message))
        self._let_go(gemm.id)
        self.recomputed.forget(gemm.id)
        output = self.outputs.pop(gemm.id, None)
        if output is not None and not output.done.done():
            output.done.set_exception(GemmFailed(message))
        return workunits, aborted
