"""Protocol-speaking test volunteers with knobs for misbehaviour (honest by default).

A ScriptedVolunteer runs the daemon's pull loop (volunteer/loop.py) with the real kernel
in-process; only its script is injected, as the emulator injects its model: a lie in what
it reports, silence, a fixed capacity, and extra compute time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import kernels
from volunteer.backoff import Backoff
from volunteer.cache import BlobCache
from volunteer.client import CoordinatorClient, ServerRefused, compute_tile
from volunteer.loop import PullLoop
from volunteer.session import Quarantined

MAX_BLOB = 64 << 20


@dataclass
class Behaviour:
    lie: bool = False  # return a wrong tile (one element changed) with its true hash
    silent: bool = False  # take work and never answer
    capacity: int = 2  # results held at most
    seconds_per_tile: float = 0.0  # simulated compute time on top of the real kernel


class ScriptedVolunteer(PullLoop):
    """A volunteer in the test's process. `taken` lists every result it was assigned,
    `done` counts its tiles the coordinator took, `refused` is the 403 that stopped it."""

    def __init__(self, url: str, name: str, behaviour: Behaviour | None = None) -> None:
        self.behaviour = behaviour or Behaviour()
        super().__init__(
            CoordinatorClient(url, timeout=10),
            name=name,
            cache=BlobCache(16 * MAX_BLOB),
            gflops=10.0,
            # Restart tests kill the coordinator: be back within moments of its return.
            backoff=Backoff(base=0.05, cap=0.05),
            idle=Backoff(base=0.02, cap=0.02),
        )
        self.url = url
        self.taken: list[str] = []
        self.held: list[str] = []  # silent: computed, never reported, listed as in progress
        self.refused: ServerRefused | None = None

    @property
    def token(self) -> str | None:
        return self.client.token

    @property
    def done(self) -> int:
        s = self.stats
        return s.reported + s.late + s.duplicate

    async def run(self, stop: asyncio.Event) -> None:
        """Work until `stop`, then vanish (no goodbye: tests of timeouts rely on it)."""
        try:
            await self.session(stop)
        except Quarantined as exc:
            self.refused = exc.refusal
        finally:
            self.cancel()
            await self.client.close()

    def _capacity(self) -> int:
        return max(0, self.behaviour.capacity - len(self.queue) - len(self.held))

    def _in_progress(self) -> list[str]:
        return super()._in_progress() + self.held

    def _heard(self, reply: dict[str, Any], wait: bool) -> None:
        self.taken += [a["result_id"] for a in reply["assignments"]]

    async def _kernel(
        self, assignment: dict[str, Any], a: bytes, b: bytes
    ) -> tuple[str | None, bytes, float]:
        started = time.perf_counter()
        output_hash, tile = compute_tile(
            assignment, a, b, hashed=assignment.get("hash_needed", True)
        )
        if self.behaviour.seconds_per_tile:
            await asyncio.sleep(self.behaviour.seconds_per_tile)  # a slower host, modelled
        return output_hash, tile, time.perf_counter() - started

    def _outcome(
        self, assignment: dict[str, Any], output_hash: str | None, tile: bytes
    ) -> dict | None:
        if self.behaviour.silent:
            self.held.append(assignment["result_id"])
            return None
        if self.behaviour.lie:
            wrong = kernels.decode_array(tile).copy()
            wrong.flat[0] += np.float32(1.0)
            tile = kernels.encode_array(wrong)
            # As the daemon does: the hash only where the assignment needs it.
            return {"hash": None if output_hash is None else kernels.blob_id(tile), "tile": tile}
        return super()._outcome(assignment, output_hash, tile)

    async def _compute(
        self, client: CoordinatorClient, stop: asyncio.Event, assignment: dict[str, Any]
    ) -> dict[str, Any] | None:
        """The report on one assignment fetched through `client`, outside the loop (for
        tests that speak the protocol by hand)."""
        blobs = [await client.fetch_blob(assignment[k], max_bytes=MAX_BLOB) for k in ("a", "b")]
        output_hash, tile, seconds = await self._kernel(assignment, *blobs)
        return self.report_of(assignment, output_hash, tile, seconds)


async def wait_until(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll a condition with a deadline (never a bare sleep as synchronisation)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise TimeoutError("condition not reached in time")
        await asyncio.sleep(0.01)
