"""What `tilehive sample` prints: the model's bytes as text a terminal shows, never obeys."""

from __future__ import annotations

import pytest

from coordinator.training import project as projects
from coordinator.training.project import ProjectError
from coordinator.training.sampling import as_text, generate, printable


def test_control_bytes_are_shown_escaped_and_text_is_left_alone():
    sampled = "def f():\n\treturn 1\x1b[2J\r\x00\x7f\x85 é ü"
    assert printable(sampled) == "def f():\n\treturn 1\\x1b[2J\\x0d\\x00\\x7f\\x85 é ü"


def test_the_text_comes_as_it_is_sampled():
    """A byte is a forward pass: `--length 100000` printed nothing for half an hour. A
    piece comes for each byte (empty while a character of several bytes is incomplete),
    and the pieces make the text the whole would."""
    sampled = [b"def ", b"\xc3", b"\xa9", b"\xff", b"\x1b", b"x", b"\xe2\x82"]
    pieces = list(as_text(sampled))
    assert pieces == ["def ", "", "é", "\ufffd", "\\x1b", "x", "", "\ufffd"]
    whole = printable(b"".join(sampled).decode("utf-8", errors="replace"))
    assert "".join(pieces) == whole


def test_nothing_comes_before_the_checkpoint_has_loaded(tmp_path):
    """A project with no checkpoint is an error before any text, not half a line."""
    project = projects.create(tmp_path / "p")
    with pytest.raises(ProjectError, match="no checkpoint"):
        next(generate(project, "def ", 5, 1.0, 0))
