"""validation.freivalds: honest tiles pass, wrong tiles fail, probes, and both paths agree."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from tests.factories import operands
from validation import freivalds
from validation.freivalds import FreivaldsResult, probe_signs, tolerance, verify

try:
    from validation import _probe
except ImportError:  # pragma: no cover - only when the extension was not built
    _probe = None

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
Trans = tuple[bool, bool]
TRANS: list[Trans] = list(itertools.product([False, True], repeat=2))
needs_compiled = pytest.mark.skipif(_probe is None, reason="validation._probe is not built")


@pytest.fixture(params=["compiled", "reference"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test on the compiled check and again on the numpy twin."""
    if request.param == "compiled":
        if _probe is None:
            pytest.skip("validation._probe is not built")
        monkeypatch.delenv(freivalds.KERNEL_ENV, raising=False)
    else:
        monkeypatch.setenv(freivalds.KERNEL_ENV, "reference")
    return request.param


def honest(
    rng: np.random.Generator, m: int, k: int, n: int, trans_a: bool, trans_b: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    a, b = operands(rng, m, n, k, trans_a, trans_b)
    return a, b, kernels.gemm(a, b, trans_a=trans_a, trans_b=trans_b)


def check(
    a: np.ndarray, b: np.ndarray, c: np.ndarray, trans: Trans = (False, False), **kw: object
) -> FreivaldsResult:
    kw.setdefault("key", KEY)
    kw.setdefault("wu_id", "wu-1")
    return verify(a, b, c, trans_a=trans[0], trans_b=trans[1], **kw)


def every_path(
    a: np.ndarray, b: np.ndarray, c: np.ndarray, trans: Trans = (False, False), **kw: object
) -> FreivaldsResult:
    """The verdict of every compiled variant and of the numpy twin, asserted identical."""
    results = []
    if _probe is not None:
        default = _probe.kernel_name()
        for name in ("avx512", "avx2", "generic"):
            try:
                _probe.force_kernel(name)
            except ValueError:
                continue
            results.append(check(a, b, c, trans, **kw))
        _probe.force_kernel(default)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(freivalds.KERNEL_ENV, "reference")
        results.append(check(a, b, c, trans, **kw))
    first = results[0]
    for other in results[1:]:
        assert repr(other) == repr(first)  # repr: NaN fields compare equal as text
    return first


# ---- honest tiles always pass ----

SHAPES = [(1, 1, 1), (1, 9, 1), (7, 1, 5), (5, 3, 1), (17, 33, 9), (31, 129, 47), (64, 64, 64)]


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
@pytest.mark.parametrize("trans", TRANS)
def test_honest_tiles_pass(
    path: str, rng: np.random.Generator, m: int, k: int, n: int, trans: Trans
) -> None:
    a, b, c = honest(rng, m, k, n, *trans)
    result = check(a, b, c, trans)
    assert result.ok, result.reason
    assert result.finite and result.rounds == freivalds.DEFAULT_ROUNDS
    assert 0 <= result.ratio <= 1 and result.residual <= result.bound
    assert result.reason.startswith("ok: max residual/bound")


@settings(max_examples=120, deadline=None, derandomize=True)
@given(
    m=st.integers(0, 24),
    k=st.integers(0, 40),
    n=st.integers(0, 24),
    trans=st.sampled_from(TRANS),
    exps=st.tuples(st.integers(-10, 10), st.integers(-10, 10)),
    mixed=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_honest_tiles_pass_any_shape_and_scale(
    m: int, k: int, n: int, trans: Trans, exps: tuple[int, int], mixed: bool, seed: int
) -> None:
    """Shapes down to 0 and 1, all trans flags, magnitudes 1e-15..1e15, stored rows of a and
    columns of b at wildly different scales: an honest tile passes, on every path alike."""
    rng = np.random.default_rng(seed)
    a, b = operands(rng, m, n, k, *trans)
    a *= np.float32(10.0 ** exps[0])
    b *= np.float32(10.0 ** exps[1])
    if mixed:
        a *= (10.0 ** rng.integers(-5, 6, size=(a.shape[0], 1))).astype(np.float32)
        b *= (10.0 ** rng.integers(-5, 6, size=(1, b.shape[1]))).astype(np.float32)
    c = kernels.gemm(a, b, trans_a=trans[0], trans_b=trans[1])
    assert np.isfinite(c).all()
    result = every_path(a, b, c, trans, wu_id=f"h{seed}")
    assert result.ok, result.reason


@pytest.mark.parametrize("scale", [1e17, 1e-17, 2.0**-70])
def test_honest_extreme_magnitudes_pass(path: str, rng: np.random.Generator, scale: float) -> None:
    """Near float32 overflow (products ~1e34 summed), and deep in the subnormal range, where
    the kernel's products underflow and only the c0 term of the bound covers the error."""
    a, b = operands(rng, 32, 48, 24, False, False)
    a *= np.float32(scale)
    b *= np.float32(scale)
    c = kernels.gemm(a, b)
    assert np.isfinite(c).all()
    result = check(a, b, c)
    assert result.ok, result.reason


def test_underflow_needs_the_c0_term(rng: np.random.Generator) -> None:
    """Why the bound has c0: products of size 2**-150 round to 0 or 2**-149 in the kernel."""
    a, b = operands(rng, 16, 16, 16, False, False)
    a, b = a * np.float32(2.0**-75), b * np.float32(2.0**-75)
    c = kernels.gemm(a, b)
    cz, _ = tolerance(16, 16)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    z = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)).sum(axis=1)
    assert (np.abs(c - exact).sum(axis=1) > cz * z).any()  # some row needs c0
    assert check(a, b, c).ok


def test_empty_tiles(path: str) -> None:
    zeros = np.zeros
    for m, k, n in [(0, 3, 4), (3, 4, 0), (0, 0, 0), (3, 0, 4)]:
        a, b = zeros((m, k), np.float32), zeros((k, n), np.float32)
        result = check(a, b, zeros((m, n), np.float32))
        assert result.ok and result.ratio == 0
    # K = 0: the product is all zeros, so anything else is wrong.
    assert not check(
        zeros((3, 0), np.float32), zeros((0, 4), np.float32), np.ones((3, 4), np.float32)
    ).ok


def test_read_only_tile_from_bytes(rng: np.random.Generator) -> None:
    a, b, c = honest(rng, 8, 8, 8, False, False)
    frozen = np.frombuffer(c.tobytes(), dtype=np.float32).reshape(c.shape)
    assert not frozen.flags.writeable
    assert check(a, b, frozen).ok


# ---- wrong tiles are rejected ----


def corrupt(
    kind: str, rng: np.random.Generator, a: np.ndarray, b: np.ndarray, c: np.ndarray, trans: Trans
) -> np.ndarray:
    bad = c.copy()
    if kind == "one element":
        bad[3, 2] += np.float32(1e-2 * (1 + abs(bad[3, 2])))
    elif kind == "row zeroed":
        bad[5] = 0
    elif kind == "scaled":
        bad *= np.float32(1.001)
    elif kind == "transposed":
        bad = np.ascontiguousarray(c.T)
    elif kind == "another product":
        a2, b2 = operands(rng, c.shape[0], c.shape[1], 32, *trans)
        bad = kernels.gemm(a2, b2, trans_a=trans[0], trans_b=trans[1])
    elif kind == "last bit of every element":
        bad = (c.view(np.uint32) ^ np.uint32(1)).view(np.float32)
    return bad


@pytest.mark.parametrize(
    "kind", ["one element", "row zeroed", "scaled", "transposed", "another product"]
)
@pytest.mark.parametrize("trans", TRANS)
def test_wrong_tiles_rejected(path: str, rng: np.random.Generator, kind: str, trans: Trans) -> None:
    a, b, c = honest(rng, 24, 32, 24, *trans)
    result = check(a, b, corrupt(kind, rng, a, b, c, trans), trans)
    assert not result.ok and result.finite
    assert result.ratio > 1 and result.residual > result.bound
    assert f"at row {result.row}" in result.reason
    assert result.reason.startswith("freivalds residual ")


def test_bit_level_deviation_is_left_to_quorum(rng: np.random.Generator) -> None:
    """One ulp everywhere is within the rounding bound: Freivalds accepts it, by design."""
    a, b, c = honest(rng, 24, 32, 24, False, False)
    assert check(a, b, corrupt("last bit of every element", rng, a, b, c, (False, False))).ok


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_tile_rejected(path: str, rng: np.random.Generator, value: float) -> None:
    a, b, c = honest(rng, 12, 12, 12, False, False)
    c[4, 4] = value
    result = check(a, b, c)
    assert not result.ok and not result.finite
    assert math.isnan(result.residual) and result.ratio == math.inf and result.row is None
    assert result.reason.startswith("non-finite values in c")


@pytest.mark.parametrize(("where", "names"), [("a", "a"), ("b", "b"), ("bc", "b and c")])
def test_non_finite_operands_left_to_quorum(
    path: str, rng: np.random.Generator, where: str, names: str
) -> None:
    a, b, c = honest(rng, 12, 12, 12, False, False)
    for name in where:
        {"a": a, "b": b, "c": c}[name][2, 3] = np.nan
    result = check(a, b, c)
    assert not result.ok and not result.finite
    assert result.reason.startswith(f"non-finite values in {names}:")


def test_honest_overflow_is_non_finite(path: str) -> None:
    """Finite operands whose product overflows: the tile holds inf, quorum decides."""
    a = np.full((2, 4), 1e20, np.float32)
    b = np.full((4, 2), 1e20, np.float32)
    c = kernels.gemm(a, b)
    assert np.isinf(c).all()
    result = check(a, b, c)
    assert not result.ok and not result.finite


def test_check_overflow_is_left_to_quorum() -> None:
    """Finite operands and a finite product, but a row's sum of |a||b| (n times an element's
    worst case) beyond float32's range: the check's own sums overflow, so it cannot decide."""
    a = np.full((2, 64), 4e17, np.float32)
    b = np.full((64, 64), 4e17, np.float32)
    c = kernels.gemm(a, b)
    assert np.isfinite(c).all()
    result = every_path(a, b, c)
    assert not result.ok and not result.finite and result.row is None
    assert result.reason.startswith("the check's float32 sums overflowed")


# ---- probes ----


def test_probes_are_reproducible_and_keyed() -> None:
    x = probe_signs(KEY, "wu-1", 8, 100)
    assert x.shape == (100, 8) and x.dtype == np.float64
    assert set(np.unique(x)) == {-1.0, 1.0}
    assert np.array_equal(x, probe_signs(KEY, b"wu-1", 8, 100))  # str and its utf-8 bytes
    assert not np.array_equal(x, probe_signs(OTHER_KEY, "wu-1", 8, 100))
    assert not np.array_equal(x, probe_signs(KEY, "wu-2", 8, 100))
    # More rounds extend the probes: round t does not depend on how many follow.
    assert np.array_equal(probe_signs(KEY, "wu-1", 3, 100), x[:, :3])
    assert abs(x.mean()) < 0.15  # balanced signs


def test_same_call_same_verdict_other_key_other_probes(rng: np.random.Generator) -> None:
    a, b, c = honest(rng, 16, 16, 16, False, False)
    c[2, 1] += 5.0
    c[2, 9] += 5.0  # cancels out whenever x_1 = -x_9
    first = check(a, b, c, rounds=1)
    assert check(a, b, c, rounds=1) == first
    verdicts = {check(a, b, c, rounds=1, key=bytes([i]) * 32).ok for i in range(40)}
    assert verdicts == {True, False}  # the key decides which way that 1/2 goes


# ---- the false-accept rate ----

TRIALS = 2000


@pytest.mark.parametrize("rounds", [1, 2, 8])
def test_false_accept_rate_matches_two_to_minus_rounds(
    rng: np.random.Generator, rounds: int
) -> None:
    """Two equal errors in one row cancel exactly when their probe signs differ: each round
    misses them with probability 1/2, so a tile is accepted with probability 2**-rounds."""
    a, b, c = honest(rng, 8, 8, 8, False, False)
    c[3, 1] += 1.0
    c[3, 6] += 1.0
    accepted = sum(check(a, b, c, rounds=rounds, wu_id=f"trial-{i}").ok for i in range(TRIALS))
    p = 2.0**-rounds
    slack = 4.5 * math.sqrt(TRIALS * p * (1 - p))  # a 4.5 sigma binomial interval
    assert abs(accepted - TRIALS * p) <= slack, accepted
    assert accepted <= TRIALS * p + slack


def test_a_single_large_error_is_always_caught(rng: np.random.Generator) -> None:
    a, b, c = honest(rng, 8, 8, 8, False, False)
    c[3, 1] += 1.0
    assert not any(check(a, b, c, rounds=1, wu_id=f"trial-{i}").ok for i in range(300))


# ---- the compiled check and the numpy twin agree bit for bit ----


@needs_compiled
@pytest.mark.parametrize("trans", TRANS)
@pytest.mark.parametrize("rounds", [1, 3, 8, 11])
def test_paths_agree(rng: np.random.Generator, trans: Trans, rounds: int) -> None:
    a, b, c = honest(rng, 37, 29, 21, *trans)
    for tile in (
        c,
        corrupt("one element", rng, a, b, c, trans),
        corrupt("scaled", rng, a, b, c, trans),
    ):
        every_path(a, b, tile, trans, rounds=rounds)


def at_offset(x: np.ndarray, offset: int) -> np.ndarray:
    """A copy of x whose data starts `offset` bytes past a 64-byte boundary."""
    buf = np.empty(x.nbytes + 128, np.uint8)
    start = -buf.ctypes.data % 64 + offset
    out = buf[start : start + x.nbytes].view(np.float32).reshape(x.shape)
    out[...] = x
    return out


@needs_compiled
@pytest.mark.parametrize("offset", [0, 4, 16, 36, 60])
@pytest.mark.parametrize("trans", TRANS)
def test_paths_agree_wherever_the_arrays_start(
    rng: np.random.Generator, offset: int, trans: Trans
) -> None:
    """Rows of a multiple of 16 floats off a 64-byte line (numpy's arrays start 16 bytes past
    one) take the AVX-512 sweep that assembles them from aligned lines: the same bits."""
    a, b, c = honest(rng, 35, 64, 48, *trans)
    for tile in (c, corrupt("one element", rng, a, b, c, trans)):
        moved = [at_offset(m, offset) for m in (a, b, tile)]
        assert [m.ctypes.data % 64 for m in moved] == [offset] * 3
        assert check(*moved, trans, rounds=3) == check(a, b, tile, trans, rounds=3)
        every_path(*moved, trans, rounds=3)


@needs_compiled
def test_compiled_variant_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(freivalds.KERNEL_ENV, raising=False)
    assert freivalds.kernel_name() in ("avx512", "avx2", "generic")


def test_missing_extension_falls_back_to_the_twin(
    rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, c = honest(rng, 9, 10, 11, False, True)
    c[2, 2] += 1.0
    expected = check(a, b, c, (False, True))
    monkeypatch.setattr(freivalds, "_probe", None)
    assert freivalds.kernel_name() == "reference"
    assert check(a, b, c, (False, True)) == expected


def test_reference_path_is_selected_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(freivalds.KERNEL_ENV, "reference")
    assert freivalds.kernel_name() == "reference"


# ---- the bound ----


def test_tolerance_covers_its_parts() -> None:
    u = 2.0**-24
    cz, c0 = tolerance(512, 512)
    # gamma_K of the kernel, plus the check's own float32 sums: 36 roundings at most in each
    # of op(B) x, Cx and op(A) y (a lane of 32 terms, then 4 halvings).
    assert (512 + 3 * 36) * u < cz < 1.001 * (512 + 3 * 36) * u
    assert c0 > 512 * 512 * 2.0**-150
    # A transposed operand is summed in chunks of 16 rows: 16 + 32 roundings instead of 36.
    assert tolerance(512, 512, True, False)[0] > cz + 11 * u
    assert tolerance(512, 512, True, True)[0] > tolerance(512, 512, True, False)[0] + 11 * u
    with pytest.raises(ValueError, match="too large"):
        tolerance(4, 2**23)
    with pytest.raises(ValueError, match="n = 134217457 is too large"):
        tolerance(freivalds.MAX_N + 1, 4)


@pytest.mark.parametrize(
    ("q", "trans", "expected"),
    [
        (0, False, 0),
        (1, False, 5),
        (16, False, 5),
        (17, False, 6),
        (512, False, 36),
        (1, True, 2),
        (16, True, 17),
        (17, True, 18),
        (512, True, 48),
    ],
)
def test_depth_counts_the_roundings_of_a_term(q: int, trans: bool, expected: int) -> None:
    assert freivalds.depth(q, trans) == expected


# ---- bad input ----

A = np.ones((3, 4), np.float32)
B = np.ones((4, 5), np.float32)
C = np.ones((3, 5), np.float32)


@pytest.mark.parametrize(
    ("args", "kw", "message"),
    [
        ((A.astype(np.float64), B, C), {}, "a must have dtype float32"),
        ((A, B, C.astype(np.float16)), {}, "c must have dtype float32"),
        ((A, [[1.0]], C), {}, "b must be a numpy.ndarray"),
        ((A, B, np.ones(15, np.float32)), {}, "c must be 2-D"),
        ((np.ones((4, 3), np.float32).T, B, C), {}, "a must be C-contiguous"),
        ((A, np.ones((3, 5), np.float32), C), {}, "inner dimensions differ"),
        ((A, B, np.ones((5, 3), np.float32)), {}, r"c must have shape \(3, 5\)"),
        ((A, B, C), {"trans_a": True}, "inner dimensions differ"),
        ((A, B, C), {"key": "k" * 32}, "key must be 32 bytes, got str"),
        ((A, B, C), {"key": bytes(31)}, "key must be 32 bytes, got 31"),
        ((A, B, C), {"key": None}, "key must be 32 bytes, got NoneType"),
        ((A, B, C), {"wu_id": 7}, "wu_id must be str or bytes"),
        ((A, B, C), {"rounds": 0}, "rounds must be between 1 and 64"),
        ((A, B, C), {"rounds": 65}, "rounds must be between 1 and 64"),
        ((A, B, C), {"rounds": True}, "rounds must be an integer"),
        ((A, B, C), {"rounds": 2.0}, "rounds must be an integer"),
    ],
)
def test_bad_input_raises(args: tuple, kw: dict, message: str) -> None:
    kw = {"key": KEY, "wu_id": "wu", **kw}
    with pytest.raises(ValueError, match=message):
        verify(*args, **kw)
