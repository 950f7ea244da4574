"""Argument checks shared by the compiled kernel and its numpy twin, so both reject alike."""

from __future__ import annotations

import numpy as np


def check_matrix(name: str, x: object) -> np.ndarray:
    """x itself if it is a C-contiguous float32 matrix; a ValueError naming `name` if not."""
    if not isinstance(x, np.ndarray):
        raise ValueError(f"{name} must be a numpy.ndarray, got {type(x).__name__}")
    if x.dtype != np.float32:
        raise ValueError(f"{name} must have dtype float32, got {x.dtype}")
    if x.ndim != 2:
        raise ValueError(f"{name} must be 2-D, got {x.ndim}-D with shape {x.shape}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous; pass np.ascontiguousarray({name})")
    return x


def op_shape(x: np.ndarray, trans: bool) -> tuple[int, int]:
    """The shape of op(x): x itself, or its transpose."""
    rows, cols = x.shape
    return (cols, rows) if trans else (rows, cols)


def check_gemm_args(
    a: object, b: object, trans_a: bool, trans_b: bool, out: object, threads: object
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate a gemm call and return (a, b, out), allocating out when it is None."""
    a = check_matrix("a", a)
    b = check_matrix("b", b)
    m, k = op_shape(a, bool(trans_a))
    k_b, n = op_shape(b, bool(trans_b))
    if k != k_b:
        raise ValueError(
            f"inner dimensions differ: op(a) is {m}x{k} but op(b) is {k_b}x{n} "
            f"(trans_a={bool(trans_a)}, trans_b={bool(trans_b)})"
        )
    if isinstance(threads, bool) or not isinstance(threads, int | np.integer) or threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    if out is None:
        return a, b, np.empty((m, n), dtype=np.float32)
    if not isinstance(out, np.ndarray):
        raise ValueError(f"out must be a numpy.ndarray, got {type(out).__name__}")
    if out.dtype != np.float32:
        raise ValueError(f"out must have dtype float32, got {out.dtype}")
    if out.shape != (m, n):
        raise ValueError(f"out must have shape {(m, n)}, got {out.shape}")
    if not out.flags.writeable:
        raise ValueError("out must be writeable")
    if m > 0 and n > 0:
        row_stride, col_stride = out.strides
        if col_stride != out.itemsize or row_stride < n * out.itemsize or row_stride % 4:
            raise ValueError(
                "out must have contiguous rows (for example a C-contiguous array or a "
                "block of whole columns of one)"
            )
    if np.shares_memory(out, a) or np.shares_memory(out, b):
        raise ValueError("out must not overlap a or b")
    return a, b, out
