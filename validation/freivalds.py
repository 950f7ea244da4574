"""The Freivalds check of a volunteer's tile against its operands (docs/validation.md)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

import blake3
import numpy as np

from kernels.checks import check_matrix, op_shape
from kernels.gemm import KERNEL_ENV
from kernels.reference import fma32  # the kernels' twin emulates fmaf exactly

try:
    from validation import _probe
except ImportError:  # pragma: no cover - only when the extension was not built
    _probe = None

# Each round misses a wrong element with probability at most 1/2, so a tile with an error
# above the bound passes all of them with probability at most 2**-rounds. The default fits the
# brief's cost bar, a check <= 5% of computing a 512^3 tile (docs/validation.md, "Cost").
DEFAULT_ROUNDS = 2
MAX_ROUNDS = 64
KEY_BYTES = 32  # blake3's keyed mode takes exactly this

# The order of the check's sums, as in csrc/probe_impl.c (probe_impl.h).
LANES = 16  # partial sums over the contiguous index of a row-major operand
CHUNK = 16  # rows per partial sum over the row index of a transposed operand
OVERFLOW = 8  # the `nonfinite` flag of a check whose own float32 sums overflowed
# The widest tile whose sums the bound covers: no term through 2**23 roundings or more.
MAX_N = CHUNK * (2**23 - CHUNK - 1)

_U32 = Fraction(1, 2**24)  # unit roundoff of float32
_U64 = Fraction(1, 2**53)  # unit roundoff of float64
_ETA32 = Fraction(1, 2**150)  # largest error of rounding a tiny result to a float32 subnormal


@dataclass(frozen=True, slots=True)
class FreivaldsResult:
    """A verdict: ok, and where the residual came closest to (or went over) its bound."""

    ok: bool
    residual: float  # |R_i^(t)| at the worst row and round (NaN when not finite)
    bound: float  # tau_i at that row (NaN when not finite)
    ratio: float  # max over rows and rounds of |R_i^(t)| / tau_i (inf when not finite)
    rounds: int
    reason: str
    row: int | None = None  # the worst row; None for an empty tile or non-finite input
    finite: bool = True  # False: NaN or inf in a, b or c, or the check's own sums overflowed:
    # Freivalds cannot decide (quorum does)


def use_reference() -> bool:
    """True when TILEHIVE_KERNEL asks for the numpy twin, or the extension is missing."""
    return _probe is None or os.environ.get(KERNEL_ENV, "").strip().lower() == "reference"


def kernel_name() -> str:
    """The implementation the next check will use: "reference" or the compiled variant."""
    return "reference" if use_reference() else _probe.kernel_name()


def _key(key: object) -> bytes:
    if not isinstance(key, bytes | bytearray):
        raise ValueError(f"key must be {KEY_BYTES} bytes, got {type(key).__name__}")
    if len(key) != KEY_BYTES:
        raise ValueError(f"key must be {KEY_BYTES} bytes, got {len(key)}")
    return bytes(key)


def _wu(wu_id: object) -> bytes:
    if isinstance(wu_id, str):
        return wu_id.encode()
    if isinstance(wu_id, bytes | bytearray):
        return bytes(wu_id)
    raise ValueError(f"wu_id must be str or bytes, got {type(wu_id).__name__}")


def _rounds(rounds: object) -> int:
    if isinstance(rounds, bool) or not isinstance(rounds, int | np.integer):
        raise ValueError(f"rounds must be an integer, got {type(rounds).__name__}")
    if not 1 <= rounds <= MAX_ROUNDS:
        raise ValueError(f"rounds must be between 1 and {MAX_ROUNDS}, got {rounds}")
    return int(rounds)


def probe_bits(key: bytes, wu_id: str | bytes, rounds: int, n: int) -> bytes:
    """The rounds * n probe bits of a work unit: bit t*n + j (little-endian in each byte) set
    means x_j^(t) = -1. Keyed by the validator's secret, so a volunteer cannot predict them."""
    length = -(-_rounds(rounds) * n // 8)
    return blake3.blake3(_wu(wu_id), key=_key(key)).digest(length=length)


def probe_signs(key: bytes, wu_id: str | bytes, rounds: int, n: int) -> np.ndarray:
    """The probe vectors as an n x rounds float64 array of +-1.0 (column t is x^(t))."""
    raw = np.frombuffer(probe_bits(key, wu_id, rounds, n), dtype=np.uint8)
    bits = np.unpackbits(raw, bitorder="little")[: rounds * n].reshape(rounds, n)
    return np.ascontiguousarray((1.0 - 2.0 * bits).T)


def _gamma(count: int, unit: Fraction) -> Fraction:
    return count * unit / (1 - count * unit)


def _round_up(x: Fraction) -> float:
    f = float(x)
    return f if Fraction(f) >= x else math.nextafter(f, math.inf)


def depth(q: int, trans: bool) -> int:
    """The most roundings a term of one of the check's q-term sums goes through: the fmaf
    steps of its lane (row-major) or chunk (transposed), then the additions after them."""
    if q == 0:
        return 0
    if trans:  # a chunk of up to CHUNK terms, then one addition per chunk into the total
        return min(q, CHUNK) + -(-q // CHUNK)
    return -(-q // LANES) + 4  # a lane of ceil(q / 16) terms, then 4 halvings of 16 lanes


@lru_cache(maxsize=256)
def tolerance(n: int, k: int, trans_a: bool = False, trans_b: bool = False) -> tuple[float, float]:
    """(cz, c0) with tau_i = cz * z_i + c0, both rounded up; the derivation, term by term, is
    in docs/validation.md ("The bound")."""
    if k * _U32 >= Fraction(1, 2):
        raise ValueError(f"K = {k} is too large for a float32 error bound (must be < 2**23)")
    if n > MAX_N:
        raise ValueError(f"n = {n} is too large for the check's float32 sums (at most {MAX_N:,})")
    u, v = _U32, _U64
    g_kernel = _gamma(k, u)  # the honest kernel: K fused multiply-adds in a row
    g_b = _gamma(depth(n, trans_b), u)  # y = op(B) x and w = |op(B)| 1
    g_c = _gamma(depth(n, False), u)  # Cx
    g_a = _gamma(depth(k, trans_a), u)  # op(A) y and z = |op(A)| w
    theta = n * k * _ETA32 * (1 + g_kernel)  # the kernel's underflows, summed over a row
    under = k * _ETA32 * (1 + g_a)  # the check's own, in op(A) y and in z
    # Honest: |R_i| <= (1 + v)(alpha z_i + beta), with s_i <= (1 + g_kernel) z_i + theta.
    alpha = g_kernel + g_c * (1 + g_kernel) + g_a * (1 + g_b) + g_b
    beta = (1 + g_c) * theta + under
    # z_i <= (z_hat_i + under) / den; (1 + v): the rounding of R; (1 - v)**2: those of tau.
    den = (1 - g_a) * (1 - g_b)
    slack = (1 + v) / (1 - v) ** 2
    return _round_up(slack * alpha / den), _round_up(slack * (alpha * under / den + beta))


def verify(
    a: np.ndarray,
    b: np.ndarray,
    c: np.ndarray,
    *,
    trans_a: bool = False,
    trans_b: bool = False,
    key: bytes,
    wu_id: str | bytes,
    rounds: int = DEFAULT_ROUNDS,
) -> FreivaldsResult:
    """Check that c is op(a) @ op(b) as kernels.gemm computes it, up to float32 rounding.

    An honest tile of finite operands with a finite result always passes; a tile with an
    element further from the exact product than its row's bound passes with probability at
    most 2**-rounds over the probes, which (key, wu_id) determine: the same call always gives
    the same verdict. a, b, c must be C-contiguous float32 matrices, c of shape
    (rows of op(a), columns of op(b)); key is the validator's 32-byte secret. Raises
    ValueError on any other input.
    """
    a, b, c = check_matrix("a", a), check_matrix("b", b), check_matrix("c", c)
    trans_a, trans_b = bool(trans_a), bool(trans_b)
    m, k = op_shape(a, trans_a)
    k_b, n = op_shape(b, trans_b)
    if k != k_b:
        raise ValueError(
            f"inner dimensions differ: op(a) is {m}x{k} but op(b) is {k_b}x{n} "
            f"(trans_a={trans_a}, trans_b={trans_b})"
        )
    if c.shape != (m, n):
        raise ValueError(
            f"c must have shape {(m, n)} (op(a) is {m}x{k}, op(b) {k}x{n}), got {c.shape}"
        )
    rounds = _rounds(rounds)
    bits = probe_bits(key, wu_id, rounds, n)
    cz, c0 = tolerance(n, k, trans_a, trans_b)
    if use_reference():
        signs = probe_signs(key, wu_id, rounds, n)
        raw = _freivalds_numpy(a, b, c, trans_a, trans_b, signs, cz, c0)
    else:
        raw = _probe.freivalds(a, b, c, trans_a, trans_b, bits, rounds, cz, c0)
    return _result(raw, rounds)


def _result(raw: tuple, rounds: int) -> FreivaldsResult:
    ok, nonfinite, row, t, residual, bound, ratio = raw
    if nonfinite == OVERFLOW:
        reason = (
            "the check's float32 sums overflowed (operands too large for it): "
            "Freivalds cannot decide this tile, quorum must"
        )
        return FreivaldsResult(False, math.nan, math.nan, math.inf, rounds, reason, None, False)
    if nonfinite:
        names = " and ".join(
            name for bit, name in ((1, "a"), (2, "b"), (4, "c")) if nonfinite & bit
        )
        reason = f"non-finite values in {names}: Freivalds cannot decide this tile, quorum must"
        return FreivaldsResult(False, math.nan, math.nan, math.inf, rounds, reason, None, False)
    if ok:
        reason = f"ok: max residual/bound {ratio:.2g} over {rounds} rounds"
    else:
        reason = f"freivalds residual {residual:.1e} > bound {bound:.1e} at row {row} (round {t})"
    return FreivaldsResult(ok, residual, bound, ratio, rounds, reason, row if row >= 0 else None)


# ---- the numpy twin: the same sums in the same order as probe_impl.c, so the same bits ----


def _combine(lanes: np.ndarray) -> np.ndarray:
    """The 16 lane sums on axis 1 halved as probe_impl.c does: l + (l+8), then +4, +2, +1."""
    while lanes.shape[1] > 1:
        half = lanes.shape[1] // 2
        lanes = lanes[:, :half] + lanes[:, half:]
    return lanes[:, 0]


def _exact_fma(v: np.ndarray, s: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """fmaf(v, s, acc) when v * s is exact in float32 (s is +-1 or 1): one rounding."""
    return acc + v * s


Fma = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def _pass(
    mat: np.ndarray, trans: bool, x: np.ndarray, w: np.ndarray, fma: Fma = _exact_fma
) -> tuple[np.ndarray, np.ndarray]:
    """(op(M) @ x, |op(M)| @ w) in float32, each term added by fma, in probe_impl.c's order."""
    if trans:  # op(M)[:, q] is row q of M: chunks of CHUNK rows, then the chunks in order
        out = np.zeros((mat.shape[1], x.shape[1]), np.float32)
        sums = np.zeros(mat.shape[1], np.float32)
        for q0 in range(0, mat.shape[0], CHUNK):
            part, abs_part = np.zeros_like(out), np.zeros_like(sums)
            for q in range(q0, min(mat.shape[0], q0 + CHUNK)):
                part = fma(mat[q][:, None], x[q], part)
                abs_part = fma(np.abs(mat[q]), w[q], abs_part)
            out, sums = out + part, sums + abs_part
        return out, sums
    # Lane l sums the terms q = l mod 16, up to a whole block: the padding adds +0.0, which
    # changes no sum but a -0.0 (into +0.0), as in every compiled variant.
    pad = -mat.shape[1] % LANES
    mat = np.pad(mat, ((0, 0), (0, pad)))
    x, w = np.pad(x, ((0, pad), (0, 0))), np.pad(w, (0, pad))
    lanes = np.zeros((mat.shape[0], LANES, x.shape[1]), np.float32)
    abs_lanes = np.zeros((mat.shape[0], LANES), np.float32)
    for q in range(0, mat.shape[1], LANES):
        block = mat[:, q : q + LANES]
        lanes = fma(block[:, :, None], x[q : q + LANES], lanes)
        abs_lanes = fma(np.abs(block), w[q : q + LANES], abs_lanes)
    return _combine(lanes), _combine(abs_lanes)


def _why_not_finite(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> int:
    found = sum(bit for bit, m in ((1, a), (2, b), (4, c)) if not np.isfinite(m).all())
    return found or OVERFLOW


def _freivalds_numpy(
    a: np.ndarray,
    b: np.ndarray,
    c: np.ndarray,
    trans_a: bool,
    trans_b: bool,
    signs: np.ndarray,
    cz: float,
    c0: float,
) -> tuple:
    """What th_freivalds returns, computed with numpy (slow, same bits)."""
    signs = signs.astype(np.float32)
    ones = np.ones(c.shape[1], np.float32)
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf when an input is not finite
        y, w = _pass(b, trans_b, signs, ones)
        cx, _ = _pass(c, False, signs, ones)
        finite = np.isfinite(w).all() and np.isfinite(cx).all()
        if finite:
            ay, z = _pass(a, trans_a, y, w, fma32)
            finite = np.isfinite(z).all() and np.isfinite(ay).all()
    if not finite:
        return (False, _why_not_finite(a, b, c), -1, 0, 0.0, 0.0, 0.0)
    tau = (cz * z.astype(np.float64) + c0)[:, None]
    residual = np.abs(cx.astype(np.float64) - ay.astype(np.float64))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(residual == 0.0, 0.0, residual / tau)
    ok = not bool((residual > tau).any())
    if ratio.size == 0:
        return (ok, 0, -1, 0, 0.0, 0.0, 0.0)
    i, t = divmod(int(np.argmax(ratio)), ratio.shape[1])
    return (ok, 0, i, t, float(residual[i, t]), float(tau[i, 0]), float(ratio[i, t]))
