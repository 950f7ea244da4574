"""Model kernel benchmark: each model kernel (kernels.nn) on one thread and on two, at
tiny-gpt's shapes and larger ones, beside the thread count that `kernels.nn` picks.

Run:  .venv/bin/python benchmarks/model_kernels.py [--repeats N]

For every kernel and shape it prints the microseconds on one thread and split over two
(however small), the nanoseconds an element costs on one thread (what `_NS_PER_ELEMENT` in
kernels/nn.py estimates), and how many threads `kernels.nn` gives the call. The smallest
rows show what a split itself costs (tens of microseconds: the pool's thread is woken and
waited for); the rule should pick 2 where the two-thread column is clearly faster.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import timeit
from collections.abc import Callable, Iterator

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import numpy as np  # noqa: E402

from kernels import nn  # noqa: E402

# (rows, width): tiny-gpt's micro-batch of 512 tokens at width 128 and its MLP's 512; the
# larger project's 2,048 tokens at width 512; and one far past the caches.
SHAPES = [(512, 128), (512, 512), (2048, 512), (4096, 2048)]


def seconds(fn: Callable[[], object], repeats: int) -> float:
    """The best of `repeats` timings of fn, each of enough calls to last about 20 ms."""
    fn()
    once = timeit.timeit(fn, number=3) / 3
    calls = max(3, int(0.02 / max(once, 1e-7)))
    return min(timeit.repeat(fn, number=calls, repeat=repeats)) / calls


@contextlib.contextmanager
def always_split() -> Iterator[None]:
    """Two threads for every call, however small (the rule's threshold lifted)."""
    threshold, nn._MIN_NS_PER_THREAD = nn._MIN_NS_PER_THREAD, 1
    try:
        yield
    finally:
        nn._MIN_NS_PER_THREAD = threshold


def cases(rows: int, width: int) -> list[tuple[str, int, int, Callable[[int], object]]]:
    """(kernel, count, work each, call with a thread count) for one shape, as kernels.nn
    splits it: by rows, by columns for colsum, by elements for AdamW."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, width)).astype(np.float32)
    dy = rng.standard_normal((rows, width)).astype(np.float32)
    bias, gain = rng.standard_normal(width).astype(np.float32), np.ones(width, np.float32)
    _, xhat, inv = nn.layernorm(x, gain, bias, 1e-5)
    _, t = nn.gelu(x.copy(), bias)
    heads = max(1, rows * width // (64 * 64))  # causal 64 x 64 score blocks, as tiny-gpt's
    scores = rng.standard_normal((heads, 64, 64)).astype(np.float32)
    probs = nn.softmax(scores, 0.125, True)
    targets = rng.integers(0, width, rows)
    h = nn.AdamScalars(
        *(np.float32(v) for v in (1, 0.9, 0.1, 0.999, 0.001, 0.5, 0.5, 1e-8, 1e-3, 0.1))
    )
    return [
        ("gelu", rows, width, lambda n: nn.gelu(x.copy(), bias, threads=n)),
        ("gelu_backward", rows, width, lambda n: nn.gelu_backward(dy, x, t, threads=n)),
        ("layernorm", rows, width, lambda n: nn.layernorm(x, gain, bias, 1e-5, threads=n)),
        (
            "layernorm_backward",
            rows,
            width,
            lambda n: nn.layernorm_backward(dy, xhat, inv, gain, threads=n),
        ),
        ("colsum", width, rows, lambda n: nn.colsum(x, threads=n)),
        ("add_bias", rows, width, lambda n: nn.add_bias(x, bias, threads=n)),
        ("softmax", heads * 64, 64, lambda n: nn.softmax(scores, 0.125, True, threads=n)),
        (
            "softmax_backward",
            heads * 64,
            64,
            lambda n: nn.softmax_backward(probs, scores, 0.125, True, threads=n),
        ),
        ("cross_entropy", rows, width, lambda n: nn.cross_entropy(x, targets, threads=n)),
        ("adamw", rows * width, 1, lambda n: nn.adamw(x, dy, x, dy, h, True, threads=n)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    print(
        f"{'shape':>10s} {'kernel':20s} {'1 thread':>10s} {'2 threads':>10s} {'2/1':>5s}"
        f" {'ns/el':>6s} {'picked':>6s}"
    )
    for rows, width in SHAPES:
        for kernel, count, each, call in cases(rows, width):
            picked = len(nn._splits(kernel, count, each, 2))
            one = seconds(lambda call=call: call(1), args.repeats)
            with always_split():
                two = seconds(lambda call=call: call(2), args.repeats)
            print(
                f"{rows:>5d}x{width:<4d} {kernel:20s} {1e6 * one:8.1f}us {1e6 * two:8.1f}us"
                f" {two / one:5.2f} {1e9 * one / (count * each):6.2f} {picked:>6d}"
            )


if __name__ == "__main__":
    main()
