"""Text from a trained checkpoint: what the model learned, byte by byte."""

from __future__ import annotations

import asyncio

import numpy as np

from coordinator.training import checkpoints
from coordinator.training.model import TinyGPT, param_shapes, softmax_rows
from coordinator.training.project import Project, ProjectError
from coordinator.training.trainer import LocalBackend


def generate(project: Project, prompt: str, length: int, temperature: float, seed: int) -> str:
    step = checkpoints.latest(project.checkpoints)
    if step is None:
        raise ProjectError(f"no checkpoint in {project.checkpoints} yet: train first")
    params, _ = checkpoints.load(project.checkpoints, step, list(param_shapes(project.model)))
    model = TinyGPT(project.model, LocalBackend())
    context = project.model.context
    tokens = list(prompt.encode()) or [10]
    rng = np.random.default_rng(seed)
    for _ in range(length):
        window = tokens[-context:]
        padded = np.zeros((1, context), np.int64)
        padded[0, : len(window)] = window
        logits, _ = asyncio.run(model.forward(params, padded))
        row = logits[len(window) - 1].astype(np.float64)
        if temperature == 0:
            tokens.append(int(row.argmax()))
        else:
            p = softmax_rows(row / temperature)
            tokens.append(int(rng.choice(len(p), p=p)))
    return bytes(tokens).decode("utf-8", errors="replace")
