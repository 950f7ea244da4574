"""The crowd as measured lately: how many hosts, how fast, and what a tile costs them beyond
its arithmetic. Products are cut to fit it (rules/sizing.py)."""

from __future__ import annotations

import statistics

from coordinator.rules.sizing import Crowd
from coordinator.state.ledger import Ledger

RECENT = 30.0  # seconds: a host heard from this recently is part of the crowd
REMEMBER = 1.0  # seconds a look at the hosts is reused: 10,000 hosts cost a few ms to scan
WEIGHT = 0.2  # of each new observation in the moving average of a tile's overhead
FIRST_OVERHEAD = 0.01  # seconds assumed before any tile is measured: a loopback round trip


class CrowdWatch:
    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.overhead = FIRST_OVERHEAD
        self._seen: tuple[float, Crowd] | None = None

    def observe(self, turnaround: float, compute: float) -> None:
        """A result came back `turnaround` seconds after it was sent, `compute` of them
        spent computing (as its host says; only the average is used, never a decision)."""
        extra = min(max(turnaround - compute, 0.0), 60.0)
        self.overhead += WEIGHT * (extra - self.overhead)

    def crowd(self, now: float) -> Crowd:
        if self._seen is not None and now - self._seen[0] < REMEMBER:
            crowd = self._seen[1]
            return Crowd(crowd.hosts, crowd.gflops, self.overhead, crowd.memory_bytes)
        hosts = [
            h
            for h in self.ledger.hosts.values()
            if not h.quarantined and now - h.last_contact <= RECENT
        ]
        memory = [h.max_memory_mb << 20 for h in hosts if h.max_memory_mb]
        crowd = Crowd(
            hosts=max(len(hosts), 1),
            gflops=statistics.median(h.gflops for h in hosts) if hosts else 1.0,
            overhead=self.overhead,
            memory_bytes=min(memory, default=0),
        )
        self._seen = (now, crowd)
        return crowd
