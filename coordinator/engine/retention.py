"""What a checkpoint lets go: the blobs of earlier products, and the database rows of the
steps before the previous checkpoint (archived first), so that a project's blob store and
database stay bounded however long it runs. The checkpoints themselves and the archive grow
with the run (docs/operator.md: an operator may delete all but the latest checkpoint)."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import gzip
import json
import time
from pathlib import Path
from typing import Any

from coordinator.state.blobs import BlobStore
from coordinator.state.ledger import Ledger
from coordinator.state.store import Store

# Under DIR/logs/: the events and the work units (with their canonical tiles' hashes) of
# purged steps.
EVENTS_ARCHIVE = "events.jsonl.gz"
RECENT_EVENTS = 60.0  # seconds of events a purge leaves: status's tiles/s window
WORKUNITS_ARCHIVE = "workunits.jsonl.gz"


class Retention:
    def __init__(self, directory: Path, ledger: Ledger, store: Store, blobs: BlobStore) -> None:
        self.directory = directory
        self.ledger = ledger
        self.store = store
        self.blobs = blobs
        self.checkpointed: int | None = None  # the step of the last checkpoint in this run

    async def prune(self, through_step: int) -> int:
        """A checkpoint at `through_step` made every earlier product useless: their blobs
        are deleted, and the rows of the steps up to the checkpoint before it are purged
        from the store once their events and work units are archived under DIR/logs/, so
        the database holds at most about two checkpoint intervals. Returns how many blobs
        were deleted."""
        await self.ledger.flush()
        previous = self.checkpointed
        if previous is not None:
            # At once after the commit, no await between: nothing of the steps about to be
            # purged is left in memory for a late report to change and write back.
            self.ledger.forget_through(previous)
        blobs = await self.store.prunable_blobs(through_step)

        def delete() -> None:
            for blob in blobs:
                self.blobs.delete(blob)
                self.ledger.drop_panel(blob)

        await asyncio.to_thread(delete)
        await self.store.mark_pruned(through_step)
        # Rows are purged one checkpoint behind: the last interval's decisions stay for
        # `tilehive logs`, and a slow host's late report of them is still recognised.
        self.checkpointed = through_step
        if previous is not None:
            self.ledger.forget_panel_steps(previous)
            self.ledger.forget_steps(previous)
            # The last minute's events stay for a later purge: status from the project's
            # files counts its tiles a second over them (cli/logs.py).
            recent = time.time() - RECENT_EVENTS
            events = await self.store.events_through(previous, before=recent)
            workunits = await self.store.workunits_through(previous)
            # Archived before they are deleted: a crash in between archives some twice.
            folder = self.directory / "logs"
            await asyncio.to_thread(archive, folder / EVENTS_ARCHIVE, events)
            await asyncio.to_thread(archive, folder / WORKUNITS_ARCHIVE, workunits)
            await self.store.purge(previous, events_before=recent)
        return len(blobs)


def archive(path: Path, records: list) -> None:
    """Append records to a gzip file of JSON lines, one object a line (one gzip member per
    call; gzip readers read the members one after another)."""
    if not records:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(_plain(_fields(r))) + "\n" for r in records)
    with gzip.open(path, "at", encoding="utf-8") as f:
        f.write(lines)


def _fields(record: Any) -> dict:
    """A record's fields by name: a dataclass's, or a named tuple's (Event)."""
    return record._asdict() if isinstance(record, tuple) else dataclasses.asdict(record)


def _plain(record: dict) -> dict:
    return {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in record.items()}
