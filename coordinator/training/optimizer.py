"""AdamW with global gradient clipping and a warmup-then-cosine learning rate, in float32.

Its state stays on the coordinator. The arithmetic is kernels.nn's (the gradient norm in
fixed float64 lanes, one fused clip-and-update pass per tensor); the norm adds the tensors in
the parameters' order, so an update is a pure function of (params, grads, state, step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from coordinator.training.model import Params, decays
from coordinator.training.project import OptimizerSettings
from kernels import nn


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
    """The L2 norm of all gradients together, in float64."""
    return nn.global_norm(list(grads.values()))


def adamw_step(
    params: Params, grads: Params, state: AdamState, lr: float, s: OptimizerSettings
) -> tuple[Params, AdamState, float]:
    """New params and state, and the gradient norm before clipping."""
    norm = global_norm(grads)
    scale = np.float32(min(1.0, s.grad_clip / (norm + 1e-6))) if s.grad_clip else np.float32(1)
    step = state.step + 1
    b1, b2 = np.float32(s.beta1), np.float32(s.beta2)
    h = nn.AdamScalars(
        scale=scale,
        beta1=b1,
        one_minus_beta1=np.float32(1) - b1,
        beta2=b2,
        one_minus_beta2=np.float32(1) - b2,
        correction1=np.float32(1 - s.beta1**step),
        correction2=np.float32(1 - s.beta2**step),
        eps=np.float32(s.eps),
        lr=np.float32(lr),
        weight_decay=np.float32(s.weight_decay),
    )
    new_params, m_new, v_new = {}, {}, {}
    for name, p in params.items():
        new_params[name], m_new[name], v_new[name] = nn.adamw(
            p, grads[name], state.m[name], state.v[name], h, decays(name)
        )
    return new_params, AdamState(step, m_new, v_new), norm
