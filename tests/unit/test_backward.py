"""The backward pass's chain of dX does not wait for weight gradients, the gradients are the
same bits whatever order the products come back in, and a batch of micro-batches takes each
weight's gradient as one product over all of them."""

from __future__ import annotations

import asyncio

import numpy as np

from coordinator.training import project as projects
from coordinator.training.model import TinyGPT, init_params
from coordinator.training.project import ModelSettings
from coordinator.training.trainer import LocalBackend, Trainer

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


class Recorded(LocalBackend):
    """The local products, each recorded as (label, parts of a, parts of b)."""

    def __init__(self) -> None:
        super().__init__()
        self.products: list[tuple[str, int, int]] = []

    async def matmul(self, a, b, *, trans_a: bool, trans_b: bool, label: str) -> np.ndarray:
        parts = (len(a), len(b)) if isinstance(a, list) else (1, 1)
        self.products.append((label, *parts))
        return await super().matmul(a, b, trans_a=trans_a, trans_b=trans_b, label=label)


def two_micro_batches(tmp_path, backend) -> Trainer:
    project = projects.create(
        tmp_path,
        **{"model.layers": 2, "model.width": 32, "model.heads": 2, "model.context": 16},
        **{"training.batch_size": 4, "training.micro_batches": 2},
    )
    return Trainer(project, backend)


async def test_a_weights_gradient_over_micro_batches_is_one_product_of_their_operands(tmp_path):
    """Two micro-batches: each weight's gradient is one product of both micro-batches'
    X and dY stacked along k, not a product each and a sum. It is their sum all the same,
    to within rounding (one reduction over both, against two and an addition)."""
    recorded = Recorded()
    trainer = two_micro_batches(tmp_path, recorded)
    params = init_params(trainer.project.model, seed=5)
    rng = np.random.default_rng(2)
    tokens, targets = rng.integers(0, 256, size=(2, 4, 16))
    loss, grads = await asyncio.wait_for(trainer.loss_and_grads(params, tokens, targets), 60)
    dw = [p for p in recorded.products if p[0].endswith(".dw")]
    assert sorted(label for label, *_ in dw) == sorted(
        ["head.dw"] + [f"block{i}.{x}.dw" for i in range(2) for x in ("fc2", "fc", "proj", "qkv")]
    )
    assert all((a, b) == (2, 2) for _, a, b in dw)
    others = [p for p in recorded.products if not p[0].endswith(".dw")]
    assert len(others) == 2 * 18 and all((a, b) == (1, 1) for _, a, b in others)
    # Each micro-batch alone, summed: the gradient as it was before.
    model = TinyGPT(trainer.project.model, LocalBackend())
    halves = [
        await model.loss_and_grads(params, x, y)
        for x, y in zip(np.split(tokens, 2), np.split(targets, 2), strict=True)
    ]
    for name, grad in grads.items():
        summed = (halves[0][1][name] + halves[1][1][name]) * np.float32(0.5)
        np.testing.assert_allclose(grad, summed, rtol=1e-4, atol=1e-6, err_msg=name)
    assert loss == (halves[0][0] + halves[1][0]) / 2


async def test_a_failed_micro_batch_stops_the_batch_and_every_product_in_flight(tmp_path):
    """One micro-batch's product fails: the batch raises at once, and no weight's gradient
    is left waiting for a micro-batch that will never hand in its operands."""
    started: list[asyncio.Task] = []

    class FailingSecond(LocalBackend):
        calls = 0

        async def matmul(self, a, b, *, trans_a: bool, trans_b: bool, label: str):
            if label.endswith(".dw"):
                started.append(asyncio.current_task())
                await asyncio.Event().wait()  # never back
            if label == "block0.qkv.dx":
                self.calls += 1
                if self.calls == 2:
                    raise RuntimeError("the product failed")
            return await super().matmul(a, b, trans_a=trans_a, trans_b=trans_b, label=label)

    trainer = two_micro_batches(tmp_path, FailingSecond())
    params = init_params(trainer.project.model, seed=5)
    tokens, targets = np.random.default_rng(2).integers(0, 256, size=(2, 4, 16))
    try:
        await asyncio.wait_for(trainer.loss_and_grads(params, tokens, targets), 60)
    except RuntimeError as exc:
        assert "the product failed" in str(exc)
    else:
        raise AssertionError("the failure was lost")
    assert started and all(task.done() for task in started)  # none left running
