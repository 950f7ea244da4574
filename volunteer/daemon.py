"""The volunteer daemon: the pull loop (volunteer/loop.py) on real cores, sockets and memory."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import resource
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import kernels
from kernels.frames import Buffer
from kernels.malloc import let_go, recycle_within
from volunteer.address import NotACoordinator
from volunteer.backoff import Backoff
from volunteer.cache import BlobCache
from volunteer.client import CoordinatorClient, compute_tile
from volunteer.idle import OwnerWatch
from volunteer.loop import PullLoop
from volunteer.policy import GROWTH, MB, WORKSPACE_PER_THREAD, budget_for, computes_inline
from volunteer.session import ProjectFinished, Quarantined
from volunteer.state import StateDir

log = logging.getLogger(__name__)

# States that end the volunteer for good, whatever stopped it afterwards.
ENDED = ("finished", "refused")
# States in which the coordinator's last note (why it has no work for us) is news; in the
# others the volunteer's own note says what is going on (offline, refused, finished).
HEARD = ("starting", "working", "idle", "stopped")


def default_threads() -> int:
    """All cores but one, so the machine stays responsive."""
    return max(1, (os.cpu_count() or 2) - 1)


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (VmHWM: unlike ru_maxrss, it does not
    inherit the high-water mark of whatever process forked us)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB
    except OSError:
        return peak_rss_mb()


@dataclass(frozen=True)
class VolunteerConfig:
    url: str
    state_dir: Path
    name: str = field(default_factory=socket.gethostname)
    threads: int = field(default_factory=default_threads)
    max_memory_mb: int = 200
    idle_only: bool = False
    low_priority: bool = True
    max_backoff: float = 60.0
    stop_timeout: float = 10.0  # seconds a stop waits for the tile being computed
    invite: str | None = None  # the project's invite code, if it asks for one


MAX_NEED_MB = 1 << 24  # a work unit's need (from the network) past this is not believed
ADVICE_MARGIN_MB = 2.0  # above the --max-memory that would just do, when one is advised
ADVICE_STEP_MB = 5  # an advised --max-memory is a multiple of this
# Seconds a registration waits for a coordinator that has not answered yet (other calls
# have minutes: a large body on a slow link): an address that takes connections and says
# nothing is then said in seconds.
FIRST_CONTACT_SECONDS = 15.0


class NotEnoughMemory(RuntimeError):
    """--max-memory leaves no room for any work."""


class Volunteer(PullLoop):
    """The daemon: the pull loop with the real kernel on threads, real sockets, a memory
    budget measured from this process, and its identity kept in the state directory."""

    def __init__(self, config: VolunteerConfig) -> None:
        super().__init__(
            CoordinatorClient(config.url, timeout=120),
            name=config.name,
            cache=BlobCache(0),
            threads=config.threads,
            budget=0,
            invite=config.invite,
            backoff=Backoff(cap=config.max_backoff),
            idle=Backoff(base=0.25, cap=min(config.max_backoff, 10.0)),
            logger=log,
        )
        self.config = config
        self.first_contact = FIRST_CONTACT_SECONDS
        # A report nearly through a slow uplink when the stop comes gets the time a tile
        # gets to finish, rather than being cut off and sent again from its first byte.
        self.stop_grace = config.stop_timeout
        self.limit_name = f"--max-memory {config.max_memory_mb} MB"
        self.state_dir = StateDir(config.state_dir)
        self.server_note = ""  # the coordinator's last word on why there is no work for us
        self._logged_note = ""
        self.started = time.monotonic()
        self.owner = OwnerWatch()  # the owner's use of the machine (--idle-only)
        self._owner_busy = False

    def prepare(self) -> None:
        """Measure speed, fix the memory budget, lower our priority. Raises NotEnoughMemory."""
        if self.config.low_priority:
            with contextlib.suppress(OSError):
                os.nice(19)
        cores = len(os.sched_getaffinity(0))  # in a container, those it may use
        if self.config.threads > cores:
            log.warning(
                "--threads %d is more than this machine's %d cores: the kernel's threads "
                "take turns on them, and a tile is no faster than with %d",
                self.config.threads,
                cores,
                cores,
            )
        self.gflops = measure_gflops(self.config.threads)
        footprint = current_rss_mb()
        spare = self.config.max_memory_mb - footprint - GROWTH / MB
        minimum = self.config.threads * WORKSPACE_PER_THREAD / MB + 8
        if spare < minimum:
            needed = footprint + GROWTH / MB + minimum
            threads = self.config.threads
            raise NotEnoughMemory(
                f"--max-memory {self.config.max_memory_mb} MB is too small: this process "
                f"already uses {footprint:.0f} MB, grows by about {GROWTH / MB:.0f} MB as "
                f"it works and needs at least {minimum:.0f} MB more for work (the kernel's "
                f"workspace of {WORKSPACE_PER_THREAD / MB:.0f} MB for each of its {threads} "
                f"thread{'s' if threads > 1 else ''}); use --max-memory {int(needed) + 1} "
                "or more" + (", or fewer --threads" if threads > 1 else "")
            )
        self.budget = int(spare * MB)
        # Half for cached operands, half for the tile being computed and those reported.
        self.cache = BlobCache(self.budget // 2)
        # Freed buffers are kept for the next of their size in what the budget leaves
        # free. The cache's half is full of panels most of the time: on the larger project,
        # within half the budget a tenth of the large buffers were reused, within three
        # quarters two thirds (the peak 177 MB of 200, against 173 keeping none), within
        # the whole of it nine in ten, but the peak came within 2-5 MB of the limit.
        recycle_within(self.budget * 3 // 4)
        log.info(
            "kernel %s: %.1f GFLOPS on %d thread%s; memory budget %.0f MB of %d MB",
            kernels.kernel_name(),
            self.gflops,
            self.config.threads,
            "s" if self.config.threads > 1 else "",
            self.budget / MB,
            self.config.max_memory_mb,
            extra={"gflops": self.gflops},
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Work until `stop` is set; then finish or abandon the current tile and report.
        Raises NotACoordinator (after that) if something else answers at the URL."""
        stranger: NotACoordinator | None = None
        try:
            await self.session(stop)
        except (Quarantined, ProjectFinished):
            stop.set()
        except NotACoordinator as exc:
            stop.set()
            stranger = exc
        try:
            await self.leave(graceful=True, timeout=self.config.stop_timeout)
        finally:
            if self.state not in ENDED:
                self.state = "stopped"
            await self.client.close()
        if stranger is not None:
            raise stranger

    # ---- the primitives: real sockets, real threads ---------------------------------------

    async def _identify(self) -> None:
        saved = self.state_dir.identity(self.config.url)
        if saved:
            self.client.token = saved["token"]
            return
        await super()._identify()
        self.state_dir.save_identity(self.config.url, self.host_id, self.client.token, self.name)
        log.info("registered with %s as host %d", self.config.url, self.host_id)

    def _heard(self, reply: dict[str, Any], wait: bool) -> None:
        if self.state == "paused":
            return  # its own note says why (its owner): the answer only repeats that
        note = reply.get("note", "")
        need = reply.get("memory_need_mb")
        if note and isinstance(need, int | float) and 0 < need < MAX_NEED_MB:
            note = f"{note} (start this volunteer with --max-memory {self._max_memory_for(need)})"
        self.server_note = note
        if note and note != self._logged_note:
            # Once per reason, however often the coordinator repeats it between tiles. At
            # INFO: a note says why work waits (paused, finished, too few or too many
            # volunteers), which is nothing this volunteer did wrong or can mend.
            self._logged_note = note
            log.info("coordinator: %s", note)

    def _max_memory_for(self, need_mb: float) -> int:
        """The --max-memory that would offer a work unit of `need_mb`: what this process
        keeps of --max-memory for itself (its size at start, which moves by a fraction of
        a megabyte from one start to the next: ADVICE_MARGIN_MB), and the budget that
        offers it; in round figures (ADVICE_STEP_MB)."""
        own = self.config.max_memory_mb - self.budget / MB
        exact = own + budget_for(math.ceil(need_mb), self.config.threads) / MB
        return math.ceil((exact + ADVICE_MARGIN_MB) / ADVICE_STEP_MB) * ADVICE_STEP_MB

    def _resting(self) -> None:
        let_go()  # a daemon that waits holds no memory it does not use

    def _forget(self) -> None:
        self.state_dir.identity_file.unlink(missing_ok=True)

    def _paused(self) -> float:
        if not self.config.idle_only:
            return 0.0
        busy = self.owner.busy()
        others = f"other programs use {self.owner.share or 0.0:.0%} of a core"
        if busy != self._owner_busy:  # said once a pause, not every look
            self._owner_busy = busy
            log.info("%s: %s (--idle-only)", "pausing" if busy else "resuming", others)
        if busy:
            self.state = "paused"
            self.note = f"machine busy: {others} (--idle-only)"
            return 2.0
        return 0.0

    async def _kernel(
        self, assignment: dict[str, Any], a: Buffer, b: Buffer
    ) -> tuple[str | None, bytes, float]:
        started = time.perf_counter()
        compute = functools.partial(
            compute_tile,
            assignment,
            a,
            b,
            threads=self.config.threads,
            hashed=assignment.get("hash_needed", True),
        )
        if computes_inline(self.expected_seconds([assignment])):
            output_hash, tile = compute()
        else:
            output_hash, tile = await asyncio.to_thread(compute)
        return output_hash, tile, time.perf_counter() - started

    def status(self) -> dict[str, Any]:
        s = self.stats
        return {
            "pid": os.getpid(),
            "url": self.config.url,
            "state": self.state,
            "note": self.server_note or self.note if self.state in HEARD else self.note,
            "tiles": s.tiles,
            "gflops": round(s.gflops(), 2),
            "benchmark_gflops": round(self.gflops, 2),
            "mb_down": round(s.bytes_down / MB, 2),
            "mb_up": round(s.bytes_up / MB, 2),
            "cache_hit_rate": round(self.cache.hit_rate, 3),
            "cache_mb": round(self.cache.bytes / MB, 2),
            "backoff": round(max(self.backoff.current, self.idle.current), 2),
            "errors": s.errors,
            "refused": s.refused,
            "aborted": s.aborted,
            "compute_seconds": round(s.compute_seconds, 3),
            "uptime": round(time.monotonic() - self.started, 3),
            "peak_rss_mb": round(peak_rss_mb(), 1),
            "max_memory_mb": self.config.max_memory_mb,
            "threads": self.config.threads,
            "time": time.time(),
        }


def measure_gflops(threads: int, size: int = 192) -> float:
    """A short kernel benchmark, as BOINC's client runs at start: best of a few products."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size)).astype(np.float32)
    out = np.empty_like(a)
    kernels.gemm(a, a, out=out, threads=threads)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        kernels.gemm(a, a, out=out, threads=threads)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9
