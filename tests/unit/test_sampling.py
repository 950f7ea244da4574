"""What `tilehive sample` prints: the model's bytes as text a terminal shows, never obeys."""

from __future__ import annotations

from coordinator.training.sampling import printable


def test_control_bytes_are_shown_escaped_and_text_is_left_alone():
    sampled = "def f():\n\treturn 1\x1b[2J\r\x00\x7f\x85 é ü"
    assert printable(sampled) == "def f():\n\treturn 1\\x1b[2J\\x0d\\x00\\x7f\\x85 é ü"
