"""Each host's uplink, as the coordinator times the bodies of its reports.

A tile's arithmetic is measured by its host, and the crowd's round trip and download from
the results' turnaround (engine/crowd.py); neither says what a tile of a few megabytes
costs a host on a home uplink of 100 KB/s, where its upload takes a minute. Timed where
the bytes arrive, the uplink is the coordinator's own measure: a host cannot talk its
deadlines longer than its reports actually take, and a volunteer of any version is timed.

Only bodies of MIN_SAMPLE bytes or more are timed: a small one arrives within its first
packets, and its time is the loop's, not the link's. The time runs from the body's first
read (the headers have arrived) to its last byte, so a loop busy elsewhere makes an uplink
look slower, never faster: its tiles' deadlines err long.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

MIN_SAMPLE = 256 << 10  # bytes: the smallest body whose arrival is timed
WEIGHT = 0.3  # of each new sample in a host's moving average
# Uplinks faster than this are as good as free for a tile (a megabyte in 0.1 s, under a
# tile's round trip and deadline floor): a host on loopback or a LAN, whose reports a busy
# loop reads at tens of MB/s, keeps the deadlines and the tiles it had.
FREE_PER_BYTE = 1e-7  # seconds a byte: 10 MB/s


class Uplinks:
    """Seconds a byte takes each host's uplink, a moving average over its timed reports."""

    def __init__(self) -> None:
        self._per_byte: dict[int, float] = {}

    def timed(self, host_id: int, nbytes: int, seconds: float) -> None:
        """A body of `nbytes` from the host arrived in `seconds`."""
        if nbytes < MIN_SAMPLE:
            return
        sample = max(seconds, 0.0) / nbytes
        old = self._per_byte.get(host_id)
        self._per_byte[host_id] = sample if old is None else old + WEIGHT * (sample - old)

    def per_byte(self, host_id: int) -> float:
        """Seconds a byte takes the host's uplink; 0.0 when not measured, or free
        (FREE_PER_BYTE)."""
        per_byte = self._per_byte.get(host_id, 0.0)
        return per_byte if per_byte > FREE_PER_BYTE else 0.0

    def rate(self, host_id: int) -> float | None:
        """The host's uplink in bytes a second, None when not measured."""
        per_byte = self._per_byte.get(host_id)
        return None if not per_byte else 1.0 / per_byte

    def typical(self, host_ids: Iterable[int]) -> tuple[float, float]:
        """(median, largest) seconds a byte over the hosts: the typical uplink that sizes
        a product's tiles, and the slowest, which caps them. Hosts not measured, or
        free, count as 0."""
        if not self._per_byte:  # nothing timed yet: no host's uplink to look up
            return 0.0, 0.0
        per_byte = [self.per_byte(h) for h in host_ids]
        if not per_byte:
            return 0.0, 0.0
        return statistics.median(per_byte), max(per_byte)
