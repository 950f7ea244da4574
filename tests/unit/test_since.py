"""`tilehive logs --since`: what an operator types, read as the moment it names."""

from __future__ import annotations

from datetime import datetime

import pytest

from coordinator.cli.logs import InspectError, parse_since

NOW = datetime(2026, 11, 29, 16, 10, 0).timestamp()  # local time, as the log shows it


def test_a_duration_counts_back_from_now():
    assert parse_since("90s", NOW) == NOW - 90
    assert parse_since("2h", NOW) == NOW - 7200


def test_a_time_of_day_as_the_log_shows_it_is_the_latest_such_moment():
    """The coordinator's log shows times of day: an operator copies one from it."""
    assert parse_since("14:05", NOW) == datetime(2026, 11, 29, 14, 5).timestamp()
    assert parse_since("9:05:30", NOW) == datetime(2026, 11, 29, 9, 5, 30).timestamp()
    # Later than now today: yesterday's.
    assert parse_since("23:59", NOW) == datetime(2026, 11, 28, 23, 59).timestamp()


def test_an_iso_time_is_read_as_it_is():
    assert parse_since("2026-11-29T15:00", NOW) == datetime(2026, 11, 29, 15).timestamp()


@pytest.mark.parametrize(
    ("value", "said"),
    [("24:00", "not a time of day"), ("12:61", "not a time of day"), ("10x", "a duration")],
)
def test_what_is_none_of_them_says_what_would_be(value, said):
    with pytest.raises(InspectError, match=said):
        parse_since(value, NOW)
