"""After a kill, the tiles made again are said a step at a time, the last step included."""

from __future__ import annotations

import logging

import pytest

from coordinator.engine.recovery import Recomputed
from coordinator.work.records import Gemm, Policy


def gemm_record(step: int, gid: str) -> Gemm:
    return Gemm(gid * 64, step, "l0", 16, 16, 4, False, False, 4, "a" * 64, "b" * 64, Policy.QUORUM)


def gemms(*steps: int) -> list[Gemm]:
    """A product record of each step, with ids a, b, c..."""
    return [gemm_record(step, "abcdefgh"[i]) for i, step in enumerate(steps)]


@pytest.fixture
def recomputed(caplog) -> Recomputed:
    caplog.set_level(logging.INFO, logger="coordinator.engine.recovery")
    return Recomputed()


def said(caplog) -> list[str]:
    return [r.getMessage().split(" (blobs")[0] for r in caplog.records]


def test_each_step_is_said_once_when_the_next_begins_and_the_last_at_the_end(recomputed, caplog):
    first, second, later, dropped = gemms(3, 3, 4, 4)
    for gemm, tiles in ((first, 2), (second, 3), (later, 1), (dropped, 5)):
        for _ in range(tiles):
            recomputed.tile(gemm.id)
    recomputed.product_done(first)
    recomputed.product_done(second)
    assert said(caplog) == []  # step 3 may have more products yet
    recomputed.product_done(later)
    assert said(caplog) == ["step 3: 5 tile(s) of 2 product(s) were gone; recomputed"]
    recomputed.forget(dropped.id)
    recomputed.product_done(dropped)  # dropped: nothing of it counts
    recomputed.flush()
    assert said(caplog)[1:] == ["step 4: 1 tile(s) of 1 product(s) were gone; recomputed"]
    recomputed.flush()
    assert len(said(caplog)) == 2


def test_products_whose_panels_were_stored_again_are_counted_in_their_steps_line(
    recomputed, caplog
):
    """A restart logged a line per product and micro-batch (310 after one kill)."""
    both, panels_only, dropped, later = gemms(7, 7, 7, 8)
    recomputed.tile(both.id)
    for gemm in (both, panels_only, dropped, later):
        recomputed.panels(gemm.id)
    recomputed.forget(dropped.id)
    for gemm in (both, panels_only, dropped, later):
        recomputed.product_done(gemm)
    recomputed.flush()
    assert said(caplog) == [
        "step 7: 1 tile(s) of 1 product(s) were gone; recomputed; "
        "the operand panels of 2 product(s) were gone; stored again",
        "step 8: the operand panels of 1 product(s) were gone; stored again",
    ]
