"""Shared fixtures and the --runslow switch for long variants."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.factories import metric_values, operands, running, volunteers
from tests.volunteers import Behaviour, wait_until


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", help="also run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="long variant: pass --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261122)


@pytest.fixture
def reaper():
    """Register real processes with `reaper(popen)`; they are killed at the end of the test."""
    from tests.procs import Reaper

    keeper = Reaper()
    yield keeper
    keeper.reap()


@pytest.fixture
async def worked(tmp_path, rng):
    """A coordinator that computed two products with one liar among three volunteers."""
    async with running(tmp_path, tile=16) as (co, queue, url):
        before = await metric_values(url)
        a, b = operands(rng, 48, 32, 16, False, False)
        async with volunteers(url, [Behaviour(lie=True, capacity=3)]) as liar:
            product = asyncio.ensure_future(queue.matmul(a, b, step=1, label="l0.fwd"))
            await wait_until(lambda: liar[0].done >= 1)
            async with volunteers(url, [Behaviour()] * 2) as crew:
                await crew.finish(product)
                c, d = operands(rng, 16, 16, 8, False, True)
                await crew.finish(queue.matmul(c, d, trans_b=True, step=2, label="l0.dx"))
        yield co, url, before, tmp_path / "project", liar[0]
