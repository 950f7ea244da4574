"""The scheduler: which unsent results a host gets, with which deadline, and what it drops.

BOINC's rules and the fixes for what its users complain about:
- never two replicas of one work unit to the same host (one bad host cannot form a quorum),
  except the replacement of a single-replica work unit's timed-out replica (below);
- a host has an in-progress quota, cut when it returns invalid or no results, and sized in
  seconds of work once it has a long valid record (small tiles cost no round trip each);
- a host on a slow uplink holds no more tiles than it can upload well within the project's
  delay_bound, and each tile's deadline waits for the uploads queued before it (its
  uplink as the coordinator timed its reports: engine/uplinks.py);
- results whose operand panels the host has cached come first (the bytes saved are counted);
- the host lists what it is working on, so an assignment whose reply was lost is sent again
  and one the coordinator no longer needs is aborted: no ghost tasks;
- adaptive replication: a host with CV consecutive valid results gets a work unit alone
  with probability 1 - 1/CV, and that tile is always Freivalds-checked;
- tail acceleration: spare replicas at the end of a GEMM, and a straggler's, go only to
  proven hosts not far slower than the typical proven one;
- while other hosts wait for work, a host takes only its share of each product's unsent
  results (the product was cut for all of them: rules/sizing.py), and of all of them;
- a host holds at most its share of a product's results over the whole crowd, waiting or
  not: the hosts busy uploading their last tiles ask again within a round trip, and one
  host given a product's every tile uploads them one after another;
- a crowd larger than the work is asked to spread its asks (idle_delay);
- a host is told which of its cached panels no product will use again (stale_panels), so
  its cache, and the list of it in every request, hold the work in flight and not history.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

from coordinator.state.ledger import Ledger
from coordinator.work.events import Event
from coordinator.work.protocol import WorkRequest
from coordinator.work.records import (
    Host,
    Outcome,
    Policy,
    Result,
    ServerState,
    ValidateState,
    WorkUnit,
    WuState,
)

# A spare goes to a proven host at least this share of the typical proven host's speed:
# the median would leave the slower half of an even crowd out (of two honest hosts, the
# one that does not hold the work unit already, half the time), and a spare is worth
# giving to any host far faster than the one sitting on its tile.
SPARE_SPEED_SHARE = 0.5
# A tile's deadline gives the uploads queued on its host's uplink, its own included, this
# many times the time they take at the uplink's measured rate: a rate is measured on a few
# reports, and an uplink is shared with whatever else its owner sends.
UPLOAD_MARGIN = 2.0


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    deadline_floor: float = 5.0  # seconds any host gets, however fast
    deadline_slack: float = 20.0  # times the host's expected compute time
    trust_threshold: int = 10  # consecutive valid results before adaptive replication
    # On: a host with a long valid record may get a work unit alone, Freivalds-checked. Off
    # (the default): every work unit gets its full replication, so a trusted host that turns
    # liar below the Freivalds tolerance is still caught (docs/security.md).
    adaptive_replication: bool = False
    # A host with trust_threshold valid results in a row may hold this many seconds of work
    # at its measured speed, up to max_quota results, beyond its standing's count (see
    # quota): enough to hide round trips behind tiles of a millisecond, not so much that a
    # few hosts hold a whole product while the others wait (tiles of 100 ms stay at the
    # count). Under deadline_floor: the last of them is still due in time.
    quota_seconds: float = 0.25
    max_quota: int = 64
    # Off: a host's cached panels no longer put the results that use them first (oldest
    # first only); for measuring what cache-aware scheduling saves on the wire.
    cache_preference: bool = True
    # Off: every replica uploads its full tile, none only its hash; for measuring what
    # hash-only check replicas save on the wire.
    hash_only_replicas: bool = True


@dataclass(slots=True)
class Assignment:
    result: Result
    wu: WorkUnit


@dataclass(slots=True)
class Uplink:
    """A host's uplink while a plan fills it: seconds a byte, and the bytes queued on it."""

    per_byte: float
    queued: int
    # No connected host can send some tiles in time (engine/waiting.py): one goes to a host
    # with nothing queued on its uplink anyway, due at delay_bound, rather than wait for ever.
    anyway: bool = False
    full: bool = False  # its queue took all it may: no further candidate fits either


@dataclass(slots=True)
class Plan:
    """A work request's answer: new or resent assignments, results to abort, bytes saved."""

    assignments: list[Assignment] = field(default_factory=list)
    abort: list[str] = field(default_factory=list)
    bytes_saved: int = 0
    events: list[Event] = field(default_factory=list)
    room: int = 0  # how many more results the host could take (capacity and quota)
    # Work units skipped because they need more memory than the host has (ids: a work
    # unit's replicas are met one after another, and count once).
    too_big: set[str] = field(default_factory=set)
    too_slow: int = 0  # tiles skipped because the host's uplink could not send one in time
    slowest_upload: float = 0.0  # seconds the host's uplink takes for the smallest of those
    held_back: int = 0  # unsent results of products whose share the host already holds
    smallest_need: int = 0  # bytes the smallest of those needs


def report_deadline(
    wu: WorkUnit, host: Host, now: float, config: SchedulerConfig, uploads: float = 0.0
) -> float:
    """From delay_bound, the host's measured speed and `uploads`, the seconds its uplink
    needs for the tiles it is to upload up to and including this one: never later than
    delay_bound."""
    expected = wu.flops / max(host.gflops, 1e-3) / 1e9
    allowed = config.deadline_floor + config.deadline_slack * expected + UPLOAD_MARGIN * uploads
    return now + min(wu.delay_bound, allowed)


def upload_budget(delay_bound: float, config: SchedulerConfig) -> float:
    """Seconds of uploads a host may have queued, a new tile's included: what leaves the
    tile's deadline (report_deadline) inside delay_bound, with room for the floor."""
    return max(delay_bound - config.deadline_floor, 0.0) / UPLOAD_MARGIN


def tile_upload_bytes(wu: WorkUnit) -> int:
    """Bytes of a work unit's tile, float32: what a replica that uploads it sends."""
    m, n, _ = wu.shape
    return 4 * m * n


def queued_upload_bytes(ledger: Ledger, host_id: int) -> int:
    """Bytes of the tiles the host holds and is to upload: its uplink's queue."""
    queued = 0
    for result_id in ledger.in_progress_of.get(host_id, ()):
        result = ledger.results[result_id]
        if result.upload_tile:
            queued += tile_upload_bytes(ledger.wus[result.wu_id])
    return queued


def too_slow_to_upload(wu: WorkUnit, per_byte: float, config: SchedulerConfig) -> bool:
    """Whether an uplink of `per_byte` seconds a byte takes longer to send the tile alone
    than a host may have queued (upload_budget): no deadline would hold."""
    return tile_upload_bytes(wu) * per_byte > upload_budget(wu.delay_bound, config)


def idle_delay(idle_hosts: int, waited: float, base: float, asks_per_s: float, cap: float) -> float:
    """Seconds a host answered without work waits before it asks again: at least `base`,
    and long enough that `idle_hosts` such hosts together ask about `asks_per_s` times a
    second, up to `cap` between two asks (the time this request already waited in a long
    poll counts).

    BOINC's clients back off on their own; a crowd far larger than the work (10,000 hosts
    and a product of 64 tiles) must not spend the coordinator's core, or the network's,
    on asking. New work still goes out at once: `asks_per_s` asks a second find it."""
    return max(base, min(cap, idle_hosts / asks_per_s) - waited)


def waits_for_the_loop(round_trip: float | None, between: float | None) -> bool:
    """Whether a host woken by new work is answered only once the training loop has
    published what it is about to (True), rather than at once.

    The two micro-batches take turns (engine/products.py, hand_over): answered at once, a
    host computes one micro-batch's product while the coordinator spends `between` seconds
    on the other's, but one host serving both then makes a round trip per product instead
    of one for both. For one host, taking turns costs a link about 2 x max(between, round
    trip + tile) against 2 x between + round trip + 2 tiles together: it pays while the
    round trip is under twice `between`. Unknown either way: at once."""
    if round_trip is None or between is None:
        return False
    return round_trip > 2.0 * between


def quota(host: Host, flops: float, config: SchedulerConfig) -> int:
    """In-progress results of `flops` each that a host may hold.

    Its standing's count (host.max_in_progress: a few per thread, halved by each error) and,
    once it has a long valid record, as many as make quota_seconds of work at its measured
    speed, up to max_quota: tiles that take a millisecond would otherwise cost a round trip
    each, and a product would wait on the network rather than on its volunteers."""
    if host.consecutive_valid < config.trust_threshold:
        return host.max_in_progress
    by_time = int(config.quota_seconds * host.gflops * 1e9 / max(flops, 1.0))
    return max(host.max_in_progress, min(config.max_quota, by_time))


def stale_panels(
    cached: tuple[str, ...], panel_step: Mapping[str, int], oldest_active_step: int | None
) -> list[str]:
    """The cached panels that no product will use again: each was last published for a
    step before that of every product in flight, and a step's products never take an
    earlier step's operands (the model changed in between). Panels this coordinator does
    not know are left alone; one published again later is simply fetched again."""
    if oldest_active_step is None:  # between products: the next may still use any
        return []
    return [p for p in cached if panel_step.get(p, oldest_active_step) < oldest_active_step]


def memory_need(wu: WorkUnit, panel_bytes: dict[str, int]) -> int:
    """Bytes a volunteer needs for one work unit: both panels, and the tile three times
    (the one computed and room for finished ones on their way, as volunteer/policy.py
    tile_memory counts it)."""
    m, n, _ = wu.shape
    return panel_bytes.get(wu.a_panel, 0) + panel_bytes.get(wu.b_panel, 0) + 12 * m * n


def fast_and_reliable(host: Host, ledger: Ledger) -> bool:
    """A host that may take a spare (tail acceleration, a straggler's): proven, and at least
    SPARE_SPEED_SHARE of the typical proven host's speed. Only proven hosts' speeds count:
    they are what each host claims, and hosts that claim a thousand GFLOPS and compute
    nothing would set the bar above every honest host, and no spare would go anywhere."""
    if host.consecutive_valid < 1 or host.quarantined:
        return False
    speeds = [
        h.gflops for h in ledger.hosts.values() if h.consecutive_valid >= 1 and not h.quarantined
    ]
    return host.gflops >= SPARE_SPEED_SHARE * statistics.median(speeds)


def takes_replacement(host: Host, wu: WorkUnit, siblings: list[Result]) -> bool:
    """Whether a host that already had a replica of wu may get another: only when all of
    its replicas of it timed out, so that a project with few volunteers goes on after a
    missed deadline (a late report of the first still arrives, but the validator counts one
    vote per host). Never to one that gave it back (it would take it back, and give it back,
    until the work unit's budget ran out), erred on it or still holds it."""
    mine = [r for r in siblings if r.host_id == host.id]
    return all(timed_out(r) for r in mine)


def given_back(result: Result) -> bool:
    """Given back uncomputed by its host (`abandoned`): over, no reply, a received time."""
    return (
        result.server_state is ServerState.OVER
        and result.outcome is Outcome.NO_REPLY
        and result.received_time is not None
    )


def timed_out(result: Result) -> bool:
    """Missed its deadline; a result given back has its received time, a timed-out one none."""
    return (
        result.server_state is ServerState.OVER
        and result.outcome is Outcome.NO_REPLY
        and result.received_time is None
    )


def uploads_tile(wu: WorkUnit, siblings: list[Result], config: SchedulerConfig) -> bool:
    """Whether a replica of `wu` sent now uploads its tile, not only its hash."""
    return (
        wants_tile(siblings)
        or wu.min_quorum <= 1
        or wu.accelerated
        or not config.hash_only_replicas
    )


def wants_tile(wu_results: list[Result]) -> bool:
    """Upload the full tile unless another live replica already does."""
    usable = (ValidateState.INIT, ValidateState.VALID)
    for r in wu_results:
        if r.server_state is ServerState.IN_PROGRESS and r.upload_tile:
            return False
        # An inconclusive tile (outside any quorum so far) may never become canonical.
        if r.outcome is Outcome.SUCCESS and r.has_tile and r.validate_state in usable:
            return False
    return True


class Scheduler:
    def __init__(self, ledger: Ledger, config: SchedulerConfig, rng: random.Random) -> None:
        self.ledger = ledger
        self.config = config
        self.rng = rng

    def plan(
        self,
        host: Host,
        request: WorkRequest,
        now: float,
        others: int = 0,
        crowd: int = 1,
        upload_per_byte: float = 0.0,
        upload_anyway: bool = False,
    ) -> Plan:
        """`others`: how many other hosts want work just now; this one then takes no more
        than its share of each product's unsent results. `crowd`: the hosts in recent
        contact, whom products are cut for (engine/crowd.py); this one holds no more than
        its share of each product's results, whether or not the others are asking at this
        moment (they are uploading their last tiles, say, a round trip from asking).
        `upload_per_byte`: seconds a byte takes the host's uplink (0: not measured, or
        too fast to matter); `upload_anyway`: no connected host can send some tiles in
        time, and one goes to a host with nothing queued on its uplink all the same."""
        plan = Plan()
        queued = queued_upload_bytes(self.ledger, host.id) if upload_per_byte else 0
        uplink = Uplink(upload_per_byte, queued, upload_anyway)
        ledger = self.ledger
        listed = set(request.in_progress)
        for result_id in request.in_progress:
            r = ledger.results.get(result_id)
            if r is None or r.host_id != host.id or r.server_state is not ServerState.IN_PROGRESS:
                plan.abort.append(result_id)
        for result_id in list(ledger.in_progress_of.get(host.id, ())):
            if result_id not in listed:
                r = ledger.results[result_id]
                if (r.report_deadline or math.inf) <= now:
                    # Expired: the host would only skip it and ask again (a spin); the
                    # transitioner times it out and reissues it.
                    ledger.touched.add(r.wu_id)
                    continue
                plan.assignments.append(Assignment(r, ledger.wus[r.wu_id]))
                plan.events.append(
                    _event(ledger.wus[r.wu_id], r, now, "resent", "reply was lost; resent")
                )
        in_progress = len(ledger.in_progress_of.get(host.id, ()))
        # Resent work fills the host's capacity like new work does.
        most = quota(host, 0.0, self.config)  # for the smallest work units
        room = min(request.capacity - len(plan.assignments), most - in_progress)
        plan.room = max(0, room)
        if room <= 0:
            return plan
        cached = set(request.cached)
        preferred = cached if self.config.cache_preference else set()
        taken: dict[str, int] = {}  # results of each product given in this plan
        sharing = others > 0 or crowd > 1
        shares: dict[str, int] = {}  # the most of each product's unsent results this plan gives
        open_products = 0
        if sharing:
            # Looked at once for every product with work unsent (there are few): a host that
            # holds its share of each is answered without a walk through thousands of
            # results none of which it may take.
            held = self._held_by_product(host) if crowd > 1 else {}
            for gemm, unsent in ledger.unsent_of_gemm.items():
                shares[gemm] = self._share(gemm, others, crowd, held.get(gemm, 0))
                if shares[gemm] > 0:
                    open_products += 1
                else:
                    plan.held_back += unsent
            if not open_products:
                return plan
        if others > 0:
            # Its share of all the work, too: two products published together (a layer's dX
            # and dW, or the micro-batches' products) go to twice the hosts, not twice
            # to the same ones while the rest idle.
            room = min(room, math.ceil(len(ledger.unsent) / (others + 1)))
        for result_id in self._candidates(preferred):
            if room <= 0:
                break
            if sharing:
                gemm = self._gemm_of(result_id)
                if gemm is not None and taken.get(gemm, 0) >= shares.get(gemm, 0):
                    continue
            assignment = self._try_assign(host, result_id, now, plan, in_progress, uplink)
            if uplink.full:
                break
            if assignment is None:
                continue
            if assignment.result.upload_tile:
                uplink.queued += tile_upload_bytes(assignment.wu)
            saved = {assignment.wu.a_panel, assignment.wu.b_panel} & cached
            plan.bytes_saved += sum(ledger.panel_bytes.get(p, 0) for p in saved)
            plan.assignments.append(assignment)
            gemm = assignment.wu.gemm_id
            taken[gemm] = taken.get(gemm, 0) + 1
            in_progress += 1
            room -= 1
            if sharing and (taken[gemm] == shares.get(gemm) or gemm not in ledger.unsent_of_gemm):
                open_products -= 1
                if not open_products:
                    # The rest of the unsent results belong to products whose share this
                    # host has: looking at each of them (thousands, at a large product)
                    # finds nothing.
                    break
        return plan

    def _share(self, gemm: str, others: int, crowd: int, held: int) -> int:
        """How many more of a product's unsent results this plan may give the host: its
        share of them over the hosts asking now (`others` and itself), and no more than its
        share of all of the product's results over the crowd, counting those it `held`."""
        ledger = self.ledger
        share = ledger.unsent_of_gemm[gemm]
        if others > 0:
            share = math.ceil(share / (others + 1))
        wus = ledger.wus_of.get(gemm)
        if crowd > 1 and wus:
            # Replicas as the first work unit has them (adaptive replication may have cut
            # some to one): the share paces hosts, and an estimate of it is enough.
            results = len(wus) * ledger.wus[next(iter(wus))].target_nresults
            share = min(share, math.ceil(results / crowd) - held)
        return share

    def _held_by_product(self, host: Host) -> dict[str, int]:
        """The host's results in progress, counted by product."""
        held: dict[str, int] = {}
        for result_id in self.ledger.in_progress_of.get(host.id, ()):
            gemm = self._gemm_of(result_id)
            if gemm is not None:
                held[gemm] = held.get(gemm, 0) + 1
        return held

    def _gemm_of(self, result_id: str) -> str | None:
        result = self.ledger.results.get(result_id)
        wu = self.ledger.wus.get(result.wu_id) if result is not None else None
        return wu.gemm_id if wu is not None else None

    def _candidates(self, cached: set[str]):
        """Unsent results: first those using the most cached panels, then oldest first."""
        ledger = self.ledger
        scores: dict[str, int] = {}
        # A host's cache lists hundreds of panels, the unsent work a few: walk the fewer.
        by_panel = ledger.unsent_by_panel
        shared = [p for p in by_panel if p in cached] if len(by_panel) < len(cached) else cached
        for panel in shared:
            for result_id in by_panel.get(panel, ()):
                scores[result_id] = scores.get(result_id, 0) + ledger.panel_bytes.get(panel, 1)
        yield from sorted(scores, key=lambda r: -scores[r])
        yield from (r for r in list(ledger.unsent) if r not in scores)

    def _try_assign(
        self, host: Host, result_id: str, now: float, plan: Plan, held: int, uplink: Uplink
    ):
        ledger = self.ledger
        result = ledger.results.get(result_id)
        if result is None or result.server_state is not ServerState.UNSENT:
            return None
        wu = ledger.wus[result.wu_id]
        if wu.state is not WuState.ACTIVE:
            return None
        if host.id in ledger.hosts_of_wu.get(wu.id, ()) and not takes_replacement(
            host, wu, ledger.results_for(wu.id)
        ):
            return None
        if held >= quota(host, wu.flops, self.config):
            return None
        siblings = ledger.results_for(wu.id)
        if wu.accelerated and not fast_and_reliable(host, ledger):
            # Only the spare is kept for fast hosts; replicas the quorum needs go to anyone.
            live = sum(
                1
                for r in siblings
                if r.server_state is ServerState.IN_PROGRESS
                or (r.outcome is Outcome.SUCCESS and r.validate_state is not ValidateState.INVALID)
            )
            if live >= wu.min_quorum:
                return None
        if host.max_memory_mb:
            need = memory_need(wu, ledger.panel_bytes)
            if need > host.max_memory_mb << 20:
                plan.too_big.add(wu.id)
                plan.smallest_need = min(plan.smallest_need or need, need)
                return None
        # Before _maybe_trust, which records its choice: a work unit it could send alone
        # has no replica out yet, so wants_tile already holds for it.
        upload_tile = uploads_tile(wu, siblings, self.config)
        uploads = 0.0  # seconds of uploads queued on the host's uplink up to this tile's
        if upload_tile and uplink.per_byte:
            tile = tile_upload_bytes(wu)
            uploads = (uplink.queued + tile) * uplink.per_byte
            if too_slow_to_upload(wu, uplink.per_byte, self.config):
                if not (uplink.anyway and not uplink.queued):
                    plan.too_slow += 1
                    alone = tile * uplink.per_byte
                    plan.slowest_upload = min(plan.slowest_upload or alone, alone)
                    return None
            elif uploads > upload_budget(wu.delay_bound, self.config):
                uplink.full = True  # more as it reports
                return None
        wu = self._maybe_trust(host, wu, siblings, now, plan)
        result = result.evolve(
            host_id=host.id,
            server_state=ServerState.IN_PROGRESS,
            sent_time=now,
            report_deadline=report_deadline(wu, host, now, self.config, uploads),
            upload_tile=upload_tile,
        )
        ledger.put_result(result)
        if result.report_deadline < wu.transition_time:
            wu = wu.evolve(transition_time=result.report_deadline)
            ledger.reschedule(wu)
        plan.events.append(
            _event(
                wu,
                result,
                now,
                ServerState.IN_PROGRESS.value,
                f"sent to host {host.id} ({'tile' if result.upload_tile else 'hash only'}), "
                f"deadline in {result.report_deadline - now:.1f}s",
            )
        )
        return Assignment(result, wu)

    def _maybe_trust(self, host, wu, siblings, now, plan) -> WorkUnit:
        """BOINC's adaptive replication, decided when the first replica is sent."""
        if not self.config.adaptive_replication or wu.policy is Policy.FREIVALDS:
            return wu
        if wu.min_quorum <= 1:
            return wu
        if any(r.server_state is not ServerState.UNSENT for r in siblings):
            return wu
        cv = host.consecutive_valid
        if cv < self.config.trust_threshold or self.rng.random() >= 1 - 1 / cv:
            return wu
        wu = wu.evolve(target_nresults=1, min_quorum=1)
        self.ledger.put_wu(wu)
        spare = [r for r in siblings if r.server_state is ServerState.UNSENT][1:]
        for r in spare:
            self.ledger.put_result(
                r.evolve(server_state=ServerState.OVER, outcome=Outcome.DIDNT_NEED)
            )
        plan.events.append(
            _event(
                wu,
                None,
                now,
                "single_replica",
                f"adaptive replication: host {host.id} has {cv} consecutive valid results; "
                "one replica, Freivalds-checked",
            )
        )
        return wu


def _event(wu: WorkUnit, result: Result | None, now: float, state: str, message: str) -> Event:
    return Event.about(wu, now, state, message, result)
