"""After a kill or a power cut: blobs are held in memory until written, never synced, and a
finished product's leave memory with it (docs/architecture.md, "Durability"), so a
restarted coordinator may find a product's panels or tiles gone. Each is made again from
what is synced: tiles with the kernel (the same bits), panels from the operands, and an
unfinished product whose blobs are gone is dropped so that the training loop runs it
again."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from collections.abc import Iterable

import numpy as np

import kernels
from coordinator.state.blobs import BlobNotFound, BlobStore
from coordinator.state.ledger import Ledger
from coordinator.state.store import Store
from coordinator.work.records import Gemm, GemmState, WorkUnit, short_workunit_id

log = logging.getLogger(__name__)

# After a kill every product since the last checkpoint may have lost its blobs (they are
# held in memory until written): the first recovery says why, the others go to INFO.
_explained = False


def _recovered(message: str, *args: object) -> None:
    global _explained
    if _explained:
        log.info(message, *args)
        return
    _explained = True
    # Expected after any stop, orderly or not: the blob store keeps a product's blobs in
    # memory and lets them go unwritten (docs/architecture.md, "Durability").
    log.info(
        message + " (blobs live in memory and are not written, so a restart makes again, "
        "bit for bit, those of the products since the last checkpoint; expected after a stop)",
        *args,
    )


def panels(
    a: np.ndarray, b: np.ndarray, trans_a: bool, trans_b: bool, tile: int, m: int, n: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Row panels op(A)[i0:i1, :] and column panels op(B)[:, j0:j1], stored as in A and B:
    views, copied once into their blobs (kernels.array_blob)."""
    rows = [a[:, i0 : i0 + tile] if trans_a else a[i0 : i0 + tile] for i0 in range(0, m, tile)]
    cols = [b[j0 : j0 + tile] if trans_b else b[:, j0 : j0 + tile] for j0 in range(0, n, tile)]
    return rows, cols


def panel_ids(workunits: Iterable[WorkUnit]) -> list[str]:
    """The operand panels these work units read, each once, in a fixed order."""
    return sorted({p for wu in workunits for p in (wu.a_panel, wu.b_panel)})


def canonical_tile(
    blobs: BlobStore, wu: WorkUnit, recomputed: Recomputed | None = None
) -> np.ndarray:
    """A validated work unit's tile, from its blob; recomputed with the kernel (the same
    bits) when a kill or a power cut took the blob, or the disk damaged it (counted in
    `recomputed`)."""
    try:
        return blobs.get_array(wu.canonical_hash)
    except (BlobNotFound, ValueError):
        log.debug(
            "tile %s of work unit %s is gone; recomputing it",
            wu.canonical_hash[:12],
            short_workunit_id(wu.id),
        )
        if recomputed is not None:
            recomputed.tile(wu.gemm_id)
        tile = kernels.gemm(
            blobs.get_array(wu.a_panel),
            blobs.get_array(wu.b_panel),
            trans_a=wu.trans_a,
            trans_b=wu.trans_b,
        )
        blobs.put(kernels.encode_array(tile), wu.canonical_hash)
        return tile


class Recomputed:
    """The tiles canonical_tile made again, and the products whose panels restore_panels
    stored again, said a step at a time: a line per tile or product was thousands of lines
    after a kill. Counted from worker threads too."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_product: Counter[str] = Counter()
        self._restored: set[str] = set()  # products whose panels were stored again
        self._step: int | None = None  # the step whose products' counts add up below
        self._tiles = self._products = self._panels = 0

    def tile(self, gemm_id: str) -> None:
        with self._lock:
            self._by_product[gemm_id] += 1

    def panels(self, gemm_id: str) -> None:
        with self._lock:
            self._restored.add(gemm_id)

    def product_done(self, gemm: Gemm) -> None:
        """A product's tiles are all in its output: its counts join its step's, and a step
        before it is said (the training loop runs a step's products before the next's)."""
        with self._lock:
            count = self._by_product.pop(gemm.id, 0)
            restored = gemm.id in self._restored
            self._restored.discard(gemm.id)
            if self._step is not None and gemm.step != self._step:
                self._say()
            if count or restored:
                self._step = gemm.step
                self._tiles += count
                self._products += bool(count)
                self._panels += restored

    def forget(self, gemm_id: str) -> None:
        """A product dropped before it was done: nothing of it to say."""
        with self._lock:
            self._by_product.pop(gemm_id, None)
            self._restored.discard(gemm_id)

    def flush(self) -> None:
        """Say the last step's counts (training is done, or the coordinator stops)."""
        with self._lock:
            if self._step is not None:
                self._say()

    def _say(self) -> None:
        said = []
        if self._tiles:
            said.append(
                f"{self._tiles} tile(s) of {self._products} product(s) were gone; recomputed"
            )
        if self._panels:
            said.append(f"the operand panels of {self._panels} product(s) were gone; stored again")
        _recovered("step %d: %s", self._step, "; ".join(said))
        self._step, self._tiles, self._products, self._panels = None, 0, 0, 0


async def restore_panels(
    blobs: BlobStore,
    ledger: Ledger,
    store: Store,
    gemm: Gemm,
    a: np.ndarray,
    b: np.ndarray,
    recomputed: Recomputed,
) -> list[str]:
    """Store again, from its operands, the panels of a product made before a restart
    (counted in `recomputed`, said with its step).

    Returns the panels, held (BlobStore.hold) before they were looked for: a new product
    sharing one (the same weight, another micro-batch) lets go of it when it is done, and
    that must not delete it under this one. The caller releases them with the product."""
    workunits = ledger.workunits_for(gemm.id) or (await store.gemm_work(gemm.id))[0]
    needed = panel_ids(workunits)
    blobs.hold(needed)
    try:
        if all(await asyncio.to_thread(lambda: [blobs.has(p) for p in needed])):
            return needed

        def store_panels() -> None:
            rows, cols = panels(a, b, gemm.trans_a, gemm.trans_b, gemm.tile, gemm.m, gemm.n)
            blobs.put_many([(kernels.array_blob(p), None) for p in (*rows, *cols)])

        await asyncio.to_thread(store_panels)
    except BaseException:
        blobs.release(needed)
        raise
    log.debug("step %d: %s's operand panels were gone; stored again", gemm.step, gemm.label)
    recomputed.panels(gemm.id)
    return needed


def lost_products(ledger: Ledger, blobs: BlobStore) -> list[Gemm]:
    """The active products some of whose panels or reported tiles are gone."""
    lost = []
    for gemm in [g for g in ledger.gemms.values() if g.state is GemmState.ACTIVE]:
        needed = set()
        for wu in ledger.workunits_for(gemm.id):
            needed.update((wu.a_panel, wu.b_panel))
            needed.update(r.output_hash for r in ledger.results_for(wu.id) if r.has_tile)
        if not all(blobs.has(blob) for blob in needed):
            lost.append(gemm)
    return lost
