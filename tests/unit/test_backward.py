"""The backward pass's chain of dX does not wait for weight gradients, and the gradients are
the same bits whatever order the products come back in."""

from __future__ import annotations

import asyncio

import numpy as np

from coordinator.training.model import TinyGPT, init_params
from coordinator.training.project import ModelSettings
from coordinator.training.trainer import LocalBackend

SETTINGS = ModelSettings(layers=2, width=32, heads=2, context=16)


class WeightGradientsLast(LocalBackend):
    """The local products, but every dW held back until the last dX has gone out: a crowd
    whose weight-gradient tiles come back long after the input gradients."""

    def __init__(self, dx_products: int) -> None:
        super().__init__()
        self.dx_left = dx_products
        self.released = asyncio.Event()
        self.order: list[str] = []

    async def matmul(self, a, b, *, trans_a: bool, trans_b: bool, label: str) -> np.ndarray:
        self.order.append(label)
        if label.endswith(".dw"):
            await self.released.wait()
        elif label.endswith(".dx"):
            self.dx_left -= 1
            if not self.dx_left:
                self.released.set()
        return await super().matmul(a, b, trans_a=trans_a, trans_b=trans_b, label=label)


def batch():
    rng = np.random.default_rng(1)
    return rng.integers(0, 256, size=(3, 16)), rng.integers(0, 256, size=(3, 16))


async def test_the_next_dx_goes_out_while_weight_gradients_are_in_flight():
    params = init_params(SETTINGS, seed=5)
    tokens, targets = batch()
    # The head's dX, and four per block: fc2, fc, proj and qkv.
    held = WeightGradientsLast(dx_products=1 + 4 * SETTINGS.layers)
    # Were a dX to wait for its layer's dW, the chain would stop at the first layer.
    loss, grads = await asyncio.wait_for(
        TinyGPT(SETTINGS, held).loss_and_grads(params, tokens, targets), timeout=60
    )
    dx = [label for label in held.order if label.endswith(".dx")]
    assert held.order.index(dx[-1]) > held.order.index("head.dw")  # out before head.dW was back
    reference_loss, reference = await TinyGPT(SETTINGS, LocalBackend()).loss_and_grads(
        params, tokens, targets
    )
    assert loss == reference_loss
    assert list(grads) == list(reference)
    for name in reference:
        assert grads[name].tobytes() == reference[name].tobytes(), name


async def test_a_failed_dx_cancels_the_weight_gradients_in_flight():
    started: list[asyncio.Task] = []

    class FailingDx(LocalBackend):
        async def matmul(self, a, b, *, trans_a: bool, trans_b: bool, label: str):
            if label.endswith(".dw"):
                started.append(asyncio.current_task())
                await asyncio.Event().wait()  # never back
            if label == "block1.fc2.dx":
                raise RuntimeError("the product failed")
            return await super().matmul(a, b, trans_a=trans_a, trans_b=trans_b, label=label)

    tokens, targets = batch()
    model = TinyGPT(SETTINGS, FailingDx())
    try:
        await model.loss_and_grads(init_params(SETTINGS, seed=5), tokens, targets)
    except RuntimeError as exc:
        assert "the product failed" in str(exc)
    else:
        raise AssertionError("the failure was lost")
    assert started and all(task.cancelled() for task in started)  # none left running
