"""The operand cache: verified blobs kept in memory, least recently used out first, and the
downloads that fill it, one per blob."""

from __future__ import annotations

import asyncio
import functools
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from kernels.frames import Buffer


class BlobCache:
    """Blob bytes by id, bounded in bytes; counts hits and misses for the status line."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._blobs: OrderedDict[str, Buffer] = OrderedDict()
        self.bytes = 0
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
        """Keep a blob (already verified by the caller); too large a blob is not kept."""
        size = self._size(data)
        if blob_id in self._blobs or size > self.max_bytes:
            return
        self._blobs[blob_id] = data
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, evicted = self._blobs.popitem(last=False)
            self.bytes -= self._size(evicted)

    def drop(self, blob_id: str) -> None:
        """Let a blob go before its turn (the coordinator says no product will use it)."""
        data = self._blobs.pop(blob_id, None)
        if data is not None:
            self.bytes -= self._size(data)

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
    """Downloads under way, one per blob: every queued tile starts fetching its operands when
    it arrives, and the tiles of one row or column of a product share a panel; the second
    and later ask for the download already running instead of starting their own. One
    tile dropped meanwhile does not cancel the download for the others."""

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
