"""The `tilehive` command line: every flag may also come from TILEHIVE_<FLAG>."""

from __future__ import annotations

import os
import time

import click
import numpy as np

import kernels
from kernels import reference
from volunteer.cli import option, volunteer


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tilehive")
def main() -> None:
    """tilehive: train neural networks on volunteered computers, every tile verified."""


main.add_command(volunteer)


def _bits_equal(x: np.ndarray, y: np.ndarray) -> bool:
    return x.shape == y.shape and np.array_equal(x.view(np.uint32), y.view(np.uint32))


def _self_check(rng: np.random.Generator, threads: int) -> list[str]:
    """Compare the compiled kernel with its twin and with its own sub-blocks; list failures."""
    failures = []
    for m, n, k in [(1, 1, 1), (7, 13, 5), (45, 29, 131), (64, 96, 200)]:
        for trans_a in (False, True):
            for trans_b in (False, True):
                a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(np.float32)
                b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
                flags = {"trans_a": trans_a, "trans_b": trans_b}
                full = kernels.gemm(a, b, threads=threads, **flags)
                label = f"{m}x{n}x{k} trans_a={trans_a} trans_b={trans_b}"
                if not _bits_equal(full, reference.gemm(a, b, **flags)):
                    failures.append(f"{label}: compiled kernel differs from the numpy twin")
                i0, j0 = m // 3, n // 4
                rows = a[:, i0:] if trans_a else a[i0:]
                cols = b[j0:] if trans_b else b[:, j0:]
                block = kernels.gemm(
                    np.ascontiguousarray(rows), np.ascontiguousarray(cols), **flags
                )
                if not _bits_equal(block, full[i0:, j0:]):
                    failures.append(f"{label}: a sub-block differs from the full product")
    return failures


def _gflops(size: int, threads: int, repeats: int = 5) -> float:
    rng = np.random.default_rng(1)
    a = rng.standard_normal((size, size)).astype(np.float32)
    b = rng.standard_normal((size, size)).astype(np.float32)
    out = np.empty((size, size), np.float32)
    kernels.gemm(a, b, out=out, threads=threads)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        kernels.gemm(a, b, out=out, threads=threads)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


@main.command()
@option(
    "--threads",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Threads for the kernel.",
)
@option(
    "--size",
    type=click.IntRange(min=1, max=4096),
    default=512,
    show_default=True,
    help="Matrix size of the speed measurement.",
)
def selftest(threads: int, size: int) -> None:
    """Check this machine's kernel bit for bit and measure its speed.

    Runs the compiled kernel against its numpy twin and against its own sub-blocks (two
    honest machines must return identical tiles), then times a SIZE x SIZE x SIZE product.
    Exits 1 if any bit differs.
    """
    click.echo(f"kernel: {kernels.kernel_name()}")
    if kernels.kernel_name() == "reference":
        click.echo("note: running the numpy twin (TILEHIVE_KERNEL=reference or no extension)")
    failures = _self_check(np.random.default_rng(0), threads)
    for failure in failures:
        click.echo(f"FAIL {failure}", err=True)
    if failures:
        raise click.ClickException(f"{len(failures)} bitwise check(s) failed on this machine")
    click.echo("bitwise: compiled == twin, sub-blocks == full product: ok")
    if kernels.kernel_name() != "reference":
        rate = _gflops(size, threads)
        click.echo(f"speed: {rate:.1f} GFLOPS at {size}^3 with {threads} thread(s)")
    click.echo(f"cpu count: {os.cpu_count()}")


if __name__ == "__main__":
    main(prog_name="tilehive")
