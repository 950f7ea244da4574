"""The Freivalds check of a volunteer's tile against its operands (docs/validation.md)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

import blake3
import numpy as np

from kernels.checks import check_matrix, op_shape
from kernels.gemm import KERNEL_ENV

try:
    from validation import _probe
except ImportError:  # pragma: no cover - only when the extension was not built
    _probe = None

# Each round misses a wrong element with probability at most 1/2, so a tile with an error
# above the bound passes all of them with probability at most 2**-rounds. The default is the
# most that fits the brief's cost bar, a check <= 5% of computing a 512^3 tile, with the
# operands in cache (2 rounds measured 4.4-5.2%, 3 rounds 5.3-5.7%); with them in memory any
# number of rounds up to 4 costs 6-7%, the price of reading them (docs/validation.md).
DEFAULT_ROUNDS = 2
MAX_ROUNDS = 64
KEY_BYTES = 32  # blake3's keyed mode takes exactly this

_U32 = Fraction(1, 2**24)  # unit roundoff of float32
_U64 = Fraction(1, 2**53)  # unit roundoff of float64
_ETA32 = Fraction(1, 2**150)  # largest error of rounding a tiny result to a float32 subnormal
_VELTKAMP = 536870913.0  # 2**29 + 1: splits a float64 into 24 significant bits and the rest


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
    finite: bool = True  # False: a, b or c held NaN or inf, Freivalds cannot decide (quorum does)


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


@lru_cache(maxsize=256)
def tolerance(n: int, k: int) -> tuple[float, float]:
    """(cz, c0) with tau_i = cz * z_i + c0, both rounded up; the derivation, term by term, is
    in docs/validation.md ("The bound")."""
    if k * _U32 >= Fraction(1, 2):
        raise ValueError(f"K = {k} is too large for a float32 error bound (must be < 2**23)")
    u, v = _U32, _U64
    g32, g_n, g_k = _gamma(k, u), _gamma(n, v), _gamma(k, v)
    theta = n * k * _ETA32 * (1 + g32)  # the kernel's underflows, summed over a row
    y_err = g_n + u * (1 + g_n)  # |y24_k - y_k| <= y_err * w_k
    # Honest: |R_i| <= (1 + v)(alpha z_i + theta + g_n s_i) and s_i <= (1 + g32) z_i + theta.
    alpha = g32 + g_k * (1 + u) * (1 + g_n) + y_err + g_n * (1 + g32)
    # z_i <= z_hat_i / (...); (1 + v): the rounding of R; (1 - v)**2: the two roundings of tau.
    slack = (1 + v) / (1 - v) ** 2
    cz = slack * alpha / ((1 - g_k) * (1 - u) * (1 - g_n))
    return _round_up(cz), _round_up(slack * (1 + g_n) * theta)


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
    cz, c0 = tolerance(n, k)
    if use_reference():
        signs = probe_signs(key, wu_id, rounds, n)
        raw = _freivalds_numpy(a, b, c, trans_a, trans_b, signs, cz, c0)
    else:
        raw = _probe.freivalds(a, b, c, trans_a, trans_b, bits, rounds, cz, c0)
    return _result(raw, rounds)


def _result(raw: tuple, rounds: int) -> FreivaldsResult:
    ok, nonfinite, row, t, residual, bound, ratio = raw
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


def _round24(y: np.ndarray) -> np.ndarray:
    """y rounded to nearest on 24 significant bits (Veltkamp's split), as probe_impl.c does."""
    high = y * _VELTKAMP
    return high - (high - y)


def _combine(lanes: np.ndarray) -> np.ndarray:
    """((S0+S4)+(S2+S6))+((S1+S5)+(S3+S7)) over axis 1 of length 8."""
    s4 = lanes[:, :4] + lanes[:, 4:]
    s2 = s4[:, :2] + s4[:, 2:]
    return s2[:, 0] + s2[:, 1]


def _pass(mat: np.ndarray, trans: bool, x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, ...]:
    """(op(M) @ x, |op(M)| @ w) with every product exact and the additions in the fixed order."""
    m64 = mat.astype(np.float64)
    if trans:  # op(M)[:, q] is row q of M; each output sums in increasing q
        out = np.zeros((m64.shape[1], x.shape[1]))
        sums = np.zeros(m64.shape[1])
        for q in range(m64.shape[0]):
            out += m64[q][:, None] * x[q]
            sums += np.abs(m64[q]) * w[q]
        return out, sums
    # Lane l sums the terms q = l mod 8; zero padding adds +0.0, which changes no sum.
    pad = -m64.shape[1] % 8
    m64 = np.pad(m64, ((0, 0), (0, pad)))
    x, w = np.pad(x, ((0, pad), (0, 0))), np.pad(w, (0, pad))
    lanes = np.zeros((m64.shape[0], 8, x.shape[1]))
    abs_lanes = np.zeros((m64.shape[0], 8))
    for q in range(0, m64.shape[1], 8):
        block = m64[:, q : q + 8]
        lanes += block[:, :, None] * x[q : q + 8]
        abs_lanes += np.abs(block) * w[q : q + 8]
    return _combine(lanes), _combine(abs_lanes)


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
    ones = np.ones(c.shape[1])
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf when an input is not finite
        y, w = _pass(b, trans_b, signs, ones)
        cx, _ = _pass(c, False, signs, ones)
    nonfinite = (0 if np.isfinite(w).all() else 2) | (0 if np.isfinite(cx).all() else 4)
    if nonfinite:
        return (False, nonfinite, -1, 0, 0.0, 0.0, 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        ay, z = _pass(a, trans_a, _round24(y), _round24(w))
    if not np.isfinite(z).all():
        return (False, 1, -1, 0, 0.0, 0.0, 0.0)
    tau = (cz * z + c0)[:, None]
    residual = np.abs(cx - ay)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(residual == 0.0, 0.0, residual / tau)
    ok = not bool((residual > tau).any())
    if ratio.size == 0:
        return (ok, 0, -1, 0, 0.0, 0.0, 0.0)
    i, t = divmod(int(np.argmax(ratio)), ratio.shape[1])
    return (ok, 0, i, t, float(residual[i, t]), float(tau[i, 0]), float(ratio[i, t]))
