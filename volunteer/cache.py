"""The operand cache: verified blobs kept in memory, least recently used out first, and the
downloads that fill it, one per blob."""

from __future__ import annotations

import asyncio
import functools
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable

from kernels.frames import Buffer


class BlobCache:
    """Blob bytes by id, bounded in bytes; counts hits and misses for the status line.

    A queued tile pins its two operands from when it starts to fetch them until its turn
    has come and they are in hand: a pinned blob is not evicted, and its size (reserved
    when pinned, before it has arrived) counts against the bound. So everything the queue
    holds is counted once, here: without pins, a queued tile's operands that the cache let
    go stayed in memory that nothing counted (docs/volunteer.md, `--max-memory`)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._blobs: OrderedDict[str, Buffer] = OrderedDict()
        self.bytes = 0  # of the blobs cached
        self._pins: dict[str, list[int]] = {}  # blob id: [pins, bytes reserved]
        self.pinned_bytes = 0  # reserved by pinned blobs, cached or still on their way
        self._loose_bytes = 0  # of the cached blobs not pinned: what eviction may free
        self.hits = 0
        self.misses = 0

    def __contains__(self, blob_id: str) -> bool:
        return blob_id in self._blobs

    def get(self, blob_id: str, *, count: bool = True) -> Buffer | None:
        data = self._blobs.get(blob_id)
        if count:
            self.count(hit=data is not None)
        if data is not None:
            self._blobs.move_to_end(blob_id)
        return data

    def count(self, hit: bool) -> None:
        """One operand needed: a hit when it cost no download of its own."""
        if hit:
            self.hits += 1
        else:
            self.misses += 1

    def put(self, blob_id: str, data: Buffer) -> None:
        """Keep a blob (already verified by the caller); too large a blob is not kept, nor
        one that only pinned blobs leave no room for."""
        size = self._size(data)
        if blob_id in self._blobs or size > self.max_bytes:
            return
        self._blobs[blob_id] = data
        self.bytes += size
        if blob_id not in self._pins:
            self._loose_bytes += size
        self._evict()

    def drop(self, blob_id: str) -> None:
        """Let a blob go before its turn (the coordinator says no product will use it); a
        pinned one stays."""
        if blob_id in self._pins:
            return
        data = self._blobs.pop(blob_id, None)
        if data is not None:
            self.bytes -= self._size(data)
            self._loose_bytes -= self._size(data)

    def pin(self, sizes: dict[str, int]) -> bool:
        """Pin these blobs (of these sizes, cached or about to be) if they fit beside those
        pinned already, until unpinned as often; False, and none pinned, if they do not."""
        pins = self._pins
        new = 0
        for blob_id, size in sizes.items():
            if blob_id not in pins:
                new += size
        if self.pinned_bytes + new > self.max_bytes:
            return False
        for blob_id, size in sizes.items():
            pin = pins.get(blob_id)
            if pin is not None:
                pin[0] += 1
                continue
            pins[blob_id] = [1, size]
            self.pinned_bytes += size
            if blob_id in self._blobs:
                self._loose_bytes -= self._size(self._blobs[blob_id])
        if new:
            self._evict()
        return True

    def unpin(self, blob_ids: Iterable[str]) -> None:
        for blob_id in blob_ids:
            pin = self._pins.get(blob_id)
            if pin is None:
                continue
            pin[0] -= 1
            if pin[0]:
                continue
            del self._pins[blob_id]
            self.pinned_bytes -= pin[1]
            if blob_id in self._blobs:
                self._loose_bytes += self._size(self._blobs[blob_id])
        self._evict()

    def _evict(self) -> None:
        """The least recently used blobs not pinned out, until the loose ones and the
        reservations fit the bound."""
        excess = self._loose_bytes + self.pinned_bytes - self.max_bytes
        out = []
        for blob_id, data in self._blobs.items():
            if excess <= 0:
                break
            if blob_id not in self._pins:
                out.append(blob_id)
                excess -= self._size(data)
        for blob_id in out:
            size = self._size(self._blobs.pop(blob_id))
            self.bytes -= size
            self._loose_bytes -= size

    def _size(self, value: Buffer) -> int:
        """The bytes a kept value counts for (a model of a cache may keep less)."""
        return len(value)

    def ids(self) -> list[str]:
        """Cached ids, most recently used first (the scheduler routes work by them)."""
        return list(reversed(self._blobs))

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class Downloads:
    """Downloads under way, one per blob: queued tiles fetch their operands ahead (as far
    as the cache has room for them), and the tiles of one row or column of a product share
    a panel; the second and later ask for the download already running instead of starting
    their own. One tile dropped meanwhile does not cancel the download for the others."""

    def __init__(self) -> None:
        self._running: dict[str, asyncio.Future[Buffer]] = {}

    def running(self, blob_id: str) -> bool:
        return blob_id in self._running

    async def get(self, blob_id: str, download: Callable[[], Awaitable[Buffer]]) -> Buffer:
        running = self._running.get(blob_id)
        if running is None:
            running = asyncio.ensure_future(download())
            self._running[blob_id] = running
            running.add_done_callback(functools.partial(self._finished, blob_id))
        return await asyncio.shield(running)

    def _finished(self, blob_id: str, done: asyncio.Future[Buffer]) -> None:
        if self._running.get(blob_id) is done:
            del self._running[blob_id]
        if not done.cancelled():
            done.exception()  # retrieved: whoever awaited it has seen it
