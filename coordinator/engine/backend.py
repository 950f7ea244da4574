"""Where the training loop meets the engine: the trainer's linear layers' products sent to
the coordinator's event loop as work units.

A large model's own arithmetic (element-wise work, attention, the optimizer) runs on a
training thread with its own event loop, so the server's loop never waits for it: work
requests, reports and status are answered at every moment of a step. A small model's runs on
the server's loop itself: between two of its products it computes for a millisecond or two,
less than a hand-off to another thread and back costs (`trains_on_server_loop`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from coordinator.engine.products import Products
from coordinator.training.model import parameter_count, widest_activation
from coordinator.training.project import Project
from coordinator.training.trainer import batched_gemm

T = TypeVar("T")

TRAINING_NICE = 5  # the training thread's nice value above the server's
# A model whose widest activation in a micro-batch, and whose parameters, are each smaller
# than this trains on the server's loop. Trained so, tiny-gpt (1 MB and 1.9 MB) kept a status
# request waiting 6.4 ms at most in three runs, and AdamW over 4 MB of parameters takes 2 ms
# (docs/performance-history.md, the twelfth round).
SMALL_MODEL_BYTES = 4 << 20


def trains_on_server_loop(project: Project) -> bool:
    """Whether the model's arithmetic is small enough to run on the server's event loop."""
    sequences = project.training.batch_size // project.training.micro_batches
    widest = 4 * widest_activation(project.model, sequences)
    return max(widest, 4 * parameter_count(project.model)) < SMALL_MODEL_BYTES


class VolunteerBackend:
    """Linear-layer products as work units for volunteers; attention in this process.

    Each product is awaited on the coordinator's loop: directly when the trainer runs there,
    through a hand-off when it runs on a training thread."""

    def __init__(self, products: Products, loop: asyncio.AbstractEventLoop) -> None:
        self.products = products
        self.loop = loop  # the coordinator's event loop
        self.step = 0

    async def matmul(self, a, b, *, trans_a: bool, trans_b: bool, label: str) -> np.ndarray:
        product = self.products.matmul(
            np.ascontiguousarray(a, dtype=np.float32),
            np.ascontiguousarray(b, dtype=np.float32),
            trans_a=trans_a,
            trans_b=trans_b,
            step=self.step,
            label=label,
        )
        if asyncio.get_running_loop() is self.loop:
            return await product
        return await on_loop(product, self.loop)

    batched = staticmethod(batched_gemm)


def on_loop(coroutine: Coroutine[Any, Any, T], loop: asyncio.AbstractEventLoop) -> Awaitable[T]:
    """Run `coroutine` on another thread's `loop` and await it from this one; cancelling the
    wait cancels it there too."""
    return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, loop))


def lower_priority() -> None:
    """Let the server's thread run first when the cores are busy: it only ever needs a
    moment, and a request waiting for a core waits a whole time slice (Linux: a thread may
    raise its own nice value; elsewhere this does nothing)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TRAINING_NICE)


class TrainingThread:
    """Runs one coroutine on a new thread with its own event loop, awaitable from this loop.

    Cancelling `run()` cancels the coroutine on its thread and waits for the thread to end,
    so nothing of the training loop outlives the coordinator that stops it."""

    def __init__(self, make: Callable[[], Coroutine[Any, Any, T]]) -> None:
        self.make = make
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._started = threading.Event()

    async def run(self) -> T:
        caller = asyncio.get_running_loop()
        done: asyncio.Future = caller.create_future()
        # Marked retrieved: once run() is cancelled, nobody awaits the outcome any more.
        done.add_done_callback(lambda f: f.cancelled() or f.exception())

        def settle(value: Any, error: BaseException | None) -> None:
            if done.done():
                return
            if error is None:
                done.set_result(value)
            else:
                done.set_exception(error)

        def target() -> None:
            lower_priority()
            loop = asyncio.new_event_loop()
            # Checkpoints and evaluation run on this loop's worker threads: niced as well.
            loop.set_default_executor(
                ThreadPoolExecutor(
                    thread_name_prefix="tilehive-training", initializer=lower_priority
                )
            )
            self._loop = loop
            self._task = loop.create_task(self.make())
            self._started.set()
            try:
                value = loop.run_until_complete(self._task)
                caller.call_soon_threadsafe(settle, value, None)
            except BaseException as exc:  # handed to whoever awaits run()
                caller.call_soon_threadsafe(settle, None, exc)
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(loop.shutdown_default_executor())
                loop.close()

        thread = threading.Thread(target=target, name="tilehive-training", daemon=True)
        thread.start()
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            await asyncio.to_thread(self._started.wait)
            self._loop.call_soon_threadsafe(self._task.cancel)
            await asyncio.to_thread(thread.join)
            raise
