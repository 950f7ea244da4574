"""Checkpoints: DIR/checkpoints/step-NNNNNN.npz (one array per named parameter) and the
optimizer state beside it in step-NNNNNN.opt.npz, each written atomically."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np

from coordinator.state.blobs import write_atomic
from coordinator.training.model import Params
from coordinator.training.optimizer import AdamState

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


def load(directory: Path, step: int, names: list[str]) -> tuple[Params, AdamState]:
    target = path(directory, step)
    with np.load(target) as data:
        params = {name: data[name] for name in names}
    with np.load(target.with_suffix(".opt.npz")) as data:
        state = AdamState(
            int(data["step"]),
            {name: data[f"m.{name}"] for name in names},
            {name: data[f"v.{name}"] for name in names},
        )
    return params, state
