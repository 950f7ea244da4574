"""The `tilehive` command line: every flag may also come from TILEHIVE_<FLAG>."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import click
import numpy as np

import kernels
from coordinator.corpus import CorpusError
from coordinator.project import MODELS, ProjectError
from coordinator.project import create as create_project
from coordinator.project import load as load_project
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


def _fail_on_project_error(fn):
    """Bad settings and missing projects become a clear message, never a traceback."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ProjectError, CorpusError) as exc:
            raise click.ClickException(str(exc)) from exc

    return wrapper


def _bind(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise click.BadParameter(f"{value!r} is not HOST:PORT (e.g. 0.0.0.0:8470)")
    return host.strip("[]"), int(port)


def _logging() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")


@main.command()
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@option("--model", type=click.Choice(MODELS), default="tiny-gpt", show_default=True)
@option(
    "--corpus",
    default="python-stdlib",
    show_default=True,
    help='"python-stdlib" or a path to a text file or folder.',
)
@option("--seed", type=click.IntRange(min=0), default=None, help="Weights and batch order.")
@option("--steps", type=click.IntRange(min=1), default=None, help="Optimizer steps.")
@option("--tile", type=click.IntRange(min=1, max=4096), default=None, help="Tile size.")
@_fail_on_project_error
def init(directory: Path, model: str, corpus: str, seed, steps, tile) -> None:
    """Create a project in DIRECTORY with a documented project.toml."""
    overrides = {"model.name": model, "corpus.source": corpus}
    for key, value in (("training.seed", seed), ("training.steps", steps), ("work.tile", tile)):
        if value is not None:
            overrides[key] = value
    if corpus != "python-stdlib":
        overrides["corpus.source"] = str(Path(corpus).expanduser().resolve())
    created = create_project(directory, **overrides)
    click.echo(
        f"created {directory / 'project.toml'}: {created.model.name}, "
        f"{created.training.steps} steps, tiles of {created.work.tile}"
    )
    click.echo(f"next: tilehive coordinator {directory}   (or: tilehive train {directory} --local)")


@main.command("coordinator")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@option("--bind", default="0.0.0.0:8470", show_default=True, help="HOST:PORT to listen on.")
@option("--keep-serving", is_flag=True, help="Keep the API up after the last step.")
@_fail_on_project_error
def coordinator_command(directory: Path, bind: str, keep_serving: bool) -> None:
    """Host the project in DIRECTORY: serve volunteers and train until its steps are done.

    A restarted coordinator resumes from the last checkpoint and the tiles already validated.
    """
    import asyncio

    from coordinator.host import host_project

    host, port = _bind(bind)
    project = load_project(directory)
    _logging()
    sys.exit(asyncio.run(host_project(project, host, port, keep_serving)))


@main.command()
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@option("--local", is_flag=True, help="Run every product in this process (required).")
@option(
    "--steps",
    type=click.IntRange(min=1),
    default=None,
    help="Stop after this step (the schedule still follows the project's steps).",
)
@option("--threads", type=click.IntRange(min=1), default=1, show_default=True)
@_fail_on_project_error
def train(directory: Path, local: bool, steps: int | None, threads: int) -> None:
    """Train the project in one process: the reference a distributed run equals bit for bit."""
    import asyncio

    from coordinator.trainer import LocalBackend, Trainer

    if not local:
        raise click.UsageError(
            "train runs the single-machine reference: pass --local "
            "(to train with volunteers run `tilehive coordinator DIR`)"
        )
    project = load_project(directory)
    trainer = Trainer(project, LocalBackend(threads))

    def show(r) -> None:
        val = f"  val_loss {r.val_loss:.4f}" if r.val_loss is not None else ""
        click.echo(f"step {r.step}/{r.steps}  loss {r.loss:.4f}{val}  ({r.seconds:.2f}s)")

    asyncio.run(trainer.run(until=steps, on_step=show))
    click.echo(f"checkpoints: {project.checkpoints}")


@main.command()
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@option("--prompt", default="def ", show_default=True)
@option("--length", type=click.IntRange(min=1, max=100_000), default=200, show_default=True)
@option("--temperature", type=click.FloatRange(min=0), default=0.8, show_default=True)
@option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@_fail_on_project_error
def sample(directory: Path, prompt: str, length: int, temperature: float, seed: int) -> None:
    """Generate text from the project's latest checkpoint."""
    from coordinator.sampling import generate

    click.echo(generate(load_project(directory), prompt, length, temperature, seed))


@main.command()
@option("--volunteers", type=click.IntRange(min=1, max=32), default=3, show_default=True)
@option("--steps", type=click.IntRange(min=1), default=20, show_default=True)
@option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Project directory (default: a temporary one, removed afterwards).",
)
@option("--keep", is_flag=True, help="Keep the temporary project directory.")
@_fail_on_project_error
def demo(volunteers: int, steps: int, directory: Path | None, keep: bool) -> None:
    """Train a small model with a coordinator and volunteers on this machine."""
    from coordinator.demo import run_demo

    run_demo(volunteers, steps, directory, keep)


if __name__ == "__main__":
    main(prog_name="tilehive")
