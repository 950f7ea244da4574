"""The operand cache: verified blobs kept in memory, least recently used out first."""

from __future__ import annotations

from collections import OrderedDict


class BlobCache:
    """Blob bytes by id, bounded in bytes; counts hits and misses for the status line."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._blobs: OrderedDict[str, bytes] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, blob_id: str) -> bytes | None:
        data = self._blobs.get(blob_id)
        if data is None:
            self.misses += 1
            return None
        self.hits += 1
        self._blobs.move_to_end(blob_id)
        return data

    def put(self, blob_id: str, data: bytes) -> None:
        """Keep a blob (already verified by the caller); too large a blob is not kept."""
        if blob_id in self._blobs or len(data) > self.max_bytes:
            return
        self._blobs[blob_id] = data
        self.bytes += len(data)
        while self.bytes > self.max_bytes:
            _, evicted = self._blobs.popitem(last=False)
            self.bytes -= len(evicted)

    def ids(self) -> list[str]:
        """Cached ids, most recently used first (the scheduler routes work by them)."""
        return list(reversed(self._blobs))

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0
