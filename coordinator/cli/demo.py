"""`tilehive demo`: a project, its coordinator and N volunteers on this machine, watched."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import click
from tqdm import tqdm

from coordinator.state.reader import ProjectReader
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
    lines = [
        f"validation: {wus} work units in {gemms} products; results "
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
            status = json.loads((directory / f"volunteer-{i}" / "status.json").read_text())
        except (OSError, ValueError):
            continue
        compute += status.get("compute_seconds", 0.0)
        uptime += status.get("uptime", 0.0)
    return compute / uptime if uptime else None


def run_demo(volunteers: int, steps: int, directory: Path | None, keep: bool) -> None:
    temporary = directory is None
    directory = Path(tempfile.mkdtemp(prefix="tilehive-demo-")) if temporary else directory
    if not (directory / projects.PROJECT_FILE).exists():
        projects.create(directory, **{"training.steps": steps, "training.checkpoint_every": steps})
    project = projects.load(directory)
    logs = directory / "logs"
    logs.mkdir(exist_ok=True)
    children: list[subprocess.Popen] = []
    click.echo(
        f"project: {directory} ({project.training.steps} steps, "
        f"{project.work.policy} validation, {volunteers} volunteers)"
    )
    try:
        coordinator = _spawn(
            ["coordinator", str(directory), "--bind", "127.0.0.1:0"], logs / "coordinator.log"
        )
        children.append(coordinator)
        first = coordinator.stdout.readline()
        coordinator.stdout.close()
        if "http://" not in first:
            raise click.ClickException(
                f"the coordinator did not start; see {logs / 'coordinator.log'}"
            )
        url = first[first.index("http://") :].split()[0]
        for i in range(volunteers):
            children.append(
                _spawn(
                    [
                        "volunteer",
                        "start",
                        url,
                        "--state-dir",
                        str(directory / f"volunteer-{i}"),
                        "--threads",
                        "1",
                        "--name",
                        f"demo-{i}",
                        "--max-backoff",
                        "2",
                    ],
                    logs / f"volunteer-{i}.log",
                )
            )
        _watch(coordinator, url, project.training.steps)
        if coordinator.wait() != 0:
            raise click.ClickException(f"the coordinator failed; see {logs / 'coordinator.log'}")
    except KeyboardInterrupt:
        click.echo("\ninterrupted; stopping the coordinator and volunteers")
        raise SystemExit(130) from None
    finally:
        for child in reversed(children):
            _stop(child)
    for line in _summary(directory):
        click.echo(line)
    busy = _busy_share(directory, volunteers)
    if busy is not None:
        click.echo(f"volunteers were computing {100 * busy:.0f}% of the time they ran")
    metrics = [json.loads(x) for x in (directory / "train.jsonl").read_text().splitlines()]
    click.echo(
        f"loss: {metrics[0]['loss']:.3f} at step 1 -> {metrics[-1]['loss']:.3f} at step "
        f"{metrics[-1]['step']}"
    )
    click.echo(f"checkpoints: {project.checkpoints}")
    click.echo(f"logs: {logs} (coordinator.log, volunteer-N.log), {directory / 'train.jsonl'}")
    if temporary and not keep:
        shutil.rmtree(directory, ignore_errors=True)
        click.echo("(temporary project removed; pass --dir DIR or --keep to keep it)")


def _watch(coordinator: subprocess.Popen, url: str, steps: int) -> None:
    """A progress bar over training steps, with loss, tiles/s and rejected tiles."""
    bar = tqdm(total=steps, unit="step", dynamic_ncols=True, file=sys.stdout)
    last_tiles, last_time, step = 0, time.monotonic(), 0
    try:
        while coordinator.poll() is None:
            status = _status(url)
            training = status.get("training") or {}
            now = time.monotonic()
            tiles = status.get("tiles_in", last_tiles)
            rate = (tiles - last_tiles) / max(now - last_time, 1e-6)
            last_tiles, last_time = tiles, now
            if training.get("step", 0) > step:
                bar.update(training["step"] - step)
                step = training["step"]
            if training:
                bar.set_postfix(
                    loss=f"{training['loss']:.3f}",
                    tiles_s=f"{rate:.0f}",
                    rejected=status.get("invalid", 0),
                    refresh=False,
                )
            bar.refresh()
            time.sleep(POLL)
        if coordinator.returncode == 0:
            bar.update(steps - step)
    finally:
        bar.close()
