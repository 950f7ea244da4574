"""The HTTP client of the tilehive protocol: what a volunteer says to a coordinator."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aiohttp
import msgpack
import numpy as np

import kernels
from kernels import frames, localsocket
from volunteer.address import is_loopback_url, not_tilehive

log = logging.getLogger(__name__)

T = TypeVar("T")

CONTENT_TYPE = "application/msgpack"
ACCEPT = f"{frames.CONTENT_TYPE}, {CONTENT_TYPE}"  # framed answers preferred
# Bodies this large move in pieces: sent a piece at a time, read into one buffer as they
# arrive. A whole write has its unsent rest copied into fresh memory, a read's chunks are
# joined again: on loopback both cost 3x the time (benchmarks/transfer.py).
PIECE_BYTES = 1 << 20
PACE_BYTES = 64 << 10  # a paced body's piece: a 256 KB report arrives in four
# A call is given its timeout and a second more for each MIN_RATE bytes its body and its
# reply carry: a large report over a slow uplink arrives, as the coordinator allows it to
# (body_min_rate, the same 16 KiB/s), and so do panels over a slow downlink.
MIN_RATE = 16 << 10
BAD_REPLY = "bad_reply"  # a busy or failing server's reply that is not msgpack (a proxy's)
# 5xx that say the server does not speak the request (501 Not Implemented: a POST to a
# static file server; 505: HTTP Version Not Supported): never a coordinator that is down.
NOT_SPOKEN = frozenset({501, 505})
NOT_TILEHIVE = "not_tilehive"  # any other reply in no tilehive coordinator's words


class ServerRefused(Exception):
    """The coordinator answered with an error status; `status`, `code`, `message` say why."""

    def __init__(self, status: int, code: str, message: str, retry_after: float = 0.0) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after  # from a 429's Retry-After header

    @property
    def retriable(self) -> bool:
        """Worth sending again later: the server was busy or slow, not the request wrong;
        or the reply was not the coordinator's word at all (a proxy's or a captive
        portal's page, which says nothing of what the coordinator would make of it)."""
        return self.status >= 500 or self.status in (408, 429) or self.code == NOT_TILEHIVE


class LocalConnector(aiohttp.UnixConnector):
    """Connections to a coordinator's local socket (coordinator/server/local.py), each with
    a send buffer that holds a piece of a body."""

    def __init__(self, name: str) -> None:
        super().__init__(localsocket.address(name))

    async def _create_connection(self, req, traces, timeout):  # type: ignore[no-untyped-def]
        # aiohttp names no hook for a connection's socket options: this one is its own.
        protocol = await super()._create_connection(req, traces, timeout)
        sock = protocol.transport.get_extra_info("socket") if protocol.transport else None
        if sock is not None:
            localsocket.widen(sock)
        return protocol


class CoordinatorClient:
    """One volunteer's session with one coordinator (register, ask, fetch, report).

    A coordinator on this machine offers its local socket in its answers; a client with a
    session of its own then talks to it there, and goes back to TCP for good with that name
    if the socket cannot be reached (the coordinator restarted and drew a new one)."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        session: aiohttp.ClientSession | None = None,
        timeout: float = 60.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self._session = session
        self._own_session = session is None
        self.timeout = timeout
        # Each call has a deadline by the bytes it moves (allowed), not one total: a call
        # moving megabytes over a slow link takes minutes and is still on its way.
        self._timeout = aiohttp.ClientTimeout(sock_connect=timeout)
        # The coordinator answered in frames (kernels/frames.py): it reads them too, and
        # reports go framed, their tiles uncopied. Until then, plain msgpack.
        self.frames = False
        self.local: str | None = None  # the local socket talked through, if any
        self._unreachable: set[str] = set()  # local socket names that did not answer
        self._retired: list[aiohttp.ClientSession] = []  # TCP's, closed with the client
        # Emulated links only (volunteer/emulator.py): awaited with each PACE_BYTES of a
        # request body before it is sent, so that the body arrives at the link's pace and
        # the coordinator times the uplink it models (engine/uplinks.py).
        self.pace: Callable[[int], Awaitable[None]] | None = None

    async def __aenter__(self) -> CoordinatorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def close(self) -> None:
        if self._own_session:
            for session in [*self._retired, self._session]:
                if session is not None:
                    await session.close()
            self._session, self._retired = None, []

    def offered_local_socket(self, name: object) -> None:
        """The coordinator offers its local socket: talk through it if this client may
        (a session of its own, a coordinator on this machine, a name not failed before)."""
        if (
            self.local is not None
            or not self._own_session
            or not localsocket.supported()
            or not localsocket.is_name(name)
            or name in self._unreachable
            or not is_loopback_url(self.url)
            # A coordinator under a path (a proxy on this machine serving it at /tilehive)
            # serves no such prefix on its socket: every call there would be a 404.
            or urlsplit(self.url).path.strip("/")
        ):
            return
        assert isinstance(name, str)
        # Calls in flight finish on the old session, which closes with the client.
        if self._session is not None:
            self._retired.append(self._session)
        self._session = aiohttp.ClientSession(timeout=self._timeout, connector=LocalConnector(name))
        self.local = name
        log.info("the coordinator is on this machine: talking to it through @%s", name)

    def _leave_local(self, exc: BaseException) -> None:
        """The local socket cannot be reached: back to TCP, and never that name again."""
        name = self.local
        assert name is not None and self._session is not None
        self._unreachable.add(name)
        self._retired.append(self._session)
        self._session = aiohttp.ClientSession(timeout=self._timeout)
        self.local = None
        log.info("the coordinator's local socket @%s does not answer (%s): back to TCP", name, exc)

    async def _call(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """`attempt()`; through the local socket, once more over TCP if the socket cannot
        be reached: the call was not sent, so sending it again is safe."""
        if self.local is None:
            return await attempt()
        try:
            return await attempt()
        except aiohttp.ClientConnectorError as exc:
            self._leave_local(exc)
        return await attempt()

    def allowed(self, nbytes: int) -> float:
        """Seconds a call that moves `nbytes` one way may take."""
        return self.timeout + nbytes / MIN_RATE

    @staticmethod
    def _from_now(seconds: float) -> float:
        return asyncio.get_running_loop().time() + seconds

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": CONTENT_TYPE, "Accept": ACCEPT}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    async def _post(self, path: str, message: dict[str, Any]) -> dict[str, Any]:
        reply = await self._call(lambda: self._post_once(path, message))
        if "local_socket" in reply:  # answers to asks and reports over loopback TCP
            self.offered_local_socket(reply["local_socket"])
        return reply

    async def _post_once(self, path: str, message: dict[str, Any]) -> dict[str, Any]:
        headers = self._headers()
        if self.frames:
            parts = frames.pack(message)
            headers["Content-Type"] = frames.CONTENT_TYPE
        else:
            parts = [msgpack.packb(message, use_bin_type=True)]
        size = sum(memoryview(part).nbytes for part in parts)
        data: bytes | AsyncIterator[memoryview] = parts[0]
        if self.pace is not None and size >= PACE_BYTES:
            data = in_pieces(parts, PACE_BYTES, self.pace)
            headers["Content-Length"] = str(size)
        elif len(parts) > 1 or size >= PIECE_BYTES:  # a report of tiles
            data = in_pieces(parts)
            headers["Content-Length"] = str(size)
        if self.pace is not None and size < PACE_BYTES:
            await self.pace(size)
        async with (
            asyncio.timeout(self.allowed(size)) as deadline,
            self.session.post(self.url + path, data=data, headers=headers) as resp,
        ):
            size = resp.content_length
            deadline.reschedule(self._from_now(self.allowed(size or 0)))
            if size is not None and resp.status < 400 and resp.content_type == frames.CONTENT_TYPE:
                self.frames = True
                return await read_framed(resp.content, size, f"POST {path}")
            if size is not None and size >= PIECE_BYTES:
                payload = await read_into(resp.content, size)
            else:
                payload = await resp.read()
            return self._decode(resp, payload, f"POST {path}")

    def _decode(
        self, resp: aiohttp.ClientResponse, payload: frames.Buffer, request: str
    ) -> dict[str, Any]:
        status, retry_after = resp.status, resp.headers.get("Retry-After")
        try:
            if resp.content_type == frames.CONTENT_TYPE:
                message = frames.unpack(payload)
                self.frames = True
            else:
                message = msgpack.unpackb(payload, raw=False)
        except Exception:
            message = None
        if not isinstance(message, dict):
            if status in (408, 429) or (status >= 500 and status not in NOT_SPOKEN):
                # A proxy's word on a coordinator that is down or busy: try again later.
                raise ServerRefused(status, BAD_REPLY, f"reply to {request} is not msgpack")
            # Another web server: the session decides whether to believe it (NotACoordinator).
            why = not_tilehive(self.url, request, status, resp.content_type, payload)
            raise ServerRefused(status, NOT_TILEHIVE, why)
        if status >= 400:
            try:
                wait = float(retry_after) if retry_after else 0.0
            except ValueError:
                wait = 0.0
            raise ServerRefused(
                status, str(message.get("error", "error")), str(message.get("message", "")), wait
            )
        return message

    async def register(
        self,
        name: str,
        *,
        gflops: float = 1.0,
        threads: int = 1,
        max_memory_mb: int = 0,
        invite: str | None = None,
    ) -> int:
        message: dict[str, Any] = {
            "name": name,
            "gflops": gflops,
            "threads": threads,
            "max_memory_mb": max_memory_mb,
        }
        if invite:
            message["invite"] = invite
        reply = await self._post("/v1/hosts", message)
        self.token = reply["token"]
        return int(reply["host_id"])

    async def request_work(
        self,
        request_id: str,
        *,
        capacity: int,
        cached: list[str] | tuple[str, ...] = (),
        in_progress: list[str] | tuple[str, ...] = (),
        gflops: float | None = None,
        wait: bool = True,
        round_trip: float | None = None,
        leaving: bool = False,
        paused: bool = False,
        max_memory_mb: int | None = None,
    ) -> dict[str, Any]:
        message: dict[str, Any] = {
            "request_id": request_id,
            "capacity": capacity,
            "cached": list(cached),
            "in_progress": list(in_progress),
            "wait": wait,
        }
        if leaving:
            message["leaving"] = True
        if paused:
            message["paused"] = True
        if gflops is not None:
            message["gflops"] = gflops
        if max_memory_mb is not None:
            message["max_memory_mb"] = max_memory_mb
        if round_trip is not None:
            message["round_trip"] = round_trip
        return checked_answer(await self._post("/v1/work", message))

    async def fetch_blob(self, blob_id: str, *, max_bytes: int) -> frames.Buffer:
        """The blob's bytes, verified against its id (kernels.BlobMismatchError if not)."""
        return await self._call(lambda: self._fetch_blob_once(blob_id, max_bytes))

    async def _fetch_blob_once(self, blob_id: str, max_bytes: int) -> frames.Buffer:
        too_large = f"blob over {max_bytes} bytes"
        async with (
            asyncio.timeout(self.timeout) as deadline,
            self.session.get(f"{self.url}/v1/blobs/{blob_id}", headers=self._headers()) as resp,
        ):
            if resp.status >= 400:
                self._decode(resp, await resp.read(), "GET /v1/blobs")
            size = resp.content_length
            deadline.reschedule(self._from_now(self.allowed(min(size or max_bytes, max_bytes))))
            if size is not None:
                if size > max_bytes:
                    raise ServerRefused(resp.status, "too_large", too_large)
                data = await read_into(resp.content, size)
            else:
                data = bytearray()
                async for chunk in resp.content.iter_chunked(1 << 16):
                    data += chunk
                    if len(data) > max_bytes:
                        raise ServerRefused(resp.status, "too_large", too_large)
        kernels.verify_blob(data, blob_id)
        return data

    async def report(
        self, results: list[dict[str, Any]], work: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Send results; `work` (the fields of a work request) asks for more work in the same
        round trip, and its answer comes back as the reply's `work`."""
        message: dict[str, Any] = {"results": results}
        if work is not None:
            message["work"] = work
        return await self._post("/v1/results", message)

    async def status(self) -> dict[str, Any]:
        async def once() -> dict[str, Any]:
            async with (
                asyncio.timeout(self.timeout),
                self.session.get(self.url + "/v1/status") as resp,
            ):
                return await resp.json()

        return await self._call(once)


async def in_pieces(
    parts: list[bytes | memoryview],
    piece: int = PIECE_BYTES,
    pace: Callable[[int], Awaitable[None]] | None = None,
) -> AsyncIterator[memoryview]:
    """A request body of several buffers for aiohttp, `piece` bytes at a time (each sent
    once the last drained), each after `pace(its bytes)` if given."""
    for part in parts:
        view = memoryview(part).cast("B")
        for start in range(0, len(view), piece):
            chunk = view[start : start + piece]
            if pace is not None:
                await pace(len(chunk))
            yield chunk


# The fields of an assignment the volunteer reads, and what each must be.
ASSIGNMENT_FIELDS = {
    "result_id": str,
    "a": str,
    "b": str,
    "m": int,
    "n": int,
    "k": int,
    "a_bytes": int,
    "b_bytes": int,
    "trans_a": bool,
    "trans_b": bool,
    "upload": str,
    "deadline_in": (int, float),
}


def checked_answer(reply: dict[str, Any]) -> dict[str, Any]:
    """A work answer whose assignments hold what the volunteer reads, or ValueError (a
    reply that does not parse as the protocol says: retried after the backoff, never a
    crash). A proxy or another program answering in msgpack could send anything."""
    assignments = reply.get("assignments")
    if not isinstance(assignments, list) or not isinstance(reply.get("abort", []), list):
        raise ValueError("the work answer has no list of assignments")
    for assignment in assignments:
        if not isinstance(assignment, dict):
            raise ValueError("a work answer's assignment is not a map")
        for field, kind in ASSIGNMENT_FIELDS.items():
            if not isinstance(assignment.get(field), kind):
                raise ValueError(f"a work answer's assignment lacks a valid {field!r}")
    return reply


async def read_into(stream: aiohttp.StreamReader, size: int) -> memoryview:
    """Exactly `size` bytes of a body, each chunk copied once into one buffer as it arrives
    (aiohttp.ClientPayloadError if the body ends first)."""
    view = frames.body_buffer(size)
    await fill(stream, [view])
    return view


async def read_framed(stream: aiohttp.StreamReader, size: int, request: str) -> dict[str, Any]:
    """The message of a framed body of `size` bytes, read with each of its binaries into
    memory of its own (kernels.frames.unpack_apart): a panel the cache keeps then holds
    only itself, not the whole answer it came in. A malformed frame is a broken reply
    (aiohttp.ClientPayloadError), retried like one cut off."""
    try:
        head = await stream.readexactly(frames.HEAD_BYTES)
        length = frames.document_length(head, size)
        document = await stream.readexactly(length)
        message, buffers = frames.unpack_apart(document, size - frames.HEAD_BYTES - length)
    except asyncio.IncompleteReadError as exc:
        raise aiohttp.ClientPayloadError(f"the reply to {request} was cut off") from exc
    except frames.FrameError as exc:
        why = f"the reply to {request} is no valid frame: {exc}"
        raise aiohttp.ClientPayloadError(why) from exc
    if not isinstance(message, dict):
        raise aiohttp.ClientPayloadError(f"the reply to {request} is not a msgpack map")
    await fill(stream, buffers)
    return message


async def fill(stream: aiohttp.StreamReader, buffers: list[memoryview]) -> None:
    """Read the next bytes of a body into `buffers`, one after another, each chunk copied
    once as it arrives (aiohttp.ClientPayloadError if the body ends first)."""
    rest = memoryview(b"")  # what the last chunk held beyond the last buffer
    total, done = sum(len(view) for view in buffers), 0
    for view in buffers:
        got = 0
        while got < len(view):
            if not rest:
                chunk, end_of_http_chunk = await stream.readchunk()
                if not chunk:
                    if end_of_http_chunk:
                        continue
                    raise aiohttp.ClientPayloadError(
                        f"the body ended after {done + got} of {total} bytes"
                    )
                rest = memoryview(chunk)
            take = min(len(view) - got, len(rest))
            view[got : got + take] = rest[:take]
            got += take
            rest = rest[take:]
        done += got


def compute_tile(
    assignment: dict[str, Any],
    a_blob: frames.Buffer,
    b_blob: frames.Buffer,
    *,
    threads: int = 1,
    hashed: bool = True,
) -> tuple[str | None, memoryview]:
    """The output tile of an assignment as (hash, blob), from verified operand blobs; the
    kernel writes the tile into its blob. Without `hashed` the hash is None: a tile that is
    uploaded is hashed by the coordinator, and hashing it here too would only delay it."""
    a = kernels.decode_array(a_blob)
    b = kernels.decode_array(b_blob)
    m, n, k = assignment["m"], assignment["n"], assignment["k"]
    trans_a, trans_b = bool(assignment["trans_a"]), bool(assignment["trans_b"])
    expect_a = (k, m) if trans_a else (m, k)
    expect_b = (n, k) if trans_b else (k, n)
    if a.dtype != np.float32 or b.dtype != np.float32 or a.shape != expect_a or b.shape != expect_b:
        raise ValueError(
            f"operands {a.dtype}{a.shape}, {b.dtype}{b.shape} do not fit the assignment "
            f"(expected float32 {expect_a} and {expect_b})"
        )
    blob, c = kernels.blob_array((m, n), np.float32)
    kernels.gemm(
        np.ascontiguousarray(a),
        np.ascontiguousarray(b),
        trans_a=trans_a,
        trans_b=trans_b,
        out=c,
        threads=threads,
    )
    return (kernels.blob_id(blob) if hashed else None), blob
