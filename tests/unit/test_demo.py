"""What the demo says about who set the pace of training."""

from __future__ import annotations

from coordinator.cli.demo import coordinator_share, pace_line


def test_the_coordinators_share_is_the_median_step_after_the_first():
    records = [
        {"step": 1, "seconds": 2.0, "cpu_seconds": 0.1},  # waited for the volunteers
        {"step": 2, "seconds": 0.1, "cpu_seconds": 0.06},
        {"step": 3, "seconds": 0.1, "cpu_seconds": 0.07},
        {"step": 4, "seconds": 0.1, "cpu_seconds": 0.09},
    ]
    assert abs(coordinator_share(records) - 0.7) < 1e-9


def test_lines_without_cpu_seconds_give_no_share():
    # train.jsonl written before the CPU was recorded
    assert coordinator_share([{"step": 1, "seconds": 0.1}, {"step": 2, "seconds": 0.1}]) is None
    assert coordinator_share([]) is None


def test_the_pace_is_laid_at_the_coordinator_only_when_it_was_the_busier():
    assert pace_line(0.65, 0.10).endswith("more than the volunteers', set the pace")
    assert "set the pace" not in pace_line(0.30, 0.60)
    assert "set the pace" not in pace_line(0.65, None)  # the volunteers' share is unknown
    assert pace_line(0.65, 0.10).startswith(
        "the coordinator's own CPU came to 65% of each step's time"
    )
