"""The coordinator end to end: the real aiohttp server, a real SQLite file, protocol clients."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

import kernels
from coordinator.api import serve
from coordinator.engine import Coordinator, CoordinatorConfig
from coordinator.queue import WorkQueue
from coordinator.workunits import Policy
from tests.conftest import bits, operands
from tests.volunteers import Behaviour, ScriptedVolunteer

TIMEOUT = 60


@contextlib.asynccontextmanager
async def running(tmp_path, **settings):
    config = CoordinatorConfig(directory=tmp_path / "project", **settings)
    coordinator = Coordinator(config)
    runner, url = await serve(coordinator, "127.0.0.1", 0)
    try:
        yield coordinator, WorkQueue(coordinator), url
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
async def volunteers(url, behaviours):
    stop = asyncio.Event()
    crew = Crew(ScriptedVolunteer(url, f"v{i}", b) for i, b in enumerate(behaviours))
    crew.tasks = [asyncio.create_task(v.run(stop)) for v in crew]
    try:
        yield crew
    finally:
        stop.set()
        await asyncio.gather(*crew.tasks)


@pytest.mark.parametrize("policy", list(Policy))
async def test_odd_shaped_products_through_several_clients_equal_the_kernel(tmp_path, rng, policy):
    async with (
        running(tmp_path, policy=policy, tile=16) as (_co, queue, url),
        volunteers(url, [Behaviour()] * 3) as crew,
    ):
        jobs = []
        for m, n, k, ta, tb in [
            (37, 29, 23, False, False),
            (17, 45, 33, False, True),
            (40, 9, 19, True, False),
        ]:
            a, b = operands(rng, m, n, k, ta, tb)
            jobs.append((a, b, ta, tb, queue.matmul(a, b, trans_a=ta, trans_b=tb, label=f"{m}")))
        results = await crew.finish(asyncio.gather(*(j[4] for j in jobs)))
        for (a, b, ta, tb, _), got in zip(jobs, results, strict=True):
            assert np.array_equal(bits(got), bits(kernels.gemm(a, b, trans_a=ta, trans_b=tb)))
