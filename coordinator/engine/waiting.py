"""Why work waits: a paused project, a blob store that cannot be written, no volunteers,
volunteers too small for the tiles or on uplinks too slow to send them, volunteers gone
quiet or paused by their owners, or too few of them for the validation policy.

Checked once a second. A change is said once: a warning in the log when work starts to wait
(but for the operator's pause, said where it is made), an info line when it flows again,
and a `wait` event (`waiting` or `flowing`), so that `tilehive status DIR` and `tilehive
logs` see it as well as `/v1/status` and the dashboard; a host asking for work while it
waits is told why in its reply's `note`."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.rules.scheduler import memory_need, takes_replacement
from coordinator.state.ledger import Ledger
from coordinator.work.events import Event
from coordinator.work.records import Host, Outcome, ServerState, ValidateState, WorkUnit

log = logging.getLogger(__name__)

CONNECTED_WITHIN = 60.0  # seconds since its last request for a host to count as connected
# Seconds past the delay it was told before a host that holds no work counts as quiet: a
# volunteer with no work asks again within its own backoff (10 s at most) or that delay,
# whichever is longer, and a round trip later it has been heard.
QUIET_AFTER = 15.0
SAMPLE = 256  # waiting results looked at: enough to tell, few enough for 10,000 hosts
MB = 1 << 20


@dataclass(frozen=True, slots=True)
class Wait:
    # paused | storage | no_volunteers | hosts_too_small | hosts_too_slow | hosts_paused |
    # hosts_quiet | needs_hosts
    reason: str
    message: str
    tiles: int = 0  # results waiting to be sent
    since: float = 0.0
    # needs_hosts: the hosts it counted (connected, each holding its replicas). A host
    # not among them, one that joined since, is the other volunteer asked for.
    hosts: frozenset[int] = frozenset()

    def to_dict(self) -> dict:
        return {
            "reason": self.reason,
            "message": self.message,
            "tiles": self.tiles,
            "since": self.since,
        }


def explain(
    ledger: Ledger,
    paused: bool,
    now: float,
    storage: str | None = None,
    too_slow: Callable[[Host, WorkUnit], float] = lambda host, wu: 0.0,
    quiet: Callable[[Host, float], float] = lambda host, now: 0.0,
    owner_busy: Callable[[Host], bool] = lambda host: False,
) -> Wait | None:
    """Why the unsent work is not going out, or None when it is (or there is none).
    `storage`: what the blob store's writer last failed with, if it is failing.
    `too_slow(host, wu)`: the seconds the host's uplink would take to send the work
    unit's tile when that is past what a deadline allows (rules/scheduler.py), else 0.
    `quiet(host, now)`: the seconds since the host was last heard from, when it is long past
    due to ask again and holds no work (stopped, asleep or cut off), else 0.
    `owner_busy(host)`: whether the host said it is paused while its owner uses the machine
    (`--idle-only`)."""
    if paused:
        return Wait(
            "paused",
            "the project is paused by its operator: no new work goes out "
            "(tilehive admin resume URL --project DIR)",
        )
    if storage is not None:
        return Wait(
            "storage",
            f"work waits for the blob store: {storage}; tiles and new products are refused "
            "until it can be written again (free space, or fix the disk), then work goes on",
            len(ledger.unsent),
        )
    if not ledger.unsent:
        return None
    hosts = [
        h
        for h in ledger.hosts.values()
        if h.in_service and h.has_asked and now - h.last_contact < CONNECTED_WITHIN
    ]
    waiting = len(ledger.unsent)
    if not hosts:
        return Wait(
            "no_volunteers",
            "work waits for volunteers: none is connected, none has asked for work lately "
            "(start one: tilehive volunteer start URL)",
            waiting,
        )
    away_for: dict[int, float] = {}  # each host's silence (-1: paused by its owner), once
    ordered = False  # the hosts that may take work now first (once one away was met)

    def away(h: Host) -> float:
        if (seconds := away_for.get(h.id)) is None:
            seconds = away_for[h.id] = quiet(h, now) or (-1.0 if owner_busy(h) else 0.0)
        return seconds

    too_small = held = quorum = slow = silent = paused_by_owners = 0
    need = 0
    fastest = 0.0  # the least seconds a connected host's uplink needs for a tile it cannot send
    # The seconds since the latest word of the quiet hosts that could take the work: none
    # of them has been heard from since.
    heard = math.inf
    policy = ""
    for result_id in itertools.islice(ledger.unsent, SAMPLE):
        result = ledger.results.get(result_id)
        wu = ledger.wus.get(result.wu_id) if result is not None else None
        if wu is None or result.server_state is not ServerState.UNSENT:
            continue
        if wu.accelerated and _live(ledger.results_for(wu.id)) >= wu.min_quorum:
            continue  # a tail's spare replica: wanted if a fast host is free, never waited for
        wants = memory_need(wu, ledger.panel_bytes)
        holders = ledger.hosts_of_wu.get(wu.id, set())
        fits = False
        upload = 0.0  # the least seconds a host that has the memory needs to send it
        # The first host away (quiet: seconds since its last word; paused by its owner:
        # -1) that may take it, when none that may take work now may.
        absent = 0.0
        for h in hosts:  # usually the first host settles it: with many, work flows
            if h.max_memory_mb and wants > h.max_memory_mb * MB:
                continue
            if seconds := too_slow(h, wu):
                upload = min(upload or seconds, seconds)
                continue
            fits = True
            if h.id not in holders or takes_replacement(h, wu, ledger.results_for(wu.id)):
                if not (seconds := away(h)):
                    return None  # a connected host may take it: work flows
                if not absent or seconds < 0 < absent:
                    absent = seconds  # one paused is known alive: said before one quiet
                if ordered:
                    break  # those that may take work now came first: none of them may
        if absent and not ordered:
            # A host away met: from now on those that may take work now are walked first,
            # then the paused (known alive), then the quiet, so that one away reached
            # settles a work unit (10,000 hosts away are walked once, not once a work unit).
            hosts = (
                [h for h in hosts if not away(h)]
                + [h for h in hosts if away(h) < 0]
                + [h for h in hosts if away(h) > 0]
            )
            ordered = True
        if absent < 0:
            paused_by_owners += 1
        elif absent:
            silent += 1
            heard = min(heard, absent)
        elif upload and not fits:
            slow += 1
            fastest = max(fastest, upload)
        elif not fits:
            too_small += 1
            need = max(need, wants)
        else:
            held += 1
            quorum, policy = max(quorum, wu.min_quorum), wu.policy.value
    others = max(held, silent, paused_by_owners)  # the work units the later reasons count
    if too_small >= others and too_small:
        largest = max(h.max_memory_mb for h in hosts)
        return Wait(
            "hosts_too_small",
            f"work waits for a larger volunteer: a tile needs {need / MB:.1f} MB and the "
            f"largest connected volunteer offers {largest} MB for work (raise its "
            "--max-memory, or lower the project's work.tile)",
            waiting,
        )
    if slow >= others and slow:
        return Wait(
            "hosts_too_slow",
            f"work waits for a faster uplink: a tile would take {fastest:.0f}s to send from "
            "the fastest connected volunteer that could compute it, longer than the "
            "project's work.delay_bound leaves for uploads; such tiles go one at a time to "
            "volunteers with nothing else to send (raise work.delay_bound, lower work.tile, "
            "or start a volunteer on a faster link)",
            waiting,
        )
    if paused_by_owners >= max(held, silent) and paused_by_owners:
        return Wait(
            "hosts_paused",
            "work waits for volunteers: those that could take it are paused while their "
            "owners use their machines (--idle-only); it goes on when a machine is idle "
            "again, or when another volunteer starts",
            waiting,
        )
    if silent >= held and silent:
        return Wait(
            "hosts_quiet",
            # A time of day, not seconds ago: the log and `status DIR` keep the message as
            # it was first said, and "for 47s" would read the same a minute later.
            f"work waits for volunteers: those that could take it have not been heard from "
            f"since {clock(now - heard)} (stopped, asleep or cut off?); a volunteer counts as "
            f"gone {CONNECTED_WITHIN:.0f}s after its last word",
            waiting,
        )
    if held:
        return Wait(
            "needs_hosts",
            f"work waits for another volunteer: the {policy} policy has each tile computed "
            f"by {quorum} different volunteers and the {len(hosts)} connected already hold "
            "theirs (start another volunteer; see README: volunteers per policy)",
            waiting,
            hosts=frozenset(h.id for h in hosts),
        )
    return None


def clock(when: float) -> str:
    """A wall time as the coordinator's log shows the time of day (local, to the second)."""
    return time.strftime("%H:%M:%S", time.localtime(when))


def _live(results) -> int:
    """Replicas in progress, or reported and not found invalid."""
    return sum(
        1
        for r in results
        if r.server_state is ServerState.IN_PROGRESS
        or (r.outcome is Outcome.SUCCESS and r.validate_state is not ValidateState.INVALID)
    )


class Waiting:
    """The current reason work waits, said once per change."""

    def __init__(
        self,
        ledger: Ledger,
        paused: Callable[[], bool],
        storage: Callable[[], str | None] = lambda: None,
        too_slow: Callable[[Host, WorkUnit], float] = lambda host, wu: 0.0,
        quiet: Callable[[Host, float], float] = lambda host, now: 0.0,
        owner_busy: Callable[[Host], bool] = lambda host: False,
    ) -> None:
        self.ledger = ledger
        self.paused = paused  # the Coordinator's switch
        self.storage = storage  # the blob store's failure, as a message, or None
        self.too_slow = too_slow  # a host's uplink too slow for a tile (explain)
        self.quiet = quiet  # a host long past due to ask (explain)
        self.owner_busy = owner_busy  # a host paused while its owner works (explain)
        self.current: Wait | None = None
        self._seen: str | None = None  # the reason found by the previous look
        # When work began to wait, whatever the reasons since: a wait that moved from one
        # reason to another flows again after all of it, not after its last reason's share.
        self._began: float | None = None

    def check(self, now: float) -> bool:
        """Look again; True when the reason changed (and was logged). A new reason counts
        once two looks in a row find it (a moment between two products is no wait); a
        pause, the operator's own doing, and the end of a wait count at once."""
        found = explain(
            self.ledger,
            self.paused(),
            now,
            self.storage(),
            self.too_slow,
            self.quiet,
            self.owner_busy,
        )
        reason = found.reason if found is not None else None
        seen, self._seen = self._seen, reason
        before = self.current
        if before is not None and found is not None and before.reason == found.reason:
            # The same wait, perhaps with other counts: keep its start, say nothing again.
            self.current = dataclasses.replace(found, since=before.since)
            return False
        if before is None and found is None:
            return False
        if found is not None and reason != seen and reason != "paused":
            return False  # not sure yet: keep what was said
        if found is not None:
            self.current = dataclasses.replace(found, since=now)
            if before is None:
                self._began = now
            # Most reasons say "work waits for ..." themselves. The operator's pause is said
            # where it is made, once (engine/operator.py, and Coordinator at a restart).
            said = found.message
            if not said.startswith("work waits"):
                said = f"work waits: {said}"
            if found.reason != "paused":
                log.warning("%s", said, extra={"reason": found.reason})
            data = json.dumps({"reason": found.reason})
            self.ledger.log([Event(now, "wait", "waiting", found.message, data=data)])
        else:
            self._flowing(before, now)
        return True

    def end(self, now: float) -> None:
        """Training is done: a wait that was said ends now, not at a next look that a
        coordinator about to exit never takes."""
        if self.current is not None:
            self._flowing(self.current, now, "training is done: work no longer waits")
        self._seen = None

    def _flowing(self, before: Wait, now: float, said: str = "work flows again") -> None:
        self.current = None
        began = before.since if self._began is None else self._began
        self._began = None
        message = f"{said} (it waited {now - began:.0f}s: {before.reason})"
        log.info(message)
        self.ledger.log([Event(now, "wait", "flowing", message)])

    @property
    def reason(self) -> str | None:
        """The current wait's reason, or None while work flows."""
        return self.current.reason if self.current is not None else None

    def note(self, host: Host) -> str | None:
        """What a host that got no work is told: why the project's work waits, if it does.
        Never that no volunteer asks for work: the host asking is one, and the next look
        finds the reason it meets (a new volunteer was told so on its first ask). Nor, to a
        volunteer the last look did not count, that another is needed: it is that other one
        (a second volunteer was told to start another, in 3 of 6 tries)."""
        current = self.current
        if current is None or current.reason in ("paused", "no_volunteers"):
            return None
        if current.reason == "needs_hosts" and host.id not in current.hosts:
            return None
        return current.message
