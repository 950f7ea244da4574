"""The numpy twin of the compiled kernel: same API, same order of arithmetic, same bits.

numpy has no fused multiply-add, so each step fmaf(x, y, acc) is emulated in float64: the
product of two float32 values is exact in float64 (48 significant bits <= 53); the sum is then
rounded *to odd* (round to nearest, then, if that was inexact and landed on an even
significand, step one ulp toward the exact sum), and finally rounded to nearest float32.
Rounding to odd with 53 >= 2*24 + 2 bits and then to nearest float32 gives the correctly
rounded float32 result (Boldo & Melquiond, "Emulation of FMA and correctly rounded sums:
proved algorithms using rounding to odd", IEEE TC 2008), which is what fmaf returns; plain
double rounding would be wrong in rare ties. Slow (one numpy pass per k) but exact.
"""

from __future__ import annotations

import numpy as np

from kernels.checks import check_gemm_args

CANONICAL_NAN_BITS = np.uint32(0x7FC00000)


def _round_to_odd_sum(p: np.ndarray, c: np.ndarray) -> np.ndarray:
    """p + c in float64, rounded to odd; p and c are float64 arrays."""
    s = p + c
    # TwoSum (Knuth): e is the exact error, s + e == p + c.
    bb = s - p
    e = (p - (s - bb)) + (c - bb)
    bits = s.view(np.int64)
    needs_odd = (e != 0) & ((bits & 1) == 0) & np.isfinite(s)
    # Adding 1 to the bit pattern grows the magnitude; do so when the error points away from 0.
    away = (e > 0) == (s > 0)
    step = np.where(away, np.int64(1), np.int64(-1))
    return np.where(needs_odd, bits + step, bits).view(np.float64)


def fma32(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """Elementwise correctly rounded float32 fma(x, y, z) (broadcasting like numpy)."""
    with np.errstate(all="ignore"):
        p = np.asarray(x, np.float64) * np.asarray(y, np.float64)
        s = _round_to_odd_sum(p, np.asarray(z, np.float64))
        return canonicalize_nans(s.astype(np.float32))


def canonicalize_nans(c: np.ndarray) -> np.ndarray:
    """Write every NaN as the quiet NaN 0x7fc00000, as the compiled kernel does; in place."""
    nan = np.isnan(c)
    if nan.any():
        c.view(np.uint32)[nan] = CANONICAL_NAN_BITS
    return c


def gemm_checked(
    a: np.ndarray, b: np.ndarray, out: np.ndarray, trans_a: bool, trans_b: bool
) -> np.ndarray:
    """out = op(a) @ op(b) for arguments already checked by check_gemm_args."""
    opa = (a.T if trans_a else a).astype(np.float64)
    opb = (b.T if trans_b else b).astype(np.float64)
    m, k = opa.shape
    n = opb.shape[1]
    acc = np.zeros((m, n), dtype=np.float64)
    with np.errstate(all="ignore"):
        for p in range(k):
            product = np.multiply.outer(opa[:, p], opb[p, :])
            acc = _round_to_odd_sum(product, acc).astype(np.float32).astype(np.float64)
        out[...] = acc.astype(np.float32)
    canonicalize_nans(out)
    return out


def gemm(
    a: np.ndarray,
    b: np.ndarray,
    *,
    trans_a: bool = False,
    trans_b: bool = False,
    out: np.ndarray | None = None,
    threads: int = 1,
) -> np.ndarray:
    """The same contract as kernels.gemm, computed with numpy; `threads` is accepted and unused."""
    a, b, out = check_gemm_args(a, b, trans_a, trans_b, out, threads)
    return gemm_checked(a, b, out, bool(trans_a), bool(trans_b))
