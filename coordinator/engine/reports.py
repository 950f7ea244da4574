"""Reports: a host's results checked at the edge, their tiles stored, then applied at once."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable

import kernels
from coordinator.engine.config import CoordinatorConfig
from coordinator.engine.crowd import CrowdWatch
from coordinator.engine.metrics import Metrics
from coordinator.engine.offload import offload
from coordinator.engine.uplinks import Uplinks
from coordinator.rules import sizing, trust
from coordinator.rules.scheduler import tile_upload_bytes
from coordinator.state.blobs import BlobStore
from coordinator.state.ledger import Ledger
from coordinator.state.store import Store
from coordinator.work.events import Event
from coordinator.work.protocol import (
    BadRequest,
    Forbidden,
    NotFound,
    ReportRequest,
    ResultReport,
    StorageUnavailable,
)
from coordinator.work.records import WU_DECIDED, Host, Outcome, Result, ServerState, WorkUnit

log = logging.getLogger(__name__)

STORAGE_RETRY = 5.0  # seconds a volunteer waits before resending a report the store refused


class Reports:
    """Accepts batches of results; a success goes to the validator through `arrived`."""

    def __init__(
        self,
        config: CoordinatorConfig,
        ledger: Ledger,
        store: Store,
        blobs: BlobStore,
        metrics: Metrics,
        stats: dict,
        arrived: Callable[[str], None],
        wake: Callable[[], None],
        crowd: CrowdWatch,
        hold: Callable[[str, list[str]], None],
        uplinks: Uplinks | None = None,
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.store = store
        self.blobs = blobs
        self.metrics = metrics
        self.stats = stats
        self.arrived = arrived  # a work unit has a new success to validate
        self.wake = wake  # the passes: something changed
        self.crowd = crowd  # learns what a tile costs beyond its arithmetic
        self.uplinks = uplinks or Uplinks()  # and its upload, each host's (engine/uplinks.py)
        self.hold = hold  # a stored tile is held until its product is done (Products.hold)
        # A host reported, so its results in progress went down (WorkRequests.reported):
        # whether it computed something, and whether the work request riding on the report
        # says it is paused.
        self.reported: Callable[[int, bool, bool], None] = lambda host_id, computed, paused: None

    def arriving(self, host_id: int, began: float, now: float) -> None:
        """A report from the host, begun at `began`, is still arriving at `now` (a sign of
        it each second, BodyClock). The results the host held when it began, which it may
        carry, are leased the deadline floor from now: they do not time out while their
        report is on its way. A host's first tiles are cut before its uplink is known; on
        a slow one they timed out on the way, and were computed and sent again.

        A lease, not a forecast: once the body stops coming (cut off below body_min_rate,
        or hung up), the results time out within the floor. A host that keeps a report
        coming at body_min_rate or more holds them as long as it does (docs/security.md)."""
        due = now + self.config.scheduler.deadline_floor
        for result_id in list(self.ledger.in_progress_of.get(host_id, ())):
            result = self.ledger.results[result_id]
            if (
                result.sent_time is not None
                and result.sent_time < began
                and (result.report_deadline or math.inf) < due
            ):
                self.ledger.put_result(result.evolve(report_deadline=due))

    async def report(self, host: Host, request: ReportRequest, now: float) -> dict:
        """Accept a batch of results: all entries are checked before any is applied.

        A batch refused for a forged or malformed result costs the host as an invalid result
        would: an honest client never sends one, and a liar must not lie for free. A report
        that also asks for work is committed with the answer to that ask (server/api.py).
        A quarantined host's reports are refused: what it held went to others when it was
        quarantined, and its tiles are no votes any more."""
        current = self.ledger.hosts[host.id]
        if current.quarantined:
            raise Forbidden(trust.why_quarantined(current, self.config.trust))
        try:
            return await self._report(host, request, now)
        except (BadRequest, Forbidden) as exc:
            self._punish(host.id, exc.message, now)
            await self.ledger.flush()
            raise

    def _punish(self, host_id: int, reason: str, now: float) -> None:
        current = self.ledger.hosts[host_id]
        changed = trust.after_invalid(current, self.config.trust)
        self.ledger.put_host(changed)
        self.stats["invalid"] += 1
        data = {"method": "protocol", "trust_before": current.consecutive_valid, "trust_after": 0}
        self.ledger.log(
            [
                Event(
                    now,
                    "validation",
                    "invalid",
                    f"refused report: {reason}",
                    host_id=host_id,
                    data=json.dumps(data),
                )
            ]
        )
        if changed.quarantined and not current.quarantined:
            self.ledger.log([quarantine_event(changed, now)])

    async def _report(self, host: Host, request: ReportRequest, now: float) -> dict:
        checked = []
        finished = []  # results of GEMMs already done and out of memory: nothing to apply
        unknown: list[str] = []
        for entry in request.results:
            result = self.ledger.results.get(entry.result_id)
            if result is None:
                # Its GEMM is done and left memory. A replica sent just before (a spare for
                # the tail) may come back before the commit that writes it has landed.
                result = self.ledger.unwritten_result(entry.result_id)
                if result is None:
                    result = await self.store.result(entry.result_id)
                if result is None:
                    # Purged with its step after a checkpoint, or never ours: nothing to
                    # apply either way, and the rest of the report still counts.
                    unknown.append(entry.result_id)
                    continue
                if result.host_id != host.id:
                    raise Forbidden(f"result {entry.result_id} is not assigned to host {host.id}")
                finished.append(entry.result_id)
                continue
            if result.host_id != host.id:
                raise Forbidden(f"result {entry.result_id} is not assigned to host {host.id}")
            wu = self.ledger.wus[result.wu_id]
            tile = entry.tile
            if tile is None and (
                entry.error is None
                and not entry.abandoned
                and result.upload_tile
                and wu.state not in WU_DECIDED
            ):
                raise BadRequest(f"result {entry.result_id}: the assignment asked for the tile")
            checked.append((entry, result, wu, tile))
        if unknown and len(unknown) == len(request.results):
            raise NotFound(f"unknown result {unknown[0]}")
        finished += unknown
        # Every tile is checked, then stored, before any report is applied: when the blob
        # store fails, the whole report is refused and none of it is half-done.
        uploads = [(e, r, wu, tile) for e, r, wu, tile in checked if tile is not None]
        # All are checked; a replay's tile is not stored again.
        fresh = [(e, r, wu, tile) for e, r, wu, tile in uploads if not self._reported(r)]
        hashes: dict[str, str] = {}  # result id -> the hash of its tile, as received

        def check_and_store() -> None:
            for entry, _, wu, tile in uploads:
                hashes[entry.result_id] = self._check_tile(
                    wu, entry.result_id, entry.output_hash, tile
                )
            self._store_tiles([(hashes[entry.result_id], tile) for entry, _, _, tile in fresh])

        await offload(check_and_store, sum(len(tile) for *_, tile in uploads))
        for entry, _, wu, _ in fresh:
            self.hold(wu.gemm_id, [hashes[entry.result_id]])
        summary: dict[str, list[str]] = {"accepted": [], "late": finished, "duplicate": []}
        computed = False  # a result it computed, new to the coordinator, is among them
        for entry, result, wu, tile in checked:
            output_hash = hashes.get(entry.result_id, entry.output_hash)
            verdict = self._apply(host, entry, result, wu, output_hash, tile is not None, now)
            summary[verdict].append(entry.result_id)
            computed |= _computed(entry, verdict, entry.result_id in self.ledger.results)
        # A host that reports is back, if it had said it was leaving.
        self.ledger.put_host(self.ledger.hosts[host.id].evolve(last_contact=now, gone=False))
        if request.work is None:
            self.ledger.commit_soon()
        # else: committed with the answer to the host's ask for work, in one transaction
        # (server/api.py report), right after both answers leave.
        self.wake()
        paused = request.work is not None and request.work.paused
        self.reported(host.id, computed, paused)
        return summary

    def _reported(self, result: Result) -> bool:
        current = self.ledger.results.get(result.id, result)
        return current.outcome in (Outcome.SUCCESS, Outcome.CLIENT_ERROR)

    def _store_tiles(self, tiles: list[tuple[str, bytes]]) -> None:
        # Hashed at the edge (_check_tile): each is hashed once. Kept in memory for the
        # validator, which reads them next, and held until the product is done.
        try:
            pairs = [(tile, h) for h, tile in tiles]
            self.blobs.put_many(pairs, keep=True, verified=True, behind=True, hold=True)
        except OSError as exc:  # the blob writer has logged it, once
            raise StorageUnavailable(
                f"the coordinator cannot store tiles just now (blob store: {exc.strerror}); "
                f"send the report again in {STORAGE_RETRY:.0f} s",
                retry_after=STORAGE_RETRY,
            ) from exc

    def _check_tile(self, wu: WorkUnit, result_id: str, claimed: str | None, tile: bytes) -> str:
        """The tile's id: its hash, which must be the one its host claimed, if it claimed
        one. BadRequest unless the tile is a float32 array of the work unit's shape."""
        m, n, _ = wu.shape
        if len(tile) > self.config.max_blob_bytes:
            raise BadRequest(f"result {result_id}: tile of {len(tile)} bytes is over the limit")
        try:
            if claimed is None:
                tile_id = kernels.blob_id(tile)
            else:
                kernels.verify_blob(tile, claimed)
                tile_id = claimed
            if kernels.is_float32_blob(tile, (m, n)):
                return tile_id
            array = kernels.decode_array(tile)  # what is wrong with it, if it is malformed
        except ValueError as exc:
            raise BadRequest(f"result {result_id}: {exc}") from exc
        raise BadRequest(
            f"result {result_id}: tile must be float32 of shape {(m, n)}, "
            f"got {array.dtype} {array.shape}"
        )

    def _apply(
        self,
        host: Host,
        entry: ResultReport,
        result: Result,
        wu: WorkUnit,
        output_hash: str | None,
        has_tile: bool,
        now: float,
    ) -> str:
        # Re-read: a deadline or a concurrent retry of this report may have changed it since,
        # or its GEMM finished and left memory while the tiles were being stored.
        current = self.ledger.results.get(result.id)
        if current is None:
            return "late"
        result = current
        if result.outcome in (Outcome.SUCCESS, Outcome.CLIENT_ERROR):
            return "duplicate"
        late = result.server_state is ServerState.OVER
        if (entry.abandoned or entry.error is not None) and late:
            return "late"
        over = {"server_state": ServerState.OVER, "received_time": now}
        if entry.abandoned:
            # As if its deadline had passed now: a replacement goes out at once, and the
            # host, which said so honestly, keeps its standing.
            self.ledger.put_result(result.evolve(outcome=Outcome.NO_REPLY, **over))
            state, message = "abandoned", "given back uncomputed by the host"
        elif entry.error is not None:
            self.ledger.put_result(
                result.evolve(outcome=Outcome.CLIENT_ERROR, error=entry.error, **over)
            )
            self.ledger.put_host(trust.after_error(self.ledger.hosts[host.id], self.config.trust))
            state, message = "client_error", f"host error: {entry.error}"
        else:
            self.ledger.put_result(
                result.evolve(
                    outcome=Outcome.SUCCESS,
                    output_hash=output_hash,
                    has_tile=has_tile,
                    **over,
                )
            )
            self.stats["tiles_in"] += 1
            if result.sent_time is not None and not late:
                moved = sizing.tile_bytes(*wu.shape, upload=has_tile)
                # Its own upload only, not the panels' download: the tile's bytes.
                upload = self.uplinks.per_byte(host.id) * tile_upload_bytes(wu) if has_tile else 0
                self.crowd.observe(now - result.sent_time, entry.seconds, moved, now, upload)
            what = "tile" if has_tile else "hash"
            message = f"{what} {output_hash[:16]} in {entry.seconds:.2f}s"
            state, message = "success", ("late " if late else "") + message
            self.arrived(wu.id)
        self.metrics.result(state)
        self.ledger.log([Event.about(wu, now, state, message, result)])
        self.ledger.touched.add(wu.id)
        return "late" if late else "accepted"


def _computed(entry: ResultReport, verdict: str, known: bool) -> bool:
    """Whether this entry shows its host computing: a tile or hash it computed, new to the
    coordinator (on time or late). A tile given back, an error, a repeat or a report of a
    result already gone shows nothing of the kind: a host that sat on tiles could end its
    probation with those at no cost (rules/cooling.py)."""
    return known and verdict != "duplicate" and entry.error is None and not entry.abandoned


def quarantine_event(host: Host, now: float) -> Event:
    return Event(
        now,
        "host",
        "quarantined",
        f"host {host.id} quarantined after {host.invalid_count} invalid results",
        host_id=host.id,
    )
