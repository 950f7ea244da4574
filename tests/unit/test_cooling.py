"""Hosts that sat on work wait before they get more (rules/cooling.py)."""

from __future__ import annotations

from coordinator.rules.cooling import COOL_MAX, Cooling


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
