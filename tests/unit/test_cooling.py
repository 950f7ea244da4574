"""Hosts that sat on work wait before they get more (rules/cooling.py)."""

from __future__ import annotations

from coordinator.rules.cooling import COOL_MAX, PROBATION_TILES, Cooling


def test_each_tile_sat_on_in_a_row_doubles_the_wait_and_a_report_ends_the_streak():
    cooling = Cooling()
    assert cooling.left(7, 100.0) == 0.0
    assert [cooling.sat_on(7, 100.0) for _ in range(3)] == [2.0, 4.0, 8.0]
    assert cooling.left(7, 103.0) == 5.0 and cooling.left(8, 103.0) == 0.0
    for _ in range(20):
        cooling.sat_on(7, 100.0)
    assert cooling.left(7, 100.0) == COOL_MAX
    cooling.reported(7)
    assert cooling.left(7, 100.0) == 0.0 and cooling.sat_on(7, 200.0) == 2.0


def test_a_host_is_on_probation_from_the_tile_it_sat_on_to_its_next_computed_result():
    cooling = Cooling()
    assert not cooling.on_probation(7)
    cooling.sat_on(7, 100.0)
    assert cooling.on_probation(7) and not cooling.on_probation(8)
    assert cooling.left(7, 200.0) == 0.0 and cooling.on_probation(7)  # its wait over: still
    cooling.reported(7)
    assert not cooling.on_probation(7)


def test_tiles_taken_on_probation_count_until_it_sits_on_them_or_computes():
    cooling = Cooling()
    cooling.sat_on(7, 100.0)
    cooling.took(7, PROBATION_TILES - 1)
    assert not cooling.used_up(7)
    cooling.took(7, 1)
    assert cooling.used_up(7) and not cooling.used_up(8)
    cooling.sat_on(7, 110.0)  # judged for them: counted afresh from its next wait
    assert not cooling.used_up(7)
    cooling.took(7, PROBATION_TILES)
    cooling.reported(7)  # it computed one
    assert not cooling.used_up(7) and not cooling.on_probation(7)
