"""What `tilehive sample` prints: the model's bytes as text a terminal shows, never obeys."""

from __future__ import annotations

import asyncio

from coordinator.training.sampling import printable


def test_control_bytes_are_shown_escaped_and_text_is_left_alone():
    sampled = "def f():\n\treturn 1\x1b[2J\r\x00\x7f\x85 é ü"
    assert printable(sampled) == "def f():\n\treturn 1\\x1b[2J\\x0d\\x00\\x7f\\x85 é ü"


def test_the_text_comes_as_it_is_sampled(tmp_path):
    """A byte is a forward pass: `--length 100000` printed nothing for half an hour. The
    prompt comes at once, then a piece a byte (empty while a character of several bytes
    is incomplete), and the pieces make the whole text."""
    import itertools

    from coordinator.training import project as projects
    from coordinator.training.sampling import generate
    from coordinator.training.trainer import LocalBackend, Trainer
    from tests.factories import SMALL

    project = projects.create(tmp_path / "p", **{**SMALL, "training.steps": 1})
    asyncio.run(Trainer(project, LocalBackend()).run())
    pieces = generate(project, "é ", 50, 1.0, seed=0)
    assert next(pieces) == "é "  # before any byte is sampled
    rest = list(itertools.islice(pieces, 60))
    assert len(rest) == 51  # one a byte sampled, and the decoder's end
    whole = "é " + "".join(rest)
    assert whole == "".join(generate(project, "é ", 50, 1.0, seed=0))
