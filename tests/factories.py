"""Shared factories of the tests: operands, running coordinators, crews of test volunteers,
project pairs. Test files import from here (and from procs, volunteers, liar), never from
each other."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from pathlib import Path

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from coordinator.engine.config import CoordinatorConfig
from coordinator.engine.coordinator import Coordinator
from coordinator.server.api import serve
from coordinator.state.sqlite import SqliteStore
from coordinator.training import project as projects
from tests.procs import ENV, ROOT, tilehive
from tests.volunteers import ScriptedVolunteer


def operands(
    rng: np.random.Generator, m: int, n: int, k: int, trans_a: bool, trans_b: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Random float32 operands stored so that op(a) is m x k and op(b) is k x n."""
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
    return a, b


def bits(x: np.ndarray) -> np.ndarray:
    """The raw bit patterns of a float32 array, for bitwise comparisons."""
    return np.ascontiguousarray(x).view(np.uint32)


TIMEOUT = 60


@contextlib.asynccontextmanager
async def running(tmp_path, **settings):
    settings.setdefault("no_work_delay", 0.05)
    settings.setdefault("long_poll", 0.2)
    config = CoordinatorConfig(directory=tmp_path / "project", **settings)
    coordinator = Coordinator(config, SqliteStore(config.directory / "state.db"))
    runner, url = await serve(coordinator, "127.0.0.1", 0)
    try:
        yield coordinator, coordinator.products, url
    finally:
        await runner.cleanup()


class Crew(list):
    """Running volunteers; `finish` awaits work but fails at once if a volunteer crashes."""

    tasks: list[asyncio.Task]

    async def finish(self, work, timeout: float = TIMEOUT):
        job = asyncio.ensure_future(work)
        done, _ = await asyncio.wait(
            [job, *self.tasks], timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if job not in done:
            for task in done:
                task.result()  # a crashed volunteer raises its error here
            job.cancel()
            raise TimeoutError(f"work not finished in {timeout}s")
        return job.result()


@contextlib.asynccontextmanager
async def volunteers(url, behaviours, prefix: str = "v"):
    stop = asyncio.Event()
    crew = Crew(ScriptedVolunteer(url, f"{prefix}{i}", b) for i, b in enumerate(behaviours))
    crew.tasks = [asyncio.create_task(v.run(stop)) for v in crew]
    try:
        yield crew
    finally:
        stop.set()
        await asyncio.gather(*crew.tasks)


SMALL = {
    "model.layers": 1,
    "model.width": 32,
    "model.heads": 2,
    "model.context": 16,
    "training.batch_size": 4,
    "corpus.max_mb": 1,
}


class Float64Backend:
    """Exact-enough products for finite differences."""

    async def matmul(self, a, b, *, trans_a, trans_b, label):
        return (a.T if trans_a else a) @ (b.T if trans_b else b)

    @staticmethod
    def batched(a, b, *, trans_a=False, trans_b=False):
        return np.matmul(a.swapaxes(1, 2) if trans_a else a, b.swapaxes(1, 2) if trans_b else b)


def checkpoint_bits(path: Path) -> dict[str, bytes]:
    with np.load(path) as data:
        return {name: data[name].tobytes() for name in data.files}


def start_coordinator(directory: Path, port: int, log: Path, *options: str) -> subprocess.Popen:
    with log.open("a") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "coordinator.cli",
                "coordinator",
                str(directory),
                "--bind",
                f"127.0.0.1:{port}",
                *options,
            ],
            stdout=out,
            stderr=out,
            cwd=ROOT,
            env=ENV,
        )


def make_pair(tmp_path: Path, steps: int, **extra) -> tuple[Path, Path]:
    """Two project directories with the same settings: one local, one distributed."""
    local = tmp_path / "local"
    projects.create(local, **{**SMALL, "training.steps": steps, **extra})
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "project.toml").write_text((local / "project.toml").read_text())
    result = tilehive("train", str(local), "--local", timeout=300)
    assert result.returncode == 0, result.stderr
    return local, remote


async def metric_values(url: str) -> dict[tuple, float]:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as reply:
        assert reply.status == 200
        text = await reply.text()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values
