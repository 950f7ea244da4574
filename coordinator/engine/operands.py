"""Operand ids: the content id of each array a product is handed, hashed once per array.

A step hands the same arrays to several products: a weight to every micro-batch's forward
product and again to its input gradient, an activation to its forward product and to its
weight gradient, an output gradient to both products of its layer's backward. Hashing each
of them every time was about half of the coordinator's hashing on the larger project.

An id is remembered only for an array that owns its memory, and that array is frozen
(made read-only) when it is first hashed: nothing can change its bytes afterwards without
setting it writeable again on purpose, so the remembered id stays its content's id for as
long as the array lives. The entry leaves with the array. A view, whose base another
holder could still write through, is hashed every time.
"""

from __future__ import annotations

import weakref

import numpy as np

import kernels


def freeze(x: np.ndarray) -> bool:
    """Make `x` read-only if it owns its memory; True if its bytes can no longer change."""
    if x.base is not None:
        return False
    x.flags.writeable = False
    return True


class OperandIds:
    """Ids of frozen arrays, by identity, for as long as each array lives."""

    def __init__(self) -> None:
        self._known: dict[int, tuple[weakref.ref, str]] = {}

    def __len__(self) -> int:
        return len(self._known)

    def known(self, x: np.ndarray) -> str | None:
        """The id remembered for this very array, or None."""
        entry = self._known.get(id(x))
        if entry is None or entry[0]() is not x or x.flags.writeable:
            return None
        return entry[1]

    def remember(self, x: np.ndarray, content_id: str) -> None:
        """Remember `content_id` (the id of x's bytes, hashed after `freeze(x)` returned
        True) until x is freed."""
        key = id(x)

        def forget(ref: weakref.ref, key: int = key) -> None:
            # Only this array's entry: its id may already name a newer array's.
            if self._known.get(key, (None,))[0] is ref:
                del self._known[key]

        self._known[key] = (weakref.ref(x, forget), content_id)

    def hash(self, x: np.ndarray) -> str:
        """The id of x's content: remembered, or hashed now (freezing x if it owns its
        memory, and then remembered)."""
        found = self.known(x)
        if found is not None:
            return found
        frozen = freeze(x)
        content_id = kernels.array_id(x)
        if frozen:
            self.remember(x, content_id)
        return content_id
