"""The hooks a coordinator sets around each checkpoint, in their order."""

from __future__ import annotations

import asyncio

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
