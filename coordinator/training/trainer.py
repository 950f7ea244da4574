"""The training loop: batches, forward and backward through a Backend, AdamW, checkpoints.

The same loop runs `tilehive train --local` (products in-process) and `tilehive coordinator`
(products as verified work units); with the same project both write the same bits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import kernels
from coordinator.state.blobs import sweep_temporary
from coordinator.training import checkpoints
from coordinator.training.corpus import Corpus
from coordinator.training.corpus import load as load_corpus
from coordinator.training.model import Backend, Params, TinyGPT, init_params, param_shapes
from coordinator.training.optimizer import AdamState, adamw_step, learning_rate
from coordinator.training.project import Project
from kernels import nn

log = logging.getLogger(__name__)

EVAL_BATCHES = 2


def batched_gemm(a: np.ndarray, b: np.ndarray, *, trans_a=False, trans_b=False) -> np.ndarray:
    """Per-head products with the deterministic kernel (attention runs here, locally), on the
    model kernels' threads: the bits of kernels.gemm per head, for any thread count."""
    return kernels.batched_gemm(
        np.ascontiguousarray(a, dtype=np.float32),
        np.ascontiguousarray(b, dtype=np.float32),
        trans_a=trans_a,
        trans_b=trans_b,
        threads=nn.default_threads(),
    )


class LocalBackend:
    """Every product in this process with kernels.gemm: the reference run."""

    def __init__(self, threads: int = 1) -> None:
        self.threads = threads

    async def matmul(self, a, b, *, trans_a: bool, trans_b: bool, label: str) -> np.ndarray:
        return kernels.gemm(
            np.ascontiguousarray(a),
            np.ascontiguousarray(b),
            trans_a=trans_a,
            trans_b=trans_b,
            threads=self.threads,
        )

    batched = staticmethod(batched_gemm)


class MicroBatchBackend:
    """A backend whose products are labelled with their micro-batch (`mb1.block0.fc.fwd`):
    both micro-batches run the same layers at once, and the task log, the dashboard and a
    failed product's log line tell them apart."""

    def __init__(self, backend: Backend, part: int) -> None:
        self.backend = backend
        self.prefix = f"mb{part}."
        self.batched = backend.batched

    def matmul(
        self, a: np.ndarray, b: np.ndarray, *, trans_a: bool, trans_b: bool, label: str
    ) -> Awaitable[np.ndarray]:
        return self.backend.matmul(
            a, b, trans_a=trans_a, trans_b=trans_b, label=self.prefix + label
        )


@dataclass
class StepReport:
    step: int
    steps: int
    loss: float
    lr: float
    grad_norm: float
    seconds: float
    # The whole process's CPU over the step, every thread (for a coordinator: serving its
    # volunteers too), so an operator sees what a step costs the host besides its time.
    cpu_seconds: float = 0.0
    val_loss: float | None = None

    def record(self) -> dict:
        """The step as train.jsonl keeps it, and as status and the dashboard show it: the
        same fields from the file after a restart as from the running coordinator."""
        line = {
            "step": self.step,
            "loss": self.loss,
            "lr": self.lr,
            "grad_norm": self.grad_norm,
            "seconds": round(self.seconds, 4),
            "cpu_seconds": round(self.cpu_seconds, 4),
            "time": time.time(),
        }
        if self.val_loss is not None:
            line["val_loss"] = self.val_loss
        return line


class Trainer:
    def __init__(self, project: Project, backend, corpus: Corpus | None = None) -> None:
        self.project = project
        self.backend = backend
        self.model = TinyGPT(project.model, backend)
        parts = project.training.micro_batches
        self.parts = [TinyGPT(project.model, MicroBatchBackend(backend, i)) for i in range(parts)]
        self.corpus = corpus
        self.metrics = project.directory / "train.jsonl"
        # Called after each checkpoint with its step (the coordinator prunes old blobs).
        self.on_checkpoint: Callable[[int], Awaitable[object]] | None = None
        # Awaited before each checkpoint is written (the coordinator commits what its
        # products' ends left queued: no checkpoint is on disk before its step is done there).
        self.before_checkpoint: Callable[[], Awaitable[object]] | None = None

    def _corpus(self) -> Corpus:
        if self.corpus is None:
            c = self.project.corpus
            self.corpus = load_corpus(c.source, c.max_mb, c.validation_share)
        return self.corpus

    def resume(self) -> tuple[int, Params, AdamState]:
        """The last checkpoint, or fresh weights at step 0."""
        if self.project.checkpoints.is_dir() and sweep_temporary(self.project.checkpoints):
            log.info("removed the temporary files of a checkpoint a stop interrupted")
        done = checkpoints.latest(self.project.checkpoints)
        if done is None:
            params = init_params(self.project.model, self.project.training.seed)
            return 0, params, AdamState.zeros(params)
        params, state = checkpoints.load(
            self.project.checkpoints, done, param_shapes(self.project.model)
        )
        return done, params, state

    async def evaluate(self, params: Params, step: int) -> float:
        """Validation loss on fixed held-out batches, computed locally (it changes no weight)."""
        t = self.project.training
        local = TinyGPT(self.project.model, LocalBackend())
        losses = []
        for i in range(EVAL_BATCHES):
            x, y = self._corpus().batch(t.seed, i, t.batch_size, self.project.model.context, "val")
            losses.append(await local.loss(params, x, y))
        return float(np.mean(losses))

    async def loss_and_grads(
        self, params: Params, tokens: np.ndarray, targets: np.ndarray
    ) -> tuple[float, Params]:
        """The batch's mean loss and gradients, from its micro-batches computed together.

        Each micro-batch's products are in flight at once; their losses and gradients are
        then summed in micro-batch order and scaled once, so the bits depend on the
        setting alone, never on which product finished first."""
        parts = self.project.training.micro_batches
        if parts == 1:
            return await self.model.loss_and_grads(params, tokens, targets)
        results = await asyncio.gather(
            *(
                model.loss_and_grads(params, x, y)
                for model, x, y in zip(
                    self.parts, np.split(tokens, parts), np.split(targets, parts), strict=True
                )
            )
        )
        scale = np.float32(1.0 / parts)
        grads = {}
        for name in params:
            total = results[0][1][name].copy()
            for _, part in results[1:]:
                total += part[name]
            total *= scale
            grads[name] = total
        loss = sum(loss for loss, _ in results) / parts
        return loss, grads

    async def run(
        self, until: int | None = None, on_step: Callable[[StepReport], None] | None = None
    ) -> Params:
        t, opt = self.project.training, self.project.optimizer
        last = min(until or t.steps, t.steps)
        # Files read off the running loop: it may be the server's, answering volunteers.
        step, params, state = await asyncio.to_thread(self.resume)
        corpus = await asyncio.to_thread(self._corpus)
        if step:
            log.info("resuming after step %d from %s", step, self.project.checkpoints)
        else:
            log.info("no checkpoint yet: training from step 1")
        reported: asyncio.Task | None = None  # the previous step's report, in order
        try:
            while step < last:
                step += 1
                started, cpu_started = time.perf_counter(), time.process_time()
                if hasattr(self.backend, "step"):
                    self.backend.step = step
                x, y = corpus.batch(t.seed, step, t.batch_size, self.project.model.context)
                loss, grads = await self.loss_and_grads(params, x, y)
                lr = learning_rate(step, t.steps, opt)
                params, state, norm = adamw_step(params, grads, state, lr, opt)
                report = StepReport(
                    step,
                    t.steps,
                    loss,
                    lr,
                    norm,
                    time.perf_counter() - started,
                    time.process_time() - cpu_started,
                )
                evaluation = None
                if step % t.eval_every == 0 or step == t.steps:
                    # On a worker thread, beside the next step: it changes no weight.
                    frozen = {name: p.copy() for name, p in params.items()}
                    evaluation = asyncio.create_task(
                        asyncio.to_thread(asyncio.run, self.evaluate(frozen, step))
                    )
                # Before the checkpoint: a stop while it is written (its thread finishes it)
                # still records the step.
                reported = asyncio.create_task(self._report(reported, report, evaluation, on_step))
                if step % t.checkpoint_every == 0 or step == last:
                    if self.before_checkpoint is not None:
                        await self.before_checkpoint()
                    await asyncio.to_thread(
                        checkpoints.save, self.project.checkpoints, step, params, state
                    )
                    if self.on_checkpoint is not None:
                        await self.on_checkpoint(step)
            if reported is not None:
                await reported
        finally:
            if reported is not None and not reported.done():
                # Stopped: the steps trained are recorded now, without the evaluations
                # still running (Trainer._report), before this returns.
                reported.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reported
        return params

    async def _report(
        self,
        previous: asyncio.Task | None,
        report: StepReport,
        evaluation: asyncio.Task | None,
        on_step: Callable[[StepReport], None] | None,
    ) -> None:
        """Record a step once the one before it is recorded and its evaluation is done; if
        training stops first, at once without its evaluation: a restart resumes after the
        last checkpoint, so a step checkpointed and not recorded would be missing for good."""
        try:
            if previous is not None:
                await previous
            if evaluation is not None:
                report.val_loss = await evaluation
        finally:
            self._record(report)
        if on_step:
            on_step(report)

    def _record(self, r: StepReport) -> None:
        with Path(self.metrics).open("a") as f:
            f.write(json.dumps(r.record()) + "\n")
