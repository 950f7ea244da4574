"""The GEMM kernel: bitwise determinism, tiling invariance, accuracy and input checks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from kernels import _gemm, reference
from kernels.gemm import row_splits
from tests.factories import bits, operands

FLAGS = [(False, False), (False, True), (True, False), (True, True)]
SHAPES = [(1, 1, 1), (1, 17, 3), (19, 1, 8), (5, 7, 1), (13, 31, 29), (70, 33, 301), (3, 65, 2)]
MICRO_KERNELS = [name for name in ("avx512", "avx2", "generic")]


def supported(name: str) -> bool:
    try:
        _gemm.force_kernel(name)
    except ValueError:
        return False
    finally:
        _gemm.force_kernel(_default_kernel)
    return True


_default_kernel = _gemm.kernel_name()


@pytest.fixture
def micro_kernel(request: pytest.FixtureRequest):
    if not supported(request.param):
        pytest.skip(f"this CPU cannot run the {request.param} micro-kernel")
    _gemm.force_kernel(request.param)
    yield request.param
    _gemm.force_kernel(_default_kernel)


@pytest.mark.parametrize("micro_kernel", MICRO_KERNELS, indirect=True)
@pytest.mark.parametrize(("trans_a", "trans_b"), FLAGS)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_every_micro_kernel_matches_the_numpy_twin_bit_for_bit(
    rng, micro_kernel, m, n, k, trans_a, trans_b
):
    a, b = operands(rng, m, n, k, trans_a, trans_b)
    compiled = kernels.gemm(a, b, trans_a=trans_a, trans_b=trans_b)
    twin = reference.gemm(a, b, trans_a=trans_a, trans_b=trans_b)
    assert np.array_equal(bits(compiled), bits(twin))


def test_the_twin_fma_is_correctly_rounded_on_hard_cases(rng):
    from fractions import Fraction

    # Products that nearly cancel the addend put the exact sum near float32 ties, where a
    # plain float64 sum followed by a float32 cast can round twice the wrong way.
    x = rng.standard_normal(4000).astype(np.float32)
    y = rng.standard_normal(4000).astype(np.float32)
    z = (-(x.astype(np.float64) * y.astype(np.float64))).astype(np.float32)
    z = np.nextafter(z, np.float32(np.inf) * rng.choice([-1, 1], size=z.size)).astype(np.float32)
    got = reference.fma32(x, y, z)
    for xi, yi, zi, gi in zip(x[:400], y[:400], z[:400], got[:400], strict=True):
        exact = Fraction(float(xi)) * Fraction(float(yi)) + Fraction(float(zi))
        candidates = [np.float32(float(exact))]
        candidates += [np.nextafter(candidates[0], np.float32(s)) for s in (-np.inf, np.inf)]
        errors = [abs(Fraction(float(c)) - exact) for c in candidates]
        best = min(errors)
        ties = [c for c, e in zip(candidates, errors, strict=True) if e == best]
        expected = (
            ties[0]
            if len(ties) == 1
            else next(c for c in ties if int(np.float32(c).view(np.uint32)) % 2 == 0)
        )
        assert np.float32(gi).view(np.uint32) == np.float32(expected).view(np.uint32)


def test_double_rounding_case_that_a_naive_emulation_gets_wrong():
    # (1 + 2^-12)^2 + 2^-60 = 1 + 2^-11 + 2^-24 + 2^-60: just above the float32 tie, so fmaf
    # rounds up. A float64 sum drops the 2^-60, lands on the tie and then rounds to even.
    x = np.array([1 + 2**-12], np.float32)
    z = np.array([2.0**-60], np.float32)
    naive = (x.astype(np.float64) * x + z).astype(np.float32)[0]
    assert naive == np.float32(1 + 2**-11)
    assert reference.fma32(x, x, z)[0] == np.float32(1 + 2**-11 + 2**-23)
    # The same step inside a product: acc = 2^-60 after k=0, then fmaf(x, x, acc) at k=1.
    a = np.array([[2.0**-60, 1 + 2**-12]], np.float32)
    b = np.array([[1.0], [1 + 2**-12]], np.float32)
    for gemm in (kernels.gemm, reference.gemm):
        assert gemm(a, b)[0, 0] == np.float32(1 + 2**-11 + 2**-23)


@given(
    m=st.integers(1, 40),
    n=st.integers(1, 40),
    k=st.integers(1, 60),
    flags=st.sampled_from(FLAGS),
    data=st.data(),
)
@settings(max_examples=150, deadline=None)
def test_any_sub_block_has_the_bits_of_the_full_product(m, n, k, flags, data):
    trans_a, trans_b = flags
    seed = data.draw(st.integers(0, 2**32 - 1))
    a, b = operands(np.random.default_rng(seed), m, n, k, trans_a, trans_b)
    i0 = data.draw(st.integers(0, m - 1))
    i1 = data.draw(st.integers(i0 + 1, m))
    j0 = data.draw(st.integers(0, n - 1))
    j1 = data.draw(st.integers(j0 + 1, n))
    full = kernels.gemm(a, b, trans_a=trans_a, trans_b=trans_b)
    rows = np.ascontiguousarray(a[:, i0:i1] if trans_a else a[i0:i1])
    cols = np.ascontiguousarray(b[j0:j1] if trans_b else b[:, j0:j1])
    block = kernels.gemm(rows, cols, trans_a=trans_a, trans_b=trans_b)
    assert np.array_equal(bits(block), bits(full[i0:i1, j0:j1]))


@pytest.mark.parametrize(("trans_a", "trans_b"), FLAGS)
def test_thread_count_never_changes_a_bit(rng, trans_a, trans_b):
    a, b = operands(rng, 301, 203, 517, trans_a, trans_b)
    one = kernels.gemm(a, b, trans_a=trans_a, trans_b=trans_b, threads=1)
    for threads in (2, 4):
        many = kernels.gemm(a, b, trans_a=trans_a, trans_b=trans_b, threads=threads)
        assert np.array_equal(bits(one), bits(many)), threads


def test_row_splits_cover_every_row_once():
    for m in (1, 13, 14, 15, 100, 1000):
        for parts in (1, 2, 3, 4, 8):
            ranges = row_splits(m, parts, 14)
            assert ranges[0][0] == 0 and ranges[-1][1] == m and len(ranges) <= parts
            assert all(r0 % 14 == 0 for r0, _ in ranges)
            assert all(prev[1] == nxt[0] for prev, nxt in itertools.pairwise(ranges))


def test_large_k_crosses_cache_blocks_in_order(rng):
    # K larger than the kernel's K block, so partial sums are stored and reloaded.
    a, b = operands(rng, 20, 40, 1500, False, False)
    assert np.array_equal(bits(kernels.gemm(a, b)), bits(reference.gemm(a, b)))


def test_accuracy_within_the_documented_bound(rng):
    m, n, k = 64, 48, 700
    a, b = operands(rng, m, n, k, False, False)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    bound = (k * 2.0**-24 / (1 - k * 2.0**-24)) * (np.abs(a).astype(np.float64) @ np.abs(b))
    error = np.abs(kernels.gemm(a, b).astype(np.float64) - exact)
    assert np.all(error <= bound)
    assert error.max() > 0  # the check above is not vacuous


def test_nan_and_inf_propagate(rng):
    a, b = operands(rng, 6, 5, 9, False, False)
    a[2, 3] = np.nan
    a[4, 0] = np.inf
    b[:, 1] = np.abs(b[:, 1]) + 1
    a[4, 1:] = 1.0
    c = kernels.gemm(a, b)
    assert np.isnan(c[2]).all()
    assert np.isposinf(c[4, 1])
    assert np.isfinite(np.delete(c, [2, 4], axis=0)).all()
    # every NaN has one bit pattern, so honest hosts hash NaN tiles alike
    assert set(bits(c)[np.isnan(c)].tolist()) == {0x7FC00000}
    assert np.array_equal(bits(c), bits(reference.gemm(a, b)))


@pytest.mark.parametrize("pattern", [0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7FBFFFFF])
def test_a_nan_of_any_sign_and_payload_comes_out_canonical(rng, pattern):
    """The payload a NaN carries through an FMA is the hardware's choice: whatever it is,
    the tile holds 0x7fc00000, and infinities and the largest floats stay as they are."""
    a, b = operands(rng, 20, 40, 8, False, False)
    a.view(np.uint32)[3, 5] = pattern  # as bits: a signalling NaN would raise on a cast
    a[7, :] = 0.0
    a[7, 0] = np.inf
    b[0, :] = np.abs(b[0, :]) + 1
    a[9, :] = 0.0
    a[9, 0] = np.finfo(np.float32).max
    b[0, 2] = 1.0
    c = kernels.gemm(a, b)
    assert set(bits(c[3]).tolist()) == {0x7FC00000}
    assert np.isposinf(c[7]).all()
    assert c[9, 2] == np.finfo(np.float32).max
    with np.errstate(invalid="ignore"):  # numpy's twin casts the signalling NaNs
        twin = reference.gemm(a, b)
    assert np.array_equal(bits(c), bits(twin))


def test_out_receives_the_product_even_inside_a_larger_array(rng):
    a, b = operands(rng, 9, 11, 7, False, True)
    big = np.full((20, 30), 7.0, np.float32)
    block = big[3:12, 5:16]
    result = kernels.gemm(a, b, trans_b=True, out=block)
    assert result is block
    assert np.array_equal(bits(block), bits(reference.gemm(a, b, trans_b=True)))
    untouched = big.copy()
    untouched[3:12, 5:16] = 7.0
    assert (untouched == 7.0).all()


def test_empty_inner_dimension_gives_zeros_and_empty_shapes_work(rng):
    a = np.empty((3, 0), np.float32)
    b = np.empty((0, 4), np.float32)
    assert np.array_equal(kernels.gemm(a, b), np.zeros((3, 4), np.float32))
    assert kernels.gemm(np.empty((0, 5), np.float32), np.ones((5, 2), np.float32)).shape == (0, 2)


def test_the_environment_variable_forces_the_twin(monkeypatch, rng):
    monkeypatch.setenv("TILEHIVE_KERNEL", "reference")
    assert kernels.kernel_name() == "reference"
    a, b = operands(rng, 4, 4, 4, False, False)
    assert np.array_equal(bits(kernels.gemm(a, b)), bits(reference.gemm(a, b)))
    monkeypatch.delenv("TILEHIVE_KERNEL")
    assert kernels.kernel_name() != "reference"


F32 = np.ones((4, 3), np.float32)
BAD_CALLS = [
    ((np.ones((4, 3)), F32.T.copy()), {}, "dtype float32"),
    ((F32, np.ones((3, 2), np.float32)[:, ::-1]), {}, "C-contiguous"),
    ((F32, np.ones((4, 2), np.float32)), {}, "inner dimensions differ"),
    ((np.ones(4, np.float32), F32), {}, "2-D"),
    (([[1.0]], F32), {}, "numpy.ndarray"),
    ((F32, F32), {"trans_b": True, "out": np.empty((4, 5), np.float32)}, "shape (4, 4)"),
    ((F32, F32), {"trans_b": True, "out": np.empty((4, 4))}, "out must have dtype"),
    ((F32, F32), {"trans_b": True, "out": np.empty((4, 8), np.float32)[:, ::2]}, "rows"),
    ((F32, F32), {"trans_b": True, "threads": 0}, "threads"),
    ((F32, F32), {"trans_b": True, "threads": 1.5}, "threads"),
]


@pytest.mark.parametrize(("args", "kwargs", "message"), BAD_CALLS)
@pytest.mark.parametrize("gemm", [kernels.gemm, reference.gemm], ids=["compiled", "twin"])
def test_bad_input_is_a_clear_value_error(gemm, args, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        gemm(*args, **kwargs)


def test_out_overlapping_an_operand_is_refused():
    a = np.ones((4, 4), np.float32)
    with pytest.raises(ValueError, match="overlap"):
        kernels.gemm(a, np.ones((4, 4), np.float32), out=a)
