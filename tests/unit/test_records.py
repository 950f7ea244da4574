"""Work unit ids: content names that keep a step's work units together in the store."""

from __future__ import annotations

import re

from coordinator.work.records import (
    Gemm,
    Policy,
    Redundancy,
    short_workunit_id,
    tile_bounds,
    tile_workunit,
)


def workunits(step: int, gemm_digit: str) -> list:
    gemm = Gemm(
        gemm_digit * 64, step, "l0", 16, 16, 4, False, False, 4, "a" * 64, "b" * 64, Policy.QUORUM
    )
    return [
        tile_workunit(gemm, bounds, "a" * 64, "b" * 64, Redundancy(), 1)
        for bounds in tile_bounds(gemm.m, gemm.n, gemm.tile)
    ]


def test_work_unit_ids_name_their_content_and_sort_by_step():
    earlier = workunits(7, "e") + workunits(7, "1")
    later = workunits(8, "0")
    ids = [wu.id for wu in earlier + later]
    assert all(re.fullmatch(r"[0-9a-f]{64}", i) for i in ids)
    assert len(set(ids)) == len(ids)
    # The same description names the same work unit: a restarted coordinator finds it.
    assert [wu.id for wu in workunits(8, "0")] == [wu.id for wu in later]
    # A step's work units are neighbours in the store's indexes, after the steps before
    # (a commit writes the pages it touches whole: docs/performance-history.md,
    # the twenty-second round), and a GEMM's work units are neighbours within its step.
    assert max(wu.id for wu in earlier) < min(wu.id for wu in later)
    in_order = sorted(earlier, key=lambda wu: wu.id)
    assert len({wu.gemm_id for wu in in_order[:16]}) == 1
    assert len({wu.gemm_id for wu in in_order[16:]}) == 1


def test_the_short_id_in_logs_tells_a_products_tiles_apart():
    tiles = workunits(3, "c")
    assert len({short_workunit_id(wu.id) for wu in tiles}) == len(tiles) == 16
