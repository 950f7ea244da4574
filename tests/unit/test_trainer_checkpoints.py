"""The hooks a coordinator sets around each checkpoint, in their order."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from coordinator.training import history
from coordinator.training import project as projects
from coordinator.training.trainer import LocalBackend, Trainer
from tests.factories import SMALL


def test_the_work_is_committed_before_a_checkpoint_is_written_and_pruned_after(tmp_path):
    """A checkpoint on disk whose products the database still holds active would leave them
    active for good after a kill: nothing asks for a step before a checkpoint again."""
    project = projects.create(
        tmp_path / "p", **{**SMALL, "training.steps": 2, "training.checkpoint_every": 1}
    )
    trainer = Trainer(project, LocalBackend())
    seen: list[tuple[str, bool]] = []

    def written() -> bool:
        return any(project.checkpoints.glob("step-*.npz"))

    async def before() -> None:
        seen.append(("commit", written()))

    async def after(step: int) -> None:
        seen.append((f"prune {step}", written()))

    trainer.before_checkpoint = before
    trainer.on_checkpoint = after
    asyncio.run(trainer.run())
    assert seen == [("commit", False), ("prune 1", True), ("commit", True), ("prune 2", True)]


def test_a_step_checkpointed_as_training_stops_is_in_the_history(tmp_path):
    """A coordinator stopped just after a checkpoint resumes after that step, so the step's
    line must be in train.jsonl by then, its evaluation done or not: else the history (and
    `status`) lacks it for good."""
    project = projects.create(
        tmp_path / "p",
        **{**SMALL, "training.steps": 4, "training.checkpoint_every": 1, "training.eval_every": 1},
    )
    trainer = Trainer(project, LocalBackend())
    evaluated = threading.Event()  # evaluations (on their own threads) end when the test says

    async def slow_evaluation(params, step: int) -> float:
        await asyncio.to_thread(evaluated.wait)
        return 0.0

    async def stopped_after_step_two() -> None:
        training = asyncio.create_task(trainer.run())

        async def stop(step: int) -> None:
            if step == 2:
                training.cancel()

        trainer.on_checkpoint = stop
        trainer.evaluate = slow_evaluation
        try:
            with contextlib.suppress(asyncio.CancelledError):
                await training
        finally:
            evaluated.set()

    asyncio.run(stopped_after_step_two())
    checkpointed = sorted(int(p.stem[5:]) for p in project.checkpoints.glob("step-??????.npz"))
    assert checkpointed[:2] == [1, 2]
    assert [r["step"] for r in history.read(trainer.metrics)] == checkpointed


def test_each_micro_batchs_products_are_labelled_with_it(tmp_path):
    """Both micro-batches run the same layers at once: the task log, the dashboard and a
    failed product's log line named each product twice, alike."""

    class Labels(LocalBackend):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        async def matmul(self, a, b, *, trans_a: bool, trans_b: bool, label: str):
            self.seen.append(label)
            return await super().matmul(a, b, trans_a=trans_a, trans_b=trans_b, label=label)

    project = projects.create(
        tmp_path / "p", **{**SMALL, "training.steps": 1, "training.micro_batches": 2}
    )
    backend = Labels()
    asyncio.run(Trainer(project, backend).run())
    first = sorted(label.removeprefix("mb0.") for label in backend.seen if label.startswith("mb0."))
    second = sorted(
        label.removeprefix("mb1.") for label in backend.seen if label.startswith("mb1.")
    )
    assert first and first == second and "head.fwd" in first
    assert len(first) + len(second) == len(backend.seen)
