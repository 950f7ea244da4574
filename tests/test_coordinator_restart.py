"""Crash safety: a coordinator process killed with SIGKILL mid-GEMM resumes and finishes it."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import kernels
from tests.conftest import bits, operands
from tests.test_coordinator_e2e import volunteers
from tests.volunteers import Behaviour, wait_until

JOB = Path(__file__).parent / "processes" / "gemm_job.py"
ROOT = Path(__file__).parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_job(directory: Path, npz: Path, output: Path, port: int, policy: str, log: Path):
    """Start the job; its stderr goes to `log`, its first stdout line is the URL."""
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
                "--policy",
                policy,
            ],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )


async def url_of(process: subprocess.Popen) -> str:
    line = await asyncio.to_thread(process.stdout.readline)
    process.stdout.close()
    return line.strip()


def committed(directory: Path, query: str) -> list[tuple]:
    with sqlite3.connect(directory / "state.db") as db:
        return db.execute(query).fetchall()


@pytest.mark.parametrize("policy", ["quorum", "freivalds"])
async def test_a_coordinator_killed_mid_gemm_resumes_and_finishes_it_exactly(tmp_path, rng, policy):
    flags = [(False, False), (True, False)]
    products = [operands(rng, 80, 64, 40, ta, tb) for ta, tb in flags]
    npz = tmp_path / "operands.npz"
    np.savez(
        npz,
        **{f"a{i}": a for i, (a, _) in enumerate(products)},
        **{f"b{i}": b for i, (_, b) in enumerate(products)},
        **{f"flags{i}": np.array(f) for i, f in enumerate(flags)},
    )
    directory, output, port = tmp_path / "project", tmp_path / "out.npz", free_port()
    log = tmp_path / "coordinator.log"
    first = start_job(directory, npz, output, port, policy, log)
    url = await url_of(first)
    assert url.startswith("http://"), log.read_text()
    slow = Behaviour(capacity=1, seconds_per_tile=0.02)
    async with volunteers(url, [slow, slow]) as crew:
        query = "SELECT id FROM workunits WHERE state IN ('validated', 'assimilated')"
        await wait_until(lambda: len(committed(directory, query)) >= 8, timeout=60)
        first.send_signal(signal.SIGKILL)
        await asyncio.to_thread(first.wait)
        killed_at = time.time()
        validated_before = {row[0] for row in committed(directory, query)}
        total = committed(directory, "SELECT COUNT(*) FROM workunits")[0][0]
        assert 8 <= len(validated_before) < total, "kill landed after the end"
        second = start_job(directory, npz, output, port, policy, log)
        assert await url_of(second) == url, log.read_text()
        code = await crew.finish(asyncio.to_thread(second.wait, 120), timeout=120)
    assert code == 0, log.read_text()
    results = np.load(output)
    for i, ((a, b), (ta, tb)) in enumerate(zip(products, flags, strict=True)):
        assert np.array_equal(
            bits(results[f"c{i}"]), bits(kernels.gemm(a, b, trans_a=ta, trans_b=tb))
        )
    reissued = committed(
        directory,
        f"SELECT wu_id FROM results WHERE sent_time > {killed_at}",
    )
    assert not validated_before & {row[0] for row in reissued}, "validated tiles were re-issued"
