"""Real processes for end-to-end tests: a coordinator job and `tilehive volunteer` daemons."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

ROOT = Path(__file__).parent.parent
JOB = Path(__file__).parent / "processes" / "gemm_job.py"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "TILEHIVE_MAX_BACKOFF": "0.5"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_operands(path: Path, products: list[tuple[np.ndarray, np.ndarray, bool, bool]]) -> None:
    arrays = {}
    for i, (a, b, trans_a, trans_b) in enumerate(products):
        arrays[f"a{i}"], arrays[f"b{i}"] = a, b
        arrays[f"flags{i}"] = np.array([trans_a, trans_b])
    np.savez(path, **arrays)


def start_job(
    directory: Path, npz: Path, output: Path, port: int, log: Path, *options: str
) -> subprocess.Popen:
    """A coordinator process computing the products in npz; stderr goes to `log`, its first
    stdout line is the URL (read it with `url_of`)."""
    with log.open("a") as stderr:
        return subprocess.Popen(
            [
                sys.executable,
                str(JOB),
                str(directory),
                str(npz),
                str(output),
                "--port",
                str(port),
                *options,
            ],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            cwd=ROOT,
            env=ENV,
        )


async def url_of(process: subprocess.Popen) -> str:
    line = await asyncio.to_thread(process.stdout.readline)
    process.stdout.close()
    return line.strip()


def committed(directory: Path, query: str) -> list[tuple]:
    """Rows from a coordinator's committed state (read-only, any time)."""
    with sqlite3.connect(f"file:{directory / 'state.db'}?mode=ro", uri=True) as db:
        return db.execute(query).fetchall()


def tilehive(
    *args: str, timeout: float = 60, env: dict[str, str] | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "coordinator.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**ENV, **(env or {})},
        timeout=timeout,
    )


@contextlib.contextmanager
def following(*args: str, ignore_sigint: bool = False) -> Iterator[subprocess.Popen]:
    """`tilehive ARGS` that runs until stopped (`logs ... --follow`), its stdout and stderr
    piped for the test to read; killed at the end. `ignore_sigint`: started as a
    background job of a script is, with SIGINT ignored."""

    def ignoring() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    process = subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=ENV,
        preexec_fn=ignoring if ignore_sigint else None,
    )
    try:
        yield process
    finally:
        process.kill()
        process.wait()
        process.stdout.close()
        process.stderr.close()


def start_volunteer(url: str, state_dir: Path, *options: str) -> subprocess.Popen:
    """A foreground `tilehive volunteer start` process; its output goes to state_dir/out."""
    state_dir.mkdir(parents=True, exist_ok=True)
    with (state_dir / "out").open("a") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "coordinator.cli",
                "volunteer",
                "start",
                url,
                "--state-dir",
                str(state_dir),
                "--threads",
                "1",
                *options,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=ENV,
        )


def volunteer_status(state_dir: Path) -> dict:
    try:
        return json.loads((state_dir / "status.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def stop(process: subprocess.Popen, timeout: float = 30) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    return process.wait(timeout)


class Reaper:
    """Kills every process it was given when the test ends, passed or failed."""

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen] = []

    def __call__(self, process: subprocess.Popen) -> subprocess.Popen:
        self.processes.append(process)
        return process

    def reap(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()


def poll(predicate, timeout: float = 60, what: str = "the condition") -> None:
    """Wait for `predicate()` with a deadline (never a bare sleep as synchronisation)."""
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached in {timeout:g}s")
        time.sleep(0.02)


COORDINATOR = [sys.executable, "-m", "coordinator.cli", "coordinator"]


def start_coordinator(directory: Path, bind: str, log: Path, *options: str) -> subprocess.Popen:
    """`tilehive coordinator DIR --bind BIND` as a user starts it; stdout is a pipe (its first
    line names the URL), stderr goes to `log`."""
    with log.open("ab") as stderr:
        return subprocess.Popen(
            [*COORDINATOR, str(directory), "--bind", bind, *options],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            cwd=ROOT,
            env=ENV,
        )


def first_url(process: subprocess.Popen, timeout: float = 60) -> str:
    """The URL a coordinator announces on its first stdout line (it started serving); closes
    the pipe after it."""
    import select

    ready, _, _ = select.select([process.stdout], [], [], timeout)
    if not ready:
        raise TimeoutError(f"no URL from the coordinator in {timeout:g}s")
    line = process.stdout.readline()
    process.stdout.close()  # the coordinator copes with a reader that stopped listening
    if "http://" not in line:
        raise AssertionError(f"the coordinator did not start: {line!r}")
    return line[line.index("http://") :].split()[0]
