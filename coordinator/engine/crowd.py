"""The crowd as measured lately: how many hosts, how fast, and what a tile costs them beyond
its arithmetic (a fixed part, the round trip, and a part per byte moved). Products are cut to
fit it (rules/sizing.py)."""

from __future__ import annotations

import statistics

from coordinator.rules.sizing import Crowd
from coordinator.state.ledger import Ledger

RECENT = 30.0  # seconds: a host heard from this recently is part of the crowd
REMEMBER = 1.0  # seconds a look at the hosts is reused: 10,000 hosts cost a few ms to scan
WEIGHT = 0.1  # of each new observation in the moving averages
FIRST_OVERHEAD = 0.01  # seconds assumed before any tile is measured: a loopback round trip


class CrowdWatch:
    """Learns a tile's cost beyond its arithmetic from the results that come back, as a
    line: seconds = overhead + seconds_per_byte x bytes, fitted by moving averages (the
    hosts' own compute seconds are taken out; they only ever inform this estimate)."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        # Moving averages of bytes (x), extra seconds (y), x*x and x*y.
        self._x = self._y = self._xx = self._xy = 0.0
        self._seen_any = False
        self._hosts: tuple[float, Crowd] | None = None

    def observe(self, turnaround: float, compute: float, nbytes: int) -> None:
        """A result came back `turnaround` seconds after it was sent, `compute` of them
        spent computing (as its host says), its tile having moved `nbytes`."""
        y = min(max(turnaround - compute, 0.0), 60.0)
        x = float(nbytes)
        if not self._seen_any:
            self._x, self._y, self._xx, self._xy = x, y, x * x, x * y
            self._seen_any = True
            return
        w = WEIGHT
        self._x += w * (x - self._x)
        self._y += w * (y - self._y)
        self._xx += w * (x * x - self._xx)
        self._xy += w * (x * y - self._xy)

    def cost(self) -> tuple[float, float]:
        """(overhead seconds, seconds per byte): the line through what was seen; a flat
        line at the mean while the tiles seen were all of one size."""
        if not self._seen_any:
            return FIRST_OVERHEAD, 0.0
        var = self._xx - self._x * self._x
        slope = (self._xy - self._x * self._y) / var if var > (0.05 * self._x) ** 2 else 0.0
        slope = max(slope, 0.0)
        return max(self._y - slope * self._x, 0.0), slope

    def crowd(self, now: float) -> Crowd:
        overhead, per_byte = self.cost()
        if self._hosts is None or now - self._hosts[0] >= REMEMBER:
            hosts = [
                h
                for h in self.ledger.hosts.values()
                if not h.quarantined and now - h.last_contact <= RECENT
            ]
            memory = [h.max_memory_mb << 20 for h in hosts if h.max_memory_mb]
            looked = Crowd(
                hosts=max(len(hosts), 1),
                gflops=statistics.median(h.gflops for h in hosts) if hosts else 1.0,
                overhead=overhead,
                memory_bytes=min(memory, default=0),
            )
            self._hosts = (now, looked)
        seen = self._hosts[1]
        return Crowd(seen.hosts, seen.gflops, overhead, seen.memory_bytes, per_byte)
