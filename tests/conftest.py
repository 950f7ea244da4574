"""Shared fixtures and the --runslow switch for long variants."""

from __future__ import annotations

import numpy as np
import pytest


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


@pytest.fixture
def reaper():
    """Register real processes with `reaper(popen)`; they are killed at the end of the test."""
    from tests.procs import Reaper

    keeper = Reaper()
    yield keeper
    keeper.reap()
