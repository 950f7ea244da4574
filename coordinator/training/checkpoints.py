"""Checkpoints: DIR/checkpoints/step-NNNNNN.npz (one array per named parameter) and the
optimizer state beside it in step-NNNNNN.opt.npz, each written atomically."""

from __future__ import annotations

import io
import re
import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from coordinator.state.blobs import write_atomic
from coordinator.training.model import Params
from coordinator.training.optimizer import AdamState
from coordinator.training.project import ProjectError


class CheckpointError(ProjectError):
    """A checkpoint that cannot be read, or that does not fit the model in project.toml."""


NAME = re.compile(r"step-(\d{6})\.npz")


def path(directory: Path, step: int) -> Path:
    return directory / f"step-{step:06d}.npz"


def _write_atomic(target: Path, arrays: dict[str, np.ndarray]) -> None:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    write_atomic(target, buffer.getbuffer())


def save(directory: Path, step: int, params: Params, state: AdamState) -> Path:
    """The optimizer state first: a parameter file only exists beside complete state."""
    directory.mkdir(parents=True, exist_ok=True)
    target = path(directory, step)
    optimizer = {f"m.{k}": v for k, v in state.m.items()}
    optimizer.update({f"v.{k}": v for k, v in state.v.items()})
    optimizer["step"] = np.array(state.step, dtype=np.int64)
    _write_atomic(target.with_suffix(".opt.npz"), optimizer)
    _write_atomic(target, params)
    return target


def latest(directory: Path) -> int | None:
    steps = [int(m.group(1)) for p in directory.glob("step-*.npz") if (m := NAME.fullmatch(p.name))]
    return max(steps, default=None)


def latest_readable(directory: Path, shapes: Mapping[str, tuple[int, ...]]) -> int:
    """The latest checkpoint's step (0: none), once its files open and each array in them
    has the model's shape (`shapes`, read from the arrays' headers alone: resuming reads
    the arrays). A checkpoint cut off (a full disk, a copy interrupted), or one of other
    model settings, raises CheckpointError before anything is said of resuming from it or
    of the project being done (`nothing to do`, then the error). A byte changed inside an
    array's data is found only when the arrays are read, by their CRC."""
    step = latest(directory)
    if step is None:
        return 0
    target = path(directory, step)
    optimizer = target.with_suffix(".opt.npz")
    with _opened(target) as data:
        for name, shape in shapes.items():
            _shape(data, target, name, shape)
    with _opened(optimizer) as data:
        _shape(data, optimizer, "step", ())
        for name, shape in shapes.items():
            _shape(data, optimizer, f"m.{name}", shape)
            _shape(data, optimizer, f"v.{name}", shape)
    return step


def load(
    directory: Path, step: int, shapes: Mapping[str, tuple[int, ...]]
) -> tuple[Params, AdamState]:
    """The parameters and optimizer state of `step`, each array of the shape the model has
    (`shapes`, model.param_shapes). CheckpointError for a damaged file, or one written for
    another model (its settings changed in project.toml since); OSError for a missing one."""
    target = path(directory, step)
    optimizer = target.with_suffix(".opt.npz")
    with _opened(target) as data:
        params = {name: _array(data, target, name, shape) for name, shape in shapes.items()}
    with _opened(optimizer) as data:
        count = _array(data, optimizer, "step", ())
        state = AdamState(
            int(count),
            {name: _array(data, optimizer, f"m.{name}", shape) for name, shape in shapes.items()},
            {name: _array(data, optimizer, f"v.{name}", shape) for name, shape in shapes.items()},
        )
    return params, state


def _opened(file: Path):
    try:
        return np.load(file)
    except (zipfile.BadZipFile, ValueError, EOFError) as exc:  # not an .npz: cut off, damaged
        raise CheckpointError(
            f"{file} is damaged ({exc}): move it and its other half (.npz, .opt.npz) aside, "
            "and training resumes from the checkpoint before it"
        ) from None


def _array(data, file: Path, key: str, shape: tuple[int, ...]) -> np.ndarray:
    """data[key], of `shape`; CheckpointError if it is missing, unreadable or shaped for
    another model."""
    try:
        array = data[key]
    except KeyError:
        raise _missing(file, key) from None
    except (zipfile.BadZipFile, ValueError, EOFError, OSError) as exc:
        raise CheckpointError(f"{file} is damaged ({exc}): its {key!r} cannot be read") from None
    _check_shape(file, key, array.shape, shape)
    return array


def _shape(data, file: Path, key: str, shape: tuple[int, ...]) -> None:
    """As _array, from the array's header alone."""
    try:
        with data.zip.open(f"{key}.npy") as member:
            version = np.lib.format.read_magic(member)
            if version == (1, 0):
                found, _, _ = np.lib.format.read_array_header_1_0(member)
            else:
                found, _, _ = np.lib.format.read_array_header_2_0(member)
    except KeyError:
        raise _missing(file, key) from None
    except (zipfile.BadZipFile, ValueError, EOFError, OSError) as exc:
        raise CheckpointError(f"{file} is damaged ({exc}): its {key!r} cannot be read") from None
    _check_shape(file, key, found, shape)


def _missing(file: Path, key: str) -> CheckpointError:
    return CheckpointError(
        f"{file} holds no {key!r}: it was written for another model than project.toml's "
        "(restore the model's settings, or start a new project with tilehive init)"
    )


def _check_shape(file: Path, key: str, found: tuple[int, ...], shape: tuple[int, ...]) -> None:
    if found != shape:
        raise CheckpointError(
            f"{file}: {key!r} is {found}, the model in project.toml has {shape}: the "
            "model's settings changed after this checkpoint was written (restore them, or "
            "start a new project with tilehive init)"
        )
