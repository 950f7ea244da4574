"""Protocol-speaking test volunteers with knobs for misbehaviour (honest by default)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import dataclass, field

import numpy as np

import kernels
from volunteer.client import CoordinatorClient, compute_tile

MAX_BLOB = 64 << 20


@dataclass
class Behaviour:
    lie: bool = False  # return a wrong tile (one element changed) with its true hash
    silent: bool = False  # take work and never answer
    capacity: int = 2


@dataclass
class ScriptedVolunteer:
    url: str
    name: str
    behaviour: Behaviour = field(default_factory=Behaviour)
    cache: dict[str, bytes] = field(default_factory=dict)
    done: int = 0
    taken: list[str] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        async with CoordinatorClient(self.url) as client:
            await client.register(self.name, gflops=10.0)
            requests = itertools.count()
            in_progress: list[str] = []
            while not stop.is_set():
                reply = await client.request_work(
                    f"{self.name}-{next(requests)}",
                    capacity=self.behaviour.capacity,
                    cached=list(self.cache),
                    in_progress=in_progress,
                )
                if self.behaviour.silent:
                    in_progress += [a["result_id"] for a in reply["assignments"]]
                    self.taken += [a["result_id"] for a in reply["assignments"]]
                if not reply["assignments"] or self.behaviour.silent:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), timeout=max(reply["delay"], 0.02))
                    continue
                reports = [await self._compute(client, a) for a in reply["assignments"]]
                await client.report(reports)
                self.done += len(reports)

    async def _compute(self, client: CoordinatorClient, assignment: dict) -> dict:
        blobs = []
        for key in ("a", "b"):
            blob_id = assignment[key]
            if blob_id not in self.cache:
                self.cache[blob_id] = await client.fetch_blob(blob_id, max_bytes=MAX_BLOB)
            blobs.append(self.cache[blob_id])
        output_hash, tile = compute_tile(assignment, *blobs)
        if self.behaviour.lie:
            wrong = kernels.decode_array(tile).copy()
            wrong.flat[0] += np.float32(1.0)
            tile = kernels.encode_array(wrong)
            output_hash = kernels.blob_id(tile)
        report = {"result_id": assignment["result_id"], "hash": output_hash, "seconds": 0.01}
        if assignment["upload"] == "tile":
            report["tile"] = tile
        return report
