"""Work requests: what a host is given, long-polled while there is nothing, answered once.

A request carries an id; its answer is remembered (in memory, and in the store when it
assigns or aborts something), so a retry of a request whose answer was lost on the way gets
the same bytes back instead of a second set of assignments (BOINC's ghost tasks)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from coordinator.engine.config import CoordinatorConfig
from coordinator.engine.waiters import Waiters
from coordinator.rules import trust
from coordinator.rules.cooling import PROBATION_TILES, Cooling
from coordinator.rules.scheduler import (
    Scheduler,
    given_back,
    idle_delay,
    stale_panels,
    waits_for_the_loop,
)
from coordinator.state.blobs import BlobStore
from coordinator.state.ledger import Ledger
from coordinator.state.store import Reply, Store
from coordinator.work.events import Event
from coordinator.work.protocol import Forbidden, WorkRequest, encode
from coordinator.work.records import Host, Result, WorkUnit, WuState

log = logging.getLogger(__name__)

REPLIES_KEPT_PER_HOST = 16  # in memory; the store keeps config.replies_per_host
PAUSED_DELAY = 5.0  # seconds a host waits before asking a paused project again
INLINE_BYTES = 64 << 20  # operand panels sent inside one work reply, at most
FINISHED_DELAY = 60.0  # an older volunteer that does not know `finished` asks seldom
FINISHED_NOTE = "the project is finished: every training step is done"
# An idle host asks at most this long after its last ask: inside the 30 s in which a host
# still counts as part of the crowd (engine/crowd.py) and as idle (IdleHosts).
IDLE_DELAY_CAP = 25.0
IDLE_WITHIN = 30.0
# Turns of the loop a far host's woken request lets pass, at most, for the training loop
# to publish another product: the other micro-batch, handed its product in the same pass
# (engine/products.py, hand_over), does its element-wise work in them. Four left one
# emulated laptop 30 ms away 0.2 s a step short of answering both together (11.31-11.34 s
# against 11.14): some links await on the way. Sixteen: 11.14.
SETTLE_TURNS = 16


class IdleHosts:
    """Hosts answered without work in the last IDLE_WITHIN seconds, oldest first: how many
    there are spreads their next asks (rules/scheduler.py, idle_delay). A host given work
    leaves."""

    def __init__(self) -> None:
        self._since: OrderedDict[int, float] = OrderedDict()

    def idle(self, host_id: int) -> int:
        """This host was answered without work just now; the number of idle hosts."""
        now = time.monotonic()
        self._since.pop(host_id, None)
        self._since[host_id] = now
        while next(iter(self._since.values())) < now - IDLE_WITHIN:
            self._since.popitem(last=False)
        return len(self._since)

    def busy(self, host_id: int) -> None:
        self._since.pop(host_id, None)

    def __len__(self) -> int:
        return len(self._since)


@dataclass(frozen=True, slots=True)
class Answer:
    """The answer to a work request: its msgpack map (`body`, what a retry gets again), and
    riding along on this answer only, the operand panels it sends (`blobs`) and those of
    the host's cache that it may drop (`forget`), which the server puts into the body in
    the form the host reads (server/api.py)."""

    body: bytes
    blobs: dict[str, bytes] = field(default_factory=dict)
    forget: list[str] = field(default_factory=list)  # cached panels of no more use
    assigned: int = 0  # results given to the host by this answer (a retry's: none new)


class WorkRequests:
    """Answers work requests: plans them with the Scheduler, waits for work, remembers."""

    def __init__(
        self,
        config: CoordinatorConfig,
        ledger: Ledger,
        store: Store,
        scheduler: Scheduler,
        stats: dict,
        blobs: BlobStore,
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.store = store
        self.blobs = blobs
        self.scheduler = scheduler
        self.stats = stats
        self.paused = False  # set by the operator: no new work goes out
        # Why work waits, as told to this host (engine/waiting.py).
        self.why_waiting: Callable[[Host], str | None] = lambda host: None
        # The training loop's seconds between a product done and its next one published
        # (Products.between; None: not yet known).
        self.between_products: Callable[[], float | None] = lambda: None
        # Hosts in recent contact (engine/crowd.py): each holds its share of a product.
        self.crowd: Callable[[float], int] = lambda now: 1
        # Seconds a byte takes a host's uplink (engine/uplinks.py; 0.0: free or unknown).
        self.upload_per_byte: Callable[[int], float] = lambda host_id: 0.0
        # Whether work waits because no connected host can send it in time (engine/
        # waiting.py): a host with nothing queued on its uplink then takes a tile anyway.
        self.uplinks_too_slow: Callable[[], bool] = lambda: False
        self.finished = False  # training is done: every request is told so
        self.told: set[int] = set()  # hosts told that the project is finished
        self.waiters = Waiters()  # long-polling work requests
        self._replies: dict[int, OrderedDict[str, bytes]] = {}
        self.idle = IdleHosts()
        # Monotonic time by which every host told to wait has asked again (serve.py waits
        # that long, at most, for them to hear that the project is finished).
        self.asks_due_by = 0.0
        # Wall time by which each host was due to ask again, by the delay it was last told
        # (engine/waiting.py: a host long past it has gone quiet).
        self.next_ask: dict[int, float] = {}
        self.started = time.time()
        # Hosts whose last request said their owner is using the machine (`paused`).
        self.owner_busy: set[int] = set()
        # A host's request begins a pause, and ends it (engine/passes.py: spares for what it
        # holds, judged only from the pause's end).
        self.on_paused: Callable[[int, float], None] = lambda host_id, now: None
        self.on_resumed: Callable[[int, float], None] = lambda host_id, now: None
        # A host sat on tiles (the Coordinator: no trust, and a wait), and why.
        self.sat_on: Callable[[int, float, str], None] = lambda host_id, now, why: None
        # A host on probation took tiles (engine/passes.py: spares for them at once): how
        # many were spared, and so count towards its PROBATION_TILES.
        self.on_probation: Callable[[int, list[str], float], int] = lambda h, r, now: 0
        self._inflight: dict[tuple[int, str], asyncio.Future] = {}
        self.cooling = Cooling()  # hosts that sat on a tile wait before they get more

    def signal_work(self) -> None:
        """New unsent results: wake as many waiting requests as there is work for."""
        self.waiters.wake(len(self.ledger.unsent))

    def reported(self, host_id: int, computed: bool, paused: bool) -> None:
        """The host reported results: a request of its own waiting for work, which its
        share of a product held back, may take more now. If it `computed` some, it is not
        sitting on its tiles (its cooling streak and probation end), and, unless the work
        request riding on the report says it is `paused`, its owner's pause is over. Tiles
        given back, errors and repeats show neither."""
        self.waiters.wake_host(host_id)
        if computed:
            self.cooling.reported(host_id)
            if not paused:
                self._resume(host_id)

    def _resume(self, host_id: int, now: float | None = None, leaving: bool = False) -> None:
        """The host's pause for its owner, if it was paused, is over (said in the task log,
        unless the host is stopping: its `left` says that)."""
        if host_id in self.owner_busy:
            self.owner_busy.discard(host_id)
            now = time.time() if now is None else now
            self.on_resumed(host_id, now)
            if not leaving:
                self._log_pause(host_id, now, "resumed", "its owner's machine is idle again")

    def _log_pause(self, host_id: int, now: float, state: str, why: str) -> None:
        host = self.ledger.hosts.get(host_id)
        name = f" {host.name!r}" if host is not None else ""
        message = f"host {host_id}{name} {state}: {why} (--idle-only)"
        log.info(message)
        self.ledger.log([Event(now, "host", state, message, host_id=host_id)])

    def finish(self) -> None:
        """Training is done: from now on every work request is answered `finished`, and
        the requests waiting for work are answered at once."""
        self.finished = True
        self.waiters.wake_all()

    def untold(self, since: float) -> list[int]:
        """Hosts in contact since `since` that have not yet been told the project is done."""
        return [
            h.id
            for h in self.ledger.hosts.values()
            if h.last_contact >= since and h.in_service and h.id not in self.told
        ]

    async def request_work(self, host: Host, request: WorkRequest, now: float) -> Answer:
        """The answer to a work request; a repeated request id gets the same bytes back.

        With no work to give, the request waits (long poll) up to `long_poll` seconds for
        work to appear, so volunteers pick up the next product of a step at once instead of
        sleeping through it."""
        self.stats["work_requests"] += 1
        key = (host.id, request.request_id)
        stored = self._replies.get(host.id, {}).get(request.request_id)
        if stored is None and key in self._inflight:
            return await asyncio.shield(self._inflight[key])
        if stored is None and host.id not in self._replies:
            # Only a host's first request since this coordinator started can be a retry of a
            # reply it lost before a restart; every later one is found in memory.
            stored = await self.store.reply(host.id, request.request_id)
        if stored is not None:
            return Answer(stored)
        if host.quarantined:
            await self.ledger.flush()  # the verdict that quarantined it, if still queued
            raise Forbidden(trust.why_quarantined(host, self.config.trust))
        answer = asyncio.get_running_loop().create_future()
        self._inflight[key] = answer
        try:
            body = await self._answer(host, request, now)
            answer.set_result(body)
            return body
        except BaseException as exc:
            answer.set_exception(exc)
            answer.exception()  # retrieved: the caller re-raises it
            raise
        finally:
            del self._inflight[key]

    async def _answer(self, host: Host, request: WorkRequest, now: float) -> Answer:
        # Re-read: the record may have changed while this request awaited the store.
        host = self.ledger.hosts[host.id].evolve(last_contact=now, gone=request.leaving)
        if request.paused:
            if host.id not in self.owner_busy:
                self.on_paused(host.id, now)
                why = "its owner is using the machine, so it takes no work"
                self._log_pause(host.id, now, "paused", why)
            self.owner_busy.add(host.id)
        else:
            self._resume(host.id, now, leaving=request.leaving)
        if request.gflops:
            host = host.evolve(gflops=request.gflops)
        if request.max_memory_mb is not None and request.max_memory_mb != host.max_memory_mb:
            host = host.evolve(max_memory_mb=request.max_memory_mb)
        self.ledger.put_host(host)
        if request.leaving:
            # Nothing to plan: what it held it gave back before (a resend would be wrong).
            message = f"host {host.id} {host.name!r} stopped: not waited for until it asks again"
            log.info(message)
            self.forgive_give_backs(host.id)
            self.ledger.log([Event(now, "host", "left", message, host_id=host.id)])
            return Answer(encode({"assignments": [], "abort": [], "bytes_saved": 0, "delay": 0}))
        if self.finished:
            return self._finished(host, request)
        if self.paused:
            return Answer(
                encode(
                    {
                        "assignments": [],
                        "abort": [],
                        "bytes_saved": 0,
                        "delay": PAUSED_DELAY,
                        "note": "the project is paused by its operator",
                    }
                )
            )
        # On probation, it took its PROBATION_TILES and computed none: nothing new (not
        # even by waiting for work), and once none is left in its hands, it sat on them. Not
        # while its owner uses the machine: that is judged from the pause's end.
        used_up = self.cooling.used_up(host.id)
        if used_up and not request.paused and not self.ledger.in_progress_of.get(host.id):
            why = (
                f"this volunteer took {PROBATION_TILES} tiles since it last sat on one and "
                "computed none of them; each went to another volunteer too"
            )
            self.sat_on(host.id, now, why)
            host = self.ledger.hosts[host.id]  # its trust and quota as sat_on left them
        cooling = self.cooling.left(host.id, now)
        if cooling or used_up:  # told what to abort, given nothing new (rules/cooling.py)
            request = replace(request, capacity=0, wait=False)
        # Other hosts get their share of a product: one host does not take all of its tiles
        # while the rest idle or finish their last (sized work cut it for all of them).
        uplink = self.upload_per_byte(host.id), self.uplinks_too_slow()
        plan = self.scheduler.plan(host, request, now, self.waiters.hosts, self.crowd(now), *uplink)
        asked = time.monotonic()
        deadline = asked + self.config.long_poll
        while not plan.assignments and plan.room > 0 and request.wait:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not await self.waiters.wait(remaining, host.id):
                break
            if self.finished:
                return self._finished(host, request)
            if self.waiters.hosts <= 1 and waits_for_the_loop(
                request.round_trip, self.between_products()
            ):
                # Far away, and no other host waiting to take the training loop's next
                # product: a second round trip would cost more than that product takes to
                # come, so this answer takes it too.
                await self._settle()
            now = time.time()
            host = self.ledger.hosts[host.id]
            plan = self.scheduler.plan(
                host, request, now, self.waiters.hosts - 1, self.crowd(now), *uplink
            )
            if not plan.assignments and self.ledger.unsent:
                # Work is there, but none this host may take (it holds a replica, or lacks
                # the memory): answer now rather than be woken again and again for it. The
                # wake-up is not passed on: a chain through every waiter is the herd again.
                break
        self.ledger.log(plan.events)
        self.stats["bytes_saved"] += plan.bytes_saved
        assignments = [self._assignment(a.wu, a.result, now) for a in plan.assignments]
        if plan.assignments and self.cooling.on_probation(host.id):
            # New ones only: a tile resent (its reply lost) was judged from its first send.
            taken = [a.result.id for a in plan.assignments if a.result.sent_time == now]
            self.cooling.took(host.id, self.on_probation(host.id, taken, now))
        # A host that computes (or may hold no more) is not idle: it asks again when its
        # queue runs low, whatever `delay` says.
        if not assignments and not request.in_progress and (plan.room > 0 or request.paused):
            # (A host paused for its owner asks as an idle one does, and spreads its asks.)
            idle_hosts = self.idle.idle(host.id)
        else:
            self.idle.busy(host.id)
            idle_hosts = len(self.idle)
        delay = 0.0
        if not assignments:
            delay = idle_delay(
                idle_hosts,
                time.monotonic() - asked,
                self.config.no_work_delay,
                self.config.idle_asks_per_s,
                IDLE_DELAY_CAP,
            )
            self.asks_due_by = max(self.asks_due_by, time.monotonic() + delay)
        message = {
            "assignments": assignments,
            "abort": plan.abort,
            "bytes_saved": plan.bytes_saved,
            "delay": delay,
        }
        self.next_ask[host.id] = time.time() + max(delay, cooling)
        if cooling:
            delay = max(delay, cooling)
            message["delay"] = delay
            why = self.cooling.why.get(host.id) or "it sat on a tile"
            message["note"] = f"no new work for {math.ceil(cooling)}s: {why}"
        elif plan.too_big and not assignments:
            need_mb = plan.smallest_need / (1 << 20)
            message["note"] = (
                f"{len(plan.too_big)} work unit(s) need more memory than this volunteer "
                f"offers for one ({host.max_memory_mb} MB); the smallest needs "
                f"{need_mb:.1f} MB: raise --max-memory"
            )
            # The volunteer knows what --max-memory leaves it for a work unit, and says
            # which one would do (volunteer/daemon.py).
            message["memory_need_mb"] = math.ceil(need_mb * 10) / 10
        elif plan.too_slow and not assignments:
            message["note"] = (
                f"{plan.too_slow} tile(s) would take this volunteer's uplink "
                f"{plan.slowest_upload:.0f}s or more to send, past what the project's "
                "delay_bound leaves for uploads; other volunteers take them"
            )
        elif not assignments and (why := self.why_waiting(host)):
            message["note"] = why
        elif not assignments and plan.held_back:
            message["note"] = (
                "this volunteer holds its share of each product in flight; more as it "
                "reports them, or as others take theirs"
            )
        elif delay > self.config.no_work_delay:
            message["note"] = (
                "more volunteers than work: idle hosts ask less often, so that together "
                f"they ask about {self.config.idle_asks_per_s:.0f} times a second"
            )
        body = encode(message)
        # A reply that assigns or aborts nothing changes nothing: a retry may be planned
        # afresh, so only memory keeps it (10,000 idle hosts would write 5,000 rows/s).
        durable = bool(assignments or plan.abort)
        self._remember(host.id, request.request_id, body, now, durable)
        if durable:
            self.ledger.commit_soon()
        # else it promises nothing: the host's last contact is committed with the next
        # commit, within the passes' window, and idle hosts do not queue behind commits.
        # The panels ride along on this answer only; a retry gets the stored answer
        # without them and fetches what it lacks.
        forget = stale_panels(
            request.cached, self.ledger.panel_step, self.ledger.oldest_active_step()
        )
        inline = self._inline(assignments, set(request.cached), host)
        return Answer(body, inline, forget, len(assignments))

    async def _settle(self) -> None:
        """Let the training loop run until it publishes another product, SETTLE_TURNS
        turns of the event loop at most."""
        seen = len(self.ledger.unsent)
        for _ in range(SETTLE_TURNS):
            await asyncio.sleep(0)
            if len(self.ledger.unsent) > seen:
                return

    def _inline(self, assignments: list[dict], cached: set[str], host: Host) -> dict[str, bytes]:
        """Small operand panels the host lacks, sent inside the answer: each fetch saved is a
        round trip saved per product. Only panels still in memory (just published); never
        more than INLINE_BYTES in all, nor than the host offers for a work unit (its operand
        cache holds as much, volunteer/policy.py): the answer arrives whole, and a host
        with little memory fetches the rest in turn, as its budget allows."""
        most = INLINE_BYTES
        if host.max_memory_mb:
            most = min(most, host.max_memory_mb << 20)
        inline: dict[str, bytes] = {}
        size = 0
        for a in assignments:
            for blob in (a["a"], a["b"]):
                if blob in cached or blob in inline:
                    continue
                data = self.blobs.in_memory(blob)
                if data is None or size + len(data) > most:
                    continue
                inline[blob] = data
                size += len(data)
        return inline

    def due_back(self, host: Host) -> float:
        """Wall time by which the host was due to ask again: as its last answer told it; not
        answered since this coordinator started, IDLE_DELAY_CAP after the later of its last
        contact and the start (what it was told before a restart is not known)."""
        told = self.next_ask.get(host.id)
        if told is not None:
            return max(told, host.last_contact)
        return max(host.last_contact, self.started) + IDLE_DELAY_CAP

    def forgive_give_backs(self, host_id: int) -> None:
        """A host that stops gives back what it held: when it returns (a restart) it may
        take that work again, as after a timeout. A give-back within a session bars its host
        from the replacement (rules/scheduler.py, takes_replacement); across a stop it left
        a project with one volunteer, or a quorum whose other replica another host holds,
        waiting for that work for ever (found by a review). So does a quarantine's
        take-back, once the operator releases the host (engine/operator.py)."""
        for result in [r for r in self.ledger.results.values() if r.host_id == host_id]:
            wu = self.ledger.wus.get(result.wu_id)
            if given_back(result) and wu is not None and wu.state is WuState.ACTIVE:
                self.ledger.put_result(result.evolve(received_time=None))

    def _finished(self, host: Host, request: WorkRequest) -> Answer:
        """The answer once training is done: no work, ever; drop what you hold. The host
        stops on it, so status counts it idle from now on, as one that said it stops."""
        self.told.add(host.id)
        self.ledger.put_host(self.ledger.hosts[host.id].evolve(gone=True))
        return Answer(
            encode(
                {
                    "assignments": [],
                    "abort": list(request.in_progress),
                    "bytes_saved": 0,
                    "delay": FINISHED_DELAY,
                    "finished": True,
                    "note": FINISHED_NOTE,
                }
            )
        )

    def _assignment(self, wu: WorkUnit, result: Result, now: float) -> dict:
        m, n, k = wu.shape
        return {
            "result_id": result.id,
            "wu_id": wu.id,
            "a": wu.a_panel,
            "b": wu.b_panel,
            "a_bytes": self.ledger.panel_bytes.get(wu.a_panel, 0),
            "b_bytes": self.ledger.panel_bytes.get(wu.b_panel, 0),
            "trans_a": wu.trans_a,
            "trans_b": wu.trans_b,
            "m": m,
            "n": n,
            "k": k,
            "upload": "tile" if result.upload_tile else "hash",
            # The report may leave out the hash of a tile it uploads (the coordinator hashes
            # the bytes); said here, so a volunteer does not leave it out for an older
            # coordinator, which would refuse the report and count the host a liar.
            "hash_needed": not result.upload_tile,
            "deadline_in": max(0.0, (result.report_deadline or now) - now),
            "kernel_version": wu.kernel_version,
        }

    def _remember(
        self, host_id: int, request_id: str, body: bytes, now: float, durable: bool
    ) -> None:
        recent = self._replies.setdefault(host_id, OrderedDict())
        recent[request_id] = body
        while len(recent) > REPLIES_KEPT_PER_HOST:
            recent.popitem(last=False)
        if durable:
            self.ledger.remember_reply(Reply(host_id, request_id, now, body))

    async def prune_replies(self, now: float) -> None:
        """Forget stored replies older than `reply_ttl` and all but each host's newest
        `replies_per_host`: a retry comes within seconds, and the table must not grow for as
        long as the project runs."""
        await self.ledger.flush()
        await self.store.prune_replies(now - self.config.reply_ttl, self.config.replies_per_host)
