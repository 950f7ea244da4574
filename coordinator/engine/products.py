"""The API the training loop uses: `await queue.matmul(a, b)` computed by volunteers."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable

import numpy as np

import kernels
from coordinator.engine.coordinator import (
    Coordinator,
    GemmFailed,
    GemmOutput,
    new_result_id,
    redundancy_for,
)
from coordinator.work.events import Event
from coordinator.work.records import (
    Gemm,
    GemmState,
    Result,
    WorkUnit,
    WuState,
    gemm_id,
    tile_bounds,
    tile_workunit,
)
from kernels.checks import check_gemm_args

log = logging.getLogger(__name__)

STORAGE_RETRY_MAX = 30.0  # seconds between attempts to store operand panels, at most

FILLED = (WuState.VALIDATED, WuState.ASSIMILATED)


def panels(
    a: np.ndarray, b: np.ndarray, trans_a: bool, trans_b: bool, tile: int, m: int, n: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Row panels op(A)[i0:i1, :] and column panels op(B)[:, j0:j1], stored as in A and B."""
    rows = [
        np.ascontiguousarray(a[:, i0 : i0 + tile] if trans_a else a[i0 : i0 + tile])
        for i0 in range(0, m, tile)
    ]
    cols = [
        np.ascontiguousarray(b[j0 : j0 + tile] if trans_b else b[:, j0 : j0 + tile])
        for j0 in range(0, n, tile)
    ]
    return rows, cols


class WorkQueue:
    """Cuts products into work units and returns exactly the kernel's bits for the whole.

    A product is named by its content (operands, flags, tile size, step, label), so calling
    matmul again after a coordinator restart finds the tiles already validated and reuses
    them; many matmul calls may be in flight at once.
    """

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

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
        co = self.coordinator
        config = co.config
        m = a.shape[1] if trans_a else a.shape[0]
        n = b.shape[0] if trans_b else b.shape[1]
        k = a.shape[0] if trans_a else a.shape[1]
        if m == 0 or n == 0 or k == 0:
            return kernels.gemm(a, b, trans_a=trans_a, trans_b=trans_b)
        a_id, b_id = await asyncio.to_thread(lambda: (kernels.array_id(a), kernels.array_id(b)))
        describe = functools.partial(
            gemm_id,
            step=step,
            label=label,
            a_id=a_id,
            b_id=b_id,
            trans_a=trans_a,
            trans_b=trans_b,
            tile=config.tile,
            policy=config.policy,
            kernel_version=kernels.KERNEL_VERSION,
        )
        gid = await self._attempt(describe)
        if gid in co.outputs:
            result = await asyncio.shield(co.outputs[gid].done)
            return result.copy()
        # Registered before the first await, so a concurrent call with the same operands
        # waits for this one instead of publishing the work twice.
        output = GemmOutput(
            gemm=None,
            out=np.empty((m, n), np.float32),
            remaining=set(),
            done=asyncio.get_running_loop().create_future(),
        )
        co.outputs[gid] = output
        try:
            gemm = co.ledger.gemms.get(gid) or await co.store.gemm(gid)
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
                    tile=config.tile,
                    a_id=a_id,
                    b_id=b_id,
                    policy=config.policy,
                    created=now,
                )
                await self._publish(gemm, a, b)
            elif gemm.state is GemmState.FAILED:
                raise GemmFailed(gemm.error)
            elif gemm.state is GemmState.PRUNED:
                raise GemmFailed(
                    f"GEMM {gid[:12]} of step {step} was pruned after a later checkpoint; "
                    "resume from that checkpoint"
                )
            elif gid not in co.ledger.gemms:
                # Finished before a restart: the tiles are committed blobs.
                wus, _ = await co.store.gemm_work(gid)
                await asyncio.to_thread(self._fill, output.out, wus)
                del co.outputs[gid]
                output.done.set_result(output.out)
                return output.out
            output.gemm = gemm
            # Tiles validated earlier (before a restart, or while we were publishing) are
            # copied in; no await separates the last look from setting `remaining`, so the
            # assimilator takes over every tile not copied here.
            copied: set[str] = set()
            while todo := [
                wu
                for wu in co.ledger.workunits_for(gid)
                if wu.state in FILLED and wu.id not in copied
            ]:
                await asyncio.to_thread(self._fill, output.out, todo)
                copied.update(wu.id for wu in todo)
            output.remaining = {wu.id for wu in co.ledger.workunits_for(gid)} - copied
        except BaseException as exc:
            co.outputs.pop(gid, None)
            if not output.done.done():
                output.done.set_exception(exc)
                output.done.exception()  # retrieved: the caller gets it raised below
            raise
        if not output.remaining:
            await co.finish_gemm(output, now)
        co.wake()
        result = await asyncio.shield(output.done)
        return result

    async def _attempt(self, describe: Callable[..., str]) -> str:
        """The id of this product's current attempt.

        A product that failed (or whose step was cancelled) in an earlier run of the
        coordinator is run again as a new GEMM; one that failed in this run stays failed, so
        its caller hears why instead of the work starting over behind its back."""
        co = self.coordinator
        attempt = 0
        while True:
            gid = describe(attempt=attempt)
            if gid in co.outputs or gid in co.failed_here:
                return gid
            gemm = co.ledger.gemms.get(gid) or await co.store.gemm(gid)
            if gemm is None or gemm.state is not GemmState.FAILED:
                return gid
            attempt += 1
            log.info(
                "step %d: %s failed in an earlier run; running it again (attempt %d)",
                gemm.step,
                gemm.label or f"GEMM {gid[:12]}",
                attempt + 1,
            )

    def _fill(self, out: np.ndarray, wus: list[WorkUnit]) -> None:
        for wu in wus:
            out[wu.i0 : wu.i1, wu.j0 : wu.j1] = self.coordinator.blobs.get_array(wu.canonical_hash)

    async def _publish(self, gemm: Gemm, a: np.ndarray, b: np.ndarray) -> None:
        """Store the operand panels as blobs, then commit the GEMM and its work units."""
        co = self.coordinator
        config = co.config
        rows, cols = panels(a, b, gemm.trans_a, gemm.trans_b, gemm.tile, gemm.m, gemm.n)

        def store_panels() -> tuple[list[str], list[str]]:
            encoded = [kernels.encode_array(p) for p in (*rows, *cols)]
            ids = co.blobs.put_many([(data, None) for data in encoded], serve=True)
            for panel_id, data in zip(ids, encoded, strict=True):
                co.ledger.panel_bytes[panel_id] = len(data)
            return ids[: len(rows)], ids[len(rows) :]

        delay = 1.0
        while True:
            try:
                row_ids, col_ids = await asyncio.to_thread(store_panels)
                break
            except OSError as exc:
                # Nothing of this GEMM is committed yet: waiting loses nothing, and the step
                # goes on by itself once the operator has fixed the disk.
                log.error(
                    "blob store %s cannot be written (%s): step %d waits; retrying in %.0f s",
                    co.blobs.root,
                    exc,
                    gemm.step,
                    delay,
                )
                await asyncio.sleep(delay)
                delay = min(2 * delay, STORAGE_RETRY_MAX)
        red = redundancy_for(config.policy, config.redundancy)
        co.ledger.put_gemm(gemm)
        now = gemm.created
        for bounds in tile_bounds(gemm.m, gemm.n, gemm.tile):
            a_panel = row_ids[bounds[0] // gemm.tile]
            b_panel = col_ids[bounds[2] // gemm.tile]
            wu = tile_workunit(gemm, bounds, a_panel, b_panel, red, kernels.KERNEL_VERSION)
            co.ledger.put_wu(wu)
            for _ in range(red.target_nresults):
                co.ledger.put_result(Result(id=new_result_id(), wu_id=wu.id))
        co.ledger.log(
            [
                Event(
                    now,
                    "gemm",
                    "created",
                    f"{gemm.label or 'gemm'} {gemm.m}x{gemm.n}x{gemm.k} "
                    f"(trans_a={gemm.trans_a}, trans_b={gemm.trans_b}) in "
                    f"{len(co.ledger.wus_of[gemm.id])} tiles of {gemm.tile}",
                    gemm.step,
                    gemm.id,
                )
            ]
        )
        await co.ledger.flush()
