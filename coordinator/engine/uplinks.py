"""Each host's uplink, as the coordinator times the bodies of its reports.

A tile's arithmetic is measured by its host, and the crowd's round trip and download from
the results' turnaround (engine/crowd.py); neither says what a tile of a few megabytes
costs a host on a home uplink of 100 KB/s, where its upload takes a minute.

A body of MIN_SAMPLE bytes or more is timed from its first chunk's arrival to its last's,
the first chunk's bytes left out (server/api.py, BodyClock.pace), and only when the report
brings work the coordinator takes: a host that sends junk slowly does not make its uplink
look slow. What is timed is the link as the host drives it. A host can send its reports
slower than its link allows, and so lengthen its own deadlines (within delay_bound) and
shrink its own share of the work; bytes that waited in the socket for a busy loop make an
uplink look faster, and a report beside another slower.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable

MIN_SAMPLE = 64 << 10  # bytes: the smallest body whose arrival is timed (a tile of 128)
WEIGHT = 0.3  # of each new sample in a host's moving average
# Uplinks faster than this are as good as free for a tile (a megabyte in 0.1 s, under a
# tile's round trip and deadline floor): a host on loopback or a LAN, whose reports a busy
# loop reads at tens of MB/s, keeps the deadlines and the tiles it had.
FREE_PER_BYTE = 1e-7  # seconds a byte: 10 MB/s
# A host's average older than this says little of its link now (a laptop taken from home
# to the office): it counts as unknown, and the next sample replaces it rather than moving
# it by WEIGHT. (Left standing, a link timed slow would be given no tile large enough to
# be timed again.)
STALE = 600.0  # seconds


class Uplinks:
    """Seconds a byte takes each host's uplink, a moving average over its timed reports."""

    def __init__(self) -> None:
        self._per_byte: dict[int, float] = {}
        self._when: dict[int, float] = {}  # when each host's uplink was last timed

    def timed(self, host_id: int, nbytes: int, seconds: float, now: float) -> None:
        """A body of `nbytes` from the host arrived in `seconds`, by `now`."""
        if nbytes < MIN_SAMPLE:
            return
        sample = max(seconds, 0.0) / nbytes
        old = self._per_byte.get(host_id)
        if old is None or self._stale(host_id, now):
            self._per_byte[host_id] = sample
        else:
            self._per_byte[host_id] = old + WEIGHT * (sample - old)
        self._when[host_id] = now

    def per_byte(self, host_id: int, now: float | None = None) -> float:
        """Seconds a byte takes the host's uplink; 0.0 when not measured lately (STALE), or
        free (FREE_PER_BYTE)."""
        per_byte = self._per_byte.get(host_id, 0.0)
        if per_byte <= FREE_PER_BYTE or self._stale(host_id, now):
            return 0.0
        return per_byte

    def rate(self, host_id: int, now: float | None = None) -> float | None:
        """The host's uplink in bytes a second, None when not measured lately."""
        per_byte = self._per_byte.get(host_id)
        return None if not per_byte or self._stale(host_id, now) else 1.0 / per_byte

    def _stale(self, host_id: int, now: float | None) -> bool:
        return (time.time() if now is None else now) - self._when[host_id] > STALE

    def typical(self, host_ids: Iterable[int]) -> float:
        """Seconds a byte over the hosts, the typical one's (the lower median: of two, the
        faster), which sizes a product's tiles: a slow host, or one that makes itself look
        slow, does not shrink every host's tiles; tiles it cannot send go to others.
        Hosts not measured, or free, count as 0."""
        if not self._per_byte:  # nothing timed yet: no host's uplink to look up
            return 0.0
        now = time.time()
        per_byte = [self.per_byte(h, now) for h in host_ids]
        return statistics.median_low(per_byte) if per_byte else 0.0
