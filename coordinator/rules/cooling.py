"""Hosts that sat on work: no new work for a while, twice as long each time in a row.

A host whose tile needed a straggler's spare (engine/passes.py) held up a product it
was trusted with; a slow, stopped or hoarding host would take the next product's tile
the moment it asked again, and hold that up too. Each time in a row it waits twice as
long before it gets more, up to COOL_MAX; a result it computed, reported, ends the streak.

Until then the host is on probation: each tile it takes once its wait is over gets a
spare at once (engine/passes.py, `Passes.probation`), and if that tile is still out in its
hands a straggler's time later, it sat on it too. A copy it was told to drop because the
spare came first is not held against it, one at a time: a host slower than the spares may
be honest. PROBATION_TILES of them taken and none computed, it sat on them all the same;
a host that takes tiles and computes none would be spared for ever otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

COOL_BASE = 2.0  # seconds without new work after the first tile a host sat on
COOL_MAX = 120.0
PROBATION_TILES = 3  # tiles a host on probation takes, computing none, before it sat on them


@dataclass
class Cooling:
    streak: dict[int, int] = field(default_factory=dict)  # tiles sat on in a row, by host
    until: dict[int, float] = field(default_factory=dict)  # no new work before (time.time)
    taken: dict[int, int] = field(default_factory=dict)  # tiles taken on probation, by host
    why: dict[int, str] = field(default_factory=dict)  # what it last sat on, in words

    def on_probation(self, host_id: int) -> bool:
        """The host sat on a tile and has computed nothing since."""
        return host_id in self.streak

    def took(self, host_id: int, count: int) -> None:
        """The host, on probation, took `count` tiles."""
        self.taken[host_id] = self.taken.get(host_id, 0) + count

    def used_up(self, host_id: int) -> bool:
        """The host took PROBATION_TILES tiles on probation since it last sat on one, and
        computed none of them."""
        return self.taken.get(host_id, 0) >= PROBATION_TILES

    def sat_on(self, host_id: int, now: float, why: str = "") -> float:
        """The host sat on a tile (`why`, as its answers will say it): seconds it now gets
        no new work."""
        streak = self.streak.get(host_id, 0) + 1
        self.streak[host_id] = streak
        self.why[host_id] = why
        self.taken.pop(host_id, None)  # its tiles on probation counted from its next wait
        seconds = min(COOL_MAX, COOL_BASE * 2 ** (streak - 1))
        self.until[host_id] = now + seconds
        return seconds

    def forget(self, host_id: int) -> None:
        """The host starts over (an operator released it from quarantine)."""
        self.reported(host_id)

    def reported(self, host_id: int) -> None:
        """The host reported a result it computed: whatever it sat on before, it computes."""
        if host_id in self.streak:
            del self.streak[host_id]
            self.until.pop(host_id, None)
            self.taken.pop(host_id, None)
            self.why.pop(host_id, None)

    def left(self, host_id: int, now: float) -> float:
        """Seconds before the host gets new work again (0: now)."""
        until = self.until.get(host_id)
        return 0.0 if until is None else max(0.0, until - now)
