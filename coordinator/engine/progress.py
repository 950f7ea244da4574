"""How training is going, for status, the dashboard and /metrics: steps, rates, counts."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from coordinator.engine.metrics import Metrics
from coordinator.state.ledger import Ledger
from coordinator.training import history
from coordinator.work.records import GemmState, counted_state, has_asked

ACTIVE_WITHIN = 300.0  # seconds since its last contact for a host to count as active


HOST_STATES = ("active", "paused", "idle", "quarantined")


def host_state(
    quarantined: bool,
    gone: bool,
    last_contact: float,
    now: float,
    paused: bool = False,
    created: float | None = None,
) -> str:
    """How `status` counts a host: quarantined; idle if it said it stops (at once), has not
    been heard from lately, or has not asked for work since it registered at `created`
    (what engine/waiting.py counts as connected agrees); paused if its owner is using its
    machine (`--idle-only`: in contact, but it takes no work); active otherwise."""
    if quarantined:
        return "quarantined"
    if gone or now - last_contact >= ACTIVE_WITHIN:
        return "idle"
    if created is not None and not has_asked(created, last_contact):
        return "idle"
    return "paused" if paused else "active"


def no_host_states() -> dict[str, int]:
    return dict.fromkeys(HOST_STATES, 0)


def eta(summary: dict) -> tuple[float | None, str]:
    """The time left, as status and the dashboard show it: (seconds, "") while training
    flows, or (None, why there is none): done, paused, no coordinator (nor `train --local`)
    running, work waiting (the step times of before say nothing of when it flows again), or
    no step timed yet."""
    training = summary.get("training") or {}
    if training.get("done"):
        return None, "done"
    if summary.get("paused"):
        return None, "none while paused"
    if "coordinator" in summary and not (summary["coordinator"] or summary.get("training_locally")):
        return None, "none while no coordinator runs"
    if summary.get("waiting"):
        return None, "unknown while work waits"
    seconds = training.get("eta_seconds")
    return (seconds, "") if seconds is not None else (None, "unknown")


def settle_eta(summary: dict) -> dict:
    """The summary with its training's eta_seconds None where `eta` says there is none, so
    `status --json` agrees with what status and the dashboard print."""
    if summary.get("training"):
        summary["training"] = {**summary["training"], "eta_seconds": eta(summary)[0]}
    return summary


class Progress:
    def __init__(self, ledger: Ledger, stats: dict) -> None:
        self.ledger = ledger
        self.stats = stats
        self.training: dict = {}  # step, steps, loss: set by the training loop
        self.history: list[dict] = []  # one entry per step: loss, val_loss, seconds
        self.rates: deque[tuple[float, int]] = deque(maxlen=600)  # (time, tiles_in) samples
        self.paused = lambda: False  # the Coordinator's switch
        self.owner_busy: Callable[[int], bool] = lambda host_id: False  # paused by its owner
        self.waiting = lambda: None  # why work waits (engine/waiting.py), if it does
        self.metrics = Metrics(self.status)

    def restore(self, records: list[dict], steps: int) -> None:
        """Start from the project's history (train.jsonl): after a restart, status, the
        dashboard and /metrics show the step reached, not step 0."""
        self.history = list(records)
        self.training = history.progress(self.history, steps)
        if "loss" in self.training:
            self.metrics.loss.set(self.training["loss"])
        self.metrics.step.set(self.training["step"])

    def record_step(self, record: dict, steps: int) -> None:
        """What the training loop reports after each step, the line it writes to train.jsonl
        (StepReport.record), for status, the dashboard and metrics."""
        self.history.append(record)
        self.training = history.progress(self.history, steps)
        self.metrics.loss.set(record["loss"])
        self.metrics.step.set(record["step"])
        self.metrics.steps.observe(record["seconds"])

    def sample_rate(self, now: float) -> None:
        """One (time, tiles in) sample a second at most, for tiles_per_second."""
        if not self.rates or now - self.rates[-1][0] >= 1.0:
            self.rates.append((now, self.stats["tiles_in"]))

    def tiles_per_second(self, window: float = 60.0) -> float:
        """Tiles received over the last `window` seconds, per second of it: what `status`
        from the project's files counts too (its results of the last minute over 60 s), so
        the two agree, through a pause or a quiet spell as much as in full flow."""
        now = time.time()
        before = [n for t, n in self.rates if t <= now - window]
        return (self.stats["tiles_in"] - (before[-1] if before else 0)) / window

    def host_states(self, now: float | None = None) -> dict[str, int]:
        now = time.time() if now is None else now
        states = no_host_states()
        for h in self.ledger.hosts.values():
            paused = self.owner_busy(h.id)
            state = host_state(h.quarantined, h.gone, h.last_contact, now, paused, h.created)
            states[state] += 1
        return states

    def full_status(self) -> dict:
        """status() with the counts of the whole project, finished products included. From
        memory: a status request never queues behind a commit."""
        summary = self.status()
        summary["workunits"] = {s: n for s, n in self.ledger.workunit_counts.items() if n}
        summary["invalid"] = self.ledger.invalid_count
        return settle_eta(summary)

    def status(self) -> dict:
        """A summary of what is in memory, for /metrics and the dashboard."""
        ledger = self.ledger
        training = dict(self.training)
        return {
            "gemms_active": sum(1 for g in ledger.gemms.values() if g.state is GemmState.ACTIVE),
            "workunits": _count(counted_state(wu) for wu in ledger.wus.values()),
            "results": _count(r.server_state.value for r in ledger.results.values()),
            "hosts": len(ledger.hosts),
            "host_states": self.host_states(),
            "hosts_quarantined": sum(1 for h in ledger.hosts.values() if h.quarantined),
            "tiles_per_second": round(self.tiles_per_second(), 2),
            "training": training,
            "paused": self.paused(),
            "waiting": _as_dict(self.waiting()),
            **self.stats,
        }


def _count(values) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return counts


def _as_dict(wait) -> dict | None:
    return wait.to_dict() if wait is not None else None


def duration(seconds: float) -> str:
    """A time left as every view says it: 3m46s, or 43h44m from an hour on."""
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds // 60 % 60:02d}m"
        if seconds >= 3600
        else f"{seconds // 60}m{seconds % 60:02d}s"
    )
