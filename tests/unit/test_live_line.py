"""The foreground volunteer's status line: it keeps the note, fits the terminal, and shows
no control character from the coordinator's words."""

from __future__ import annotations

from volunteer.cli import StatusLog, columns, live_line, status_line

STATUS = {
    "state": "idle",
    "tiles": 384,
    "gflops": 6.7,
    "benchmark_gflops": 91.1,
    "mb_down": 0.7,
    "mb_up": 1.5,
    "cache_hit_rate": 1.0,
    "backoff": 2,
    "note": "work waits for another volunteer: the quorum policy has each tile computed by 2",
}


def test_the_whole_line_when_it_fits_and_the_note_before_the_counters_when_not():
    wide = live_line(STATUS, 300)
    assert wide.rstrip() == status_line(STATUS) and columns(wide) == 299
    narrow = live_line(STATUS, 110)
    assert narrow.startswith("idle: 384 tiles, 6.7 GFLOPS | work waits for another volunteer")
    assert columns(narrow) == 109 and "cache hits" not in narrow
    tiny = live_line(STATUS, 40)
    assert columns(tiny) == 39 and tiny.rstrip().endswith("...")


def test_the_coordinators_words_reach_the_terminal_escaped_and_measured_in_columns():
    said = {**STATUS, "note": "\x1b]0;owned\x07\x1b[2J\nfake line " + "漢字" * 40}
    for line in (live_line(said, 80), status_line(said)):
        assert not any(c in line for c in "\x1b\x07\n\r"), line
        assert "\\x1b]0;owned\\x07" in line
    assert columns(live_line(said, 80)) == 79  # wide characters take two columns each


def test_without_a_terminal_the_status_line_is_logged_as_the_volunteer_moves_on_only():
    """An idle volunteer repeated its line, the coordinator's note and all, every 30 s: 2,900
    lines a day in a journal. Nor is there one at the start ("starting: 0 tiles")."""
    idle = {**STATUS, "state": "idle", "tiles": 5, "note": "work waits for another volunteer"}
    lines = StatusLog(now=0.0)
    assert lines.due({**STATUS, "state": "starting", "tiles": 0}, 1.0) is None
    said = [lines.due(idle, t) for t in (31.0, 62.0, 93.0, 600.0)]
    assert said[0] is not None and said[0].startswith("idle: 5 tiles") and said[1:] == [None] * 3
    working = {**idle, "state": "working", "tiles": 6, "note": ""}
    assert lines.due(working, 620.0) is None  # within 30 s of the last look
    assert lines.due(working, 640.0).startswith("working: 6 tiles")
    assert lines.due({**working, "tiles": 9}, 671.0).startswith("working: 9 tiles")
    # A note whose figures count down (a cooling, a retry) is the same note.
    cooling = {**working, "state": "idle", "note": "no new work for 40s: it sat on a tile"}
    assert lines.due(cooling, 702.0) is not None
    assert lines.due({**cooling, "note": "no new work for 9s: it sat on a tile"}, 733.0) is None
