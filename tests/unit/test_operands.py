"""Operand ids: an array handed to products is hashed once, and its id can never go stale."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import kernels
from coordinator.engine.operands import OperandIds


def test_an_owning_array_is_hashed_once_and_frozen(monkeypatch):
    ids = OperandIds()
    w = np.arange(12, dtype=np.float32).reshape(3, 4).copy()
    expected = kernels.array_id(w)
    hashed = []
    monkeypatch.setattr(kernels, "array_id", lambda x: hashed.append(x) or expected)

    assert ids.hash(w) == expected
    assert ids.hash(w) == expected
    assert len(hashed) == 1
    # Its id stays true because its bytes cannot change behind it.
    with pytest.raises(ValueError, match="read-only"):
        w[0, 0] = 1.0


def test_a_view_is_hashed_every_time_and_left_writeable():
    ids = OperandIds()
    base = np.zeros((4, 4), np.float32)
    view = base[:2]
    first = ids.hash(view)
    base[0, 0] = 1.0  # the base can still change the view's bytes
    assert ids.hash(view) == kernels.array_id(view) != first
    assert view.flags.writeable
    assert len(ids) == 0


def test_an_array_made_writeable_again_is_hashed_again():
    ids = OperandIds()
    x = np.zeros((2, 2), np.float32)
    before = ids.hash(x)
    x.flags.writeable = True
    x[1, 1] = 3.0
    assert ids.hash(x) == kernels.array_id(x) != before


def test_an_entry_leaves_with_its_array():
    ids = OperandIds()
    x = np.ones((2, 2), np.float32)
    ids.hash(x)
    assert len(ids) == 1
    del x
    gc.collect()
    assert len(ids) == 0
    # A new array, perhaps at the same address, is hashed for its own bytes.
    y = np.full((2, 2), 7.0, np.float32)
    assert ids.hash(y) == kernels.array_id(y)
