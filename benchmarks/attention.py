"""Attention benchmark: the coordinator's own per-head work at the larger project's shape.

Run:  .venv/bin/python benchmarks/attention.py [--repeats N]

The attention runs on the coordinator, in `--local` and distributed runs alike, and in a
distributed step it sits between two products on the chain the volunteers wait for. This
prints, side by side in one run:
- cutting Q, K and V out of the QKV product by head, in one strided pass
  (`training/model.py: split_heads`) against one pass per slice (the way before, written
  out here);
- joining dQ, dK and dV back into dQKV's columns in one write each (`join_heads`) against
  reshaping each and concatenating them (before);
- the per-head products (`kernels.batched_gemm`, 1 thread) against numpy's matmul of the
  same shapes, in GFLOPS.
"""

from __future__ import annotations

import argparse
import os
import sys
import timeit
from collections.abc import Callable

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import numpy as np  # noqa: E402

import kernels  # noqa: E402
from coordinator.training.model import join_heads, split_heads  # noqa: E402

# A micro-batch of the larger project: 16 sequences of 128 tokens, 8 heads of 64.
BATCH, CONTEXT, HEADS, HEAD_WIDTH = 16, 128, 8, 64
WIDTH = HEADS * HEAD_WIDTH


def seconds(fn: Callable[[], object], repeats: int) -> float:
    """The best of `repeats` timings of fn, each of enough calls to last about 50 ms."""
    fn()
    once = timeit.timeit(fn, number=2) / 2
    calls = max(2, int(0.05 / max(once, 1e-7)))
    return min(timeit.repeat(fn, number=calls, repeat=repeats)) / calls


def split_per_slice(qkv: np.ndarray) -> list[np.ndarray]:
    b, t, h, dh, d = BATCH, CONTEXT, HEADS, HEAD_WIDTH, WIDTH
    return [
        np.ascontiguousarray(
            qkv[:, i * d : (i + 1) * d].reshape(b, t, h, dh).transpose(0, 2, 1, 3)
        ).reshape(b * h, t, dh)
        for i in range(3)
    ]


def join_by_concatenating(parts: list[np.ndarray]) -> np.ndarray:
    b, t, h, dh, d = BATCH, CONTEXT, HEADS, HEAD_WIDTH, WIDTH
    flat = [x.reshape(b, h, t, dh).transpose(0, 2, 1, 3).reshape(b * t, d) for x in parts]
    return np.ascontiguousarray(np.concatenate(flat, axis=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((BATCH * CONTEXT, 3 * WIDTH)).astype(np.float32)
    parts = list(split_heads(qkv, BATCH, HEADS))
    assert all(map(np.array_equal, split_per_slice(qkv), parts))
    assert np.array_equal(join_by_concatenating(parts), join_heads(*parts, BATCH, HEADS))
    print(f"one micro-batch: {BATCH} x {CONTEXT} tokens, {HEADS} heads of {HEAD_WIDTH}")
    for what, before, now in [
        ("split QKV by head", lambda: split_per_slice(qkv), lambda: split_heads(qkv, BATCH, HEADS)),
        (
            "join dQKV",
            lambda: join_by_concatenating(parts),
            lambda: join_heads(*parts, BATCH, HEADS),
        ),
    ]:
        old, new = seconds(before, args.repeats), seconds(now, args.repeats)
        print(
            f"{what:28s} {1e3 * new:6.2f} ms, against {1e3 * old:6.2f} ms before ({old / new:.1f}x)"
        )
    q, k, v = parts
    att = rng.random((BATCH * HEADS, CONTEXT, CONTEXT)).astype(np.float32)
    for name, a, b, ta, tb in [
        # The attention's six products (dY, dA and dS stand in with arrays of their shapes).
        ("Q @ K^T", q, k, False, True),
        ("A @ V", att, v, False, False),
        ("dY @ V^T", q, v, False, True),
        ("A^T @ dY", att, q, True, False),
        ("dS @ K", att, k, False, False),
        ("dS^T @ Q", att, q, True, False),
    ]:
        m = a.shape[2] if ta else a.shape[1]
        n = b.shape[1] if tb else b.shape[2]
        flops = 2.0 * a.shape[0] * m * n * (a.shape[1] if ta else a.shape[2])
        ours = seconds(
            lambda a=a, b=b, ta=ta, tb=tb: kernels.batched_gemm(
                a, b, trans_a=ta, trans_b=tb, threads=1
            ),
            args.repeats,
        )
        an, bn = (a.swapaxes(1, 2) if ta else a), (b.swapaxes(1, 2) if tb else b)
        theirs = seconds(lambda an=an, bn=bn: np.matmul(an, bn), args.repeats)
        print(
            f"per-head {name:19s} {1e3 * ours:6.2f} ms, {flops / ours / 1e9:4.0f} GFLOPS on 1 "
            f"thread; numpy {flops / theirs / 1e9:4.0f} GFLOPS (its own threads)"
        )


if __name__ == "__main__":
    main()
