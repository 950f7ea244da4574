"""The model kernels' public API: checks, compiled kernel or numpy twin, thread splitting.

tiny-gpt's non-GEMM arithmetic in float32 (GELU, layernorm, softmax, cross-entropy, column
sums, AdamW, the gradient norm), each a pure function of its inputs' bits. Work is split
across threads by rows (or columns, or elements) only, and every row is computed by one
thread in an order fixed by the shapes, so the bits never depend on the thread count, the
instruction set, or whether the twin ran (docs/kernels.md, "Model kernels").
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import numpy as np

from kernels import nn_reference
from kernels.gemm import KERNEL_ENV
from kernels.pool import run_ranges

try:
    from kernels import _nn
except ImportError:  # pragma: no cover - only when the extension was not built
    _nn = None

# How many threads the model kernels use when a call does not say; any value gives the same
# bits. Unset: one per CPU, at most MAX_DEFAULT_THREADS.
THREADS_ENV = "TILEHIVE_MODEL_THREADS"
MAX_DEFAULT_THREADS = 8

# What one element costs each kernel on one thread, in nanoseconds, with its arrays in cache
# (benchmarks/model_kernels.py measures them). Only estimates: they decide how many threads
# a call is worth, never a bit of its output.
_NS_PER_ELEMENT = {
    "gelu": 1.4,
    "gelu_backward": 0.25,
    "layernorm": 0.3,
    "layernorm_backward": 1.0,
    "colsum": 0.2,
    "add_bias": 0.1,
    "softmax": 0.85,
    "softmax_backward": 0.35,
    "cross_entropy": 0.85,
    "sumsq": 0.1,
    "adamw": 0.65,
}
# A thread is handed a range only when its share is worth this much work: handing ranges to
# the pool and waiting for them costs about 60 us on the reference machine, so a split that
# leaves each thread less than a few times that is slower than one thread.
_MIN_NS_PER_THREAD = 150_000


class AdamScalars(NamedTuple):
    """One AdamW step's float32 scalars, in the order the kernel takes them."""

    scale: np.float32
    beta1: np.float32
    one_minus_beta1: np.float32
    beta2: np.float32
    one_minus_beta2: np.float32
    correction1: np.float32
    correction2: np.float32
    eps: np.float32
    lr: np.float32
    weight_decay: np.float32


def use_reference() -> bool:
    """True when TILEHIVE_KERNEL asks for the numpy twins, or the extension is missing."""
    return _nn is None or os.environ.get(KERNEL_ENV, "").strip().lower() == "reference"


def kernel_name() -> str:
    """The implementation the next call will use: "reference", "avx512", "avx2", "generic"."""
    return "reference" if use_reference() else _nn.kernel_name()


# A cap on the default set by the process (limit_threads): the coordinator leaves the cores
# that volunteers on its machine compute on to them. None: the CPU count alone.
_cap: int | None = None


def default_threads() -> int:
    """TILEHIVE_MODEL_THREADS when set, else the CPU count (at most MAX_DEFAULT_THREADS, and
    at most the cap of `limit_threads`)."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if value:
        threads = int(value)
        if threads < 1:
            raise ValueError(f"{THREADS_ENV} must be a positive integer, got {value!r}")
        return threads
    threads = max(1, min(MAX_DEFAULT_THREADS, cpu_count()))
    return threads if _cap is None else min(threads, _cap)


def limit_threads(cap: int | None) -> None:
    """From now on use at most `cap` threads by default in this process (None: no cap).
    TILEHIVE_MODEL_THREADS, the operator's own word, is never capped. Any thread count gives
    the same bits, so this may change between two calls."""
    global _cap
    if cap is not None and cap < 1:
        raise ValueError(f"a thread cap must be a positive integer, got {cap!r}")
    _cap = cap


@functools.cache
def cpu_count() -> int:
    # os.cpu_count() reads /sys on every call, and the model asks before every operation.
    return os.cpu_count() or 1


def _splits(kernel: str, count: int, work_each: int, threads: int | None) -> list[tuple[int, int]]:
    """[0, count) in at most `threads` contiguous ranges, each worth starting a thread for:
    `work_each` elements of `kernel`'s work per unit of the count."""
    if count <= 0:
        return []
    threads = default_threads() if threads is None else threads
    work_ns = count * max(1, work_each) * _NS_PER_ELEMENT[kernel]
    useful = max(1, min(threads, count, int(work_ns // _MIN_NS_PER_THREAD)))
    chunk = -(-count // useful)
    return [(start, min(count, start + chunk)) for start in range(0, count, chunk)]


def _f32(name: str, x: object, ndim: int | None = None) -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.dtype != np.float32:
        raise ValueError(f"{name} must be a float32 numpy.ndarray")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {x.shape}")
    return x


def _same(name: str, x: object, shape: tuple[int, ...]) -> np.ndarray:
    x = _f32(name, x)
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {x.shape}")
    return x


def _rows(x: np.ndarray) -> tuple[int, int]:
    """(rows, row length) of an array seen as rows of its last axis."""
    n = x.shape[-1] if x.ndim else 1
    return (x.size // n if n else 0), n


# ---- the kernels -------------------------------------------------------------------------


def gelu(
    x: np.ndarray, bias: np.ndarray | None = None, *, threads: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(gelu(x), t) with GELU's tanh approximation; t is what gelu_backward needs.

    With `bias`, x += bias first, in place (x then holds the pre-activation for backward).
    """
    x = _f32("x", x, 2)
    if bias is not None:
        bias = _same("bias", bias, (x.shape[1],))
    if use_reference():
        return nn_reference.gelu(x, bias)
    rows, n = x.shape
    y, t = np.empty_like(x), np.empty_like(x)
    if x.size:
        run_ranges(
            lambda r0, r1: _nn.gelu_fwd(x, bias, y, t, r0, r1, n), _splits("gelu", rows, n, threads)
        )
    return y, t


def gelu_backward(
    dy: np.ndarray, x: np.ndarray, t: np.ndarray, *, threads: int | None = None
) -> np.ndarray:
    """dy * gelu'(x), from gelu's x and t."""
    x = _f32("x", x, 2)
    dy, t = _same("dy", dy, x.shape), _same("t", t, x.shape)
    if use_reference():
        return nn_reference.gelu_backward(dy, x, t)
    rows, n = x.shape
    dx = np.empty_like(x)
    if x.size:
        run_ranges(
            lambda r0, r1: _nn.gelu_bwd(dy, x, t, dx, r0, r1, n),
            _splits("gelu_backward", rows, n, threads),
        )
    return dx


def layernorm(
    x: np.ndarray, g: np.ndarray, b: np.ndarray, eps: float, *, threads: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(y, xhat, inv) per row: xhat = (x - mean) * inv, inv = 1 / sqrt(var + eps), y = xhat*g+b."""
    x = _f32("x", x, 2)
    g, b = _same("g", g, (x.shape[1],)), _same("b", b, (x.shape[1],))
    if use_reference():
        return nn_reference.layernorm(x, g, b, eps)
    rows, n = x.shape
    y, xhat, inv = np.empty_like(x), np.empty_like(x), np.empty(rows, np.float32)
    if x.size:
        e = float(np.float32(eps))
        run_ranges(
            lambda r0, r1: _nn.layernorm_fwd(x, g, b, e, y, xhat, inv, r0, r1, n),
            _splits("layernorm", rows, n, threads),
        )
    return y, xhat, inv


def layernorm_backward(
    dy: np.ndarray,
    xhat: np.ndarray,
    inv: np.ndarray,
    g: np.ndarray,
    *,
    threads: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dx, dg, db) of layernorm; dg and db are column sums over the rows (see colsum)."""
    xhat = _f32("xhat", xhat, 2)
    rows, n = xhat.shape
    dy = _same("dy", dy, xhat.shape)
    inv, g = _same("inv", inv, (rows,)), _same("g", g, (n,))
    if use_reference():
        return nn_reference.layernorm_backward(dy, xhat, inv, g)
    dx = np.empty_like(dy)
    if dy.size:
        run_ranges(
            lambda r0, r1: _nn.layernorm_bwd(dy, xhat, inv, g, dx, r0, r1, n),
            _splits("layernorm_backward", rows, n, threads),
        )
    return dx, colsum(dy, xhat, threads=threads), colsum(dy, threads=threads)


def colsum(a: np.ndarray, b: np.ndarray | None = None, *, threads: int | None = None) -> np.ndarray:
    """The sum over rows of a 2-D a (of a * b elementwise, when b is given), per column.

    Rows go in blocks of 32, each block summed top-down from +0, then the blocks' sums added
    top-down; threads split the columns.
    """
    a = _f32("a", a, 2)
    if b is not None:
        b = _same("b", b, a.shape)
    if use_reference():
        return nn_reference.colsum(a, b)
    rows, cols = a.shape
    out = np.zeros(cols, np.float32)
    if a.size:
        run_ranges(
            lambda c0, c1: _nn.colsum(a, b, out, rows, cols, c0, c1),
            _splits("colsum", cols, rows, threads),
        )
    return out


def add_bias(x: np.ndarray, bias: np.ndarray, *, threads: int | None = None) -> np.ndarray:
    """x += bias on every row, in place; returns x."""
    x = _f32("x", x, 2)
    bias = _same("bias", bias, (x.shape[1],))
    if use_reference():
        return nn_reference.add_bias(x, bias)
    rows, n = x.shape
    if x.size:
        run_ranges(
            lambda r0, r1: _nn.add_bias(x, bias, r0, r1, n), _splits("add_bias", rows, n, threads)
        )
    return x


def _check_softmax(s: np.ndarray, causal: bool) -> None:
    if s.ndim < 2 or (causal and s.shape[-1] != s.shape[-2]):
        raise ValueError(f"a causal softmax needs (..., T, T) scores, got shape {s.shape}")


def softmax(s: np.ndarray, scale: float, causal: bool, *, threads: int | None = None) -> np.ndarray:
    """softmax(s * scale) over the last axis; causal: row i of each T x T block sees 0..i.

    The masked entries are never read and come out +0.
    """
    s = _f32("s", s)
    _check_softmax(s, causal)
    if use_reference():
        return nn_reference.softmax(s, scale, causal)
    rows, n = _rows(s)
    p = np.empty_like(s)
    if s.size:
        sc = float(np.float32(scale))
        run_ranges(
            lambda r0, r1: _nn.softmax_fwd(s, sc, bool(causal), p, r0, r1, n),
            _splits("softmax", rows, n, threads),
        )
    return p


def softmax_backward(
    p: np.ndarray, dp: np.ndarray, scale: float, causal: bool, *, threads: int | None = None
) -> np.ndarray:
    """The gradient with respect to s of softmax(s * scale), given p and dL/dp."""
    p = _f32("p", p)
    dp = _same("dp", dp, p.shape)
    _check_softmax(p, causal)
    if use_reference():
        return nn_reference.softmax_backward(p, dp, scale, causal)
    rows, n = _rows(p)
    ds = np.empty_like(p)
    if p.size:
        sc = float(np.float32(scale))
        run_ranges(
            lambda r0, r1: _nn.softmax_bwd(p, dp, sc, bool(causal), ds, r0, r1, n),
            _splits("softmax_backward", rows, n, threads),
        )
    return ds


def cross_entropy(
    logits: np.ndarray, targets: np.ndarray, *, threads: int | None = None
) -> tuple[float, np.ndarray]:
    """The mean negative log-likelihood of targets, and its gradient for the logits."""
    logits = _f32("logits", logits, 2)
    rows, n = logits.shape
    targets = np.ascontiguousarray(np.asarray(targets).reshape(-1), dtype=np.int64)
    if targets.shape != (rows,) or rows == 0 or n == 0:
        raise ValueError(f"need one target per row of non-empty logits {logits.shape}")
    if targets.min() < 0 or targets.max() >= n:
        raise ValueError(f"targets must lie in [0, {n})")
    if use_reference():
        return nn_reference.cross_entropy(logits, targets)
    count = np.float32(rows)
    loss, dlogits = np.empty(rows, np.float32), np.empty_like(logits)
    run_ranges(
        lambda r0, r1: _nn.cross_entropy(logits, targets, float(count), loss, dlogits, r0, r1, n),
        _splits("cross_entropy", rows, n, threads),
    )
    return float(np.float32(_nn.total(loss)) / count), dlogits


def sumsq(x: np.ndarray) -> float:
    """sum(x**2) in float64, in the lane order of every reduction (exact squares)."""
    x = _f32("x", x)
    if use_reference():
        return nn_reference.sumsq(x)
    return _nn.sumsq(x) if x.size else 0.0


def global_norm(tensors: list[np.ndarray], *, threads: int | None = None) -> float:
    """sqrt of the sum of every tensor's sumsq, added in list order in float64."""
    sums = [0.0] * len(tensors)

    def part(i0: int, i1: int) -> None:
        for i in range(i0, i1):
            sums[i] = sumsq(tensors[i])

    total_size = sum(t.size for t in tensors)
    run_ranges(part, _splits("sumsq", len(tensors), total_size // max(1, len(tensors)), threads))
    total = 0.0
    for s in sums:
        total += s
    return float(np.sqrt(total))


def adamw(
    p: np.ndarray,
    g: np.ndarray,
    m: np.ndarray,
    v: np.ndarray,
    h: AdamScalars,
    decay: bool,
    *,
    threads: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One AdamW step of a tensor: (new p, new m, new v); the inputs are not changed.

    g is scaled by h.scale (the clipping factor) first; decay adds weight_decay * p.
    """
    p = _f32("p", p)
    g, m, v = _same("g", g, p.shape), _same("m", m, p.shape), _same("v", v, p.shape)
    h = AdamScalars(*(np.float32(x) for x in h))
    if use_reference():
        return nn_reference.adamw(p, g, m, v, h, decay)
    p_out, m_out, v_out = np.empty_like(p), np.empty_like(p), np.empty_like(p)
    scalars = tuple(float(x) for x in h)
    run_ranges(
        lambda e0, e1: _nn.adamw(p, g, m, v, p_out, m_out, v_out, e0, e1, scalars, bool(decay)),
        _splits("adamw", p.size, 1, threads),
    )
    return p_out, m_out, v_out


def force_kernel(name: str) -> None:
    """Run every later compiled model kernel on one instruction set (for tests)."""
    if _nn is None:  # pragma: no cover
        raise ValueError("the compiled model kernels are not built")
    _nn.force_kernel(name)
