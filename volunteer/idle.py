"""Whether the machine's owner is using it (`--idle-only`): the CPU its programs use, not
tilehive's own.

The volunteer pauses while programs other than tilehive's use more than half a core. It
used to count every process but itself, so on the coordinator's own machine (a project
host lending its idle cores, or `tilehive demo`) it took the coordinator it serves for the
owner at work: each tile it computed kept the coordinator busy, which paused it, and a
tiny-gpt step took 32 s instead of a tenth of one. tilehive's processes are told apart by
their names (kernels/processes.py).

The share is measured over a window of a second at least: the loop asks before every tile,
and the kernel counts CPU in ticks of 10 ms, so a look every few milliseconds read noise.
The owner counts as busy once the share has stayed over the threshold for SUSTAINED
seconds: a second's burst of another program (a command run in a terminal, a page loading)
paused the volunteer, and the coordinator then gave its tiles to others.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from kernels import processes

THRESHOLD = 0.5  # cores' worth of CPU others may use before the volunteer pauses
WINDOW = 1.0  # seconds: the shortest span a share is measured over; a look is kept as long
RESCAN = 10.0  # seconds between two looks for tilehive's processes (a scan of /proc)
SUSTAINED = 2.0  # seconds others must keep over THRESHOLD before the owner counts as busy


@dataclass(frozen=True)
class Sample:
    """The machine's CPU at one moment: busy seconds in all, and each of tilehive's
    processes' own."""

    when: float
    busy: float
    ours: dict[int, float]


def others_share(before: Sample, after: Sample) -> float:
    """Cores' worth of CPU that processes not tilehive's used between two samples. A
    process seen in one sample only is not subtracted: it started or ended in between,
    and its CPU counts as others' for this window alone."""
    elapsed = after.when - before.when
    if elapsed <= 0:
        return 0.0
    # (A pid used again by a new process between the samples reads as less: not subtracted.)
    ours = sum(max(after.ours[p] - before.ours[p], 0.0) for p in after.ours.keys() & before.ours)
    return max(after.busy - before.busy - ours, 0.0) / elapsed


def machine_busy_seconds(proc: Path = processes.PROC) -> float | None:
    """CPU seconds the machine has been busy since it booted, all cores: user, nice, system
    and interrupts (not idle, I/O wait, time stolen by the hypervisor, or guests, which
    user and nice already count). None without /proc/stat."""
    try:
        with open(proc / "stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq = (fields + [0.0] * 7)[:7]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


class OwnerWatch:
    """Looks at the machine's CPU at most once a WINDOW and says whether its owner's
    programs keep it busy."""

    def __init__(self, threshold: float = THRESHOLD, proc: Path = processes.PROC) -> None:
        self.threshold = threshold
        self.proc = proc
        self.share: float | None = None  # cores others used in the last window; None: unknown
        self._last: Sample | None = None
        self._over_since: float | None = None  # since when the share has stayed over
        self._busy = False
        self._pids: set[int] = set()
        self._scanned = -RESCAN

    def busy(self, now: float | None = None) -> bool:
        """True while others have used more than `threshold` of a core in each window of
        the last SUSTAINED seconds, and in the last window."""
        now = time.monotonic() if now is None else now
        if self._last is not None and now - self._last.when < WINDOW:
            return self._busy
        sample = self.sample(now)
        if sample is None:
            return False
        if self._last is not None:
            self.share = others_share(self._last, sample)
            if self.share <= self.threshold:
                self._over_since = None
            elif self._over_since is None:
                self._over_since = self._last.when  # the window this share was measured over
        self._last = sample
        self._busy = self._over_since is not None and now - self._over_since >= SUSTAINED
        return self._busy

    def sample(self, now: float) -> Sample | None:
        """The machine's CPU now; None without /proc."""
        busy = machine_busy_seconds(self.proc)
        if busy is None:
            return None
        if now - self._scanned >= RESCAN:
            self._pids = set(processes.ours(self.proc)) | {os.getpid()}
            self._scanned = now
        ours = {}
        for pid in self._pids:
            seconds = processes.cpu_seconds(pid, self.proc)
            if seconds is not None:
                ours[pid] = seconds
        self._pids = set(ours) | {os.getpid()}  # the ones gone are dropped
        return Sample(now, busy, ours)
