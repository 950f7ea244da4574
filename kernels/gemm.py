"""The public GEMM entry point: checks, picks the compiled kernel or its twin, splits threads."""

from __future__ import annotations

import os

import numpy as np

from kernels import reference
from kernels.checks import check_gemm_args
from kernels.pool import run_ranges

try:
    from kernels import _gemm
except ImportError:  # pragma: no cover - only when the extension was not built
    _gemm = None

# Set TILEHIVE_KERNEL=reference to run every product on the numpy twin (same bits, slower).
KERNEL_ENV = "TILEHIVE_KERNEL"

# Below this many multiply-adds per thread, starting a thread costs more than it saves.
_MIN_WORK_PER_THREAD = 1 << 21


def use_reference() -> bool:
    """True when TILEHIVE_KERNEL asks for the numpy twin, or the extension is missing."""
    return _gemm is None or os.environ.get(KERNEL_ENV, "").strip().lower() == "reference"


def kernel_name() -> str:
    """The implementation the next gemm call will use: "reference" or the micro-kernel name."""
    return "reference" if use_reference() else _gemm.kernel_name()


def row_splits(m: int, parts: int, align: int) -> list[tuple[int, int]]:
    """Split rows [0, m) into at most `parts` ranges whose starts are multiples of `align`."""
    chunk = -(-m // parts)
    chunk = max(align, -(-chunk // align) * align)
    return [(start, min(m, start + chunk)) for start in range(0, m, chunk)]


def gemm(
    a: np.ndarray,
    b: np.ndarray,
    *,
    trans_a: bool = False,
    trans_b: bool = False,
    out: np.ndarray | None = None,
    threads: int = 1,
) -> np.ndarray:
    """C = op(a) @ op(b) in float32, bit for bit the same on every machine and thread count.

    op(x) is x, or x.T when trans_x is true. Each C[i, j] is accumulated over k = 0..K-1 in
    order with one fused multiply-add per step, so any block of C computed alone has exactly
    the bits of the same block of the full product (docs/kernels.md). a and b must be
    C-contiguous float32 matrices; out, when given, receives the result and is returned.
    Raises ValueError on any other input.
    """
    a, b, out = check_gemm_args(a, b, trans_a, trans_b, out, threads)
    if use_reference():
        return reference.gemm_checked(a, b, out, bool(trans_a), bool(trans_b))
    m, n = out.shape
    k = a.shape[0] if trans_a else a.shape[1]
    useful = max(1, min(int(threads), (m * n * k) // _MIN_WORK_PER_THREAD))
    ranges = row_splits(m, useful, _gemm.kernel_mr()) if m else []
    if len(ranges) <= 1:
        _gemm.sgemm_rows(a, b, out, bool(trans_a), bool(trans_b), 0, m)
        return out
    run_ranges(
        lambda m0, m1: _gemm.sgemm_rows(a, b, out, bool(trans_a), bool(trans_b), m0, m1),
        ranges,
    )
    return out


def _check_batch(name: str, x: object) -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 3:
        raise ValueError(f"{name} must be a 3-D float32 numpy.ndarray")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous; pass np.ascontiguousarray({name})")
    return x


def batched_gemm(
    a: np.ndarray,
    b: np.ndarray,
    *,
    trans_a: bool = False,
    trans_b: bool = False,
    threads: int = 1,
) -> np.ndarray:
    """C[g] = op(a[g]) @ op(b[g]) for every g: the bits of `gemm` called once per g.

    a and b are C-contiguous float32 arrays of shape (G, rows, cols); threads split the G
    products (each product is computed by one thread, in the order of `gemm`). This is the
    attention's per-head products in one call, without a Python loop over heads.
    """
    a, b = _check_batch("a", a), _check_batch("b", b)
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"a and b must have the same batch size, got {a.shape} and {b.shape}")
    if isinstance(threads, bool) or not isinstance(threads, int | np.integer) or threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    count = a.shape[0]
    m, k = (a.shape[2], a.shape[1]) if trans_a else (a.shape[1], a.shape[2])
    k_b, n = (b.shape[2], b.shape[1]) if trans_b else (b.shape[1], b.shape[2])
    if k != k_b:
        raise ValueError(f"inner dimensions differ: op(a[g]) is {m}x{k}, op(b[g]) is {k_b}x{n}")
    out = np.empty((count, m, n), np.float32)
    if use_reference():
        for g in range(count):
            reference.gemm_checked(a[g], b[g], out[g], bool(trans_a), bool(trans_b))
        return out
    useful = max(1, min(int(threads), count, count * m * n * k // _MIN_WORK_PER_THREAD))
    ranges = row_splits(count, useful, 1) if count else []
    run_ranges(
        lambda g0, g1: _gemm.sgemm_batch(a, b, out, bool(trans_a), bool(trans_b), g0, g1),
        ranges,
    )
    return out
