"""Exponential backoff with full jitter, capped (the AWS architecture blog's variant)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Backoff:
    """Delays that double after each failure up to `cap`, drawn uniformly from [0, bound]
    so that many volunteers that lost the coordinator together do not return together."""

    base: float = 0.5
    cap: float = 60.0
    rng: random.Random = field(default_factory=random.Random)
    failures: int = 0

    def next_delay(self, at_least: float = 0.0) -> float:
        """The wait after one more failure; never below what the server asked for."""
        bound = min(self.cap, self.base * 2**self.failures)
        self.failures = min(self.failures + 1, 62)
        return max(at_least, self.rng.uniform(bound / 2, bound))

    def reset(self) -> None:
        self.failures = 0

    @property
    def current(self) -> float:
        """The bound of the next delay, for the status line (0 when not backing off)."""
        return 0.0 if self.failures == 0 else min(self.cap, self.base * 2 ** (self.failures - 1))
