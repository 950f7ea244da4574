"""The model kernels: compiled equal to the numpy twin bit for bit, on every instruction set and
thread count, accurate against float64, and training bitwise the same for any thread count."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import kernels
from coordinator.training import checkpoints
from coordinator.training import project as projects
from coordinator.training.model import TinyGPT, init_params, join_heads, param_shapes, split_heads
from coordinator.training.project import ModelSettings
from coordinator.training.trainer import LocalBackend, Trainer
from kernels import _nn, nn, nn_reference
from tests.factories import SMALL, Float64Backend, bits

INSTRUCTION_SETS = ["avx512", "avx2", "generic"]
_default = _nn.kernel_name()
# Row lengths around the 16 lanes (and 1-row arrays): every tail path of the C runs.
SHAPES = [(1, 1), (1, 17), (3, 15), (5, 16), (2, 31), (7, 33), (4, 100), (37, 64)]
H = nn.AdamScalars(
    *(np.float32(x) for x in (0.37, 0.9, 0.1, 0.95, 0.05, 0.19, 0.0975, 1e-8, 0.003, 0.1))
)


def supported(name: str) -> bool:
    try:
        _nn.force_kernel(name)
    except ValueError:
        return False
    finally:
        _nn.force_kernel(_default)
    return True


@pytest.fixture
def instruction_set(request: pytest.FixtureRequest):
    if not supported(request.param):
        pytest.skip(f"this CPU cannot run the {request.param} model kernels")
    _nn.force_kernel(request.param)
    yield request.param
    _nn.force_kernel(_default)


def inputs(rng: np.random.Generator, rows: int, n: int, scale: float = 1.0) -> SimpleNamespace:
    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    x = normal(rows, n)
    d = SimpleNamespace(x=x, dy=normal(rows, n), bias=normal(n), g=normal(n), b=normal(n))
    d.m, d.v = normal(rows, n), np.abs(normal(rows, n))
    d.targets = rng.integers(0, n, size=rows)
    _, d.xhat, d.inv = nn_reference.layernorm(x, d.g, d.b, 1e-5)
    _, d.t = nn_reference.gelu(x.copy())
    d.p = nn_reference.softmax(x, 0.37, False)
    return d


OPS = {
    "gelu": lambda k, d, th: (lambda x: (x, *k.gelu(x, d.bias, threads=th)))(d.x.copy()),
    "gelu_nobias": lambda k, d, th: k.gelu(d.x.copy(), threads=th),
    "gelu_backward": lambda k, d, th: k.gelu_backward(d.dy, d.x, d.t, threads=th),
    "layernorm": lambda k, d, th: k.layernorm(d.x, d.g, d.b, 1e-5, threads=th),
    "layernorm_backward": lambda k, d, th: k.layernorm_backward(
        d.dy, d.xhat, d.inv, d.g, threads=th
    ),
    "colsum": lambda k, d, th: k.colsum(d.x, threads=th),
    "colsum_product": lambda k, d, th: k.colsum(d.x, d.dy, threads=th),
    "add_bias": lambda k, d, th: k.add_bias(d.x.copy(), d.bias, threads=th),
    "softmax": lambda k, d, th: k.softmax(d.x, 0.37, False, threads=th),
    "softmax_backward": lambda k, d, th: k.softmax_backward(d.p, d.dy, 0.37, False, threads=th),
    "cross_entropy": lambda k, d, th: k.cross_entropy(d.x, d.targets, threads=th),
    "sumsq": lambda k, d, th: k.sumsq(d.x),
    "adamw": lambda k, d, th: k.adamw(d.x, d.dy, d.m, d.v, H, True, threads=th),
    "adamw_nodecay": lambda k, d, th: k.adamw(d.x, d.dy, d.m, d.v, H, False, threads=th),
}


def flat_bits(result: object) -> list:
    """Every array of a result as its bit patterns, every float as itself."""
    items = result if isinstance(result, tuple) else (result,)
    return [bits(x).tolist() if isinstance(x, np.ndarray) else x for x in items]


@pytest.mark.parametrize("instruction_set", INSTRUCTION_SETS, indirect=True)
@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("scale", [1.0, 1e4])
def test_every_instruction_set_matches_the_twin_bit_for_bit(instruction_set, op, scale, rng):
    for rows, n in SHAPES:
        d = inputs(rng, rows, n, scale)
        compiled = flat_bits(OPS[op](nn, d, 1))
        twin = flat_bits(OPS[op](nn_reference, d, 1))
        assert compiled == twin, (op, rows, n)


@pytest.mark.parametrize("instruction_set", INSTRUCTION_SETS, indirect=True)
@pytest.mark.parametrize("t", [1, 2, 15, 16, 17, 40])
def test_the_causal_softmax_matches_the_twin_and_never_reads_the_future(instruction_set, t, rng):
    scores = (rng.standard_normal((3, t, t)) * 5).astype(np.float32)
    dp = rng.standard_normal(scores.shape).astype(np.float32)
    p = nn.softmax(scores, 0.125, True)
    assert bits(p).tolist() == bits(nn_reference.softmax(scores, 0.125, True)).tolist()
    ds = nn.softmax_backward(p, dp, 0.125, True)
    assert bits(ds).tolist() == bits(nn_reference.softmax_backward(p, dp, 0.125, True)).tolist()
    future = np.triu(np.ones((t, t), bool), k=1)
    assert not p[:, future].any() and not ds[:, future].any()
    poisoned = scores.copy()
    poisoned[:, future] = np.nan  # never read: the mask is by index
    assert bits(nn.softmax(poisoned, 0.125, True)).tolist() == bits(p).tolist()


@pytest.mark.parametrize("instruction_set", INSTRUCTION_SETS, indirect=True)
def test_minus_infinity_scores_and_huge_values_match_the_twin(instruction_set, rng):
    s = (rng.standard_normal((6, 37)) * 1e30).astype(np.float32)
    s[:, ::3] = -np.inf
    p = nn.softmax(s, 1.0, False)
    assert bits(p).tolist() == bits(nn_reference.softmax(s, 1.0, False)).tolist()
    assert (p[:, ::3] == 0).all() and np.isfinite(p).all()
    logits = np.ascontiguousarray(s[:, 1::3])  # huge, finite
    targets = rng.integers(0, logits.shape[1], size=6)
    assert flat_bits(nn.cross_entropy(logits, targets)) == flat_bits(
        nn_reference.cross_entropy(logits, targets)
    )


@pytest.mark.parametrize("op", sorted(OPS))
def test_thread_count_never_changes_a_bit(op, rng, monkeypatch):
    monkeypatch.setattr(nn, "_MIN_NS_PER_THREAD", 1)  # split even small arrays
    for rows, n in [(1, 33), (7, 33), (64, 100)]:
        d = inputs(rng, rows, n)
        results = [flat_bits(OPS[op](nn, d, threads)) for threads in (1, 2, 3)]
        assert results[0] == results[1] == results[2], (op, rows, n)


def test_batched_gemm_has_the_bits_of_gemm_per_head_for_any_thread_count(rng, monkeypatch):
    for trans_a, trans_b in [(False, False), (False, True), (True, False), (True, True)]:
        a = rng.standard_normal((5, 9, 7) if trans_a else (5, 7, 9)).astype(np.float32)
        b = rng.standard_normal((5, 11, 9) if trans_b else (5, 9, 11)).astype(np.float32)
        each = np.stack(
            [kernels.gemm(a[g], b[g], trans_a=trans_a, trans_b=trans_b) for g in range(5)]
        )
        for threads in (1, 2, 3):
            out = kernels.batched_gemm(a, b, trans_a=trans_a, trans_b=trans_b, threads=threads)
            assert bits(out).tolist() == bits(each).tolist()
        monkeypatch.setenv("TILEHIVE_KERNEL", "reference")
        out = kernels.batched_gemm(a, b, trans_a=trans_a, trans_b=trans_b)
        monkeypatch.delenv("TILEHIVE_KERNEL")
        assert bits(out).tolist() == bits(each).tolist()


def test_the_environment_variable_forces_the_twin(monkeypatch):
    assert nn.kernel_name() == _default
    monkeypatch.setenv("TILEHIVE_KERNEL", "reference")
    assert nn.kernel_name() == "reference"


def test_the_threads_setting_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("TILEHIVE_MODEL_THREADS", "3")
    assert nn.default_threads() == 3
    monkeypatch.setenv("TILEHIVE_MODEL_THREADS", "0")
    with pytest.raises(ValueError, match="TILEHIVE_MODEL_THREADS"):
        nn.default_threads()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: nn.gelu(np.zeros((2, 3))), "float32"),
        (lambda: nn.gelu(np.zeros((2, 3), np.float32).T), "C-contiguous"),
        (
            lambda: nn.layernorm(np.zeros(3, np.float32), *[np.zeros(3, np.float32)] * 2, 1e-5),
            "2-D",
        ),
        (lambda: nn.add_bias(np.zeros((2, 3), np.float32), np.zeros(4, np.float32)), "shape"),
        (lambda: nn.softmax(np.zeros((2, 3, 4), np.float32), 1.0, True), "causal"),
        (lambda: nn.cross_entropy(np.zeros((2, 3), np.float32), [0, 3]), r"\[0, 3\)"),
        (lambda: nn.cross_entropy(np.zeros((2, 3), np.float32), [0]), "one target"),
    ],
)
def test_bad_input_is_a_clear_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---- accuracy against float64 (the bounds docs/kernels.md states) -------------------------


def test_exp_tanh_and_log_are_accurate():
    x = np.linspace(-87, 88, 200_001, dtype=np.float32)
    exact = np.exp(x.astype(np.float64))
    assert np.max(np.abs(nn_reference.exp32(x) / exact - 1)) < 2e-7
    z = np.linspace(-12, 12, 200_001, dtype=np.float32)
    assert np.max(np.abs(nn_reference.tanh32(z) - np.tanh(z.astype(np.float64)))) < 1.5e-7
    y = np.geomspace(1e-30, 1e30, 200_001).astype(np.float32)
    exact = np.log(y.astype(np.float64))
    assert np.max(np.abs(nn_reference.log32(y) - exact) / np.maximum(1, np.abs(exact))) < 2e-7
    assert nn_reference.exp32(np.float32([-np.inf, -100, 0]).astype(np.float32)).tolist() == [
        0,
        0,
        1,
    ]


def test_each_kernel_is_close_to_float64(rng):
    d = inputs(rng, 64, 300, 2.0)
    x = d.x.astype(np.float64)
    c = math.sqrt(2 / math.pi)
    y, t = nn.gelu(d.x.copy())
    exact = 0.5 * x * (1 + np.tanh(c * (x + 0.044715 * x**3)))
    assert np.max(np.abs(y - exact) / (1 + np.abs(x))) < 3e-7
    t64 = np.tanh(c * (x + 0.044715 * x**3))
    slope = 0.5 * (1 + t64) + 0.5 * x * (1 - t64**2) * c * (1 + 3 * 0.044715 * x**2)
    # 1 - t*t cancels where t is near 1, so the bound grows with x^2 (the slope's factor).
    error = np.abs(nn.gelu_backward(d.dy, d.x, t) - d.dy * slope)
    assert np.max(error / (np.abs(d.dy) * (1 + x * x))) < 3e-7

    y, xhat, _ = nn.layernorm(d.x, d.g, d.b, 1e-5)
    centred = x - x.mean(axis=1, keepdims=True)
    xhat64 = centred / np.sqrt((centred**2).mean(axis=1, keepdims=True) + 1e-5)
    assert np.max(np.abs(xhat - xhat64)) < 2e-6

    p = nn.softmax(d.x, 0.37, False)
    e = np.exp(0.37 * x - (0.37 * x).max(axis=1, keepdims=True))
    assert np.max(np.abs(p - e / e.sum(axis=1, keepdims=True))) < 1e-7

    loss, dlogits = nn.cross_entropy(d.x, d.targets)
    logp = x - x.max(axis=1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
    assert abs(loss + logp[np.arange(64), d.targets].mean()) < 1e-5
    onehot = np.eye(300)[d.targets]
    assert np.max(np.abs(dlogits - (np.exp(logp) - onehot) / 64)) < 1e-8

    big = (rng.standard_normal((1000, 7)) * 3).astype(np.float32)
    assert np.max(np.abs(nn.colsum(big) - big.astype(np.float64).sum(axis=0))) < 1e-4
    assert math.isclose(nn.sumsq(big), float((big.astype(np.float64) ** 2).sum()), rel_tol=1e-14)


def test_the_adamw_kernel_is_the_adamw_formula(rng):
    d = inputs(rng, 9, 33)
    p, m, v = (a.astype(np.float64) for a in nn.adamw(d.x, d.dy, d.m, d.v, H, True))
    h = [float(s) for s in H]
    g = d.dy * h[0]
    m64 = h[1] * d.m + h[2] * g
    v64 = h[3] * d.v + h[4] * g * g
    update = (m64 / h[5]) / (np.sqrt(v64 / h[6]) + h[7]) + h[9] * d.x
    assert np.allclose(m, m64, rtol=1e-6, atol=1e-7)
    assert np.allclose(v, v64, rtol=1e-6, atol=1e-7)
    assert np.allclose(p, d.x - h[8] * update, rtol=1e-6, atol=1e-7)


# ---- the model on the kernels ------------------------------------------------------------


def test_the_float32_model_agrees_with_the_float64_one():
    """The kernels' path (float32) and the gradient-checked numpy path (float64) compute the
    same loss and gradients, to float32 accuracy."""
    settings = ModelSettings(layers=2, width=32, heads=2, context=16)
    params = init_params(settings, seed=5)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 256, size=(3, 16))
    targets = rng.integers(0, 256, size=(3, 16))
    loss32, grads32 = asyncio.run(
        TinyGPT(settings, LocalBackend()).loss_and_grads(params, tokens, targets)
    )
    params64 = {k: v.astype(np.float64) for k, v in params.items()}
    loss64, grads64 = asyncio.run(
        TinyGPT(settings, Float64Backend()).loss_and_grads(params64, tokens, targets)
    )
    assert abs(loss32 - loss64) < 1e-5
    for name, g in grads64.items():
        assert grads32[name].dtype == np.float32
        assert np.max(np.abs(grads32[name] - g)) <= 1e-4 * np.max(np.abs(g)) + 1e-9, name


def train(directory: Path, steps: int) -> dict[str, bytes]:
    project = projects.create(directory, **{**SMALL, "training.steps": steps})
    asyncio.run(Trainer(project, LocalBackend(threads=2)).run())
    params, state = checkpoints.load(project.checkpoints, steps, param_shapes(project.model))
    arrays = {**params, **{f"m.{k}": v for k, v in state.m.items()}}
    return {k: bits(v).tobytes() for k, v in arrays.items()}


def test_local_training_is_bitwise_the_same_for_1_2_and_3_kernel_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(nn, "_MIN_NS_PER_THREAD", 1)  # split every kernel call
    runs = []
    for threads in (1, 2, 3):
        monkeypatch.setenv("TILEHIVE_MODEL_THREADS", str(threads))
        runs.append(train(tmp_path / f"threads-{threads}", steps=2))
    assert runs[0] == runs[1] == runs[2]
    # And the numpy twins of every kernel (GEMM included) train to the same bits.
    monkeypatch.setenv("TILEHIVE_KERNEL", "reference")
    assert train(tmp_path / "twin", steps=2) == runs[0]


def test_a_call_too_small_to_pay_for_a_thread_runs_on_one():
    """tiny-gpt's arrays are too small for a second thread to pay for its hand-off; a GELU of
    the larger project's 2,048 x 512 is split, and never into more ranges than threads."""
    assert nn._splits("add_bias", 512, 128, 2) == [(0, 512)]
    assert nn._splits("layernorm_backward", 512, 512, 8) == [(0, 512)]
    assert nn._splits("gelu", 2048, 512, 2) == [(0, 1024), (1024, 2048)]
    assert len(nn._splits("adamw", 4096 * 2048, 1, 8)) == 8


def test_heads_are_cut_out_of_qkv_and_put_back_in_place(rng):
    """Head j of Q is columns [j*dh, (j+1)*dh) of QKV's first third, for every sequence;
    join_heads puts each head's gradient back where split_heads took it from."""
    batch, t, heads, dh = 3, 5, 4, 2
    qkv = rng.standard_normal((batch * t, 3 * heads * dh)).astype(np.float32)
    q, k, v = split_heads(qkv, batch, heads)
    assert q.shape == (batch * heads, t, dh) and q.flags.c_contiguous
    d = heads * dh
    for part, x in enumerate((q, k, v)):
        for b in range(batch):
            for j in range(heads):
                columns = slice(part * d + j * dh, part * d + (j + 1) * dh)
                assert np.array_equal(x[b * heads + j], qkv[b * t : (b + 1) * t, columns])
    assert np.array_equal(join_heads(q, k, v, batch, heads), qkv)


def test_a_cap_lowers_the_default_thread_count_but_not_the_operators(monkeypatch):
    monkeypatch.delenv("TILEHIVE_MODEL_THREADS", raising=False)
    monkeypatch.setattr(nn, "cpu_count", lambda: 6)
    try:
        nn.limit_threads(2)
        assert nn.default_threads() == 2
        nn.limit_threads(10)  # a cap above the CPUs changes nothing
        assert nn.default_threads() == 6
        monkeypatch.setenv("TILEHIVE_MODEL_THREADS", "5")
        nn.limit_threads(1)
        assert nn.default_threads() == 5
        with pytest.raises(ValueError, match="positive"):
            nn.limit_threads(0)
    finally:
        nn.limit_threads(None)
    monkeypatch.delenv("TILEHIVE_MODEL_THREADS")
    assert nn.default_threads() == 6
