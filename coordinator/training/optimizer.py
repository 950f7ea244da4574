"""AdamW with global gradient clipping and a warmup-then-cosine learning rate, in float32.

Its state stays on the coordinator. Every reduction runs in a fixed order over the
parameters' names, so an update is a pure function of (params, grads, state, step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from coordinator.training.model import Params, decays
from coordinator.training.project import OptimizerSettings


@dataclass
class AdamState:
    step: int
    m: Params
    v: Params

    @classmethod
    def zeros(cls, params: Params) -> AdamState:
        return cls(
            0,
            {k: np.zeros_like(p) for k, p in params.items()},
            {k: np.zeros_like(p) for k, p in params.items()},
        )


def learning_rate(step: int, total: int, s: OptimizerSettings) -> float:
    """Linear warmup over warmup_steps, then cosine decay from lr to min_lr at `total`."""
    if s.warmup_steps and step <= s.warmup_steps:
        return s.lr * step / s.warmup_steps
    span = max(1, total - s.warmup_steps)
    progress = min(1.0, (step - s.warmup_steps) / span)
    return s.min_lr + 0.5 * (s.lr - s.min_lr) * (1 + math.cos(math.pi * progress))


def global_norm(grads: Params) -> float:
    return math.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64))) for g in grads.values()))


def adamw_step(
    params: Params, grads: Params, state: AdamState, lr: float, s: OptimizerSettings
) -> tuple[Params, AdamState, float]:
    """New params and state, and the gradient norm before clipping."""
    norm = global_norm(grads)
    scale = np.float32(min(1.0, s.grad_clip / (norm + 1e-6))) if s.grad_clip else np.float32(1)
    step = state.step + 1
    b1, b2 = np.float32(s.beta1), np.float32(s.beta2)
    correction1 = np.float32(1 - s.beta1**step)
    correction2 = np.float32(1 - s.beta2**step)
    lr32, eps, wd = np.float32(lr), np.float32(s.eps), np.float32(s.weight_decay)
    new_params, m_new, v_new = {}, {}, {}
    for name, p in params.items():
        g = grads[name] * scale
        m = b1 * state.m[name] + (1 - b1) * g
        v = b2 * state.v[name] + (1 - b2) * g * g
        update = (m / correction1) / (np.sqrt(v / correction2) + eps)
        if decays(name):
            update = update + wd * p
        new_params[name] = (p - lr32 * update).astype(np.float32)
        m_new[name], v_new[name] = m.astype(np.float32), v.astype(np.float32)
    return new_params, AdamState(step, m_new, v_new), norm
