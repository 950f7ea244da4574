"""tiny-gpt: a decoder-only transformer on bytes, forward and backward.

Every linear layer's three products (X@W forward, dY@W^T and X^T@dY backward) go through
`Backend.matmul`, which the coordinator turns into verified work units and `--local` runs
in-process with the same kernel. The attention products (Q@K^T, A@V and their gradients) are
small and per head; they run on the coordinator with `Backend.batched`. Everything else runs
on the coordinator: in float32 (training) with the deterministic model kernels of
`kernels.nn`, in any other dtype with the plain numpy below, which the float64 gradient check
uses. The two paths compute the same functions, not the same bits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Protocol

import numpy as np

from coordinator.training.project import ModelSettings
from kernels import nn

VOCAB = 256  # bytes
LN_EPS = 1e-5
GELU_C = np.sqrt(2.0 / np.pi)

Params = dict[str, np.ndarray]


class Backend(Protocol):
    """Where the products run."""

    def matmul(
        self, a: np.ndarray, b: np.ndarray, *, trans_a: bool, trans_b: bool, label: str
    ) -> Awaitable[np.ndarray]: ...

    def batched(
        self, a: np.ndarray, b: np.ndarray, *, trans_a: bool = False, trans_b: bool = False
    ) -> np.ndarray: ...


def param_shapes(s: ModelSettings) -> dict[str, tuple[int, ...]]:
    """Named parameters in a fixed order (checkpoints and updates follow it)."""
    d = s.width
    shapes: dict[str, tuple[int, ...]] = {"embed": (VOCAB, d), "position": (s.context, d)}
    for i in range(s.layers):
        p = f"block{i}."
        shapes.update(
            {
                p + "ln1.g": (d,),
                p + "ln1.b": (d,),
                p + "attn.w_qkv": (d, 3 * d),
                p + "attn.b_qkv": (3 * d,),
                p + "attn.w_out": (d, d),
                p + "attn.b_out": (d,),
                p + "ln2.g": (d,),
                p + "ln2.b": (d,),
                p + "mlp.w_in": (d, 4 * d),
                p + "mlp.b_in": (4 * d,),
                p + "mlp.w_out": (4 * d, d),
                p + "mlp.b_out": (d,),
            }
        )
    shapes.update({"ln_f.g": (d,), "ln_f.b": (d,), "head.w": (d, VOCAB)})
    return shapes


def widest_activation(s: ModelSettings, sequences: int) -> int:
    """Elements of the largest array a forward or backward pass of `sequences` sequences
    makes: the MLP's hidden layer, the attention's scores or the logits."""
    per_token = max(4 * s.width, s.heads * s.context, VOCAB)
    return sequences * s.context * per_token


def parameter_count(s: ModelSettings) -> int:
    return sum(int(np.prod(shape)) for shape in param_shapes(s).values())


def init_params(s: ModelSettings, seed: int) -> Params:
    """GPT-2 style: N(0, 0.02) weights, residual projections scaled by 1/sqrt(2 layers)."""
    rng = np.random.default_rng([seed, 0x7417])
    params = {}
    for name, shape in param_shapes(s).items():
        if name.endswith(".g"):
            value = np.ones(shape)
        elif len(shape) == 1:
            value = np.zeros(shape)
        else:
            std = 0.02 / np.sqrt(2 * s.layers) if name.endswith("w_out") else 0.02
            value = rng.normal(0.0, std, size=shape)
        params[name] = value.astype(np.float32)
    return params


def decays(name: str) -> bool:
    """Weight decay applies to matrices, not to gains, biases or embeddings of positions."""
    return name.endswith((".w_qkv", ".w_out", ".w_in", "head.w")) or name == "embed"


# ---- layers: forward returns (output, cache); backward takes the cache -------------------
# float32 arrays go to kernels.nn (deterministic, compiled); other dtypes stay in numpy.


def _kernels(x: np.ndarray) -> bool:
    return x.dtype == np.float32


def add_bias(y, b):
    """y + b on every row; in place for float32 (y is a fresh product)."""
    if _kernels(y):
        return nn.add_bias(np.require(y, requirements=["C", "W"]), b)
    return y + b


def column_sums(x):
    """The sum over rows, per column (a bias's gradient)."""
    return nn.colsum(np.ascontiguousarray(x)) if _kernels(x) else x.sum(axis=0)


def layernorm(x, g, b):
    if _kernels(x):
        y, xhat, inv = nn.layernorm(x, g, b, LN_EPS)
        return y, (xhat, inv, g)
    mu = x.mean(axis=-1, keepdims=True)
    xc = x - mu
    inv = 1.0 / np.sqrt((xc * xc).mean(axis=-1, keepdims=True) + x.dtype.type(LN_EPS))
    xhat = xc * inv
    return xhat * g + b, (xhat, inv, g)


def layernorm_backward(dy, cache):
    xhat, inv, g = cache
    if _kernels(dy):
        return nn.layernorm_backward(dy, xhat, inv, g)
    dg = (dy * xhat).sum(axis=0)
    db = dy.sum(axis=0)
    dxhat = dy * g
    dx = inv * (
        dxhat
        - dxhat.mean(axis=-1, keepdims=True)
        - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True)
    )
    return dx, dg, db


def gelu(x, b=None):
    """GELU (tanh approximation) of x + b; the cache holds x + b and the tanh."""
    if _kernels(x):
        x = np.require(x, requirements=["C", "W"])
        y, t = nn.gelu(x, b)
        return y, (x, t)
    if b is not None:
        x = x + b
    t = np.tanh(x.dtype.type(GELU_C) * (x + x.dtype.type(0.044715) * x**3))
    return x.dtype.type(0.5) * x * (1 + t), (x, t)


def gelu_backward(dy, cache):
    x, t = cache
    if _kernels(dy):
        return nn.gelu_backward(dy, x, t)
    c, k = x.dtype.type(GELU_C), x.dtype.type(0.044715)
    half = x.dtype.type(0.5)
    return dy * (half * (1 + t) + half * x * (1 - t * t) * c * (1 + 3 * k * x * x))


def softmax_rows(s):
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def split_heads(qkv: np.ndarray, batch: int, heads: int) -> np.ndarray:
    """Q, K and V per head, shaped (3, batch * heads, t, head width), from the (batch * t,
    3 * width) QKV product: one strided pass over it, not one pass per slice."""
    t, dh = qkv.shape[0] // batch, qkv.shape[1] // (3 * heads)
    return np.ascontiguousarray(
        qkv.reshape(batch, t, 3, heads, dh).transpose(2, 0, 3, 1, 4)
    ).reshape(3, batch * heads, t, dh)


def join_heads(
    dq: np.ndarray, dk: np.ndarray, dv: np.ndarray, batch: int, heads: int
) -> np.ndarray:
    """split_heads backwards: dQKV (batch * t, 3 * width) from the per-head gradients, each
    written once into its columns (reshaping each and concatenating them copied everything
    twice, 1.5-2x as long: benchmarks/attention.py)."""
    t, dh = dq.shape[1], dq.shape[2]
    dqkv = np.empty((batch * t, 3 * heads * dh), dq.dtype)
    columns = dqkv.reshape(batch, t, 3, heads, dh)
    for i, x in enumerate((dq, dk, dv)):
        columns[:, :, i] = x.reshape(batch, heads, t, dh).transpose(0, 2, 1, 3)
    return dqkv


async def _cancelled(tasks: list[asyncio.Future]) -> None:
    """Cancel products left in flight when a step stops (a failed or cancelled product),
    and wait for them to end, so that none is left running unawaited."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class TinyGPT:
    def __init__(self, settings: ModelSettings, backend: Backend) -> None:
        self.s = settings
        self.backend = backend

    async def linear(self, x, w, b, label):
        y = await self.backend.matmul(x, w, trans_a=False, trans_b=False, label=label + ".fwd")
        return add_bias(y, b) if b is not None else y

    async def linear_backward(self, x, w, dy, label):
        """(dX, dW, the bias gradient): dX = dY @ W^T is awaited, dW = X^T @ dY is returned in
        flight (a task). Nothing on the backward chain needs a weight gradient, and with many
        hosts a dW, whose tiles each read all of its k = tokens, comes back tens of
        milliseconds after its dX: the next layer's dX goes out without waiting for it.
        loss_and_grads collects them once the chain is done."""
        # Both go out in this turn of the loop, dX first, so that one answer can carry both.
        dx = asyncio.ensure_future(
            self.backend.matmul(dy, w, trans_a=False, trans_b=True, label=label + ".dx")
        )
        dw = asyncio.ensure_future(
            self.backend.matmul(x, dy, trans_a=True, trans_b=False, label=label + ".dw")
        )
        try:
            dx_value = await dx
        except BaseException:
            await _cancelled([dx, dw])
            raise
        return dx_value, dw, column_sums(dy)

    def attention(self, qkv, batch):
        s, bmm = self.s, self.backend.batched
        t, h, d = s.context, s.heads, s.width
        dh = d // h
        q, k, v = split_heads(qkv, batch, h)
        scale = qkv.dtype.type(1.0 / np.sqrt(dh))
        if _kernels(qkv):
            # The mask is by index: the kernel never reads a future position's score.
            att = nn.softmax(bmm(q, k, trans_b=True), scale, causal=True)
            y = bmm(att, v)
            y = y.reshape(batch, h, t, dh).transpose(0, 2, 1, 3).reshape(batch * t, d)
            return np.ascontiguousarray(y), (q, k, v, att, scale)
        scores = bmm(q, k, trans_b=True) * scale
        future = np.triu(np.ones((t, t), dtype=bool), k=1)
        scores = np.where(future, -np.inf, scores).astype(qkv.dtype)
        att = softmax_rows(scores)
        y = bmm(att, v)
        y = y.reshape(batch, h, t, dh).transpose(0, 2, 1, 3).reshape(batch * t, d)
        return np.ascontiguousarray(y), (q, k, v, att, scale)

    def attention_backward(self, dy, cache, batch):
        s, bmm = self.s, self.backend.batched
        t, h, d = s.context, s.heads, s.width
        dh = d // h
        q, k, v, att, scale = cache
        dy = np.ascontiguousarray(dy.reshape(batch, t, h, dh).transpose(0, 2, 1, 3)).reshape(
            batch * h, t, dh
        )
        datt = bmm(dy, v, trans_b=True)
        dv = bmm(att, dy, trans_a=True)
        if _kernels(datt):
            dscores = nn.softmax_backward(att, datt, scale, causal=True)
        else:
            dscores = att * (datt - (datt * att).sum(axis=-1, keepdims=True)) * scale
        dq = bmm(dscores, k)
        dk = bmm(dscores, q, trans_a=True)
        return join_heads(dq, dk, dv, batch, h)

    async def forward(self, params: Params, tokens: np.ndarray):
        """Logits for (batch, context) byte tokens, and what backward needs."""
        batch, t = tokens.shape
        x = params["embed"][tokens.ravel()] + np.tile(params["position"][:t], (batch, 1))
        caches = []
        for i in range(self.s.layers):
            p = f"block{i}."
            h1, ln1 = layernorm(x, params[p + "ln1.g"], params[p + "ln1.b"])
            qkv = await self.linear(
                h1, params[p + "attn.w_qkv"], params[p + "attn.b_qkv"], p + "qkv"
            )
            y, att = self.attention(qkv, batch)
            x = x + await self.linear(
                y, params[p + "attn.w_out"], params[p + "attn.b_out"], p + "proj"
            )
            h2, ln2 = layernorm(x, params[p + "ln2.g"], params[p + "ln2.b"])
            u = await self.linear(h2, params[p + "mlp.w_in"], None, p + "fc")
            a, act = gelu(u, params[p + "mlp.b_in"])
            x = x + await self.linear(
                a, params[p + "mlp.w_out"], params[p + "mlp.b_out"], p + "fc2"
            )
            caches.append((h1, ln1, att, y, h2, ln2, act, a))
        hf, lnf = layernorm(x, params["ln_f.g"], params["ln_f.b"])
        logits = await self.linear(hf, params["head.w"], None, "head")
        return logits, (tokens, caches, hf, lnf)

    @staticmethod
    def cross_entropy(logits: np.ndarray, targets: np.ndarray):
        """Mean negative log-likelihood, and its gradient with respect to the logits."""
        if _kernels(logits):
            return nn.cross_entropy(logits, targets)
        n = logits.shape[0]
        shifted = logits - logits.max(axis=-1, keepdims=True)
        log_z = np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
        logp = shifted - log_z
        rows = np.arange(n)
        loss = -logp[rows, targets.ravel()].mean()
        dlogits = np.exp(logp)
        dlogits[rows, targets.ravel()] -= 1
        return float(loss), dlogits / logits.dtype.type(n)

    async def loss(self, params: Params, tokens: np.ndarray, targets: np.ndarray) -> float:
        logits, _ = await self.forward(params, tokens)
        return self.cross_entropy(logits, targets)[0]

    async def loss_and_grads(self, params: Params, tokens, targets) -> tuple[float, Params]:
        logits, (tokens, caches, hf, lnf) = await self.forward(params, tokens)
        loss, dlogits = self.cross_entropy(logits, targets)
        grads: dict[str, np.ndarray | asyncio.Future] = {}  # weight gradients still in flight
        try:
            await self._backward(params, tokens, caches, hf, lnf, dlogits, grads)
            for name, grad in grads.items():
                if isinstance(grad, asyncio.Future):
                    grads[name] = await grad
        except BaseException:
            await _cancelled([g for g in grads.values() if isinstance(g, asyncio.Future)])
            raise
        return loss, {name: grads[name] for name in params}

    async def _backward(self, params, tokens, caches, hf, lnf, dlogits, grads) -> None:
        """Every gradient into `grads`; the weights' as tasks still in flight."""
        batch, t = tokens.shape
        dhf, grads["head.w"], _ = await self.linear_backward(hf, params["head.w"], dlogits, "head")
        dx, grads["ln_f.g"], grads["ln_f.b"] = layernorm_backward(dhf, lnf)
        for i in reversed(range(self.s.layers)):
            p = f"block{i}."
            h1, ln1, att, y, h2, ln2, act, a = caches[i]
            da, grads[p + "mlp.w_out"], grads[p + "mlp.b_out"] = await self.linear_backward(
                a, params[p + "mlp.w_out"], dx, p + "fc2"
            )
            du = gelu_backward(da, act)
            dh2, grads[p + "mlp.w_in"], grads[p + "mlp.b_in"] = await self.linear_backward(
                h2, params[p + "mlp.w_in"], du, p + "fc"
            )
            dln2, grads[p + "ln2.g"], grads[p + "ln2.b"] = layernorm_backward(dh2, ln2)
            dx = dx + dln2
            dy, grads[p + "attn.w_out"], grads[p + "attn.b_out"] = await self.linear_backward(
                y, params[p + "attn.w_out"], dx, p + "proj"
            )
            dqkv = self.attention_backward(dy, att, batch)
            dh1, grads[p + "attn.w_qkv"], grads[p + "attn.b_qkv"] = await self.linear_backward(
                h1, params[p + "attn.w_qkv"], dqkv, p + "qkv"
            )
            dln1, grads[p + "ln1.g"], grads[p + "ln1.b"] = layernorm_backward(dh1, ln1)
            dx = dx + dln1
        if _kernels(dx):
            grads["position"] = column_sums(dx.reshape(batch, -1)).reshape(t, -1)
        else:
            grads["position"] = dx.reshape(batch, t, -1).sum(axis=0)
        embed = np.zeros_like(params["embed"])
        np.add.at(embed, tokens.ravel(), dx)
        grads["embed"] = embed
