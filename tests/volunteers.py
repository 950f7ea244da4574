"""Protocol-speaking test volunteers with knobs for misbehaviour (honest by default)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import aiohttp
import numpy as np

import kernels
from volunteer.client import CoordinatorClient, ServerRefused, compute_tile

MAX_BLOB = 64 << 20
T = TypeVar("T")


@dataclass
class Behaviour:
    lie: bool = False  # return a wrong tile (one element changed) with its true hash
    silent: bool = False  # take work and never answer
    capacity: int = 2
    seconds_per_tile: float = 0.0  # simulated compute time on top of the real kernel


@dataclass
class ScriptedVolunteer:
    url: str
    name: str
    behaviour: Behaviour = field(default_factory=Behaviour)
    cache: dict[str, bytes] = field(default_factory=dict)
    done: int = 0
    taken: list[str] = field(default_factory=list)
    host_id: int | None = None
    token: str | None = None
    refused: ServerRefused | None = None  # why the coordinator stopped talking to us

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await self._work(stop)
        except ServerRefused as exc:
            if exc.status != 403:
                raise
            self.refused = exc

    async def _work(self, stop: asyncio.Event) -> None:
        async with CoordinatorClient(self.url, timeout=10) as client:
            self.host_id = await self._retry(stop, lambda: client.register(self.name, gflops=10.0))
            self.token = client.token
            requests = itertools.count()
            in_progress: list[str] = []
            while not stop.is_set():
                request_id = f"{self.name}-{next(requests)}"
                reply = await self._retry(
                    stop,
                    lambda rid=request_id, busy=tuple(in_progress): client.request_work(
                        rid,
                        capacity=max(0, self.behaviour.capacity - len(busy)),
                        cached=list(self.cache),
                        in_progress=busy,
                    ),
                )
                if reply is None:
                    return
                assignments = reply["assignments"]
                self.taken += [a["result_id"] for a in assignments]
                if self.behaviour.silent:
                    in_progress += [a["result_id"] for a in assignments]
                if not assignments or self.behaviour.silent:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), timeout=max(reply["delay"], 0.02))
                    continue
                reports = []
                for assignment in assignments:
                    report = await self._compute(client, stop, assignment)
                    if report is None:  # stopped while fetching
                        return
                    reports.append(report)
                if await self._retry(stop, lambda r=reports: client.report(r)) is None:
                    return
                self.done += len(reports)

    async def _retry(self, stop: asyncio.Event, call: Callable[[], Awaitable[T]]) -> T | None:
        """Retry through a coordinator that is down (restart tests); None once stopped."""
        while not stop.is_set():
            try:
                return await call()
            except (aiohttp.ClientError, TimeoutError):  # refused, reset, cut mid-blob
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=0.05)
        return None

    async def _compute(self, client: CoordinatorClient, stop, assignment: dict) -> dict | None:
        blobs = []
        for key in ("a", "b"):
            blob_id = assignment[key]
            if blob_id not in self.cache:
                data = await self._retry(
                    stop, lambda b=blob_id: client.fetch_blob(b, max_bytes=MAX_BLOB)
                )
                if data is None:
                    return None
                self.cache[blob_id] = data
            blobs.append(self.cache[blob_id])
        output_hash, tile = compute_tile(assignment, *blobs)
        if self.behaviour.seconds_per_tile:
            await asyncio.sleep(self.behaviour.seconds_per_tile)
        if self.behaviour.lie:
            wrong = kernels.decode_array(tile).copy()
            wrong.flat[0] += np.float32(1.0)
            tile = kernels.encode_array(wrong)
            output_hash = kernels.blob_id(tile)
        report = {"result_id": assignment["result_id"], "hash": output_hash, "seconds": 0.01}
        if assignment["upload"] == "tile":
            report["tile"] = tile
        return report


async def wait_until(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll a condition with a deadline (never a bare sleep as synchronisation)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise TimeoutError("condition not reached in time")
        await asyncio.sleep(0.01)
