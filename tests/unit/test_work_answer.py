"""A work answer in msgpack but not in the protocol's shape is a malformed reply (retried),
never a crash of the volunteer (volunteer/client.py, checked_answer)."""

from __future__ import annotations

import pytest

from volunteer.client import checked_answer
from volunteer.session import TRANSIENT

GOOD = {
    "result_id": "r" * 32,
    "a": "a" * 64,
    "b": "b" * 64,
    "m": 16,
    "n": 16,
    "k": 8,
    "a_bytes": 512,
    "b_bytes": 512,
    "trans_a": False,
    "trans_b": True,
    "upload": "tile",
    "deadline_in": 5.0,
}


@pytest.mark.parametrize(
    ("reply", "words"),
    [
        ({"hello": 1}, "no list of assignments"),
        ({"assignments": [{"result_id": "x"}]}, "lacks a valid 'a'"),
        ({"assignments": [{**GOOD, "m": "16"}]}, "lacks a valid 'm'"),
        ({"assignments": ["not a map"]}, "not a map"),
        ({"assignments": [], "abort": "all"}, "no list of assignments"),
    ],
)
def test_a_work_answer_of_another_shape_is_a_malformed_reply(reply, words):
    with pytest.raises(ValueError, match=words) as refused:
        checked_answer(reply)
    assert isinstance(refused.value, TRANSIENT)  # backed off and retried, like a cut reply


def test_a_work_answer_in_the_protocols_shape_passes():
    reply = {"assignments": [GOOD], "abort": [], "delay": 0.0}
    assert checked_answer(reply) is reply
