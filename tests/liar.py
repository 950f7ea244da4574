"""A lying volunteer speaking the real protocol, one configurable lie at a time."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import kernels
from volunteer.client import CoordinatorClient, ServerRefused, compute_tile

MAX_BLOB = 64 << 20


class Lie(enum.Enum):
    """What a liar sends instead of the honest report (docs/security.md's catalogue)."""

    ONE_ULP = "one_ulp"  # one element moved to the next float32 up: below the Freivalds bound
    BIG = "big"  # one element changed by 1000
    ZERO = "zero"  # a tile of zeros
    NAN = "nan"  # one element NaN
    OTHER_WU = "other_wu"  # the honest tile of another work unit of the same shape
    STALE = "stale"  # the tile it computed for a previous product (the closest one)
    WRONG_SHAPE = "wrong_shape"  # an extra column, with a hash that matches it
    REPLAY = "replay"  # honest, then the same accepted report again (and once more altered)
    BAD_HASH = "bad_hash"  # the honest tile under a hash that is not its own
    FOREIGN = "foreign"  # a report naming a result assigned to another host


# Refused at the edge (4xx) whenever the report carries the tile; without a tile (a quorum's
# hash-only replica) such a report is just a wrong hash and the validator must catch it.
EDGE = frozenset({Lie.WRONG_SHAPE, Lie.BAD_HASH, Lie.FOREIGN})
# Well-formed: decode as float32 of the right shape under their true hash; only the
# validator can tell them from the truth.
WELL_FORMED = frozenset({Lie.ONE_ULP, Lie.BIG, Lie.ZERO, Lie.NAN, Lie.OTHER_WU, Lie.STALE})


@dataclass(frozen=True)
class Computed:
    """A tile a liar computed honestly, kept to lie with later."""

    epoch: int
    wu_id: str
    tile: bytes

    @property
    def array(self) -> np.ndarray:
        return kernels.decode_array(self.tile)


@dataclass
class Registry:
    """What liars share with each other and with the test.

    `epoch` is bumped by the test between products (STALE replays tiles of older epochs);
    `peers` are honest volunteers whose result ids (`.taken`) a FOREIGN liar steals;
    `agreed` is the colluders' table: one wrong tile per work unit that all of them send.
    """

    epoch: int = 0
    computed: list[Computed] = field(default_factory=list)
    peers: list[Any] = field(default_factory=list)
    agreed: dict[str, bytes] = field(default_factory=dict)
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(7))


@dataclass
class Sent:
    """One lie and what the coordinator said to it at the edge."""

    lie: Lie
    result_id: str
    upload: str  # what the report carried: "tile" or "hash"
    status: int  # HTTP status of the report
    outcome: str  # accepted, late, duplicate, or the refusal message
    output_hash: str = ""  # the hash the report claimed

    @property
    def refused(self) -> bool:
        return 400 <= self.status < 500


class Liar:
    """Registers, asks for work, computes every tile honestly, then reports `lie` instead.

    Each result goes in its own report, so one refusal never hides another. A result refused
    at the edge is kept in the in-progress list (the liar goes quiet on it) until the
    coordinator tells it to abort. With `lie=None` it is honest; `colluding` liars send the
    registry's agreed wrong tile for a work unit, so a quorum of them agrees on it.
    """

    def __init__(
        self,
        url: str,
        name: str,
        lie: Lie | None,
        registry: Registry,
        *,
        capacity: int = 4,
        colluding: bool = False,
        token: str | None = None,
    ) -> None:
        self.url = url
        self.name = name
        self.lie = lie
        self.registry = registry
        self.capacity = capacity
        self.colluding = colluding
        self.token = token
        self.host_id: int | None = None
        self.sent: list[Sent] = []
        self.honest = 0  # reports that carried the honest tile (nothing to lie with yet)
        self.taken: list[str] = []
        self.refused: ServerRefused | None = None  # the 403 that ended its work (quarantine)
        self.cache: dict[str, bytes] = {}
        self._stolen: set[str] = set()

    # ---- bookkeeping the tests read ----------------------------------------------------

    def lies(self, *, refused: bool | None = None) -> list[Sent]:
        return [s for s in self.sent if refused is None or s.refused == refused]

    # ---- the loop ------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        async with CoordinatorClient(self.url, token=self.token, timeout=20) as client:
            if self.token is None:
                self.host_id = await client.register(self.name, gflops=10.0)
                self.token = client.token
            requests = itertools.count()
            in_progress: list[str] = []
            while not stop.is_set():
                try:
                    reply = await client.request_work(
                        f"{self.name}-{next(requests)}",
                        capacity=max(0, self.capacity - len(in_progress)),
                        cached=list(self.cache),
                        in_progress=in_progress,
                    )
                except ServerRefused as exc:
                    if exc.status != 403:
                        raise
                    self.refused = exc  # quarantined: no more work for this host
                    return
                aborted = set(reply["abort"])
                in_progress = [r for r in in_progress if r not in aborted]
                assignments = reply["assignments"]
                self.taken += [a["result_id"] for a in assignments]
                if self.lie is Lie.FOREIGN:
                    await self._steal(client)
                if not assignments:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), timeout=max(reply["delay"], 0.02))
                    continue
                for blob_id, data in (reply.get("blobs") or {}).items():
                    kernels.verify_blob(data, blob_id)  # panels inside the answer
                    self.cache[blob_id] = data
                done = [(a, await self._compute(client, a)) for a in assignments]
                # A panel gone (410) belonged to a product done meanwhile: work dropped.
                done = [(a, honest) for a, honest in done if honest is not None]
                computed = [honest for _, honest in done]
                for assignment, honest in done:
                    if not await self._report(client, assignment, honest, computed):
                        in_progress.append(assignment["result_id"])

    async def _compute(self, client: CoordinatorClient, assignment: dict) -> Computed | None:
        blobs = []
        for key in ("a", "b"):
            blob_id = assignment[key]
            if blob_id not in self.cache:
                try:
                    data = await client.fetch_blob(blob_id, max_bytes=MAX_BLOB)
                except ServerRefused as exc:
                    if exc.status == 410:
                        return None
                    raise
                self.cache[blob_id] = data
            blobs.append(self.cache[blob_id])
        _, tile = compute_tile(assignment, *blobs)
        return Computed(self.registry.epoch, assignment["wu_id"], bytes(tile))

    async def _report(
        self,
        client: CoordinatorClient,
        assignment: dict,
        honest: Computed,
        batch: list[Computed],
    ) -> bool:
        """Report one result, lying as configured; False if the edge refused it."""
        lie = self.lie if self.lie not in (Lie.FOREIGN, Lie.REPLAY) else None
        tile, output_hash = self._falsify(lie, assignment, honest, batch)
        self.registry.computed.append(honest)
        if tile == honest.tile and output_hash == kernels.blob_id(honest.tile):
            lie = None
        report: dict[str, Any] = {"result_id": assignment["result_id"], "hash": output_hash}
        if assignment["upload"] == "tile":
            report["tile"] = tile
        status, outcome = await self._send(client, report)
        if lie is None:
            self.honest += 1
        else:
            self.sent.append(
                Sent(lie, report["result_id"], assignment["upload"], status, outcome, output_hash)
            )
        if self.lie is Lie.REPLAY and outcome == "accepted":
            await self._replay(client, report)
        return status < 400

    def _falsify(
        self, lie: Lie | None, assignment: dict, honest: Computed, batch: list[Computed]
    ) -> tuple[bytes, str]:
        truth = honest.array
        if self.colluding:
            agreed = self.registry.agreed.get(honest.wu_id)
            if agreed is None:
                wrong = truth + self.registry.rng.normal(0, 1, truth.shape).astype(np.float32)
                agreed = self.registry.agreed[honest.wu_id] = kernels.encode_array(wrong)
            return agreed, kernels.blob_id(agreed)
        wrong = truth.copy()
        if lie is None:
            return honest.tile, kernels.blob_id(honest.tile)
        if lie is Lie.ONE_ULP:
            i = int(np.argmax(np.abs(wrong)))
            wrong.flat[i] = np.nextafter(wrong.flat[i], np.float32(np.inf))
        elif lie is Lie.BIG:
            wrong.flat[0] += np.float32(1000.0)
        elif lie is Lie.ZERO:
            wrong[...] = 0
        elif lie is Lie.NAN:
            wrong.flat[wrong.size // 2] = np.nan
        elif lie is Lie.OTHER_WU:
            other = self._other_tile(honest, batch)
            if other is None:
                return honest.tile, kernels.blob_id(honest.tile)
            return other, kernels.blob_id(other)
        elif lie is Lie.STALE:
            stale = self._stale_tile(honest)
            if stale is None:
                return honest.tile, kernels.blob_id(honest.tile)
            return stale, kernels.blob_id(stale)
        elif lie is Lie.WRONG_SHAPE:
            wrong = np.pad(wrong, ((0, 0), (0, 1)))
        elif lie is Lie.BAD_HASH:
            return honest.tile, kernels.blob_id(b"not this tile" + honest.tile)
        tile = kernels.encode_array(wrong)
        return tile, kernels.blob_id(tile)

    def _other_tile(self, honest: Computed, batch: list[Computed]) -> bytes | None:
        """The tile of another work unit of the same shape (this batch first, then older)."""
        shape = honest.array.shape
        for seen in [*batch, *reversed(self.registry.computed)]:
            other = seen.wu_id != honest.wu_id and seen.tile != honest.tile
            if other and seen.array.shape == shape:
                return seen.tile
        return None

    def _stale_tile(self, honest: Computed) -> bytes | None:
        """Of the tiles computed for earlier products, the one nearest the true tile:
        typically the same tile of the previous training step, the hardest stale lie."""
        truth = honest.array.astype(np.float64)
        old = [
            c
            for c in self.registry.computed
            if c.epoch < self.registry.epoch and c.array.shape == truth.shape
        ]
        if not old:
            return None
        nearest = min(old, key=lambda c: float(np.abs(c.array - truth).sum()))
        return None if nearest.tile == honest.tile else nearest.tile

    async def _send(self, client: CoordinatorClient, report: dict) -> tuple[int, str]:
        try:
            reply = await client.report([report])
        except ServerRefused as exc:
            return exc.status, exc.message
        for outcome in ("accepted", "late", "duplicate"):
            if report["result_id"] in reply[outcome]:
                return 200, outcome
        return 200, f"not listed in {reply}"

    async def _replay(self, client: CoordinatorClient, report: dict) -> None:
        """The accepted report again, byte for byte, and then with a changed tile."""
        status, outcome = await self._send(client, report)
        self.sent.append(
            Sent(Lie.REPLAY, report["result_id"], "same", status, outcome, report["hash"])
        )
        if "tile" in report:
            wrong = kernels.decode_array(report["tile"]).copy()
            wrong.flat[0] += np.float32(1000.0)
            tile = kernels.encode_array(wrong)
            altered = {**report, "tile": tile, "hash": kernels.blob_id(tile)}
            status, outcome = await self._send(client, altered)
            self.sent.append(
                Sent(Lie.REPLAY, report["result_id"], "altered", status, outcome, altered["hash"])
            )

    async def _steal(self, client: CoordinatorClient) -> None:
        """Report, with a wrong tile, one result id that an honest peer was given."""
        mine = set(self.taken)
        for peer in self.registry.peers:
            for result_id in list(peer.taken):
                if result_id in mine or result_id in self._stolen:
                    continue
                self._stolen.add(result_id)
                shape = (1, 1)
                if self.registry.computed:
                    shape = self.registry.computed[-1].array.shape
                tile = kernels.encode_array(np.full(shape, 1000.0, np.float32))
                report = {"result_id": result_id, "hash": kernels.blob_id(tile), "tile": tile}
                status, outcome = await self._send(client, report)
                self.sent.append(
                    Sent(Lie.FOREIGN, result_id, "tile", status, outcome, report["hash"])
                )
                return


@contextlib.asynccontextmanager
async def liars(url: str, specs: list[tuple[Lie | None, dict]], registry: Registry):
    """Running liars (one task each); their errors surface when the block ends."""
    stop = asyncio.Event()
    crew = [Liar(url, f"liar{i}", lie, registry, **opts) for i, (lie, opts) in enumerate(specs)]
    tasks = [asyncio.create_task(liar.run(stop)) for liar in crew]
    try:
        yield crew
    finally:
        stop.set()
        await asyncio.gather(*tasks)
