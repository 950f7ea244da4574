"""`tilehive demo`: a project, its coordinator and N volunteers on this machine, watched."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import click
from tqdm import tqdm

from coordinator.cli.serve import finished, more_steps
from coordinator.state.lock import in_use
from coordinator.state.reader import ProjectReader
from coordinator.training import checkpoints, history
from coordinator.training import project as projects

POLL = 0.5


def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    with log.open("a") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli", *args],
            stdout=subprocess.PIPE if args[0] == "coordinator" else out,
            stderr=out,
            text=True,
            start_new_session=True,  # Ctrl-C reaches us only; we stop the children in order
        )


def last_port(directory: Path) -> int:
    """The port this project's demo served on last time, if it is free now; else 0 (any).
    Its volunteers keep their identities by the coordinator's URL: on the same port they
    are the same hosts again, where on a new one each registered anew, and every name
    then belonged to several hosts (`logs --host demo-1` had to ask which)."""
    try:
        # Read, not through volunteer.state.StateDir, which makes the folder it names.
        saved = json.loads((volunteer_dir(directory, 0) / "identity.json").read_text())
        port = urllib.parse.urlsplit(saved["url"]).port or 0
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    with socket.socket() as probe:
        # As the coordinator binds: the last run's connections, closing, do not hold it.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return 0
    return port


def volunteer_dir(directory: Path, i: int) -> Path:
    """The state directory of the demo's i-th volunteer."""
    return directory / f"volunteer-{i}"


def _status(url: str) -> dict:
    try:
        with urllib.request.urlopen(url + "/v1/status", timeout=2) as resp:
            return json.load(resp)
    except OSError:
        return {}


def _stop(process: subprocess.Popen, timeout: float = 15.0) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _summary(directory: Path) -> list[str]:
    with ProjectReader(directory / "state.db") as reader:
        states = reader.result_verdicts()
        hosts = reader.host_totals()
        gemms, wus = reader.product_counts()
        oldest = reader.oldest_step()
    # A project checkpointed before its last step (one made with `init`) keeps no rows of
    # the steps before that checkpoint; the hosts' own totals count every step.
    purged = (
        f" of steps {oldest} on (those before were purged at a checkpoint)"
        if (oldest or 1) > 1
        else ""
    )
    lines = [
        f"validation: {wus} work units in {gemms} products{purged}; results "
        + ", ".join(f"{n} {state}" for state, n in sorted(states.items())),
    ]
    for name, valid, invalid, errors in hosts:
        lines.append(f"  host {name}: {valid} valid, {invalid} invalid, {errors} errors")
    return lines


def _busy_share(directory: Path, volunteers: int) -> float | None:
    """Compute time over run time, summed over the volunteers (from their final status)."""
    compute = uptime = 0.0
    for i in range(volunteers):
        try:
            status = json.loads((volunteer_dir(directory, i) / "status.json").read_text())
        except (OSError, ValueError):
            continue
        compute += status.get("compute_seconds", 0.0)
        uptime += status.get("uptime", 0.0)
    return compute / uptime if uptime else None


def coordinator_share(records: list[dict]) -> float | None:
    """The coordinator's CPU over a step's time, the median over the steps after the first
    (which waits for the volunteers to start); None without the figures."""
    shares = [
        r["cpu_seconds"] / r["seconds"]
        for r in records[1:] or records
        if r.get("seconds") and isinstance(r.get("cpu_seconds"), int | float)
    ]
    return statistics.median(shares) if shares else None


def pace_line(coordinator: float, volunteers: float | None) -> str:
    """What the coordinator's share of each step says about who set the pace."""
    line = f"the coordinator's own CPU came to {100 * coordinator:.0f}% of each step's time"
    if volunteers is not None and coordinator > volunteers:
        line += ": its work between products, more than the volunteers', set the pace"
    return line


BUSY_MEANING = (
    "the rest of the time they waited: for the next product of a step (each needs the one "
    "before), for the coordinator's own arithmetic between products, and for the network"
)


class Stopped(KeyboardInterrupt):
    """The demo was told to stop by a signal (Ctrl-C, `kill`, its terminal closed)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum: int, frame: object) -> None:
    raise Stopped(signum)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def volunteers_needed(project: projects.Project) -> int:
    """The volunteers a tile of this project needs: one under Freivalds alone, the quorum's
    number of different ones otherwise."""
    return project.redundancy.for_policy(project.policy).min_quorum


DEFAULT_STEPS = 20


def _said(log: Path, start: int) -> str:
    """The last `Error:` line a process wrote to its log from byte `start` on (the log is
    appended to, run after run), as ": ..." (or "")."""
    with contextlib.suppress(OSError), log.open("rb") as lines:
        lines.seek(start)
        for line in reversed(lines.read().decode(errors="replace").splitlines()):
            if line.startswith("Error: "):
                return ": " + line.removeprefix("Error: ")
    return ""


def run_demo(
    volunteers: int, steps: int | None, directory: Path | None, keep: bool, wait: bool = True
) -> None:
    # Ctrl-C, `kill` and a closed terminal each stop the demo and everything it started.
    # Its children run in sessions of their own (_spawn), so nothing else stops them, and
    # SIGINT needs a handler even when a shell started the demo ignoring it (a background
    # job): Python then installs none, and the demo would train on, deaf to Ctrl-C.
    for signum in STOP_SIGNALS:
        signal.signal(signum, _raise_stopped)
    temporary = directory is None
    if not temporary and (directory / projects.PROJECT_FILE).exists():
        busy = in_use(directory)
        if busy:
            raise click.ClickException(busy)
        settings = projects.load(directory)
        if finished(settings):
            click.echo(
                f"nothing to do: all {settings.training.steps} steps of {directory} are done "
                f"({more_steps(settings)})"
            )
            return
    else:  # the defaults a new project gets, checked before anything is written
        settings = projects.Project(directory=Path())
    needed = volunteers_needed(settings)
    if volunteers < needed:
        raise click.ClickException(
            f"--volunteers {volunteers}: the project's {settings.work.policy} policy has each "
            f"tile computed by {needed} different volunteers, so its work would wait for "
            f"ever; use --volunteers {needed} or more"
        )
    directory = Path(tempfile.mkdtemp(prefix="tilehive-demo-")) if temporary else directory
    logs = directory / "logs"
    children: list[subprocess.Popen] = []
    stopped: Stopped | None = None
    project: projects.Project | None = None
    try:
        if not (directory / projects.PROJECT_FILE).exists():
            # One checkpoint, at the last step: an earlier one would purge the steps before it
            # from the database, and the summary counts every step's work.
            new = steps or DEFAULT_STEPS
            projects.create(directory, **{"training.steps": new, "training.checkpoint_every": new})
        elif steps is not None and steps != settings.training.steps:
            click.echo(
                f"--steps {steps} is for a new project: {directory} keeps its own "
                f"{settings.training.steps} (training.steps in its project.toml)"
            )
        project = projects.load(directory)
        logs.mkdir(exist_ok=True)
        click.echo(
            f"project: {directory} ({project.training.steps} steps, "
            f"{project.work.policy} validation, {volunteers} volunteers)"
        )
        log = logs / "coordinator.log"
        for port in dict.fromkeys((last_port(directory), 0)):  # the same port, else any
            earlier = log.stat().st_size if log.exists() else 0  # an earlier run's lines
            coordinator = _spawn(
                ["coordinator", str(directory), "--bind", f"127.0.0.1:{port}", "--keep-serving"],
                log,
            )
            children.append(coordinator)
            first = coordinator.stdout.readline()
            coordinator.stdout.close()
            if "http://" in first:
                break
            _stop(coordinator)  # the port taken meanwhile, or failed: said in its log
        if "http://" not in first:
            raise click.ClickException(
                f"the coordinator did not start{_said(log, earlier)}; see {log}"
            )
        url = first[first.index("http://") :].split()[0]
        click.echo(f"dashboard: {url}/  (open it in a browser to watch the volunteers work)")
        crew = [
            _spawn(
                [
                    "volunteer",
                    "start",
                    url,
                    "--state-dir",
                    str(volunteer_dir(directory, i)),
                    "--threads",
                    "1",
                    "--name",
                    f"demo-{i}",
                    "--max-backoff",
                    "2",
                ],
                logs / f"volunteer-{i}.log",
            )
            for i in range(volunteers)
        ]
        children += crew
        if not _watch(coordinator, url, project.training.steps):
            raise click.ClickException(f"the coordinator failed; see {logs / 'coordinator.log'}")
        for volunteer in crew:  # told the project is finished, each writes its status, exits
            with contextlib.suppress(subprocess.TimeoutExpired):
                volunteer.wait(30)
        for line in _summary(directory):
            click.echo(line)
        busy = _busy_share(directory, volunteers)
        if busy is not None:
            click.echo(f"volunteers were computing {100 * busy:.0f}% of the time they ran;")
            click.echo(f"  {BUSY_MEANING}")
        metrics = history.read(directory / "train.jsonl")
        share = coordinator_share(metrics)
        if share is not None:
            click.echo(pace_line(share, busy))
        click.echo(
            f"loss: {metrics[0]['loss']:.3f} at step {metrics[0]['step']} -> "
            f"{metrics[-1]['loss']:.3f} at step {metrics[-1]['step']}"
        )
        if wait and sys.stdin.isatty():
            click.echo(f"training done; the dashboard stays at {url}/ : press Enter to stop")
            with contextlib.suppress(EOFError):
                input()
    except Stopped as stop:
        stopped = stop
        click.echo(f"\n{stop} received; stopping the coordinator and volunteers")
    except BaseException:
        keep = True  # a failure's logs, named in its message, stay to be read
        raise
    finally:
        for signum in STOP_SIGNALS:  # a second Ctrl-C must not leave a child running
            signal.signal(signum, signal.SIG_IGN)
        for child in reversed(children):
            _stop(child)
        if temporary and not keep:
            shutil.rmtree(directory, ignore_errors=True)
    if temporary and not keep:
        click.echo(
            "(the project was temporary and is removed; pass --keep or --dir DIR to keep its "
            "checkpoints and logs)"
        )
    else:
        folder = projects.Project(directory=directory).checkpoints
        latest = checkpoints.latest(folder)
        if latest:
            click.echo(f"checkpoints: {folder} (the last of step {latest})")
        elif project is not None:  # stopped before the first
            first = min(project.training.checkpoint_every, project.training.steps)
            click.echo(f"checkpoints: none yet (the first is written at step {first})")
        click.echo(f"logs: {logs} (coordinator.log, volunteer-N.log), {directory / 'train.jsonl'}")
    if stopped is not None:
        raise SystemExit(128 + stopped.signum)


def _watch(coordinator: subprocess.Popen, url: str, steps: int) -> bool:
    """A progress bar over training steps, with loss, tiles/s and rejected tiles, until the
    coordinator says training is done (True) or exits first (False). Why work waits, when
    it does, is said above the bar once, as the coordinator says it."""
    bar = tqdm(total=steps, unit="step", dynamic_ncols=True, file=sys.stdout)
    last_tiles, last_time, step = 0, time.monotonic(), 0
    said = None  # the wait last said
    try:
        while coordinator.poll() is None:
            status = _status(url)
            if status:
                wait = (status.get("waiting") or {}).get("message")
                if wait != said:
                    bar.write(wait or "work flows again")
                    said = wait
            training = status.get("training") or {}
            now = time.monotonic()
            tiles = status.get("tiles_in", last_tiles)
            rate = (tiles - last_tiles) / max(now - last_time, 1e-6)
            last_tiles, last_time = tiles, now
            if training.get("step", 0) > step:
                bar.update(training["step"] - step)
                step = training["step"]
            if "loss" in training:
                bar.set_postfix(
                    loss=f"{training['loss']:.3f}",
                    tiles_s=f"{rate:.0f}",
                    rejected=status.get("invalid", 0),
                    refresh=False,
                )
            bar.refresh()
            if training.get("done"):
                return True
            time.sleep(POLL)
        return False
    finally:
        bar.close()
