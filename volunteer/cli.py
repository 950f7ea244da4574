"""`tilehive volunteer start|stop|status` and `tilehive emulate`: the volunteer's command line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import select
import shutil
import signal
import socket
import sys
import time
import unicodedata
from pathlib import Path
from typing import Any

import click

from kernels import processes
from kernels.malloc import return_freed_memory
from volunteer.address import NotACoordinator, check_url
from volunteer.daemon import ENDED, NotEnoughMemory, Volunteer, VolunteerConfig, default_threads
from volunteer.emulator import (
    DEFAULT_REAL_FLOPS,
    CoordinatorUnreachable,
    EmulationReport,
    default_connections,
    hints,
    raise_file_limit,
    run_emulation,
)
from volunteer.logsetup import configure as configure_logging
from volunteer.logsetup import one_line
from volunteer.profile import ProfileError
from volunteer.profile import load as load_profile
from volunteer.service import REFUSED_EXIT
from volunteer.state import AlreadyRunning, StateDir, default_state_dir

ENV_PREFIX = "TILEHIVE_"
STARTUP_TIMEOUT = 60.0
MAX_NAME = 64  # what the coordinator accepts (docs/protocol.md: register)
LIVE_WIDTH = 110  # columns of the live status line where the terminal's are unknown

log = logging.getLogger("volunteer")


def option(*names: str, **kwargs: Any):
    """A click option that also reads TILEHIVE_<FLAG> from the environment: the flag's
    longest spelling (`--max-memory`: TILEHIVE_MAX_MEMORY), never the parameter's Python
    name (`--json`, stored as `as_json`, is TILEHIVE_JSON)."""
    long_name = max((n for n in names if n.startswith("--")), key=len).lstrip("-")
    kwargs.setdefault("envvar", ENV_PREFIX + long_name.upper().replace("-", "_"))
    kwargs.setdefault("show_envvar", True)
    return click.option(*names, **kwargs)


class Folder(click.Path):
    """A folder's path, never empty text: "" would mean the working directory, which nobody
    means by a blank argument or an empty TILEHIVE_STATE_DIR; nor a URL (`logs URL`: only
    `status` and `admin` ask a coordinator by its URL)."""

    def __init__(self) -> None:
        super().__init__(file_okay=False, path_type=Path)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None):
        if isinstance(value, str) and not value.strip():
            self.fail("an empty path (give '.' for the working directory)", param, ctx)
        if isinstance(value, str) and "://" in value:
            # A path would fold its '//' into '/' and name a folder nobody meant.
            self.fail(f"{value} is a URL: give a folder on this machine", param, ctx)
        return super().convert(value, param, ctx)


class Number(click.FloatRange):
    """A finite number in a range. click's FloatRange takes "nan" (it fails no comparison
    with a bound) and "inf": a backoff of NaN seconds was no wait at all, a stop timeout of
    NaN killed at once."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


state_dir_option = option(
    "--state-dir",
    type=Folder(),
    default=default_state_dir,
    show_default="$XDG_STATE_HOME/tilehive/volunteer",
    help="Where the token, pid file, log and status live; one per volunteer.",
)


threads_option = option(
    "--threads",
    type=click.IntRange(min=1, max=4096),  # what the coordinator takes (docs/protocol.md)
    default=default_threads,
    show_default="cores - 1",
)


max_memory_option = option(
    "--max-memory",
    type=click.IntRange(min=1, max=1 << 24),  # 16 TB: what the coordinator takes
    default=200,
    show_default=True,
    help="Peak memory in MB; work that would not fit is refused (a systemd unit's MemoryMax "
    "is this plus 100).",
)


log_format_option = option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="json: one JSON object per log line, for machines.",
)


def check_name(name: str | None) -> str | None:
    """A --name the coordinator takes (1 to MAX_NAME printable characters, not digits alone),
    refused here in one line rather than by every registration after start."""
    if name is not None and not (1 <= len(name) <= MAX_NAME and name.isprintable()):
        raise click.ClickException(
            f"--name {name!r}: a name is 1 to {MAX_NAME} printable characters"
        )
    if name is not None and name.isascii() and name.isdigit():
        raise click.ClickException(
            f"--name {name!r}: a name must not be digits alone (digits name a host's id)"
        )
    return name


def default_name(state_dir: Path) -> str:
    """The host's name and the state directory's: two volunteers on one machine (one state
    directory each) get two names."""
    return f"{socket.gethostname()}/{Path(state_dir).name}"[:MAX_NAME]


@click.group()
def volunteer() -> None:
    """Donate this machine's idle CPU to a tilehive project."""


name_option = option(
    "--name",
    default=None,
    callback=lambda ctx, param, value: check_name(value),
    help="Shown in the coordinator's logs and dashboard (default: HOSTNAME/STATE-DIR-NAME, "
    "so each volunteer on one machine has its own).",
)
idle_only_option = option(
    "--idle-only", is_flag=True, help="Pause while other programs keep the CPU busy."
)
invite_option = option("--invite", default=None, help="The project's invite code, if it needs one.")


@volunteer.command()
@click.argument("url", envvar="TILEHIVE_URL")
@option("--daemon", is_flag=True, help="Detach and run in the background.")
@threads_option
@max_memory_option
@name_option
@state_dir_option
@idle_only_option
@option(
    "--priority",
    type=click.Choice(["low", "normal"]),
    default="low",
    show_default=True,
    help="CPU priority; low is nice 19.",
)
@invite_option
@option(
    "--max-backoff",
    type=Number(min=0.1),
    default=60.0,
    show_default=True,
    help="Longest wait in seconds between retries when the coordinator is unreachable.",
)
@log_format_option
def start(
    url: str,
    daemon: bool,
    threads: int,
    max_memory: int,
    name: str | None,
    state_dir: Path,
    idle_only: bool,
    priority: str,
    invite: str | None,
    max_backoff: float,
    log_format: str,
) -> None:
    """Pull work from the coordinator at URL, compute it and send it back."""
    try:
        url = check_url(url)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    # Absolute before anything else: a daemon leaves the working directory behind.
    state_dir = state_dir.expanduser().absolute()
    config = VolunteerConfig(
        url=url,
        state_dir=state_dir,
        threads=threads,
        max_memory_mb=max_memory,
        idle_only=idle_only,
        low_priority=priority == "low",
        max_backoff=max_backoff,
        invite=invite,
        name=name or default_name(state_dir),
    )
    try:
        state = StateDir(state_dir)
        # The log opened as the daemon will open it: a folder that takes no files is said
        # here, in one line, not in a log that cannot be written.
        os.close(os.open(state.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
    except OSError as exc:
        raise click.ClickException(
            f"cannot use the state directory {state_dir}: {exc.strerror or exc}"
        ) from None
    pid = state.running_pid()
    if pid is not None:
        raise click.ClickException(
            f"a volunteer (pid {pid}) already runs with state directory {state_dir}; "
            "stop it first or use another --state-dir"
        )
    if daemon:
        report = _daemonize(state, log_format)
        _run(config, state, report)
    else:
        # A log line in a terminal first clears the status line redrawn there each second.
        configure_logging(log_format, clear_line=sys.stdout.isatty() and sys.stderr.isatty())
        _run(config, state, None)


def _daemonize(state: StateDir, log_format: str) -> int:
    """Detach (double fork, new session, no terminal). The parent waits for the daemon to
    say it started and exits; the daemon returns the pipe on which to say so."""
    read_end, write_end = os.pipe()
    if os.fork() > 0:
        os.close(write_end)
        ready, _, _ = select.select([read_end], [], [], STARTUP_TIMEOUT)
        message = os.read(read_end, 4096).decode() if ready else ""
        with contextlib.suppress(ChildProcessError):
            os.wait()
        if message.startswith("ok "):
            click.echo(f"volunteer started (pid {message.split()[1]}); log: {state.log_file}")
            sys.exit(0)
        click.echo(message or f"volunteer did not start; see {state.log_file}", err=True)
        sys.exit(1)
    os.close(read_end)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    os.chdir("/")
    os.umask(0o077)
    devnull = os.open(os.devnull, os.O_RDWR)
    log_fd = os.open(state.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(devnull, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(devnull)
    os.close(log_fd)
    configure_logging(log_format)
    return write_end


def _run(config: VolunteerConfig, state: StateDir, report: int | None) -> None:
    def fail(message: str) -> None:
        """Said once: as the `Error:` line on stderr, or in the daemon's log (and by the
        parent it reports to)."""
        if report is None:
            raise click.ClickException(message)
        log.error(message)
        os.write(report, f"Error: {message}".encode())  # as click says it in the foreground
        raise SystemExit(1)

    try:
        lock = state.lock()
    except AlreadyRunning as exc:
        fail(str(exc))
        return
    # By this name an idle-only volunteer on this machine does not count it as the owner's.
    processes.name_this_process(processes.VOLUNTEER)
    try:
        return_freed_memory()  # before the kernel's threads: its resident size is what it holds
        worker = Volunteer(config)
        try:
            worker.prepare()
        except NotEnoughMemory as exc:
            fail(str(exc))
            return
        if report is not None:
            os.write(report, f"ok {os.getpid()}".encode())
            os.close(report)
        try:
            interactive = report is None and sys.stdout.isatty()
            asyncio.run(_serve(worker, state, lock, interactive, daemon=report is not None))
        except NotACoordinator as exc:  # said once: on stderr, or in the daemon's log
            if report is None:
                raise click.ClickException(str(exc)) from None
            raise SystemExit(1) from None
        if worker.state == "refused":  # said once already, in the log (Session._quarantined)
            raise SystemExit(REFUSED_EXIT)
    finally:
        state.release(lock)


async def _serve(
    worker: Volunteer, state: StateDir, lock: int, interactive: bool, daemon: bool = False
) -> None:
    """Run the volunteer until a signal or its end. A daemon's log says why it ends before
    that it stopped (the foreground's error line is printed last, by click)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: a closed terminal
        loop.add_signal_handler(sig, stop.set)
    reporter = asyncio.create_task(_report_status(worker, state, lock, stop, interactive))
    try:
        await worker.run(stop)
    except NotACoordinator as exc:
        if daemon:
            log.error("%s", exc)
        raise
    finally:
        stop.set()
        await reporter
        if state.holds(lock):
            state.write_status(worker.status())
        if interactive:
            click.echo()
        log.info("volunteer stopped after %d tiles", worker.stats.tiles)


STATUS_LOG_EVERY = 30.0  # seconds between status lines in the log (no terminal)
FIGURES = re.compile(r"\d+(?:\.\d+)?")


class StatusLog:
    """When a volunteer without a terminal writes its status line to the log: every
    STATUS_LOG_EVERY seconds while it moves on. Not at the start, where it would say
    "starting: 0 tiles, 0.0 GFLOPS delivered" beside the line that says what the kernel
    does; and not again while idle: it repeated its line, the coordinator's note and all,
    every 30 s (2,900 lines a day in a journal; the note itself is logged once as it comes,
    daemon.py)."""

    def __init__(self, now: float) -> None:
        self.last = now
        self.said: tuple = ()

    def due(self, status: dict[str, Any], now: float) -> str | None:
        if now - self.last <= STATUS_LOG_EVERY:
            return None
        self.last = now
        # A note's figures (a countdown, a retry's seconds) move on by themselves.
        said = (status["state"], status["tiles"], FIGURES.sub("#", status.get("note") or ""))
        if said == self.said:
            return None
        self.said = said
        return status_line(status)


async def _report_status(
    worker: Volunteer, state: StateDir, lock: int, stop: asyncio.Event, live: bool
) -> None:
    """Write status.json every second; in a terminal, also redraw one status line. Stop
    the volunteer if its state directory is deleted or replaced under it: `status` and
    `stop` could no longer find it, and it would run on unseen."""
    lines = StatusLog(time.monotonic())
    unwritten = ""  # the last error writing status.json, said once
    while not stop.is_set():
        if not state.holds(lock):
            log.error(
                "the state directory %s was deleted or replaced: stopping, since "
                "`tilehive volunteer status` and `stop` can no longer find this volunteer",
                state.path,
            )
            stop.set()
            return
        status = worker.status()
        try:
            state.write_status(status)
        except OSError as exc:  # the directory going (checked above next time), a full disk
            if str(exc) != unwritten:
                log.warning("cannot write %s: %s", state.status_file, exc)
                unwritten = str(exc)
        if live:
            width = shutil.get_terminal_size((LIVE_WIDTH, 24)).columns
            click.echo("\r" + live_line(status, width), nl=False)
        elif (line := lines.due(status, time.monotonic())) is not None:
            log.info(line)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=1.0)


def live_line(s: dict[str, Any], width: int) -> str:
    """The status line redrawn in a terminal `width` columns wide: the whole of it if it
    fits, else the state, tiles and speed with the note after them, which says why the
    volunteer waits: the counters alone fill about 105 columns, and a line cut at the
    terminal's edge hid the note every time."""
    width = max(20, width) - 1  # a character written in the last column wraps on some
    line = status_line(s)
    if columns(line) > width:
        note = f" | {one_line(s['note'])}" if s.get("note") else ""
        line = f"{s['state']}: {s['tiles']} tiles, {s['gflops']:.1f} GFLOPS{note}"
        if columns(line) > width:
            line = cut_to(line, width - 3) + "..."
    return line + " " * (width - columns(line))


def columns(text: str) -> int:
    """The terminal columns `text` takes: two for a wide character (CJK), none for a
    combining one."""
    return sum(
        0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1
        for c in text
    )


def cut_to(text: str, width: int) -> str:
    """The longest start of `text` that takes at most `width` columns."""
    taken = 0
    for i, c in enumerate(text):
        taken += columns(c)
        if taken > width:
            return text[:i]
    return text


def status_line(s: dict[str, Any]) -> str:
    backoff = f", backoff {s['backoff']:.0f}s" if s["backoff"] else ""
    # Delivered: flops of the tiles computed over the time computing them; the benchmark
    # (measured at start, shown on the dashboard) is what the kernel does at best.
    return (
        f"{s['state']}: {s['tiles']} tiles, {s['gflops']:.1f} GFLOPS delivered "
        f"(benchmark {s.get('benchmark_gflops', 0):.1f}), "
        f"{s['mb_down']:.1f} MB down / {s['mb_up']:.1f} MB up, "
        f"cache hits {100 * s['cache_hit_rate']:.0f}%{backoff}"
        # The note may hold the coordinator's words: no control character reaches the
        # terminal (an escape sequence, a newline breaking the redrawn line).
        + (f" | {one_line(s['note'])}" if s.get("note") else "")
    )


@volunteer.command("install-service")
@click.argument("url", envvar="TILEHIVE_URL")
@threads_option
@max_memory_option
@name_option
@state_dir_option
@idle_only_option
@invite_option
@option(
    "--unit",
    "unit_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the unit here (default: ~/.config/systemd/user/tilehive-volunteer.service).",
)
@option("--print", "print_only", is_flag=True, help="Print the unit instead of writing it.")
def install_service(
    url: str,
    threads: int,
    max_memory: int,
    name: str | None,
    state_dir: Path,
    idle_only: bool,
    invite: str | None,
    unit_path: Path | None,
    print_only: bool,
) -> None:
    """Write a systemd user unit that runs this volunteer at idle priority: ExecStart points
    at this installation's tilehive; Nice=19, CPU and I/O scheduling idle, MemoryMax."""
    from volunteer.service import unit, user_unit_path

    options = [*(("--name", name) if name else ()), *(("--idle-only",) if idle_only else ())]
    try:
        # What `volunteer start` would refuse, the unit would restart every 30 s for ever.
        text = unit(check_url(url), state_dir, threads, max_memory, options, invite)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    if print_only:
        click.echo(text, nl=False)
        return
    target = unit_path or user_unit_path()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch(mode=0o600)  # its invite code, if any, for this user's eyes only
        target.chmod(0o600)
        target.write_text(text)
    except OSError as exc:
        raise click.ClickException(f"cannot write {target}: {exc.strerror}") from exc
    click.echo(f"wrote {target}")
    if unit_path is None:
        click.echo(
            "now: systemctl --user daemon-reload && "
            "systemctl --user enable --now tilehive-volunteer\n"
            "     loginctl enable-linger $USER   # keep it running when you are logged out"
        )


@volunteer.command()
@state_dir_option
@option(
    "--timeout",
    type=Number(min=0),
    default=30.0,
    show_default=True,
    help="Seconds to wait for a graceful stop before killing.",
)
def stop(state_dir: Path, timeout: float) -> None:
    """Stop the volunteer of this state directory: the current tile is finished or
    abandoned and reported."""
    state = _existing(state_dir)
    pid = state.running_pid() if state is not None else None
    if pid is None:
        click.echo(f"no volunteer is running with state directory {state_dir}")
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while (alive(pid) or state.running_pid() is not None) and time.monotonic() < deadline:
        time.sleep(0.05)
    if alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        while alive(pid):
            time.sleep(0.05)
        state.running_pid()  # removes the now stale pid file
        click.echo(f"volunteer (pid {pid}) did not stop in {timeout:.0f}s and was killed")
        return
    click.echo(f"volunteer stopped (pid {pid})")


def _existing(state_dir: Path) -> StateDir | None:
    """The state directory, if a volunteer ever ran with it: reading it creates nothing."""
    return StateDir(state_dir) if state_dir.is_dir() else None


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


@volunteer.command()
@state_dir_option
@option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status(state_dir: Path, as_json: bool) -> None:
    """Show whether the volunteer runs and what it has done. Exits 3 when it does not run."""
    state = _existing(state_dir)
    pid = state.running_pid() if state is not None else None
    saved = state.read_status() if state is not None else None
    try:
        _say_status(pid, saved, state_dir, as_json)
    except (KeyError, TypeError, ValueError) as exc:  # a field missing or of another type
        # Said as a status, not an error: whether it runs is known, and exit 3 keeps its meaning.
        # (Only a saved status can be damaged, so there is a state directory.)
        click.echo(
            f"{f'running (pid {pid})' if pid else 'not running'}; {state.status_file} is not "
            f"a status this volunteer wrote (damaged?): {type(exc).__name__} {exc}"
        )
    if pid is None:
        sys.exit(3)


def _say_status(pid: int | None, saved: dict | None, state_dir: Path, as_json: bool) -> None:
    import json

    # Not running, yet its file says it works: it ended without a word (kill -9, a crash,
    # its machine down), and what the file says is only what it last wrote.
    left = (*ENDED, "stopped")  # the states a daemon leaves its status file in
    vanished = pid is None and saved is not None and saved.get("state") not in left
    if as_json:
        said = {"running": pid is not None, **(saved or {})}
        if vanished:
            said |= {"state": "not_running", "last_state": saved.get("state")}
        click.echo(json.dumps(said))
    elif vanished:
        click.echo(
            f"not running: it ended without a word while {saved.get('state')} (killed, or its "
            f"machine went down); state directory {state_dir}"
        )
    elif pid is None and saved and saved.get("state") == "finished":
        click.echo(
            f"not running: the project at {saved['url']} is finished "
            f"({saved['tiles']} tiles computed; state directory {state_dir})"
        )
    elif pid is None and saved and saved.get("state") == "refused":
        # The note may be the coordinator's own words: on one line whatever they hold.
        click.echo(f"not running: {one_line(str(saved.get('note')))} (state directory {state_dir})")
    elif pid is None:
        click.echo(f"not running (state directory {state_dir})")
    else:
        click.echo(f"running (pid {pid}) against {saved['url'] if saved else '?'}")
        if saved:
            click.echo(status_line(saved))
            click.echo(
                f"peak memory {saved['peak_rss_mb']:.0f} of {saved['max_memory_mb']} MB, "
                f"{saved['threads']} threads, {saved['errors']} errors, "
                f"{saved['refused']} refused, {saved['aborted']} aborted"
            )


@click.command()
@click.argument("url", envvar="TILEHIVE_URL")
@option(
    "--hosts",
    type=click.IntRange(min=1, max=100_000),
    default=100,
    show_default=True,
    help="Emulated volunteers to run in this process.",
)
@option(
    "--profile",
    default="mixed",
    show_default=True,
    help="phones, laptops, mixed, or a profile file (docs/emulator.md).",
)
@option("--duration", type=Number(min=0.1), default=None, help="Seconds to run.")
@option("--until-done", is_flag=True, help="Stop when the coordinator's training is done.")
@option(
    "--ramp",
    type=Number(min=0),
    default=None,
    show_default="1 s per 500 hosts",
    help="Seconds over which hosts start.",
)
@option(
    "--connections",
    type=click.IntRange(min=1),
    default=None,
    show_default="two per host, within the open-file limit",
    help="Connections the shared pool may open to the coordinator.",
)
@option(
    "--real-mflops",
    type=Number(min=0),
    default=DEFAULT_REAL_FLOPS / 1e6,
    show_default=True,
    help="Tiles up to this size are computed by each host; larger ones once per work unit.",
)
@option("--compute-threads", type=click.IntRange(min=1), default=1, show_default=True)
@option("--no-long-poll", is_flag=True, help="Never wait for work: latencies are service times.")
@option("--seed", type=click.IntRange(min=0), default=None, help="Draw the same hosts again.")
@invite_option
@option(
    "--interval",
    type=Number(min=0),
    default=10.0,
    show_default=True,
    help="Seconds between progress lines (0: none).",
)
@option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def emulate(
    url: str,
    hosts: int,
    profile: str,
    duration: float | None,
    until_done: bool,
    ramp: float | None,
    connections: int | None,
    real_mflops: float,
    compute_threads: int,
    no_long_poll: bool,
    seed: int | None,
    invite: str | None,
    interval: float,
    as_json: bool,
) -> None:
    """Run many emulated volunteers against the coordinator at URL, then summarize.

    Each host speaks the real protocol; its speed, bandwidth, latency, sessions, errors and
    lies are drawn from the profile. Runs for --duration, until --until-done, or Ctrl-C.
    The project must allow the registrations: see docs/emulator.md."""
    try:
        check_url(url)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="URL") from None
    try:
        chosen = load_profile(profile)
    except ProfileError as exc:
        raise click.BadParameter(str(exc), param_hint="--profile") from None
    try:
        raise_file_limit((connections or default_connections(hosts)) + 256)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--connections") from None
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    def show(report: EmulationReport) -> None:
        click.echo(
            f"[{report.seconds:6.0f}s] {report.online} online, {report.assigned} received, "
            f"{report.reported} reported, {report.lies} lies, {report.error_count} errors",
            err=True,
        )

    async def run() -> EmulationReport:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await run_emulation(
            url,
            hosts,
            chosen,
            duration=duration,
            stop=stop,
            until_done=until_done,
            ramp=ramp,
            connections=connections,
            real_flops=real_mflops * 1e6,
            compute_threads=compute_threads,
            seed=seed,
            invite=invite,
            progress=show if interval > 0 else None,
            interval=interval or 10.0,
            long_poll=not no_long_poll,
        )

    try:
        report = asyncio.run(run())
    except CoordinatorUnreachable as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        for line in report.lines():
            click.echo(line)
    for hint in hints(report):
        click.echo(f"hint: {hint}", err=True)
