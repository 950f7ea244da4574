"""Values from the network reach the log escaped: no forged lines, no NUL (issue 15, item 4)."""

from __future__ import annotations

import logging
import signal
import socket

import pytest

from coordinator.server.api import REFUSALS_EVERY, RefusalLog
from coordinator.training import project as projects
from coordinator.work import protocol
from coordinator.work.protocol import loggable
from tests.procs import Reaper, first_url, free_port, poll, start_coordinator
from volunteer.logsetup import TextFormatter


@pytest.mark.parametrize(
    ("value", "logged"),
    [
        ("plain text", "plain text"),
        ("x\n2030-01-01 00:00:00,000 INFO FORGED", "x\\n2030-01-01 00:00:00,000 INFO FORGED"),
        ("nul\x00\r\t\x1b[31m", "nul\\x00\\r\\t\\x1b[31m"),
        ("a\\nb", "a\\\\nb"),  # a sent backslash cannot pass for an escape
        ("line\u2028sep\u202eltr", "line\\u2028sep\\u202eltr"),
        ("\ud800", "\\ud800"),
        ("é 日本", "é 日本"),
        (7, "7"),
    ],
)
def test_loggable_keeps_a_value_on_one_printable_line(value, logged):
    assert loggable(value) == logged


def formatted(*args: object) -> str:
    record = logging.makeLogRecord({"msg": "coordinator: %s", "args": args, "levelname": "INFO"})
    return TextFormatter("%(levelname)s %(message)s").format(record)


def test_every_text_log_line_stays_one_line_whatever_its_values_hold():
    # A volunteer logs its coordinator's notes and refusals as they come over the network.
    assert formatted("paused\n2030-01-01 INFO FORGED\x00") == (
        "INFO coordinator: paused\\n2030-01-01 INFO FORGED\\x00"
    )
    # A value escaped where it was made is not escaped twice.
    assert formatted(loggable("a\nb")) == "INFO coordinator: a\\nb"


def test_a_volunteers_error_text_is_escaped_where_it_is_parsed():
    report = protocol.parse_report(
        {"results": [{"result_id": "0" * 32, "error": "boom\n2030-01-01 INFO FORGED\x00"}]}
    )
    assert report.results[0].error == "boom\\n2030-01-01 INFO FORGED\\x00"


def test_names_that_could_break_a_line_are_refused():
    for name in ("a\nb", "nul\x00", "tab\there"):
        with pytest.raises(protocol.BadRequest, match="printable"):
            protocol.parse_register({"name": name})


def send_raw(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(request)
        return conn.recv(65536)


def test_a_forged_path_and_a_malformed_header_stay_on_one_line_of_the_real_log(tmp_path):
    directory = tmp_path / "project"
    projects.create(directory, **{"model.layers": 1, "model.width": 32, "corpus.max_mb": 1})
    log = tmp_path / "coordinator.log"
    port = free_port()
    reaper = Reaper()
    try:
        coordinator = reaper(start_coordinator(directory, f"127.0.0.1:{port}", log))
        first_url(coordinator)
        forged = b"/v1/nothing%0a2030-01-01%2000:00:00,000%20INFO%20FORGED%00"
        reply = send_raw(port, b"GET " + forged + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 404")
        send_raw(port, b"GET /v1/status HTTP/1.1\r\nHost: x\r\nX-A: b\n2030 INFO FORGED\r\n\r\n")
        poll(lambda: b"malformed HTTP" in log.read_bytes(), what="the malformed request's line")
        coordinator.send_signal(signal.SIGINT)
        assert coordinator.wait(60) == 130
    finally:
        reaper.reap()
    text = log.read_bytes()
    assert b"\x00" not in text
    lines = text.decode().splitlines()
    assert not [line for line in lines if line.startswith("2030")], text.decode()
    refused = [line for line in lines if "GET /v1/nothing" in line]
    assert len(refused) == 1
    assert (
        "/v1/nothing\\n2030-01-01 00:00:00,000 INFO FORGED\\x00 from 127.0.0.1: 404" in (refused[0])
    )
    assert len([line for line in lines if "malformed HTTP" in line]) == 1


def test_refusals_told_to_come_back_later_are_a_line_every_ten_seconds_and_the_count(caplog):
    """A client in a loop, refused 429 after 429, wrote 245 lines in 0.3 s; any other
    refusal (a lie, a forged id) is news each time."""
    now = [0.0]
    refusals = RefusalLog(clock=lambda: now[0])
    for _ in range(5):
        refusals.say("POST", "/v1/work", "10.0.0.1", 429, "over the rate", later=True)
    refusals.say("POST", "/v1/work", "10.0.0.2", 429, "over the rate", later=True)
    for _ in range(2):
        refusals.say("POST", "/v1/results", "10.0.0.1", 400, "a lie", later=False)
    now[0] = REFUSALS_EVERY
    refusals.say("POST", "/v1/work", "10.0.0.1", 429, "over the rate", later=True)
    assert [r.getMessage() for r in caplog.records] == [
        "POST /v1/work from 10.0.0.1: 429 over the rate",
        "POST /v1/work from 10.0.0.2: 429 over the rate",
        "POST /v1/results from 10.0.0.1: 400 a lie",
        "POST /v1/results from 10.0.0.1: 400 a lie",
        "POST /v1/work from 10.0.0.1: 429 over the rate (4 more from it since its last line, "
        "not logged)",
    ]


def test_the_count_of_refusals_left_out_is_said_when_the_client_stops(caplog):
    """A client refused in a loop that then stops had the count of its refusals left out
    never said: the next line, which says it, never came. One still refused keeps its full
    lines (method, path, reason), a sweep taking none of their place."""
    now = [0.0]
    refusals = RefusalLog(clock=lambda: now[0])
    while now[0] < 2.5 * REFUSALS_EVERY:  # refused every 0.5 s for 25 s, swept every 10 s
        refusals.say("POST", "/v1/work", "10.0.0.3", 429, "over the rate", later=True)
        if now[0] % REFUSALS_EVERY == 0:
            refusals.sweep()
        now[0] += 0.5
    last = now[0] - 0.5
    now[0] = last + REFUSALS_EVERY - 0.5
    refusals.sweep()  # not yet: refused less than 10 s ago
    now[0] = last + REFUSALS_EVERY
    refusals.sweep()
    refusals.sweep()  # said once
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "POST /v1/work from 10.0.0.3: 429 over the rate",
        "POST /v1/work from 10.0.0.3: 429 over the rate (19 more from it since its last "
        "line, not logged)",
        "POST /v1/work from 10.0.0.3: 429 over the rate (19 more from it since its last "
        "line, not logged)",
        "9 more refusal(s) 429 from 10.0.0.3 since its last line, not logged",
    ], said


def test_the_counts_untold_at_a_stop_are_said(caplog):
    now = [0.0]
    refusals = RefusalLog(clock=lambda: now[0])
    for _ in range(3):
        refusals.say("POST", "/v1/work", "10.0.0.4", 503, "busy", later=True)
    refusals.sweep(final=True)
    assert caplog.records[-1].getMessage() == (
        "2 more refusal(s) 503 from 10.0.0.4 since its last line, not logged"
    )
