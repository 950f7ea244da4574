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


def test_a_host_on_probation_is_judged_once_for_what_it_took_and_a_report_ends_it():
    cooling = Cooling()
    assert not cooling.on_probation(7)
    cooling.sat_on(7, 100.0)
    assert cooling.on_probation(7) and not cooling.on_probation(8)
    cooling.watch(7, 105.0)
    cooling.watch(7, 106.0)  # more tiles taken: judged by the first tiles' time
    assert cooling.due(104.9) == [] and cooling.due(105.0) == [7] and cooling.due(110.0) == []
    cooling.watch(7, 112.0)
    cooling.reported(7)  # it computes after all: no longer on probation, not judged
    assert not cooling.on_probation(7) and cooling.due(200.0) == []
