"""The `tilehive` command line: every flag may also come from TILEHIVE_<FLAG>."""

from __future__ import annotations

import os
import shlex
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import click
import numpy as np

import kernels
from coordinator.cli import remote
from coordinator.engine.progress import duration, eta
from coordinator.state.integrity import DamagedState
from coordinator.state.lock import ProjectBusy, ProjectLock
from coordinator.training import checkpoints, history
from coordinator.training.corpus import CorpusError
from coordinator.training.model import param_shapes
from coordinator.training.project import (
    MAX_SEED,
    MAX_STEPS,
    MODELS,
    PROJECT_FILE,
    ProjectError,
)
from coordinator.training.project import create as create_project
from coordinator.training.project import load as load_project
from coordinator.work.records import (
    CANCELLED_STATE,
    ValidateState,
    WuState,
    short_workunit_id,
)
from kernels import processes, reference
from kernels.malloc import keep_freed_memory
from volunteer.cli import Folder, Number, emulate, log_format_option, option, volunteer
from volunteer.logsetup import configure as configure_logging


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tilehive")
def main() -> None:
    """tilehive: train neural networks on volunteered computers, every tile verified."""


main.add_command(volunteer)
main.add_command(emulate)


def _bits_equal(x: np.ndarray, y: np.ndarray) -> bool:
    return x.shape == y.shape and np.array_equal(x.view(np.uint32), y.view(np.uint32))


def _self_check(rng: np.random.Generator, threads: int) -> list[str]:
    """Compare the compiled kernel with its twin and with its own sub-blocks; list failures."""
    failures = []
    for m, n, k in [(1, 1, 1), (7, 13, 5), (45, 29, 131), (64, 96, 200)]:
        for trans_a in (False, True):
            for trans_b in (False, True):
                a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(np.float32)
                b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
                flags = {"trans_a": trans_a, "trans_b": trans_b}
                full = kernels.gemm(a, b, threads=threads, **flags)
                label = f"{m}x{n}x{k} trans_a={trans_a} trans_b={trans_b}"
                if not _bits_equal(full, reference.gemm(a, b, **flags)):
                    failures.append(f"{label}: compiled kernel differs from the numpy twin")
                i0, j0 = m // 3, n // 4
                rows = a[:, i0:] if trans_a else a[i0:]
                cols = b[j0:] if trans_b else b[:, j0:]
                block = kernels.gemm(
                    np.ascontiguousarray(rows), np.ascontiguousarray(cols), **flags
                )
                if not _bits_equal(block, full[i0:, j0:]):
                    failures.append(f"{label}: a sub-block differs from the full product")
    return failures


def _gflops(size: int, threads: int, repeats: int = 5) -> float:
    rng = np.random.default_rng(1)
    a = rng.standard_normal((size, size)).astype(np.float32)
    b = rng.standard_normal((size, size)).astype(np.float32)
    out = np.empty((size, size), np.float32)
    kernels.gemm(a, b, out=out, threads=threads)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        kernels.gemm(a, b, out=out, threads=threads)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


@main.command()
@option(
    "--threads",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Threads for the kernel.",
)
@option(
    "--size",
    type=click.IntRange(min=1, max=4096),
    default=512,
    show_default=True,
    help="Matrix size of the speed measurement.",
)
def selftest(threads: int, size: int) -> None:
    """Check this machine's kernel bit for bit and measure its speed.

    Runs the compiled kernel against its numpy twin and against its own sub-blocks (two
    honest machines must return identical tiles), then times a SIZE x SIZE x SIZE product.
    Exits 1 if any bit differs.
    """
    click.echo(f"kernel: {kernels.kernel_name()}")
    if kernels.kernel_name() == "reference":
        click.echo("note: running the numpy twin (TILEHIVE_KERNEL=reference or no extension)")
    failures = _self_check(np.random.default_rng(0), threads)
    for failure in failures:
        click.echo(f"FAIL {failure}", err=True)
    if failures:
        raise click.ClickException(f"{len(failures)} bitwise check(s) failed on this machine")
    click.echo("bitwise: compiled == twin, sub-blocks == full product: ok")
    if kernels.kernel_name() != "reference":
        rate = _gflops(size, threads)
        click.echo(f"speed: {rate:.1f} GFLOPS at {size}^3 with {threads} thread(s)")
    click.echo(f"cpu count: {os.cpu_count()}")


def _fail_on_project_error(fn):
    """Bad settings, missing, busy, damaged or unwritable projects become a clear message,
    never a traceback."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ProjectError, CorpusError, ProjectBusy, DamagedState) as exc:
            raise click.ClickException(str(exc)) from exc
        except OSError as exc:  # a folder this user may not write, a full disk, ...
            if exc.filename is None:
                raise
            raise click.ClickException(f"cannot use {exc.filename}: {exc.strerror}") from exc

    return wrapper


def _given(param: str, flag: str) -> str:
    """An option as an error names it: with the variable it came from, when it came from
    one (a value the operator never typed, set in a shell profile or a unit file)."""
    context = click.get_current_context(silent=True)
    if context is None or (
        context.get_parameter_source(param) is not click.core.ParameterSource.ENVIRONMENT
    ):
        return flag
    envvar = next(p.envvar for p in context.command.params if p.name == param)
    return f"{flag} (from {envvar})"


def _bind(value: str) -> tuple[str, int]:
    """HOST:PORT, or one line saying what is wrong with it."""
    flag = _given("bind", "--bind")
    if "://" in value:
        raise click.ClickException(
            f"{flag} {value!r} is a URL: give HOST:PORT to listen on (e.g. 0.0.0.0:8470)"
        )
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise click.ClickException(f"{flag} {value!r} is not HOST:PORT (e.g. 0.0.0.0:8470)")
    if int(port) > 65535:
        raise click.ClickException(
            f"{flag} {value!r}: port {int(port)} is out of range: give one from 0 to 65535 "
            "(0: any free port)"
        )
    return host.strip("[]"), int(port)


def _check_corpus(given: str, source: str) -> None:
    """Refuse at init what the coordinator would refuse at its start: a missing path, or
    one with too little text (the coordinator reads it with the project's defaults)."""
    from coordinator.training.corpus import load as load_corpus
    from coordinator.training.project import CorpusSettings

    if not Path(source).exists():
        raise click.BadParameter(
            f"{given!r}: no such file or folder (give a text file, a folder of text files, "
            "or python-stdlib)",
            param_hint="--corpus",
        )
    defaults = CorpusSettings()
    load_corpus(source, defaults.max_mb, defaults.validation_share)


@main.command()
@click.argument("directory", type=Folder())
@option("--model", type=click.Choice(MODELS), default="tiny-gpt", show_default=True)
@option(
    "--corpus",
    default="python-stdlib",
    show_default=True,
    help='"python-stdlib" or a path to a text file or folder.',
)
@option(
    "--seed",
    type=click.IntRange(min=0, max=MAX_SEED),
    default=None,
    help="Weights and batch order.",
)
@option("--steps", type=click.IntRange(min=1, max=MAX_STEPS), default=None, help="Optimizer steps.")
@option("--tile", type=click.IntRange(min=1, max=4096), default=None, help="Tile size.")
@_fail_on_project_error
def init(directory: Path, model: str, corpus: str, seed, steps, tile) -> None:
    """Create a project in DIRECTORY with a documented project.toml."""
    overrides = {"model.name": model, "corpus.source": corpus}
    for key, value in (("training.seed", seed), ("training.steps", steps), ("work.tile", tile)):
        if value is not None:
            overrides[key] = value
    if not corpus.strip():
        raise click.BadParameter(
            "an empty path (give python-stdlib or a path)", param_hint="--corpus"
        )
    if corpus != "python-stdlib":
        overrides["corpus.source"] = str(Path(corpus).expanduser().resolve())
        _check_corpus(corpus, overrides["corpus.source"])
    created = create_project(directory, **overrides)
    click.echo(
        f"created {directory / 'project.toml'}: {created.model.name}, "
        f"{created.training.steps} steps, tiles of {created.work.tile}"
    )
    where = shlex.quote(str(directory))  # to copy and paste, spaces and all
    click.echo(f"next: tilehive coordinator {where}   (or: tilehive train {where} --local)")


@main.command("coordinator")
@click.argument("directory", type=Folder())
@option("--bind", default="0.0.0.0:8470", show_default=True, help="HOST:PORT to listen on.")
@option("--keep-serving", is_flag=True, help="Keep the API up after the last step.")
@option(
    "--blob-memory",
    type=click.IntRange(min=0, max=1 << 20),
    default=1024,
    show_default=True,
    metavar="MB",
    help="Panels and tiles held in memory before any is written to DIR/blobs; beyond it the "
    "oldest are written (0: every one at once).",
)
@log_format_option
@_fail_on_project_error
def coordinator_command(
    directory: Path, bind: str, keep_serving: bool, blob_memory: int, log_format: str
) -> None:
    """Host the project in DIRECTORY: serve volunteers and train until its steps are done.

    A restarted coordinator resumes from the last checkpoint and the tiles already validated.
    """
    import asyncio

    from coordinator.cli.serve import host_project
    from coordinator.server.api import CannotListen

    host, port = _bind(bind)
    project = load_project(directory)
    configure_logging(log_format)
    # Its work serves the volunteers: an idle-only one on this machine does not count it as
    # the owner's use of the machine (volunteer/idle.py), which it knows by this name.
    processes.name_this_process(processes.COORDINATOR)
    try:
        code = asyncio.run(host_project(project, host, port, keep_serving, blob_memory))
    except CannotListen as exc:
        raise click.ClickException(str(exc)) from exc
    sys.exit(code)


@main.command()
@click.argument("directory", type=Folder())
@option("--local", is_flag=True, help="Run every product in this process (required).")
@option(
    "--steps",
    type=click.IntRange(min=1, max=MAX_STEPS),
    default=None,
    help="Stop after this step (the schedule still follows the project's steps).",
)
@option("--threads", type=click.IntRange(min=1), default=1, show_default=True)
@_fail_on_project_error
def train(directory: Path, local: bool, steps: int | None, threads: int) -> None:
    """Train the project in one process: the reference a distributed run equals bit for bit."""
    import asyncio

    from coordinator.cli.serve import more_steps
    from coordinator.training.trainer import LocalBackend, Trainer

    if not local:
        raise click.UsageError(
            "train runs the single-machine reference: pass --local "
            "(to train with volunteers run `tilehive coordinator DIR`)"
        )
    project = load_project(directory)
    keep_freed_memory()  # as a coordinator's process does (serve.tune_interpreter)
    trainer = Trainer(project, LocalBackend(threads))

    def show(r) -> None:
        val = f"  val_loss {r.val_loss:.4f}" if r.val_loss is not None else ""
        click.echo(f"step {r.step}/{r.steps}  loss {r.loss:.4f}{val}  ({r.seconds:.2f}s)")

    # It writes the project's checkpoints: never beside a coordinator, or another local run.
    with ProjectLock(project.directory) as lock:
        lock.acquire("train --local")
        done = checkpoints.latest_readable(project.checkpoints, param_shapes(project.model))
        click.echo(local_plan(done, steps, project.training.steps, more_steps(project)))
        # Ctrl-C stops it even when it was started with SIGINT ignored (a background job of
        # a script): Python then installs no handler, and asyncio.run none either.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            asyncio.run(trainer.run(until=steps, on_step=show))
        except KeyboardInterrupt:
            click.echo(
                "stopped; run the same command again to resume from the last checkpoint "
                f"(step {checkpoints.latest(project.checkpoints) or 0})",
                err=True,
            )
            sys.exit(130)
    click.echo(f"checkpoints: {project.checkpoints}")


def local_plan(done: int, until: int | None, steps: int, more: str = "") -> str:
    """What `train --local` is about to do, from the last checkpoint's step `done`, its
    --steps `until` and the project's `steps`: one line, so that a run that does nothing,
    or less than asked, says so; with `more` (how to train on) once all steps are done."""
    target = min(until or steps, steps)
    beyond = (
        f" (--steps {until} is beyond the project's {steps})" if until and until > steps else ""
    )
    if done >= target:
        how = f" ({more})" if more and done >= steps else ""
        return f"nothing to do: step {done} of {steps} is done already{beyond}{how}"
    start = f"resuming after step {done}" if done else "starting at step 1"
    return f"{start}, training to step {target} of {steps}{beyond}"


@main.command()
@click.argument("directory", type=Folder())
@option("--prompt", default="def ", show_default=True)
@option("--length", type=click.IntRange(min=1, max=100_000), default=200, show_default=True)
@option("--temperature", type=Number(min=0), default=0.8, show_default=True)
@option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@_fail_on_project_error
def sample(directory: Path, prompt: str, length: int, temperature: float, seed: int) -> None:
    """Generate text from the project's latest checkpoint."""
    from coordinator.training.sampling import generate

    for text in generate(load_project(directory), prompt, length, temperature, seed):
        click.echo(text, nl=False)  # as it comes
    click.echo()


@main.command()
@option("--volunteers", type=click.IntRange(min=1, max=32), default=3, show_default=True)
@option(
    "--steps",
    type=click.IntRange(min=1, max=MAX_STEPS),
    default=None,
    help="Steps of a new project (default 20); a --dir project keeps its own.",
)
@option(
    "--dir",
    "directory",
    type=Folder(),
    default=None,
    help="Project directory (default: a temporary one, removed afterwards).",
)
@option("--keep", is_flag=True, help="Keep the temporary project directory.")
@option(
    "--no-wait",
    is_flag=True,
    help="Stop as soon as training is done (default: keep the dashboard up until Enter).",
)
@_fail_on_project_error
def demo(
    volunteers: int, steps: int | None, directory: Path | None, keep: bool, no_wait: bool
) -> None:
    """Train a small model with a coordinator and volunteers on this machine.

    Prints the dashboard's URL; once training is done, keeps it up until you press Enter
    (or stops at once with --no-wait, or when not run from a terminal)."""
    from coordinator.cli.demo import run_demo

    run_demo(volunteers, steps, directory, keep, wait=not no_wait)


@main.group()
def logs() -> None:
    """Task and validation logs of a project (works while its coordinator runs, or not)."""


def _clock(t: float | None) -> str:
    from coordinator.engine.waiting import clock

    return clock(t) if t else "-"


def _view(directory: Path, follow: bool = False):
    """The project's history; with --follow, a project no coordinator has run yet is waited
    for (an operator may start the follower first), until Ctrl-C."""
    from coordinator.cli.logs import InspectError, NotStarted, ProjectView

    said = False
    while True:
        try:
            return ProjectView(directory)
        except NotStarted as exc:
            if not follow:
                raise click.ClickException(str(exc)) from exc
            if not said:
                click.echo(
                    f"-- no coordinator has run {directory} yet; waiting for its first "
                    "(tilehive coordinator DIR); Ctrl-C to stop --",
                    err=True,
                )
                said = True
            try:
                time.sleep(0.3)
            except KeyboardInterrupt:
                raise SystemExit(0) from None
        except InspectError as exc:
            raise click.ClickException(str(exc)) from exc


def _status_of(directory: Path) -> dict:
    from coordinator.cli.logs import InspectError, status_of

    try:
        return status_of(directory)
    except InspectError as exc:
        raise click.ClickException(str(exc)) from exc


def _since(value: str | None) -> float | None:
    from coordinator.cli.logs import InspectError, parse_since

    try:
        return parse_since(value)
    except InspectError as exc:
        raise click.BadParameter(str(exc), param_hint="--since") from exc


def _not_yet(exc: Exception, follow: bool) -> tuple[list, int]:
    """Nothing to list for a --host no host has registered as yet: an error, or (following)
    said once on stderr, and followed until it registers."""
    if not follow:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"-- {exc} yet; following until one registers --", err=True)
    return [], 0


def _follow(view, kinds, after, emit, filters, only=None) -> None:
    """Print new events as they are committed, until Ctrl-C; `only`: just these states."""
    from coordinator.cli.logs import InspectError, NoSuchHost

    click.echo("-- following new events; Ctrl-C to stop --", err=True)
    try:
        while True:
            try:
                if filters.get("host") is not None:
                    # Its id, once a host has the name: a later namesake changes nothing.
                    filters = {**filters, "host": str(view.host_id(filters["host"]))}
                new = view.events(kinds=kinds, after=after, **filters)
            except NoSuchHost:
                new = []  # not registered yet (said once, before)
            except InspectError as exc:
                raise click.ClickException(str(exc)) from exc
            for event in new:
                if only is None or event["state"] in only:
                    emit(event)
                after = event["id"]
            sys.stdout.flush()  # a pipe is block-buffered; followers want lines now
            time.sleep(0.3)
    except KeyboardInterrupt:
        pass


def _follow_steps(view, directory: Path, as_json: bool) -> None:
    """One line per finished training step, until Ctrl-C."""
    import json

    seen = {r["step"] for r in history.read(directory / "train.jsonl")}
    click.echo("-- one line per step as each finishes; Ctrl-C to stop --", err=True)
    try:
        while True:
            for record in history.read(directory / "train.jsonl"):
                if record["step"] in seen:
                    continue
                seen.add(record["step"])
                summary = view.step_summary(record)
                if as_json:
                    click.echo(json.dumps({"type": "step", **summary}))
                else:
                    click.echo(step_line(summary))
            sys.stdout.flush()
            time.sleep(0.3)
    except KeyboardInterrupt:
        pass


def step_line(s: dict) -> str:
    val = f" val_loss {s['val_loss']:.4f}" if s.get("val_loss") is not None else ""
    return (
        f"{_clock(s.get('time'))} step {s['step']}: loss {s['loss']:.4f}{val}, "
        f"{s['workunits']} work units ({s['assimilated']} assimilated, {s['errors']} failed"
        + (f", {s['cancelled']} cancelled" if s.get("cancelled") else "")
        + "), "
        f"{s['invalid']} invalid results, {s.get('seconds', 0):.2f}s"
    )


def _cut(
    shown: int,
    total: int,
    what: str,
    filtered: bool = False,
    archived: Callable[[], str] = lambda: "",
) -> None:
    """Say on stderr (not in the output a script reads) that the output was cut, or that
    nothing matched the filters given (a header alone read as a failure to look), and then
    where it may have gone (`archived`: _archived's words)."""
    if not total and filtered:
        click.echo(f"-- no {what} match{archived()} --", err=True)
    elif total > shown:
        click.echo(
            f"-- showing the newest {shown} of {total} {what}; --limit N for more --", err=True
        )


def _archived(view, archive: Path, step: int | None) -> str:
    """Where what the filters looked for may be, in a log whose purged steps go to `archive`:
    the step asked for, if a checkpoint purged it (the task log purges a step's work units
    sooner than its decisions); without --step, the steps checkpoints purged, where the
    failures `status` counts may all be."""
    if not archive.exists():
        return ""
    if step is not None:
        return f"; a checkpoint archived the step in {archive}" if view.purged(step) else ""
    oldest = view.reader.oldest_step()
    if oldest is None:
        return f"; checkpoints archived every step in {archive}"
    return f"; checkpoints archived the steps before {oldest} in {archive}"


def _event_line(e: dict) -> str:
    where = f"step {e['step']} " if e.get("step") is not None else ""
    wu = f"wu {short_workunit_id(e['wu_id'])} " if e.get("wu_id") else ""
    host = f"host {e['host'] or e['host_id']} " if e.get("host_id") is not None else ""
    return f"{_clock(e['time'])} {where}{wu}{e['kind']} {e['state']} {host}| {e['message']}"


WU_STATES = [s.value for s in WuState] + [CANCELLED_STATE]
VALIDATION_STATES = [s.value for s in ValidateState] + ["no_quorum"]
# What --failures keeps: evidence that something went wrong, not the normal flow.
TASK_FAILURES = frozenset({"client_error", "no_reply", "error", "invalid", "cancelled"})
VALIDATION_FAILURES = frozenset({"invalid", "no_quorum"})
# The HOST column of `logs validation`: wide enough that the default names of two volunteers
# on one machine ("lab-pc/volunteer1", "lab-pc/volunteer2") differ, cut at 12 before.
HOST = 20

log_filters = [
    option(
        "--step",
        type=click.IntRange(min=1, max=MAX_STEPS),
        default=None,
        help="Only this step (training starts at 1).",
    ),
    option("--host", default=None, help="Only this host (id or name)."),
    option(
        "--since",
        default=None,
        help="Only since: 90s, 10m, 2h, 1d ago, a time of day (14:05) or an ISO time.",
    ),
    option("--follow", "-f", is_flag=True, help="Keep printing new events as they happen."),
    option("--failures", is_flag=True, help="Only failures (invalid results, errors, timeouts)."),
    option("--json", "as_json", is_flag=True, help="One JSON object per line."),
]


def with_filters(fn):
    for decorator in reversed(log_filters):
        fn = decorator(fn)
    return fn


def limit_option(what: str):
    return option(
        "--limit",
        type=click.IntRange(min=1, max=1_000_000_000),
        default=200,
        show_default=True,
        help=f"Show the newest this many {what} (the output says when it cut some).",
    )


@logs.command("tasks")
@click.argument("directory", type=Folder())
@with_filters
@option(
    "--state", type=click.Choice(WU_STATES), default=None, help="Only work units in this state."
)
@limit_option("work units")
@option(
    "--by-step",
    is_flag=True,
    help="With --follow: one line per finished step instead of one per event.",
)
@_fail_on_project_error
def logs_tasks(
    directory, step, host, since, follow, failures, as_json, state, limit, by_step
) -> None:
    """Work units and their results: where each tile went and what became of it."""
    import json

    from coordinator.cli.logs import NoSuchHost
    from coordinator.engine.retention import WORKUNITS_ARCHIVE

    given = click.get_current_context().get_parameter_source("by_step")
    if by_step and not follow and given is click.core.ParameterSource.COMMANDLINE:
        # (TILEHIVE_BY_STEP set for the follows is no error of a plain listing's.)
        raise click.BadParameter(
            "is for --follow: one line per step as each finishes", param_hint="--by-step"
        )
    failures, state = _failures_or_state(failures, state)
    view = _view(directory, follow)
    start = view.last_event_id()
    if follow and by_step:
        _follow_steps(view, Path(directory), as_json)
        return
    if failures and state is None:
        state = "failed"  # error or cancelled (queries.sql, select_workunits_for_log)
    try:
        rows, total = view.tasks_counted(
            step=step, state=state, host=host, since=_since(since), limit=limit
        )
    except NoSuchHost as exc:
        rows, total = _not_yet(exc, follow)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        for row in rows:
            click.echo(json.dumps({"type": "task", **row}))
    else:
        click.echo(
            f"{'WU':12}  {'STEP':>4}  {'GEMM':22} {'TILE':19} {'STATE':11} "
            f"{'VALID':>5}  {'HOSTS':24} {'CREATED':8}  DONE"
        )
        for r in rows:
            i0, i1, j0, j1 = r["tile"]
            click.echo(
                f"{short_workunit_id(r['wu'])}  {r['step']:>4}  {r['gemm'][:22]:22} "
                f"{f'[{i0}:{i1},{j0}:{j1}]':19} {r['state']:11} "
                f"{r['valid']:>2}/{r['replicas']:<2}  {','.join(r['hosts'])[:24]:24} "
                f"{_clock(r['created'])}  {_clock(r['finished'])}"
                + (f"  {r['error']}" if r["error"] else "")
            )
    filtered = any(x is not None for x in (step, state, host, since))
    archive = Path(directory) / "logs" / WORKUNITS_ARCHIVE
    where = lambda: _archived(view, archive, step)  # noqa: E731 (asked only if nothing matched)
    _cut(len(rows), total, "work units", filtered and not follow, where)
    if follow:
        emit = (
            (lambda e: click.echo(json.dumps({"type": "event", **e})))
            if as_json
            else (lambda e: click.echo(_event_line(e)))
        )
        from coordinator.cli.logs import TASK_KINDS

        filters = {"step": step, "state": None, "host": host, "since": None}
        only = TASK_FAILURES if failures else ({state} if state else None)
        _follow(view, TASK_KINDS, start, emit, filters, only)


def _failures_or_state(failures: bool, state: str | None) -> tuple[bool, str | None]:
    """--failures is a set of states itself: with --state too, one would be ignored. Both
    typed is refused; one typed wins over the other set in the environment."""
    if not (failures and state is not None):
        return failures, state
    source = click.get_current_context().get_parameter_source
    typed = click.core.ParameterSource.COMMANDLINE
    if source("failures") is typed and source("state") is typed:
        raise click.BadParameter(
            "--failures picks the failed states itself: give --failures or --state, not both",
            param_hint="--state",
        )
    return (True, None) if source("failures") is typed else (False, state)


@logs.command("validation")
@click.argument("directory", type=Folder())
@with_filters
@option(
    "--state",
    type=click.Choice(VALIDATION_STATES),
    default=None,
    help="Only decisions with this outcome.",
)
@limit_option("decisions")
@_fail_on_project_error
def logs_validation(directory, step, host, since, follow, failures, as_json, state, limit) -> None:
    """Every validation decision: method, outcome, the reason with its numbers, host trust."""
    import json

    from coordinator.cli.logs import NoSuchHost
    from coordinator.engine.retention import EVENTS_ARCHIVE

    failures, state = _failures_or_state(failures, state)
    view = _view(directory, follow)
    start = view.last_event_id()
    states = VALIDATION_FAILURES if failures else ({state} if state else None)
    try:
        events, total = view.newest_events(
            kinds=("validation",),
            step=step,
            states=sorted(states) if states else None,
            host=host,
            since=_since(since),
            limit=limit,
        )
    except NoSuchHost as exc:
        events, total = _not_yet(exc, follow)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc

    def emit(e: dict) -> None:
        if as_json:
            click.echo(json.dumps(e))
            return
        trust = f"{e['trust_before']}->{e['trust_after']}" if "trust_before" in e else "-"
        click.echo(
            f"{_clock(e['time'])}  {e['step'] if e['step'] is not None else '-':>4}  "
            f"{short_workunit_id(e['wu_id'] or ''):12}  {str(e['host'] or '-')[:HOST]:{HOST}} "
            f"{e.get('method', '-'):9} {e['state']:12} {trust:11} {e['message']}"
        )

    if not as_json:
        click.echo(
            f"{'TIME':8}  {'STEP':>4}  {'WU':12}  {'HOST':{HOST}} {'METHOD':9} "
            f"{'OUTCOME':12} {'TRUST':11} REASON"
        )
    for event in events:
        emit(event)
    filtered = any(x is not None for x in (step, states, host, since))
    archive = Path(directory) / "logs" / EVENTS_ARCHIVE
    where = lambda: _archived(view, archive, step)  # noqa: E731 (asked only if nothing matched)
    _cut(len(events), total, "decisions", filtered and not follow, where)
    if follow:
        after = max(events[-1]["id"], start) if events else start
        filters = {"step": step, "state": None, "host": host}
        _follow(view, ("validation",), after, emit, filters, states)


@main.command()
@click.argument("target")
@option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@_fail_on_project_error
def status(target: str, as_json: bool) -> None:
    """How far training is: from a project directory, or a running coordinator's URL."""
    import json

    if not target.strip():
        raise click.BadParameter("an empty DIR|URL", param_hint="TARGET")
    problem = None
    if "://" in target:
        summary = remote.status(target)
    else:
        summary = _status_of(Path(target))
        problem = _settings_problem(Path(target))
    if as_json:
        click.echo(json.dumps({**summary, "settings_error": problem} if problem else summary))
    else:
        for line in status_lines(target, remote.escaped(summary)):
            click.echo(line)
    if problem:
        # What the files say is shown all the same; a script learns from the exit status
        # that the project cannot be trained as it stands.
        raise click.ClickException(problem)


def _settings_problem(directory: Path) -> str | None:
    """Why project.toml cannot be used (as train and coordinator would refuse it), or None.
    Called once status_of found the project's state: a directory that is no project at all
    is its to say."""
    settings = directory / PROJECT_FILE
    if not settings.exists():
        # A training project's, gone (the state of products computed without training, a
        # benchmark's or a test's, never had one).
        trained = (directory / "train.jsonl").exists() or (directory / "checkpoints").is_dir()
        if not trained:
            return None
        return f"{settings} not found: the coordinator and train refuse this project without it"
    try:
        load_project(directory)
    except ProjectError as exc:
        return str(exc)  # it names the file
    return None


def paused_hosts(n: int) -> str:
    """The hosts paused by their owners, for the hosts line: said only when there are some."""
    if not n:
        return ""
    whose = "its owner uses the machine" if n == 1 else "their owners use their machines"
    return f"{n} paused ({whose}: --idle-only), "


def status_lines(where: str, s: dict) -> list[str]:
    """What `tilehive status` prints, from a directory's summary or a coordinator's."""
    t = s.get("training") or {}
    steps = t.get("steps") or "?"
    loss = f", loss {t['loss']:.4f}" if "loss" in t else ""
    val = f" (validation {t['val_loss']:.4f})" if "val_loss" in t else ""
    hosts = s.get("host_states", {})
    wus = ", ".join(f"{n} {k}" for k, n in sorted(s.get("workunits", {}).items())) or "none"
    in_flight = s.get("results", {}).get("in_progress", 0)
    step = t.get("step", 0)
    lowered = (
        f" (project.toml's steps lowered to {steps} after step {step} was trained)"
        if isinstance(steps, int) and step > steps
        else ""
    )
    lines = [f"{where}: step {step} of {steps}{loss}{val}{lowered}"]
    if t.get("done"):
        lines.append("training finished: every step is done")
    seconds, cpu = t.get("seconds"), t.get("cpu_seconds")
    if isinstance(seconds, int | float):  # a coordinator's answer: a number or nothing
        used = (
            f", {cpu:.3f} s of the training process's CPU" if isinstance(cpu, int | float) else ""
        )
        lines.append(f"last step: {seconds:.3f} s{used}")
    if s.get("paused"):
        lines.append(
            "PAUSED by the operator: no new work goes out (tilehive admin resume URL --project DIR)"
        )
    waiting = s.get("waiting")
    if waiting and waiting.get("reason") != "paused" and not t.get("done"):
        lines.append(f"waiting: {waiting['message']}")
    lines += [
        f"work units: {wus}; {in_flight} tiles in flight",
        f"{s.get('tiles_per_second', 0):.1f} tiles/s over the last minute",
        f"hosts: {hosts.get('active', 0)} active, {paused_hosts(hosts.get('paused', 0))}"
        f"{hosts.get('idle', 0)} idle, {hosts.get('quarantined', 0)} quarantined",
        f"validation failures: {s.get('invalid', 0)} invalid results",
    ]
    seconds, why_none = eta(s)
    see_above = " (see above)" if waiting and why_none == "unknown while work waits" else ""
    left = duration(seconds) if seconds is not None else f"{why_none}{see_above}"
    lines.append(f"ETA: {left}")
    if s.get("training_locally"):
        lines.append(
            f"coordinator: not running; `tilehive train --local` (pid "
            f"{s['training_locally']}) trains the project"
        )
    elif "coordinator" in s and not s["coordinator"]:
        lines.append("coordinator: not running (tilehive coordinator DIR)")
    elif s.get("coordinator"):  # a directory's summary, its coordinator serving
        lines.append(f"coordinator: serving {remote.escaped(str(s['coordinator']))}")
    return lines


@main.group()
def admin() -> None:
    """Operate a running coordinator: pause, resume, quarantine or release a host, cancel a
    step."""


admin_options = [
    click.argument("url"),
    option(
        "--project",
        "project_dir",
        type=Folder(),
        default=None,
        help="Project directory holding admin.token.",
    ),
    option("--token", "admin_token", default=None, help="The admin token itself."),
]


def with_admin_options(fn):
    for decorator in reversed(admin_options):
        fn = decorator(fn)
    return fn


def _admin_call(url: str, path: str, project_dir: Path | None, admin_token: str | None) -> dict:
    import urllib.error
    import urllib.request

    import msgpack

    source = "--token"
    if admin_token is None:
        if project_dir is None:
            raise click.UsageError("give --project DIR (to read DIR/admin.token) or --token")
        source = str(project_dir / "admin.token")
        try:
            admin_token = (project_dir / "admin.token").read_text().strip()
        except OSError as exc:
            raise click.ClickException(f"cannot read {source}: {exc}") from exc
    if not (admin_token.isascii() and admin_token.isprintable()):  # as tokens are made
        raise click.ClickException(
            f"{source}: an admin token is printable ASCII (no control character, no space "
            "or letter beyond it)"
        )
    url = remote.url_of(url)
    request = urllib.request.Request(
        url + path,
        data=msgpack.packb({}),
        method="POST",
        headers={"Authorization": f"Bearer {admin_token}", "Content-Type": "application/msgpack"},
    )
    answer = remote.exchange(url, request, timeout=30)
    return remote.admin_reply(url, f"POST {path}", *answer)


@admin.command()
@with_admin_options
def pause(url, project_dir, admin_token) -> None:
    """Hand out no new work (work in progress is still accepted)."""
    reply = _admin_call(url, "/v1/admin/pause", project_dir, admin_token)
    click.echo("paused" if reply.get("changed", True) else "was paused already: nothing changed")


@admin.command()
@with_admin_options
def resume(url, project_dir, admin_token) -> None:
    """Hand out work again."""
    reply = _admin_call(url, "/v1/admin/resume", project_dir, admin_token)
    click.echo("resumed" if reply.get("changed", True) else "was not paused: nothing changed")


@admin.command()
@with_admin_options
@click.argument("host")
def quarantine(url, project_dir, admin_token, host) -> None:
    """Give HOST (an id, or a name as the dashboard shows it) no more work."""
    reply = _admin_call(url, _host_path(host, "quarantine"), project_dir, admin_token)
    click.echo(_host_said(reply, "quarantined", "was quarantined already: nothing changed"))


@admin.command()
@with_admin_options
@click.argument("host")
def release(url, project_dir, admin_token, host) -> None:
    """Let HOST (an id or a name) work again, starting with no trust and a quota of one."""
    reply = _admin_call(url, _host_path(host, "release"), project_dir, admin_token)
    click.echo(_host_said(reply, "released", "was not quarantined: nothing changed"))


def _host_said(reply: dict, done: str, unchanged: str) -> str:
    """What an admin call on a host did, naming it as the coordinator knows it (an older
    coordinator sends neither its name nor whether anything changed)."""
    name = f" {reply['name']!r}" if isinstance(reply.get("name"), str) else ""
    what = done if reply.get("changed", True) else unchanged
    return f"host {reply['host_id']}{name} {what}"


def _host_path(host: str, action: str) -> str:
    import urllib.parse

    if not host.strip():
        # The path would have no host in it: the coordinator's answer was "404: Not Found".
        raise click.BadParameter("is empty: give a host's id or its name", param_hint="HOST")

    return f"/v1/admin/hosts/{urllib.parse.quote(host, safe='')}/{action}"


@admin.command("cancel-step")
@with_admin_options
@click.argument("step", type=click.IntRange(min=0))
def cancel_step(url, project_dir, admin_token, step) -> None:
    """Stop STEP's products: its work is dropped or aborted and training stops; running the
    coordinator again starts the step over from the last checkpoint."""
    counts = _admin_call(url, f"/v1/admin/steps/{step}/cancel", project_dir, admin_token)
    click.echo(
        f"step {step} cancelled: {counts['gemms']} products, {counts['workunits']} work units, "
        f"{counts['aborted']} results in progress aborted"
    )


if __name__ == "__main__":
    main(prog_name="tilehive")
