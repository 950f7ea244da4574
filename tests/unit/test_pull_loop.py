"""The volunteer's pull loop against a scripted coordinator (a fake client, in this process)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import numpy as np
import pytest

import kernels
from volunteer import loop as loop_module
from volunteer import session as session_module
from volunteer.backoff import Backoff
from volunteer.cache import BlobCache
from volunteer.client import NOT_TILEHIVE, ServerRefused, compute_tile
from volunteer.loop import PullLoop


class NothingAfterTwoTiles:
    """A coordinator whose first answer is two tiles, and every later one nothing: the
    products after them wait for those tiles' reports, as a step's next product does."""

    url = "http://coordinator.invalid"
    token = "token"

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        a = kernels.encode_array(rng.standard_normal((8, 4), np.float32))
        b = kernels.encode_array(rng.standard_normal((4, 8), np.float32))
        self.blobs = {kernels.blob_id(a): a, kernels.blob_id(b): b}
        self.tiles = [self._assignment(f"r{i}", *self.blobs) for i in range(2)]
        self.asks: list[dict[str, Any]] = []
        self.reported: dict[str, float] = {}  # result id: when its report arrived

    @staticmethod
    def _assignment(result_id: str, a: str, b: str) -> dict[str, Any]:
        return {
            "result_id": result_id,
            **{"m": 8, "n": 8, "k": 4, "trans_a": False, "trans_b": False},
            **{"a": a, "b": b, "a_bytes": 0, "b_bytes": 0, "deadline_in": 600.0},
            **{"upload": "tile", "hash_needed": False},
        }

    async def request_work(self, request_id: str, **message: Any) -> dict[str, Any]:
        self.asks.append(message)
        if len(self.asks) == 1:
            return {"assignments": self.tiles, "blobs": self.blobs}
        return {"assignments": [], "delay": 0.0}

    async def report(self, batch: list[dict[str, Any]], work: dict | None) -> dict[str, Any]:
        for report in batch:
            self.reported[report["result_id"]] = time.monotonic()
        answer: dict[str, Any] = {"results": [{"result_id": r["result_id"]} for r in batch]}
        if work is not None:
            answer["work"] = await self.request_work(**work)
        return answer


class SlowTiles(PullLoop):
    """Each tile takes 50 ms: long enough that the loop asks for more while it computes."""

    async def _kernel(self, assignment, a, b):
        await asyncio.sleep(0.05)
        output_hash, tile = compute_tile(assignment, a, b, hashed=False)
        return output_hash, tile, 0.05


async def run_until(
    coordinator: Any,
    done: Callable[[], bool],
    kind: type[SlowTiles] = SlowTiles,
    cache: BlobCache | None = None,
    **options: Any,
) -> Any:
    """A volunteer's session (a `kind` of loop, with `options`) against `coordinator` until
    `done()` (10 s at most), then stopped; returns the loop."""
    loop = kind(
        coordinator,
        name="v",
        cache=cache or BlobCache(1 << 20),
        **{
            "gflops": 1e-6,  # so every tile outlasts the round trips: it asks ahead
            "idle": Backoff(base=60.0, cap=60.0),
            **options,
        },
    )
    stop = asyncio.Event()
    session = asyncio.ensure_future(loop.session(stop))
    try:
        deadline = time.monotonic() + 10.0
        while not done() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # polling with a deadline
    finally:
        stop.set()
        loop.cancel()
        await asyncio.wait_for(session, timeout=10.0)
    return loop


async def test_finished_tiles_are_reported_at_once_after_an_answer_without_work():
    """An ask sent while a tile was still queued is answered with no work (the coordinator
    has none until that tile comes back). The volunteer must then report the tile and ask
    again, not rest its idle backoff (a minute here) holding the tile the step waits for."""
    coordinator = NothingAfterTwoTiles()
    await run_until(coordinator, lambda: len(coordinator.reported) >= 2)
    assert sorted(coordinator.reported) == ["r0", "r1"]
    assert any(ask["in_progress"] == ["r1"] for ask in coordinator.asks), "never asked ahead"


async def test_panels_the_coordinator_says_no_product_will_use_are_dropped_unless_queued():
    """An answer's `forget` lists cached panels of an earlier step: the volunteer drops
    them, so its memory and the list of its cache in every request hold current work. A
    panel a queued tile still takes stays (it would cost a download), and garbage in the
    field is ignored."""
    coordinator = NothingAfterTwoTiles()
    loop = SlowTiles(coordinator, name="v", cache=BlobCache(1 << 20))  # type: ignore[arg-type]
    old, kept, queued = (f"{c}" * 64 for c in "abc")
    for blob_id in (old, kept, queued):
        loop.cache.put(blob_id, b"x" * 100)
    tile = coordinator._assignment("r9", queued, queued)
    loop._take({"assignments": [tile], "forget": [old, queued, 7, "not cached"]})
    try:
        assert sorted(loop.cache.ids()) == sorted([kept, queued])
        assert loop.cache.bytes == 200
        loop._take({"assignments": [], "forget": "not a list"})
        assert sorted(loop.cache.ids()) == sorted([kept, queued])
    finally:
        fetching = [job.operands for job in loop.queue if job.operands is not None]
        loop.cancel()
        await asyncio.gather(*fetching, return_exceptions=True)


async def test_asks_say_the_hosts_shortest_recent_call_once_it_has_made_one():
    """The coordinator answers a far host once the training loop's next product is out too
    (coordinator/rules/scheduler.py, waits_for_the_loop): it learns the distance from asks."""
    coordinator = NothingAfterTwoTiles()
    loop = await run_until(coordinator, lambda: len(coordinator.asks) >= 2)
    first, second = coordinator.asks[:2]
    assert "round_trip" not in first  # nothing measured yet
    assert isinstance(second["round_trip"], float) and 0.0 <= second["round_trip"] < 10.0
    assert second["round_trip"] >= min(loop.round_trips)  # the shortest so far, then


class OneThenTwoTiles(NothingAfterTwoTiles):
    """A coordinator that answers the first ask with one tile, the next (made while that
    tile computes) with two more, and later ones with nothing, like a step whose products
    wait for the tiles before them."""

    def __init__(self) -> None:
        super().__init__()
        self.tiles = [self._assignment(f"r{i}", *self.blobs) for i in range(3)]

    async def request_work(self, request_id: str, **message: Any) -> dict[str, Any]:
        self.asks.append(message)
        if len(self.asks) == 1:
            return {"assignments": self.tiles[:1], "blobs": self.blobs}
        if len(self.asks) == 2:
            return {"assignments": self.tiles[1:], "blobs": self.blobs}
        return {"assignments": [], "delay": 0.0}


class TimedTiles(SlowTiles):
    """SlowTiles noting when each tile's kernel ended."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ended: dict[str, float] = {}

    async def _kernel(self, assignment, a, b):
        done = await super()._kernel(assignment, a, b)
        self.ended[assignment["result_id"]] = time.monotonic()
        return done


async def test_a_finished_tile_is_reported_while_the_next_computes():
    """The answer to an ask made during a tile brought two more. When that tile is done,
    its report goes out while the next computes (the coordinator's training loop may be
    waiting for it), not with the ask made during the last queued tile, a tile later."""
    coordinator = OneThenTwoTiles()
    loop = await run_until(coordinator, lambda: len(coordinator.reported) >= 3, TimedTiles)
    assert sorted(coordinator.reported) == ["r0", "r1", "r2"]
    assert coordinator.reported["r0"] < loop.ended["r1"], "r0 was held back a tile"
    assert coordinator.reported["r1"] < loop.ended["r2"], "r1 was held back a tile"


class PanelsOfTheirOwn:
    """A coordinator whose first answer is six tiles, each with operand panels of its own
    (about 100 KB each, announced in the assignment), and every later one nothing."""

    url = "http://coordinator.invalid"
    token = "token"
    SIDE = 160  # a 160 x 160 float32 panel: 102 KB

    def __init__(self) -> None:
        rng = np.random.default_rng(1)
        self.blobs: dict[str, bytes] = {}
        self.tiles = []
        for i in range(6):
            ids = []
            for _ in "ab":
                blob = kernels.encode_array(rng.standard_normal((self.SIDE, self.SIDE), np.float32))
                ids.append(kernels.blob_id(blob))
                self.blobs[ids[-1]] = blob
            tile = NothingAfterTwoTiles._assignment(f"r{i}", *ids)
            side = self.SIDE
            tile.update(m=side, n=side, k=side, a_bytes=len(blob), b_bytes=len(blob))
            self.tiles.append(tile)
        self.asks = 0
        self.reported: dict[str, float] = {}

    async def request_work(self, request_id: str, **message: Any) -> dict[str, Any]:
        self.asks += 1
        if self.asks == 1:
            return {"assignments": self.tiles}
        return {"assignments": [], "delay": 0.0}

    async def fetch_blob(self, blob_id: str, max_bytes: int) -> bytes:
        assert len(self.blobs[blob_id]) <= max_bytes
        await asyncio.sleep(0)  # a download takes a turn of the loop at least
        return self.blobs[blob_id]

    report = NothingAfterTwoTiles.report


class HeldBytes(SlowTiles):
    """Notes, as each tile starts, the operand bytes the loop holds beside that tile's own:
    the cache's, and those of queued tiles' fetched operands that the cache let go."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.held: list[int] = []
        self.next_fetched_ahead: list[bool] = []  # the next queued tile's operands on their way

    async def _kernel(self, assignment, a, b):
        cached = set(self.cache.ids())
        let_go: dict[str, int] = {}
        for job in self.queue:
            if job.operands is not None and job.operands.done() and not job.operands.cancelled():
                for blob_id, data in zip(
                    (job.assignment["a"], job.assignment["b"]), job.operands.result(), strict=True
                ):
                    if blob_id not in cached:
                        let_go[blob_id] = len(data)
        self.held.append(self.cache.bytes + sum(let_go.values()))
        if self.queue:
            self.next_fetched_ahead.append(self.queue[0].operands is not None)
        return await super()._kernel(assignment, a, b)


async def test_the_operands_of_queued_tiles_count_against_the_cache():
    """Six queued tiles, each with two panels of its own, hold 1.2 MB of operands; the
    cache may hold 400 KB. The volunteer fetches a queued tile's operands ahead only while
    they fit the cache beside those fetched for the tiles before it, and keeps them there
    until the tile computes: the bytes it holds for its queue stay within the cache's
    bound (before, every queued tile fetched at once, and what the cache let go stayed in
    memory uncounted), and every tile is still computed and reported."""
    coordinator = PanelsOfTheirOwn()
    cache = BlobCache(400_000)
    loop = await run_until(coordinator, lambda: len(coordinator.reported) >= 6, HeldBytes, cache)
    assert sorted(coordinator.reported) == [f"r{i}" for i in range(6)]
    assert len(loop.held) == 6
    assert max(loop.held) <= cache.max_bytes, loop.held
    assert loop.next_fetched_ahead == [True] * 5  # one tile's operands fit: fetched ahead
    assert cache.pinned_bytes == 0  # every pin given back


def test_a_pinned_blob_stays_and_counts_until_unpinned():
    """Pins reserve room before the blob arrives, all of a tile's or none; the least
    recently used blobs not pinned go first; a pinned blob is neither evicted nor dropped;
    unpinned as often as pinned, it is an ordinary cached blob again."""
    cache = BlobCache(300)
    cache.put("old", b"x" * 100)
    cache.put("new", b"x" * 100)
    assert not cache.pin({"p": 100, "q": 100, "r": 101})  # too much: nothing pinned
    assert cache.pinned_bytes == 0 and cache.ids() == ["new", "old"]
    assert cache.pin({"p": 100})
    assert cache.pin({"p": 100})  # two queued tiles share it: reserved once
    assert cache.pinned_bytes == 100 and cache.ids() == ["new", "old"]
    assert cache.pin({"q": 100})  # no room left for the loose ones: the older goes first
    assert cache.ids() == ["new"]
    cache.put("p", b"x" * 100)
    cache.put("q", b"x" * 100)
    assert sorted(cache.ids()) == ["new", "p", "q"]  # they arrive in the room reserved
    cache.put("late", b"x" * 100)  # the oldest loose one makes way
    assert sorted(cache.ids()) == ["late", "p", "q"]
    cache.drop("p")
    assert "p" in cache and cache.bytes == 300
    assert not cache.pin({"r": 101})
    cache.unpin(("p",))
    assert "p" in cache and cache.pinned_bytes == 200  # p still pinned once, and q
    cache.unpin(("p", "q", "q"))  # more unpins than pins change nothing
    assert cache.pinned_bytes == 0 and cache.bytes == 300
    cache.put("r", b"x" * 100)
    assert sorted(cache.ids()) == ["late", "q", "r"] and cache.bytes == 300


class HeldDownload(NothingAfterTwoTiles):
    """Its blob downloads wait until `release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.fetching = asyncio.Event()

    async def fetch_blob(self, blob_id: str, max_bytes: int) -> bytes:
        self.fetching.set()
        await self.release.wait()
        return self.blobs[blob_id]


async def test_a_tile_waiting_for_its_operands_is_in_progress_and_can_be_aborted():
    """A tile whose turn has come, while its operands download, is neither queued nor
    computing. It is still the host's: listed in progress (else the coordinator would take
    it for a lost reply and send it again), not queued twice when an answer repeats it, and
    dropped, never computed or reported, when an answer aborts it meanwhile."""
    coordinator = HeldDownload()
    computed: list[str] = []

    class Recorded(SlowTiles):
        async def _kernel(self, assignment, a, b):
            computed.append(assignment["result_id"])
            return await super()._kernel(assignment, a, b)

    loop = Recorded(coordinator, name="v", cache=BlobCache(1 << 20))  # type: ignore[arg-type]
    tile = coordinator.tiles[0]
    loop._take({"assignments": [tile]})
    turn = asyncio.ensure_future(loop._compute_next())
    await asyncio.wait_for(coordinator.fetching.wait(), timeout=10.0)
    assert loop._in_progress() == [tile["result_id"]]
    loop._take({"assignments": [tile]})  # the same assignment again: already the host's
    assert not loop.queue
    loop._take({"assignments": [], "abort": [tile["result_id"]]})
    coordinator.release.set()
    await asyncio.wait_for(turn, timeout=10.0)
    assert computed == [] and loop.pending == [] and loop._in_progress() == []
    assert loop.aborted == set()


async def test_a_session_ending_while_a_tile_waits_for_its_operands_gives_it_back():
    """Cancelled while its operands download, the tile whose turn had come goes back to the
    head of the queue, so that leaving gives it back with the rest; its download, cancelled
    with it, would start again at its turn, and it holds no pins meanwhile. Stopping the
    loop lets every pin go."""
    coordinator = HeldDownload()
    cache = BlobCache(1 << 20)
    loop = SlowTiles(coordinator, name="v", cache=cache)  # type: ignore[arg-type]
    blobs = coordinator.blobs
    sized = [
        {**tile, "a_bytes": len(blobs[tile["a"]]), "b_bytes": len(blobs[tile["b"]])}
        for tile in coordinator.tiles
    ]
    loop._take({"assignments": sized})
    assert cache.pinned_bytes > 0  # both fit: fetched ahead, their shared panels pinned
    turn = asyncio.ensure_future(loop._compute_next())
    await asyncio.wait_for(coordinator.fetching.wait(), timeout=10.0)
    turn.cancel()
    await asyncio.gather(turn, return_exceptions=True)
    assert [job.assignment["result_id"] for job in loop.queue] == ["r0", "r1"]
    assert loop.fetching is None and loop.queue[0].operands is None
    assert loop.queue[0].pinned == () and cache.pinned_bytes > 0  # r1's pins
    fetching = [job.operands for job in loop.queue if job.operands is not None]
    loop.cancel()
    await asyncio.gather(*fetching, return_exceptions=True)
    assert cache.pinned_bytes == 0


class ReportsNeverArrive(NothingAfterTwoTiles):
    """A coordinator whose every report hangs on its way (a slow uplink, a stalled link)."""

    def __init__(self) -> None:
        super().__init__()
        self.reporting = asyncio.Event()

    async def report(self, batch: list[dict[str, Any]], work: dict | None) -> dict[str, Any]:
        self.reporting.set()
        await asyncio.Event().wait()  # never answered
        raise AssertionError("unreachable")


async def test_a_stop_cuts_off_a_report_still_on_its_way(monkeypatch, caplog):
    """Stopped while a report is on its way, the session ends STOP_GRACE later, not when
    the report arrives (minutes, over a slow uplink): the call is cut off and its results
    are kept, to be sent again or given up as the volunteer leaves."""
    monkeypatch.setattr(session_module, "STOP_GRACE", 0.05)
    coordinator = ReportsNeverArrive()
    loop = SlowTiles(coordinator, name="v", cache=BlobCache(1 << 20), gflops=1e-6)  # type: ignore[arg-type]
    stop = asyncio.Event()
    session = asyncio.ensure_future(loop.session(stop))
    await asyncio.wait_for(coordinator.reporting.wait(), timeout=10.0)
    stop.set()
    await asyncio.wait_for(session, timeout=10.0)  # before: for ever
    reported = [r["result_id"] for r in loop.pending]
    assert reported and set(reported) <= {"r0", "r1"}
    assert not loop.sending
    await loop.leave(graceful=True, timeout=0.05)  # its reports hang again: given up
    assert loop.stats.vanished >= len(reported)
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("leaving with" in line and "did not hear of" in line for line in said), said


class MangledDownloads(NothingAfterTwoTiles):
    """Its answers carry no operands, and its first `mangled` downloads arrive mangled on
    the way (a proxy's page with a 200): they do not match their names."""

    def __init__(self, mangled: int) -> None:
        super().__init__()
        self.mangled = mangled
        self.fetches = 0
        self.errors: list[str] = []  # results reported as errors

    async def report(self, batch: list[dict[str, Any]], work: dict | None) -> dict[str, Any]:
        self.errors += [r["result_id"] for r in batch if "error" in r]
        return await super().report(batch, work)

    async def request_work(self, request_id: str, **message: Any) -> dict[str, Any]:
        answer = await super().request_work(request_id, **message)
        return {**answer, "blobs": {}}

    async def fetch_blob(self, blob_id: str, max_bytes: int) -> bytes:
        self.fetches += 1
        if self.fetches <= self.mangled:  # as the client checks what arrived
            kernels.verify_blob(b"<html>sign in to the hotel wifi</html>", blob_id)
        return self.blobs[blob_id]


def quick() -> Backoff:
    """A backoff quick to retry, as these tests' coordinators fail on purpose."""
    return Backoff(base=0.01, cap=0.01)


async def run_mangled(mangled: int) -> tuple[MangledDownloads, PullLoop]:
    coordinator = MangledDownloads(mangled)
    done = lambda: len(coordinator.reported) >= 2  # noqa: E731
    return coordinator, await run_until(coordinator, done, gflops=0.0, backoff=quick())


async def test_operands_mangled_on_the_way_are_fetched_again_not_blamed_on_the_host():
    """Two mangled downloads of a tile's operands are the network's fault: fetched again
    after the backoff, and the tiles are computed and reported, none as an error (an error
    would cost the host trust)."""
    coordinator, loop = await run_mangled(mangled=2)
    assert set(coordinator.reported) == {"r0", "r1"}
    assert coordinator.errors == [] and loop.stats.tiles == 2


async def test_operands_that_never_match_are_reported_as_an_error():
    """A tile whose operands arrive mangled CORRUPT_FETCHES times is reported as an error,
    so the coordinator gives it to another host rather than this one retrying for ever."""
    coordinator, loop = await run_mangled(mangled=1000)
    assert sorted(coordinator.errors) == ["r0", "r1"] and loop.stats.tiles == 0


class ProxyPages(NothingAfterTwoTiles):
    """A proxy in front that answers the first `pages` reports with a page of its own
    (`status`), never passing them on."""

    def __init__(self, pages: int, status: int) -> None:
        super().__init__()
        self.pages = pages
        self.status = status

    async def report(self, batch: list[dict[str, Any]], work: dict | None) -> dict[str, Any]:
        if self.pages:
            self.pages -= 1
            raise ServerRefused(self.status, NOT_TILEHIVE, "POST /v1/results answered text/html")
        return await super().report(batch, work)


@pytest.mark.parametrize("status", [200, 401, 403])
async def test_a_proxys_page_in_answer_to_a_report_keeps_the_results(status):
    """A page that is not the coordinator's word (a proxy's 200 page, its 403) neither
    drops the report, whose tiles others would then compute again, nor ends the session or
    drops the token as the coordinator's 403 or 401 would: the report is sent again after
    the backoff."""
    coordinator = ProxyPages(pages=2, status=status)
    done = lambda: len(coordinator.reported) >= 2  # noqa: E731
    loop = await run_until(coordinator, done, gflops=0.0, backoff=quick())
    assert set(coordinator.reported) == {"r0", "r1"}
    assert loop.state != "refused" and coordinator.token == "token"


class PassingNotFound(NothingAfterTwoTiles):
    """A proxy's reload sends the `misrouted` asks after the first to a path the coordinator
    has nothing at: its own 404 Not Found, after it has answered at the URL."""

    def __init__(self, misrouted: int) -> None:
        super().__init__()
        self.misrouted = misrouted

    async def request_work(self, request_id: str, **message: Any) -> dict[str, Any]:
        if self.asks and self.misrouted:
            self.misrouted -= 1
            raise ServerRefused(404, "not_found", "Not Found")
        return await super().request_work(request_id, **message)


async def test_a_404_for_the_path_once_the_coordinator_answered_there_is_retried():
    """Before any answer such a 404 ends the volunteer (nothing at the URL's path); after,
    it is a proxy's passing mistake, and a healthy volunteer must not quit for good."""
    coordinator = PassingNotFound(misrouted=2)
    done = lambda: len(coordinator.reported) >= 2  # noqa: E731
    loop = await run_until(coordinator, done, gflops=0.0, backoff=quick())
    assert set(coordinator.reported) == {"r0", "r1"} and loop.state != "refused"


class ReportsPassingNotFound(NothingAfterTwoTiles):
    """A proxy's reload sends the first `misrouted` reports to a path the coordinator has
    nothing at: its 404 Not Found, which says nothing of the results in them."""

    def __init__(self, misrouted: int) -> None:
        super().__init__()
        self.misrouted = misrouted

    async def report(self, batch: list[dict[str, Any]], work: dict | None) -> dict[str, Any]:
        if self.misrouted:
            self.misrouted -= 1
            raise ServerRefused(404, "not_found", "Not Found")
        return await super().report(batch, work)


async def test_reports_met_by_a_404_for_the_path_are_sent_again_not_dropped():
    coordinator = ReportsPassingNotFound(misrouted=2)
    done = lambda: len(coordinator.reported) >= 2  # noqa: E731
    loop = await run_until(coordinator, done, gflops=0.0, backoff=quick())
    assert set(coordinator.reported) == {"r0", "r1"} and loop.state != "refused"


class DownAtFirst(NothingAfterTwoTiles):
    """Cannot be reached for its first `down` asks, then answers."""

    def __init__(self, down: int) -> None:
        super().__init__()
        self.down = down

    async def request_work(self, request_id: str, **message: Any) -> dict[str, Any]:
        if self.down:
            self.down -= 1
            raise aiohttp.ClientConnectionError("connection refused")
        return await super().request_work(request_id, **message)


async def test_once_the_coordinator_is_back_the_status_note_no_longer_says_it_is_not():
    coordinator = DownAtFirst(down=2)
    notes: list[str] = []

    class Noted(SlowTiles):
        async def _kernel(self, assignment, a, b):
            notes.append(self.note)  # what `volunteer status` would show while it computes
            return await super()._kernel(assignment, a, b)

    done = lambda: len(coordinator.reported) >= 2  # noqa: E731
    loop = await run_until(coordinator, done, Noted, gflops=0.0, backoff=quick())
    assert loop.stats.errors == 2 and notes == ["", ""]


async def test_a_tile_fetched_again_holds_no_pins_it_let_go():
    """A tile whose operands came mangled is queued again holding no pins: its own were let
    go with the failed download, and letting them go again at its next turn would take
    another queued tile's pins, whose panels the cache could then evict."""

    class Sized(MangledDownloads):  # sized assignments: queued tiles fetch ahead, pinned
        def __init__(self) -> None:
            super().__init__(mangled=1)
            sizes = {"a_bytes": len(self.blobs[self.tiles[0]["a"]])}
            sizes["b_bytes"] = len(self.blobs[self.tiles[0]["b"]])
            self.tiles = [{**tile, **sizes} for tile in self.tiles]

    turns: list[tuple[str, int, bool]] = []  # tile, its pins, the cache holding any

    class Watched(SlowTiles):
        async def _operands_in_hand(self, job):
            pinned = self.cache.pinned_bytes > 0
            turns.append((job.assignment["result_id"], len(job.pinned), pinned))
            return await super()._operands_in_hand(job)

    coordinator = Sized()
    done = lambda: len(coordinator.reported) >= 2  # noqa: E731
    loop = await run_until(coordinator, done, Watched, gflops=0.0, backoff=quick())
    assert set(coordinator.reported) == {"r0", "r1"} and coordinator.errors == []
    assert all(holds == 0 or cache_holds for _, holds, cache_holds in turns), turns
    assert loop.cache.pinned_bytes == 0


async def test_a_stop_while_a_tile_waits_for_its_operands_gives_the_tile_back(monkeypatch):
    """Its download cut off by the stop, the tile whose turn had come goes back to the
    queue, and leaving gives it back: not lost until its deadline."""
    monkeypatch.setattr(session_module, "STOP_GRACE", 0.05)

    class Fetched(HeldDownload):  # its answers carry no operands: they are downloaded
        async def request_work(self, request_id: str, **message: Any) -> dict[str, Any]:
            return {**await super().request_work(request_id, **message), "blobs": {}}

    coordinator = Fetched()
    abandoned: list[str] = []
    report = coordinator.report

    async def recorded(batch, work):
        abandoned.extend(r["result_id"] for r in batch if r.get("abandoned"))
        return await report(batch, work)

    coordinator.report = recorded  # type: ignore[method-assign]
    loop = SlowTiles(coordinator, name="v", cache=BlobCache(1 << 20), gflops=0.0)  # type: ignore[arg-type]
    stop = asyncio.Event()
    session = asyncio.ensure_future(loop.session(stop))
    await asyncio.wait_for(coordinator.fetching.wait(), timeout=10.0)
    stop.set()
    await asyncio.wait_for(session, timeout=10.0)
    assert [job.assignment["result_id"] for job in loop.queue][:1] == ["r0"]
    await loop.leave(graceful=True, timeout=5.0)
    assert sorted(abandoned) == ["r0", "r1"]


async def test_a_proxys_page_for_every_download_ends_in_an_error_not_a_retry_for_ever():
    """Downloads answered by a proxy's page (not the coordinator's words) are tried
    CORRUPT_FETCHES times, like bytes mangled on the way; then the tile is reported as an
    error and goes to another host."""

    class PagesForBlobs(MangledDownloads):
        async def fetch_blob(self, blob_id: str, max_bytes: int) -> bytes:
            self.fetches += 1
            raise ServerRefused(404, NOT_TILEHIVE, "GET /v1/blobs answered text/html")

    coordinator = PagesForBlobs(mangled=0)
    done = lambda: len(coordinator.reported) >= 2  # noqa: E731
    loop = await run_until(coordinator, done, gflops=0.0, backoff=quick())
    assert sorted(coordinator.errors) == ["r0", "r1"] and loop.stats.tiles == 0


async def test_reports_shrink_to_what_a_slow_uplink_moves_in_a_few_seconds(monkeypatch):
    """Its uplink measured from a large report, a host sends the next ones no larger than
    that uplink moves in REPORT_SECONDS, so that no tile waits minutes in a report."""
    from volunteer import policy

    monkeypatch.setattr(policy, "REPORT_SECONDS", 0.5)  # so that the test takes seconds
    coordinator = NothingAfterTwoTiles()
    loop = SlowTiles(coordinator, name="v", cache=BlobCache(1 << 20))  # type: ignore[arg-type]
    sent: list[int] = []
    report = coordinator.report

    async def slow_uplink(batch, work):  # 1 MB/s
        sent.append(len(batch))
        await asyncio.sleep(sum(len(r.get("tile", b"")) for r in batch) / 1e6)  # its pace
        return await report(batch, work)

    coordinator.report = slow_uplink  # type: ignore[method-assign]
    tile = {"hash": None, "tile": b"x" * 100_000}  # 0.1 s each at that pace
    for first in (0, 10):  # before the uplink is measured, and after
        loop.pending = [{"result_id": f"r{first + i}", **tile} for i in range(10)]
        while loop.pending:
            await loop._flush()
    assert loop.upload_rate is not None and 0.5e6 < loop.upload_rate < 1.5e6
    # One report of all ten (1 MB, 1 s); then reports of what 0.5 s moves, about five.
    assert sent[0] == 10 and sum(sent[1:]) == 10 and max(sent[1:]) <= 6, sent


class NoWork:
    """A coordinator with nothing to give, which notes each ask and when it came, and tells
    each host to wait `delay` seconds."""

    url = "http://coordinator.invalid"
    token = "token"

    def __init__(self, delay: float = 0.0) -> None:
        self.asks: list[tuple[float, dict[str, Any]]] = []
        self.delay = delay

    async def request_work(self, request_id: str, **message: Any) -> dict[str, Any]:
        self.asks.append((time.monotonic(), message))
        return {"assignments": [], "delay": self.delay}


class PausedByItsOwner(SlowTiles):
    def _paused(self) -> float:
        return 0.01


async def test_a_paused_volunteer_says_so_now_and_then_and_asks_for_nothing(monkeypatch):
    """Said to the coordinator, which counts it connected and says why work waits (its
    owner), rather than taking it for gone once it has been quiet a while."""
    monkeypatch.setattr(loop_module, "PAUSED_HEARTBEAT", 0.2)
    coordinator = NoWork()
    await run_until(coordinator, lambda: len(coordinator.asks) >= 3, PausedByItsOwner)
    assert len(coordinator.asks) >= 3
    for _, ask in coordinator.asks:
        assert ask["paused"] is True and ask["capacity"] == 0 and ask["wait"] is False
    times = [when for when, _ in coordinator.asks]
    assert all(b - a >= 0.19 for a, b in itertools.pairwise(times))  # (clocks a call apart)


async def test_a_paused_volunteer_says_so_within_its_longest_interval_whatever_it_is_told(
    monkeypatch,
):
    """Told a long delay (a cooling of minutes), it still speaks before the coordinator
    would take it for gone (60 s of silence)."""
    monkeypatch.setattr(loop_module, "PAUSED_HEARTBEAT", 0.1)
    monkeypatch.setattr(loop_module, "PAUSED_HEARTBEAT_MAX", 0.3)
    coordinator = NoWork(delay=100.0)
    await run_until(coordinator, lambda: len(coordinator.asks) >= 3, PausedByItsOwner)
    times = [when for when, _ in coordinator.asks]
    assert len(times) >= 3 and all(0.29 <= b - a < 5 for a, b in itertools.pairwise(times))


class SparedWhilePaused(NothingAfterTwoTiles):
    """Three tiles; once their host has said it is paused, an ask listing the two it still
    holds is told to drop them (other hosts computed them meanwhile)."""

    def __init__(self) -> None:
        super().__init__()
        self.tiles = [self._assignment(f"r{i}", *self.blobs) for i in range(3)]

    async def request_work(self, request_id: str, **message: Any) -> dict[str, Any]:
        said_paused = any(ask.get("paused") for ask in self.asks)
        reply = await super().request_work(request_id, **message)
        if said_paused and not message.get("paused"):
            reply["abort"] = [r for r in message["in_progress"] if r in ("r1", "r2")]
        return reply

    def settled(self) -> bool:
        """The two tiles are reported, or an ask after the pause no longer holds them."""
        after = itertools.dropwhile(lambda ask: not ask.get("paused"), self.asks)
        dropped = any(not {"r1", "r2"} & set(ask["in_progress"]) for ask in after)
        return dropped or {"r1", "r2"} <= set(self.reported)


class PausedAfterItsFirstTile(SlowTiles):
    """Its owner comes back once it has computed a tile, for three looks."""

    looks = 0

    def _paused(self) -> float:
        if self.stats.tiles and self.looks < 3:
            self.looks += 1
            return 0.01
        return 0.0


async def test_back_from_a_pause_a_volunteer_asks_before_it_computes_what_it_held():
    """The coordinator gives a paused volunteer's tiles to other hosts: back, the volunteer
    asks first, and drops those the answer says are done rather than computing them."""
    coordinator = SparedWhilePaused()
    loop = await run_until(coordinator, coordinator.settled, PausedAfterItsFirstTile)
    assert any(ask.get("paused") for ask in coordinator.asks)
    assert loop.stats.aborted == 2 and loop.stats.tiles == 1
    assert set(coordinator.reported) == {"r0"}


class GoneAway(NothingAfterTwoTiles):
    """A coordinator that stopped answering: every call fails as a refused connection."""

    async def request_work(self, request_id: str, **message: Any) -> dict[str, Any]:
        raise ConnectionRefusedError("Connection refused")


async def test_leaving_a_coordinator_that_is_gone_with_nothing_to_report_loses_nothing(caplog):
    """The goodbye alone failed, and the log said it left with "0 result(s)" unheard of."""
    caplog.set_level(logging.INFO)
    loop = SlowTiles(GoneAway(), name="v", cache=BlobCache(1 << 20), gflops=1e-6)  # type: ignore[arg-type]
    await loop.leave(graceful=True, timeout=0.05)
    said = [r.getMessage() for r in caplog.records]
    assert not any("did not hear of" in line for line in said), said
    assert any(
        line.startswith("leaving without a goodbye (ConnectionRefusedError)") for line in said
    )


class CountsRests(SlowTiles):
    """Notes each rest, and whether tiles were queued or waiting to be reported then."""

    rests: list[bool]

    def _resting(self) -> None:
        self.rests.append(bool(self.queue or self.pending))


async def test_a_volunteer_rests_only_once_it_holds_no_work():
    """A rest is when the daemon gives back the buffers it kept for reuse (kernels/malloc.py):
    after the two tiles are reported and the answer has no more, not while it holds any."""
    CountsRests.rests = []
    coordinator = NothingAfterTwoTiles()
    await run_until(coordinator, lambda: bool(CountsRests.rests), CountsRests)
    assert sorted(coordinator.reported) == ["r0", "r1"]
    assert CountsRests.rests == [False]


class PausedAndCountsRests(CountsRests, PausedByItsOwner):
    pass


async def test_a_paused_volunteer_rests():
    PausedAndCountsRests.rests = []
    await run_until(NoWork(), lambda: len(PausedAndCountsRests.rests) >= 2, PausedAndCountsRests)
    assert len(PausedAndCountsRests.rests) >= 2


class DownAndCountsRests(CountsRests):
    pass


async def test_a_volunteer_that_cannot_reach_its_coordinator_rests():
    """Its kept buffers were held through the whole outage, on someone else's machine."""
    DownAndCountsRests.rests = []
    coordinator = DownAtFirst(down=2)
    await run_until(
        coordinator, lambda: len(coordinator.reported) >= 2, DownAndCountsRests, backoff=quick()
    )
    assert DownAndCountsRests.rests[:2] == [False, False]  # each wait for the coordinator
