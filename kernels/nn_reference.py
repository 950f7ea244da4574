"""The numpy twin of the compiled model kernels: same API, same order of arithmetic, same bits.

Each line below is one float32 (or, in `sumsq`, float64) operation of csrc/nn_body.h, in the
same order: numpy's elementwise float32 +, -, *, / and sqrt round exactly as the C does, and
no step needs a fused multiply-add. Reductions are written out lane by lane (16 lanes by
index, then the fixed tree) instead of with numpy's own sums, whose order is numpy's. The
arguments are checked by kernels.nn, which calls these when TILEHIVE_KERNEL=reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

F32 = np.float32
LANES = 16
COLSUM_BLOCK = 32


def _hex(text: str) -> np.float32:
    """A float32 constant written exactly as in nn_impl.c (hex: no decimal rounding)."""
    return F32(float.fromhex(text))


ZERO, HALF, ONE, TWO = F32(0), F32(0.5), F32(1), F32(2)
NEG_INF = F32(-np.inf)
EXP_LO, EXP_HI = _hex("-0x1.5d589ep+6"), _hex("0x1.6p+6")
LOG2E, MAGIC, MAGIC_BITS = _hex("0x1.715476p+0"), _hex("0x1.8p+23"), np.uint32(0x4B400000)
LN2_HI, LN2_LO = _hex("0x1.63p-1"), _hex("-0x1.bd0106p-13")
EP = [_hex(h) for h in ("0x1.a0d2cep-13", "0x1.6e879cp-10", "0x1.11121p-7")] + [
    _hex(h) for h in ("0x1.555382p-5", "0x1.555554p-3", "0x1p-1")
]
TH = [_hex(h) for h in ("-0x1.75e1d4p-8", "0x1.52269cp-6", "-0x1.b83c5ap-5")] + [
    _hex(h) for h in ("0x1.110726p-3", "-0x1.555532p-2")
]
TH_SMALL, TH_CLAMP = _hex("0x1.4p-1"), _hex("0x1.2p+3")
LP = [_hex(h) for h in ("0x1.204376p-4", "-0x1.d7a37p-4", "0x1.de4a34p-4", "-0x1.fcba9ep-4")] + [
    _hex(h) for h in ("0x1.23d37ep-3", "-0x1.555ca0p-3", "0x1.999d58p-3", "-0x1.fffff8p-3")
]
LP.append(_hex("0x1.555554p-2"))
SQRTHF = _hex("0x1.6a09e6p-1")
GELU_C, GELU_K, GELU_K3 = _hex("0x1.988454p-1"), _hex("0x1.6e4e26p-5"), _hex("0x1.12ba9ep-3")


# ---- the building blocks: lanes, trees, exp, tanh, log ------------------------------------


def _chunks(x: np.ndarray, fill: np.float32) -> np.ndarray:
    """x (..., n) as (..., ceil(n / 16), 16): element j in chunk j // 16, lane j % 16."""
    n = x.shape[-1]
    padded = -(-n // LANES) * LANES
    if padded != n:
        pad = np.full((*x.shape[:-1], padded - n), fill, F32)
        x = np.concatenate([x, pad], axis=-1)
    return x.reshape(*x.shape[:-1], padded // LANES, LANES)


def _tree(acc: np.ndarray) -> np.ndarray:
    """The 16 lanes combined (l, l+8), (l, l+4), (l, l+2), (l, l+1)."""
    for half in (8, 4, 2, 1):
        acc = acc[..., :half] + acc[..., half : 2 * half]
    return acc[..., 0]


def lane_sum(x: np.ndarray) -> np.ndarray:
    """Sum over the last axis: lane j % 16 adds element j in increasing j from +0, then the
    tree. Padding lanes add +0, which changes nothing (a lane never holds -0)."""
    chunks = _chunks(x, ZERO)
    acc = np.zeros((*x.shape[:-1], LANES), F32)
    for c in range(chunks.shape[-2]):
        acc = acc + chunks[..., c, :]
    return _tree(acc)


def lane_max(x: np.ndarray) -> np.ndarray:
    """Max over the last axis with acc = z > acc ? z : acc per lane from -inf, then the tree
    of b > a ? b : a (so a NaN is never chosen and the first of equal values stays)."""
    chunks = _chunks(x, NEG_INF)
    acc = np.full((*x.shape[:-1], LANES), NEG_INF, F32)
    for c in range(chunks.shape[-2]):
        z = chunks[..., c, :]
        acc = np.where(z > acc, z, acc)
    for half in (8, 4, 2, 1):
        a, b = acc[..., :half], acc[..., half : 2 * half]
        acc = np.where(b > a, b, a)
    return acc[..., 0]


def exp32(x: np.ndarray) -> np.ndarray:
    """exp as nn_body.h computes it (clamp, Cody-Waite reduction, Cephes polynomial)."""
    xc = np.where(x < EXP_LO, EXP_LO, x)
    xc = np.where(xc > EXP_HI, EXP_HI, xc)
    t = xc * LOG2E
    t = t + MAGIC
    nf = t - MAGIC
    r = xc - nf * LN2_HI
    r = r - nf * LN2_LO
    p = r * EP[0]
    p = p + EP[1]
    for coefficient in EP[2:]:
        p = p * r + coefficient
    y = p * (r * r)
    y = y + r
    y = y + ONE
    n = t.view(np.uint32) - MAGIC_BITS
    two_n = ((n + np.uint32(127)) << np.uint32(23)).view(F32)
    y = y * two_n
    return np.where(x < EXP_LO, ZERO, y)


def tanh32(z: np.ndarray) -> np.ndarray:
    """tanh as nn_body.h computes it (odd polynomial near 0, 1 - 2 / (exp(2|z|) + 1) else)."""
    sign = z.view(np.uint32) & np.uint32(0x80000000)
    a = (z.view(np.uint32) & np.uint32(0x7FFFFFFF)).view(F32)
    s = z * z
    p = s * TH[0]
    p = p + TH[1]
    for coefficient in TH[2:]:
        p = p * s + coefficient
    small = (p * s) * z
    small = small + z
    ac = np.where(a > TH_CLAMP, TH_CLAMP, a)
    e = exp32(ac + ac)
    big = TWO / (e + ONE)
    big = ONE - big
    big = (big.view(np.uint32) | sign).view(F32)
    return np.where(a < TH_SMALL, small, big)


def log32(x: np.ndarray) -> np.ndarray:
    """log of positive normal floats as nn_body.h computes it (Cephes logf)."""
    bits = x.view(np.uint32)
    e = ((bits >> np.uint32(23)) & np.uint32(0xFF)).astype(np.int32) - np.int32(126)
    m = ((bits & np.uint32(0x007FFFFF)) | np.uint32(0x3F000000)).view(F32)
    low = m < SQRTHF
    e = np.where(low, e - np.int32(1), e)
    m = np.where(low, (m + m) - ONE, m - ONE)
    fe = e.astype(F32)
    z = m * m
    p = m * LP[0]
    p = p + LP[1]
    for coefficient in LP[2:]:
        p = p * m + coefficient
    y = (p * m) * z
    y = y + fe * LN2_LO
    y = y - z * HALF
    r = m + y
    return r + fe * LN2_HI


# ---- the kernels (same signatures as kernels.nn; `threads` is accepted and unused) --------


def gelu(
    x: np.ndarray, bias: np.ndarray | None = None, *, threads: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    with np.errstate(all="ignore"):
        if bias is not None:
            x[...] = x + bias
        inner = (x * x) * x
        inner = inner * GELU_K
        inner = x + inner
        t = tanh32(inner * GELU_C)
        y = (x * HALF) * (t + ONE)
    return y, t


def gelu_backward(
    dy: np.ndarray, x: np.ndarray, t: np.ndarray, *, threads: int | None = None
) -> np.ndarray:
    with np.errstate(all="ignore"):
        h = (t + ONE) * HALF
        s = ONE - t * t
        q = (x * x) * GELU_K3 + ONE
        r = (x * HALF) * s
        r = r * GELU_C
        r = r * q
        return dy * (h + r)


def layernorm(
    x: np.ndarray, g: np.ndarray, b: np.ndarray, eps: float, *, threads: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    count = F32(x.shape[-1])
    with np.errstate(all="ignore"):
        mean = lane_sum(x) / count
        c = x - mean[:, None]
        var = lane_sum(c * c) / count
        inv = ONE / np.sqrt(var + F32(eps))
        xhat = c * inv[:, None]
        return xhat * g + b, xhat, inv


def layernorm_backward(
    dy: np.ndarray,
    xhat: np.ndarray,
    inv: np.ndarray,
    g: np.ndarray,
    *,
    threads: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    count = F32(dy.shape[-1])
    with np.errstate(all="ignore"):
        d = dy * g
        m1 = lane_sum(d) / count
        m2 = lane_sum(d * xhat) / count
        dx = ((d - m1[:, None]) - xhat * m2[:, None]) * inv[:, None]
    return dx, colsum(dy, xhat), colsum(dy)


def colsum(a: np.ndarray, b: np.ndarray | None = None, *, threads: int | None = None) -> np.ndarray:
    """Column sums: blocks of 32 rows each summed top-down from +0, then the blocks' sums."""
    with np.errstate(all="ignore"):
        v = a if b is None else a * b
        rows, cols = v.shape
        blocks = -(-rows // COLSUM_BLOCK)
        padded = np.zeros((blocks * COLSUM_BLOCK, cols), F32)
        padded[:rows] = v
        padded = padded.reshape(blocks, COLSUM_BLOCK, cols)
        part = np.zeros((blocks, cols), F32)
        for i in range(COLSUM_BLOCK):
            part = part + padded[:, i, :]
        total = np.zeros(cols, F32)
        for block in range(blocks):
            total = total + part[block]
    return total


def add_bias(x: np.ndarray, bias: np.ndarray, *, threads: int | None = None) -> np.ndarray:
    with np.errstate(all="ignore"):
        x[...] = x + bias
    return x


def _causal_mask(shape: tuple[int, ...], causal: bool) -> np.ndarray:
    n = shape[-1]
    if not causal:
        return np.ones((1, n), bool)
    return np.arange(n)[None, :] <= np.arange(shape[-2])[:, None]


def softmax(s: np.ndarray, scale: float, causal: bool, *, threads: int | None = None) -> np.ndarray:
    scale = F32(scale)
    keep = _causal_mask(s.shape, causal)
    with np.errstate(all="ignore"):
        z = s * scale
        mx = lane_max(np.where(keep, z, NEG_INF))
        e = np.where(keep, exp32(z - mx[..., None]), ZERO)
        total = lane_sum(e)
        return np.where(keep, e / total[..., None], ZERO)


def softmax_backward(
    p: np.ndarray, dp: np.ndarray, scale: float, causal: bool, *, threads: int | None = None
) -> np.ndarray:
    scale = F32(scale)
    keep = _causal_mask(p.shape, causal)
    with np.errstate(all="ignore"):
        dot = lane_sum(np.where(keep, dp * p, ZERO))
        return np.where(keep, (p * (dp - dot[..., None])) * scale, ZERO)


def cross_entropy(
    logits: np.ndarray, targets: np.ndarray, *, threads: int | None = None
) -> tuple[float, np.ndarray]:
    rows = np.arange(logits.shape[0])
    count = F32(logits.shape[0])
    with np.errstate(all="ignore"):
        mx = lane_max(logits)
        e = exp32(logits - mx[:, None])
        total = lane_sum(e)
        loss = log32(total) - (logits[rows, targets] - mx)
        hit = e[rows, targets]
        dlogits = (e / total[:, None]) / count
        dlogits[rows, targets] = ((hit / total) - ONE) / count
        mean = lane_sum(loss[None, :])[0] / count
    return float(mean), dlogits


def sumsq(x: np.ndarray) -> float:
    """sum(x**2) in float64: lane j % 16 adds x[j]^2 (exact) in increasing j, then the tree."""
    flat = x.reshape(-1).astype(np.float64)
    padded = np.zeros(-(-flat.size // LANES) * LANES, np.float64)
    padded[: flat.size] = flat
    squares = (padded * padded).reshape(-1, LANES)
    if not squares.shape[0]:
        return 0.0
    # accumulate is strictly sequential; + 0.0 turns the -0 it may start from into the +0
    # the C lanes start from.
    acc = np.add.accumulate(squares, axis=0)[-1] + 0.0
    return float(_tree(acc))


def adamw(
    p: np.ndarray,
    g: np.ndarray,
    m: np.ndarray,
    v: np.ndarray,
    h: Sequence[np.float32],
    decay: bool,
    *,
    threads: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scale, beta1, omb1, beta2, omb2, correction1, correction2, eps, lr, wd = (F32(x) for x in h)
    with np.errstate(all="ignore"):
        gs = g * scale
        m_new = m * beta1 + gs * omb1
        v_new = v * beta2 + (gs * omb2) * gs
        u = (m_new / correction1) / (np.sqrt(v_new / correction2) + eps)
        if decay:
            u = u + p * wd
        return p - u * lr, m_new, v_new
