"""`tilehive coordinator DIR`: serve the protocol and train the project with volunteers."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import sys
import time

from coordinator.engine.backend import (
    TrainingThread,
    VolunteerBackend,
    on_loop,
    trains_on_server_loop,
)
from coordinator.engine.config import CoordinatorConfig
from coordinator.engine.coordinator import Coordinator
from coordinator.engine.products import GemmFailed
from coordinator.rules.access import AccessConfig, networks
from coordinator.rules.scheduler import SchedulerConfig
from coordinator.server.api import check_bind, serve
from coordinator.state import integrity
from coordinator.state.lock import ProjectLock
from coordinator.state.sqlite import SqliteStore
from coordinator.training import checkpoints, history
from coordinator.training.model import param_shapes
from coordinator.training.project import PROJECT_FILE, Project
from coordinator.training.trainer import StepReport, Trainer
from kernels.malloc import keep_freed_memory

log = logging.getLogger(__name__)

SWITCH_INTERVAL = 0.0005  # seconds a thread may hold the GIL while another waits
# The cyclic garbage collector passes when this many more container objects are alive than
# at its last pass (Python's default is 700; the older generations keep its 10). The
# coordinator's records, requests and reports are freed by reference counting: a run of the
# throughput benchmark leaves about 2,400 objects of cyclic garbage, none of them arrays. At
# the default the collector made 1,700 passes in that run, about 9% of the coordinator's CPU,
# and a full pass stalled the server's loop for about 45 ms (docs/performance-history.md,
# the tenth round).
GC_THRESHOLDS = (50_000, 10, 10)
FINISH_GRACE = 15.0  # seconds a finished coordinator waits for its volunteers to hear it
RECENT_CONTACT = 30.0  # volunteers in contact this recently are told before it exits


def coordinator_config(project: Project, blob_memory_mb: int | None = None) -> CoordinatorConfig:
    """The coordinator's settings from the project's; `blob_memory_mb` (`--blob-memory`)
    bounds the panels and tiles held in memory unwritten."""
    work, access = project.work, project.access
    unwritten = {} if blob_memory_mb is None else {"unwritten_blob_bytes": blob_memory_mb << 20}
    return CoordinatorConfig(
        directory=project.directory,
        **unwritten,
        policy=project.policy,
        redundancy=project.redundancy,
        tile=work.tile,
        tile_sizing=work.sizing == "crowd",
        freivalds_rounds=work.freivalds_rounds,
        no_work_delay=0.25,
        scheduler=SchedulerConfig(adaptive_replication=work.adaptive_replication),
        access=AccessConfig(
            invite_code=access.invite_code,
            host_rate=access.host_rate,
            host_burst=2 * access.host_rate,
            registrations_per_hour=access.registrations_per_hour,
            trusted_proxies=networks(access.trusted_proxies),
        ),
    )


def public_url(host: str, url: str) -> str:
    """The URL to give volunteers: a wildcard bind is reachable under the machine's name."""
    if host in ("0.0.0.0", "::", ""):
        port = url.rsplit(":", 1)[1]
        return f"http://{socket.gethostname()}:{port}"
    return url


def announce(text: str) -> None:
    """A line for whoever started us. Whoever that is may have stopped listening (the demo
    reads the URL and closes the pipe): that must never stop the coordinator."""
    try:
        print(text, flush=True)
    except OSError:
        # Later writes (and the flush at exit) go nowhere instead of failing again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


class Interrupts:
    """SIGINT and SIGTERM, from the first moment of host_project: while starting, the start
    is unwound (there is nothing to save yet); once serving, training stops in order; asked a
    second time, the process exits at once. Ctrl-C always stops the coordinator."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.starting = True
        self._main = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._interrupted)

    def _interrupted(self) -> None:
        if self.stop.is_set():
            # Asked twice: the operator will not wait for the orderly stop. What is committed
            # is safe as after kill -9, and a restart resumes from it.
            announce("stopping now, without waiting")
            os._exit(130)
        self.stop.set()
        if self.starting and self._main is not None:
            self._main.cancel()


def tune_interpreter() -> None:
    """Set the GIL's switch interval, the garbage collector and malloc (kernels/malloc.py)
    for a coordinator process, before its threads start."""
    # A training thread (a large model's) and worker threads compute while this one serves:
    # every time the server's loop waits on a socket it must win the GIL back, and at
    # Python's default 5 ms a request of a dozen such waits takes tens of milliseconds (the
    # convoy effect).
    sys.setswitchinterval(SWITCH_INTERVAL)
    gc.set_threshold(*GC_THRESHOLDS)
    keep_freed_memory()


async def host_project(
    project: Project,
    bind_host: str,
    port: int,
    keep_serving: bool,
    blob_memory_mb: int | None = None,
) -> int:
    """Serve and train until the project's steps are done; returns the exit code. Raises
    ProjectBusy (another process runs the project), DamagedState (state.db cannot be read)
    or CannotListen (the bind failed), each with a message for the operator."""
    tune_interpreter()
    # Before the lock, the database, the secret and the blobs' folder: a bad address
    # changes nothing in the project (serve checks again, at the moment it binds).
    await check_bind(bind_host, port)
    interrupts = Interrupts()
    try:
        with ProjectLock(project.directory) as lock:
            lock.acquire("coordinator")
            state = project.directory / "state.db"
            await asyncio.to_thread(integrity.check, state)
            coordinator = Coordinator(
                coordinator_config(project, blob_memory_mb), SqliteStore(state)
            )
            with integrity.reported(state):
                runner, url = await serve(coordinator, bind_host, port)
            interrupts.starting = False
            try:
                public = public_url(bind_host, url)
                lock.describe(url=public)
                # A finished project's coordinator only says so (_train) and stops, unless
                # it keeps serving (its dashboard and status).
                if keep_serving or not finished(project):
                    announce(
                        f"tilehive coordinator: volunteers connect to {public}\n"
                        f"  e.g. tilehive volunteer start {public}"
                    )
                return await _train(coordinator, project, public, keep_serving, interrupts.stop)
            finally:
                # Always, whatever went wrong: this closes the database, whose worker thread
                # would otherwise keep the process from exiting.
                await runner.cleanup()
    except asyncio.CancelledError:
        if not (interrupts.starting and interrupts.stop.is_set()):
            raise
        asyncio.current_task().uncancel()
        announce("stopped while starting")
        return 130


def more_steps(project: Project) -> str:
    """What to do to train a finished project further, and what it changes."""
    return (
        f"raise training.steps in {project.directory / PROJECT_FILE} to train more: the "
        "learning rate's decay then spans the new count from the next step on"
    )


def finished(project: Project) -> bool:
    """Whether the project's last checkpoint is of its last step: nothing left to train.
    CheckpointError if that checkpoint cannot be resumed (damaged, or of other model
    settings): said before "nothing to do" would be."""
    shapes = param_shapes(project.model)
    return checkpoints.latest_readable(project.checkpoints, shapes) >= project.training.steps


async def tell_volunteers(coordinator: Coordinator, stop: asyncio.Event) -> None:
    """Before exiting, let every volunteer in recent contact hear that the project is
    finished (they ask at least every FINISH_GRACE seconds, or soon after the longest delay
    a crowd of idle hosts was given), so they stop rather than retry a coordinator that is
    gone."""
    since = time.time() - RECENT_CONTACT
    requests = coordinator.requests
    deadline = max(time.monotonic(), requests.asks_due_by) + FINISH_GRACE
    while requests.untold(since) and time.monotonic() < deadline and not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=0.1)
    untold = requests.untold(since)
    if untold:
        log.warning(
            "%d volunteer(s) did not ask again in time and were not told the project is "
            "finished: they will find the coordinator gone",
            len(untold),
        )
    else:
        log.info("told %d volunteer(s) that the project is finished", len(requests.told))


async def _train(
    coordinator: Coordinator, project: Project, url: str, keep_serving: bool, stop: asyncio.Event
) -> int:
    """Train to the project's last step; `url`: where volunteers and browsers reach it."""
    steps = project.training.steps
    loop = asyncio.get_running_loop()
    if await asyncio.to_thread(finished, project):
        announce(f"nothing to do: all {steps} steps are done already ({more_steps(project)})")

    def on_step(report: StepReport) -> None:
        coordinator.progress.record_step(report.record(), steps)
        coordinator.products.drop_unasked(report.step, time.time())
        val = f" val_loss {report.val_loss:.4f}" if report.val_loss is not None else ""
        log.info(
            "step %d/%d loss %.4f%s (%.2fs)", report.step, steps, report.loss, val, report.seconds
        )

    trainer = Trainer(project, VolunteerBackend(coordinator.products, loop))
    coordinator.progress.restore(history.read(trainer.metrics), steps)
    if trains_on_server_loop(project):
        log.info("a small model: its arithmetic runs on the server's event loop")
        trainer.before_checkpoint = coordinator.ledger.flush
        trainer.on_checkpoint = coordinator.retention.prune
        training = asyncio.create_task(trainer.run(on_step=on_step))
    else:
        # On a thread of its own: what it reports and prunes, it hands back here.
        trainer.before_checkpoint = lambda: on_loop(coordinator.ledger.flush(), loop)
        trainer.on_checkpoint = lambda step: on_loop(coordinator.retention.prune(step), loop)
        thread = TrainingThread(
            lambda: trainer.run(on_step=lambda report: loop.call_soon_threadsafe(on_step, report))
        )
        training = asyncio.create_task(thread.run())
    stopper = asyncio.create_task(stop.wait())
    passes = {coordinator.loop} if coordinator.loop is not None else set()
    try:
        await asyncio.wait({training, stopper, *passes}, return_when=asyncio.FIRST_COMPLETED)
        if not training.done() and any(task.done() for task in passes):
            # Nothing would validate or commit any more: fail now rather than wait for ever.
            training.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await training
            log.error(
                "training stopped: the coordinator's loop failed (logged above); run the same "
                "command again to go on from the last checkpoint"
            )
            return 1
        if training.done():
            try:
                training.result()
            except (GemmFailed, OSError) as exc:
                # The project's state is committed up to here: say what stopped, not where.
                log.error(
                    "training stopped: %s; run the same command again to go on from the last "
                    "checkpoint",
                    exc,
                )
                return 1
            log.info("training done: %d steps; checkpoints in %s", steps, project.checkpoints)
            coordinator.finish(time.time())
            if keep_serving:
                announce(f"training done; still serving {url} (Ctrl-C to stop)")
                await stopper
            else:
                await tell_volunteers(coordinator, stop)
            return 0
        training.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await training
        announce("stopped; run the same command again to resume from the last checkpoint")
        return 130
    finally:
        stopper.cancel()
        if not training.done():
            # Cancelled from outside: the training thread must not outlive the database.
            training.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await training
