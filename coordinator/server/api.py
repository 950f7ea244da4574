"""The HTTP face of the coordinator: aiohttp routes under /v1/ speaking msgpack."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import logging
import math
import socket
import time
from collections.abc import Awaitable, Callable, Sequence

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST

from coordinator.engine.coordinator import Coordinator
from coordinator.engine.neighbours import is_loopback
from coordinator.engine.requests import Answer
from coordinator.rules.access import client_address
from coordinator.server import dashboard, local
from coordinator.work import protocol
from coordinator.work.protocol import (
    NotFound,
    ProtocolError,
    RequestTimeout,
    RetryLater,
    TooLarge,
    UnsupportedMediaType,
    loggable,
)
from kernels import frames, is_blob_id

log = logging.getLogger(__name__)

COORDINATOR = web.AppKey("coordinator", Coordinator)
LOCAL_SOCKET = web.AppKey("local_socket", str)  # its name; "" when there is none
PAGES = web.AppKey("pages", dashboard.Pages)
REFUSALS_EVERY = 10.0  # seconds: a log line for an address's refusals of one status at most
REFUSALS_KEPT = 10_000  # addresses whose last refusal is remembered
MAX_REGISTER_BYTES = 16 << 10
MAX_ADMIN_BYTES = 16 << 10  # an admin call carries nothing; a body, if any, is a msgpack map
# Bodies this large move in pieces: a buffer filled as chunks arrive, a blob written a
# piece at a time. asyncio copies a large write's unsent rest into fresh memory, and
# joining a read's chunks copies the body again: on loopback both ways were 3x slower
# (benchmarks/transfer.py).
PIECE_BYTES = 1 << 20
# Connections the kernel holds for the server until it accepts them (capped by
# net.core.somaxconn). aiohttp's default of 128 overflowed about 100 times in a run of
# 10,000 hosts (the kernel's ListenOverflows): a dropped connection is tried again after 1
# s, then 2 s later, doubling, so a host waited seconds for a server that answers in
# milliseconds.
LISTEN_BACKLOG = 4096

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]


def msgpack_response(message: dict, status: int = 200) -> web.Response:
    return web.Response(
        body=protocol.encode(message), status=status, content_type=protocol.CONTENT_TYPE
    )


def error_response(status: int, code: str, message: str) -> web.Response:
    return msgpack_response({"error": code, "message": message}, status=status)


class RefusalLog:
    """A log line for each refused request, but for those told to come back later (429,
    503) at most one every REFUSALS_EVERY seconds for each address and status: a client in
    a loop, refused 429 after 429, wrote hundreds of lines a second. The next such line
    says how many were left out. Every other refusal is a line of its own (a lie, a forged
    id: each one is news). The method, path, address and detail came from the network, so
    they are escaped."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        # (address, status) -> (when its last line was written, refusals left out since,
        # when it was last refused), the least recently refused first.
        self._last: collections.OrderedDict[tuple[str, int], tuple[float, int, float]] = (
            collections.OrderedDict()
        )

    def say(
        self, method: str, path: str, address: str, status: int, detail: str, later: bool
    ) -> None:
        left_out = self._left_out(address, status) if later else 0
        if left_out is None:
            return
        log.warning(
            "%s %s from %s: %d%s%s",
            loggable(method),
            loggable(path),
            loggable(address),
            status,
            f" {loggable(detail)}" if detail else "",
            f" ({left_out} more from it since its last line, not logged)" if left_out else "",
        )

    def sweep(self, final: bool = False) -> None:
        """Say the counts left out of clients refused none since REFUSALS_EVERY ago (all
        of them, `final`ly): one that stops would otherwise never have its count said. One
        still refused has it said by its next line, method, path and reason with it."""
        now = self.clock()
        for key, (said, untold, refused) in list(self._last.items()):
            if not final and now - refused < REFUSALS_EVERY:
                break  # those after it were refused later still
            if untold:
                self._say_untold(key, untold)
                self._last[key] = (said, 0, refused)

    def _left_out(self, address: str, status: int) -> int | None:
        """None while a line for these was written less than REFUSALS_EVERY ago (this
        refusal is counted instead); else the refusals left out since, and a line is due."""
        now = self.clock()
        key = (address, status)
        said, left_out, _ = self._last.pop(key, (-math.inf, 0, now))
        if now - said < REFUSALS_EVERY:
            self._last[key] = (said, left_out + 1, now)
            return None
        self._last[key] = (now, 0, now)
        if len(self._last) > REFUSALS_KEPT:  # the least recent goes, its count said
            gone, (_, untold, _) = self._last.popitem(last=False)
            if untold:
                self._say_untold(gone, untold)
        return left_out

    @staticmethod
    def _say_untold(key: tuple[str, int], untold: int) -> None:
        address, status = key
        log.warning(
            "%d more refusal(s) %d from %s since its last line, not logged",
            untold,
            status,
            loggable(address),
        )


REFUSALS = web.AppKey("refusals", RefusalLog)


async def _sweep_refusals(refusals: RefusalLog) -> None:
    while True:
        await asyncio.sleep(REFUSALS_EVERY)
        refusals.sweep()


def _refused(request: web.Request, status: int, detail: str = "", later: bool = False) -> None:
    request.app[REFUSALS].say(request.method, request.path, client(request), status, detail, later)


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every refusal is a 4xx with a msgpack {error, message} body and one log line."""
    try:
        return await handler(request)
    except ProtocolError as exc:
        _refused(request, exc.status, exc.message, later=isinstance(exc, RetryLater))
        response = error_response(exc.status, exc.code, exc.message)
        if isinstance(exc, RetryLater):
            response.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
        return response
    except web.HTTPRequestEntityTooLarge as exc:
        _refused(request, 413, "body too large")
        return error_response(413, "too_large", exc.text or "body too large")
    except web.HTTPException as exc:
        if exc.status >= 400:
            _refused(request, exc.status)
            return error_response(exc.status, exc.reason.lower().replace(" ", "_"), exc.reason)
        raise


@web.middleware
async def measured(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Latency per endpoint and bytes in and out, for /metrics."""
    started = time.perf_counter()
    response = await handler(request)
    metrics = request.app[COORDINATOR].metrics
    route = request.match_info.route.resource
    endpoint = route.canonical if route is not None else "other"
    metrics.labelled(metrics.requests, endpoint).observe(time.perf_counter() - started)
    if request.content_length:
        metrics.labelled(metrics.bytes, "in").inc(request.content_length)
    size = response.content_length or getattr(response, "_blob_size", 0)
    if size:
        metrics.labelled(metrics.bytes, "out").inc(size)
    return response


async def read_body(
    request: web.Request,
    limit: int,
    heard: Callable[[], None] | None = None,
    timed: Callable[[int, float], None] | None = None,
) -> dict:
    """The request's msgpack map (plain, or framed: kernels/frames.py), refusing other media
    types and bodies over `limit`; `heard()` now and then while a long body arrives, and
    `timed(bytes, seconds)` once it is in: its pace (BodyClock.pace)."""
    if request.content_type not in (protocol.CONTENT_TYPE, frames.CONTENT_TYPE):
        raise UnsupportedMediaType(
            f"send the body as {protocol.CONTENT_TYPE} or {frames.CONTENT_TYPE}, not "
            f"{request.content_type or 'nothing'}"
        )
    if request.content_length is not None and request.content_length > limit:
        raise TooLarge(f"body of {request.content_length} bytes exceeds the limit of {limit}")
    config = request.app[COORDINATOR].config
    clock = BodyClock(config.body_timeout, config.body_min_rate, heard)
    try:
        async with asyncio.timeout_at(clock.deadline(0)) as timer:
            arrived = clock.extender(timer)
            if request.content_length is not None:
                # One buffer of the announced size: a report of tiles is megabytes, and
                # growing or joining buffers copies it again on the event loop.
                body = await read_into(request.content, request.content_length, arrived)
            else:
                body = await read_chunked(request.content, limit, arrived)
    except TimeoutError as exc:
        raise RequestTimeout(f"the body did not arrive in time: {clock.said()}") from exc
    except (ConnectionError, aiohttp.ClientPayloadError, aiohttp.http.HttpProcessingError) as exc:
        # The client hung up or broke the framing mid-body: one log line, nothing applied.
        # The stream keeps this exception, and its traceback the frames that were reading
        # the body, buffer and all: a cycle only a full collection frees, and the server
        # runs few (cli/serve.py), so each body cut off would pin its megabytes for long.
        exc.__traceback__ = None
        raise protocol.BadRequest(f"the body was cut off: {type(exc).__name__}") from None
    if timed is not None and (pace := clock.pace()) is not None:
        timed(*pace)
    if request.content_type == frames.CONTENT_TYPE:
        return protocol.decode_frame(body, limit)
    return protocol.decode(body, limit)


class BodyClock:
    """How long a request body may take to arrive: `grace` seconds, and one second more
    for each `min_rate` bytes that have arrived. A report from a slow uplink gets through
    however large it is; a client that drips a body to hold a connection and its buffer
    (slowloris) is cut off once it falls below the rate. `heard()` is called each `step`
    while bytes arrive: a host minutes into a report is in contact, not silent."""

    def __init__(
        self, grace: float, min_rate: float, heard: Callable[[], None] | None = None
    ) -> None:
        self.grace = grace
        self.min_rate = min_rate
        self.heard = heard
        self.step = min(1.0, grace / 4)
        self.started = self.heard_at = asyncio.get_running_loop().time()
        self.got = 0
        self.first: tuple[float, int] | None = None  # when the first chunk came, its bytes
        self.last = 0.0  # when the last chunk came

    def deadline(self, got: int) -> float:
        """The loop time by which the body must be complete, `got` bytes of it arrived."""
        return self.started + self.grace + got / self.min_rate

    def extender(self, timer: asyncio.Timeout) -> Callable[[int], None]:
        """What a reader calls with the bytes arrived so far, to push `timer` out."""

        def arrived(got: int) -> None:
            self.got = got
            self.last = now = asyncio.get_running_loop().time()
            if self.first is None:
                self.first = (now, got)
            if self.heard is not None and now - self.heard_at >= self.step:
                self.heard_at = now
                self.heard()
            deadline = self.deadline(got)
            when = timer.when()
            # A step at a time: a body comes in hundreds of chunks, and each move is a
            # timer in the loop's heap. The step is a share of the grace, so the timer
            # is never further behind than the grace covers.
            if when is None or deadline - when >= self.step:
                timer.reschedule(deadline)

        return arrived

    def pace(self) -> tuple[int, float] | None:
        """(bytes, seconds) from the first chunk's arrival to the last's, the first chunk
        left out: it may have waited in the socket's buffers for the handler, or come with
        the headers (aiohttp's client sends them together), so its time is not the link's.
        None for a body of one chunk."""
        if self.first is None or self.got <= self.first[1]:
            return None
        return self.got - self.first[1], self.last - self.first[0]

    def said(self) -> str:
        """Why a body was cut off, for its 408."""
        return (
            f"{self.got} bytes in {asyncio.get_running_loop().time() - self.started:.0f} "
            f"seconds, slower than {self.min_rate:g} bytes a second after the first "
            f"{self.grace:g}"
        )


async def read_into(
    stream: aiohttp.StreamReader, size: int, arrived: Callable[[int], None] | None = None
) -> memoryview:
    """Exactly `size` bytes of a body, each chunk copied once into one buffer as it arrives
    (BadRequest if the body ends first); `arrived(bytes so far)` after each chunk."""
    view = frames.body_buffer(size)
    got = 0
    while got < size:
        chunk, end_of_http_chunk = await stream.readchunk()
        if not chunk:
            if end_of_http_chunk:
                continue
            raise protocol.BadRequest(f"the body was cut off: {got} of {size} bytes")
        end = min(size, got + len(chunk))
        view[got:end] = chunk[: end - got]
        got = end
        if arrived is not None:
            arrived(got)
    return view


async def read_chunked(
    stream: aiohttp.StreamReader, limit: int, arrived: Callable[[int], None] | None = None
) -> bytearray:
    """A body of no announced length, refused once it grows past `limit`."""
    body = bytearray()
    while chunk := await stream.read(1 << 16):
        body += chunk
        if len(body) > limit:
            raise TooLarge(f"body exceeds the limit of {limit} bytes")
        if arrived is not None:
            arrived(len(body))
    return body


async def send_in_pieces(
    request: web.Request, parts: Sequence[bytes | memoryview], content_type: str
) -> web.StreamResponse:
    """A body of several buffers (uncopied) written PIECE_BYTES at a time, each piece once
    the last has drained."""
    response = web.StreamResponse(headers={"Content-Type": content_type})
    response.content_length = sum(memoryview(part).nbytes for part in parts)
    await response.prepare(request)
    for part in parts:
        view = memoryview(part).cast("B")
        for start in range(0, len(view), PIECE_BYTES):
            await response.write(view[start : start + PIECE_BYTES])
    await response.write_eof()
    return response


def wants_frames(request: web.Request) -> bool:
    """The client reads framed bodies (it says so in Accept): operand panels then ride
    behind the answer uncopied, and its reports may come framed too."""
    return frames.CONTENT_TYPE in request.headers.get("Accept", "")


def client(request: web.Request) -> str:
    """Who sent the request: the local socket, its peer's address, or the client's address
    a trusted reverse proxy forwards (rules/access.py)."""
    if local.is_local(request):
        return local.PEER
    co = request.app.get(COORDINATOR)  # None in a bare app (benchmarks/transfer.py)
    proxies = co.access.config.trusted_proxies if co is not None else ()
    if not proxies:
        return request.remote or "?"
    return client_address(request.remote, request.headers.get("X-Forwarded-For"), proxies)


def on_this_machine(request: web.Request) -> bool:
    """Whether the request came from this machine: over the local socket or loopback (a
    proxy's own loopback hop does not count: the client behind it is elsewhere)."""
    return local.is_local(request) or is_loopback(client(request))


def local_offer(request: web.Request) -> dict:
    """`local_socket` for an answer to a client on this machine that came over TCP."""
    name = request.app[LOCAL_SOCKET]
    if name and not local.is_local(request) and is_loopback(client(request)):
        return {"local_socket": name}
    return {}


async def answer_response(
    request: web.Request, answer: Answer, summary: dict | None = None, offer: dict | None = None
) -> web.StreamResponse:
    """The answer to a work request (alone, or as `work` in a report's `summary`), with the
    panels riding along in the form the client reads, and the fields of `offer`."""
    fields: dict = {"blobs": answer.blobs} if answer.blobs else {}
    if answer.forget:
        fields["forget"] = answer.forget
    if offer:
        fields.update(offer)
    trailer = frames.Trailer() if wants_frames(request) else None
    body = frames.extend_map(answer.body, fields, trailer)
    if summary is not None:
        body = protocol.encode_with(summary, "work", body)
    if trailer is None:
        return web.Response(body=body, content_type=protocol.CONTENT_TYPE)
    parts = frames.frame(body, trailer)
    if trailer.size < PIECE_BYTES:
        return web.Response(body=b"".join(parts), content_type=frames.CONTENT_TYPE)
    return await send_in_pieces(request, parts, frames.CONTENT_TYPE)


def bearer(request: web.Request) -> str | None:
    """The request's bearer token, if it has one. Tokens are ASCII: a header's other bytes
    reach us as surrogates, which no token is made of and none can be hashed."""
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    if not token.isascii():
        raise protocol.Unauthorized("the bearer token holds bytes no token has (not ASCII)")
    return token.strip()


async def register(request: web.Request) -> web.Response:
    co = request.app[COORDINATOR]
    message = protocol.parse_register(await read_body(request, MAX_REGISTER_BYTES))
    # Registrations are counted by address, this machine's all as one: over loopback or
    # the local socket alike.
    address = "this machine" if on_this_machine(request) else client(request)
    host, token = await co.hosts.register(message, time.time(), address)
    # The name is printable (checked in protocol) and %r quotes it.
    log.info("registered host %d %r from %s", host.id, host.name, loggable(client(request)))
    return msgpack_response({"host_id": host.id, "token": token, "protocol": protocol.VERSION})


async def request_work(request: web.Request) -> web.Response:
    co = request.app[COORDINATOR]
    host = co.hosts.authenticate(bearer(request))
    co.access.check_rate(host.id, time.monotonic())
    co.neighbours.saw(host, on_this_machine(request), time.time())
    message = protocol.parse_work_request(await read_body(request, co.config.max_request_bytes))
    answer = await co.requests.request_work(host, message, time.time())
    co.access.credit(host.id, answer.assigned)
    return await answer_response(request, answer, offer=local_offer(request))


async def report(request: web.Request) -> web.Response:
    co = request.app[COORDINATOR]
    host = co.hosts.authenticate(bearer(request))
    co.access.check_rate(host.id, time.monotonic())
    co.neighbours.saw(host, on_this_machine(request), time.time())

    # A large report over a slow uplink takes minutes: its host is in contact meanwhile, not
    # missing from the count of connected volunteers that says why work waits, and the
    # results it may carry do not time out while it arrives (Reports.arriving).
    began = time.time()

    def heard() -> None:
        now = time.time()
        co.hosts.heard_from(host.id, now)
        co.reports.arriving(host.id, began, now)

    pace: list[tuple[int, float]] = []
    body = await read_body(request, co.config.max_report_bytes, heard, lambda *p: pace.append(p))
    message = protocol.parse_report(body)
    summary = await co.reports.report(host, message, time.time())
    if pace and summary["accepted"]:
        # Its uplink, as the body took to arrive (engine/uplinks.py): from reports it takes
        # only, so that junk sent slowly does not make a host's uplink look slow.
        co.uplinks.timed(host.id, *pace[0], time.time())
    summary.update(local_offer(request))
    if message.work is None:
        return msgpack_response(summary)
    # The host has more room: its next work comes back with this answer (long-polled).
    try:
        work = await co.requests.request_work(host, message.work, time.time())
    except protocol.Forbidden:
        # Quarantined by this very report: the report stands, and the host hears why when
        # it asks for work on its own.
        work = None
    # The report's changes go with the answer's commit; a stored answer (a retry) or a
    # refusal commits nothing, so this makes sure of it (nothing when nothing is queued).
    co.ledger.commit_soon()
    if work is None:
        return msgpack_response(summary)
    co.access.credit(host.id, work.assigned)
    return await answer_response(request, work, summary)


async def blob(request: web.Request) -> web.StreamResponse:
    co = request.app[COORDINATOR]
    host = co.hosts.authenticate(bearer(request))
    co.access.check_rate(host.id, time.monotonic())
    blob_id = request.match_info["blob_id"]
    if not is_blob_id(blob_id):
        raise protocol.BadRequest(f"malformed blob id {blob_id[:80]}")  # escaped when logged
    data = co.blobs.in_memory(blob_id)
    if data is not None and len(data) >= PIECE_BYTES:
        return await send_in_pieces(request, [data], "application/octet-stream")
    if data is not None:
        return web.Response(body=data, headers={"Content-Type": "application/octet-stream"})
    path = co.blobs.path(blob_id)
    if not path.is_file():
        if co.blobs.released(blob_id):
            raise protocol.Gone(
                f"blob {blob_id} belonged to a product that is done: drop the work that reads it"
            )
        raise NotFound(f"no blob {blob_id}")
    response = web.FileResponse(path, headers={"Content-Type": "application/octet-stream"})
    response._blob_size = path.stat().st_size  # FileResponse sets its length only when sent
    return response


async def status(request: web.Request) -> web.Response:
    co = request.app[COORDINATOR]
    return web.json_response(co.progress.full_status())


async def metrics(request: web.Request) -> web.Response:
    body = request.app[COORDINATOR].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def dashboard_page(request: web.Request) -> web.Response:
    co = request.app[COORDINATOR]
    fragment = request.query.get("fragment") == "1"
    html = await request.app[PAGES].get(co, fragment)
    return web.Response(text=html, content_type="text/html")


async def admin_coordinator(request: web.Request) -> Coordinator:
    """The coordinator, once the caller is the operator and what it sent is an admin call:
    no body, or a small msgpack map (unread before, so any bytes of any size were taken)."""
    co = request.app[COORDINATOR]
    co.access.check_admin(bearer(request))
    if request.body_exists:
        await read_body(request, MAX_ADMIN_BYTES)
    return co


async def admin_pause(request: web.Request) -> web.Response:
    co = await admin_coordinator(request)
    changed = await co.operator.set_paused(request.match_info["action"] == "pause", time.time())
    return msgpack_response({"paused": co.paused, "changed": changed})


async def admin_host(request: web.Request) -> web.Response:
    co = await admin_coordinator(request)
    host_id = co.hosts.find(request.match_info["host_id"])
    action = request.match_info["action"]
    before = co.ledger.hosts.get(host_id)
    host = await co.operator.set_quarantined(host_id, action == "quarantine", time.time())
    return msgpack_response(
        {
            "host_id": host.id,
            "name": host.name,
            "quarantined": host.quarantined,
            "changed": before is None or before.quarantined != host.quarantined,
        }
    )


async def admin_cancel_step(request: web.Request) -> web.Response:
    co = await admin_coordinator(request)
    given = request.match_info["step"]
    # ASCII digits only: int() also reads other scripts' digits ('１' cancelled step 1).
    if not (given.isascii() and given.isdigit()) or len(given) > 18:
        raise protocol.BadRequest("step must be a non-negative integer")
    step = int(given)
    counts = await co.operator.cancel_step(step, time.time())
    return msgpack_response({"step": step, **counts})


def create_app(
    coordinator: Coordinator, outer: Sequence[Middleware] = (), local_socket: str = ""
) -> web.Application:
    """The aiohttp application; the coordinator starts and stops with it. `outer`
    middlewares run first (a benchmark's own timing); `local_socket` is the name of the
    local socket it is served on too, offered to volunteers on this machine."""
    app = web.Application(
        client_max_size=coordinator.config.max_report_bytes + (1 << 20),
        middlewares=[*outer, errors, measured],
    )
    app[COORDINATOR] = coordinator
    app[LOCAL_SOCKET] = local_socket
    app[PAGES] = dashboard.Pages()
    app[REFUSALS] = RefusalLog()

    async def lifetime(app: web.Application):
        try:
            await coordinator.start()
        except BaseException:
            # aiohttp cleans up only what started: close the store here, or its thread would
            # keep the process alive after the error (which is the one to report).
            with contextlib.suppress(Exception):
                await coordinator.stop()
            raise
        sweeping = asyncio.create_task(_sweep_refusals(app[REFUSALS]), name="tilehive-refusals")
        yield
        sweeping.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):  # the stop goes on
            await sweeping
        app[REFUSALS].sweep(final=True)  # the counts still untold, before the log ends
        await coordinator.stop()

    app.cleanup_ctx.append(lifetime)
    app.router.add_post("/v1/hosts", register)
    app.router.add_post("/v1/work", request_work)
    app.router.add_post("/v1/results", report)
    app.router.add_get("/v1/blobs/{blob_id}", blob)
    app.router.add_get("/v1/status", status)
    app.router.add_post("/v1/admin/{action:pause|resume}", admin_pause)
    app.router.add_post("/v1/admin/hosts/{host_id}/{action:quarantine|release}", admin_host)
    app.router.add_post("/v1/admin/steps/{step}/cancel", admin_cancel_step)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/", dashboard_page)
    return app


class MalformedHttpFilter(logging.Filter):
    """aiohttp logs a full traceback for every request it cannot parse (a bad header line, a
    header over the size limit): on the internet that is noise, so it becomes one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            # aiohttp's message quotes the bad bytes over several lines: one escaped line.
            record.msg = loggable(f"{record.getMessage()}: malformed HTTP: {exc.message or exc}")
            record.args = ()
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def quiet_malformed_http() -> None:
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, MalformedHttpFilter) for f in server_log.filters):
        server_log.addFilter(MalformedHttpFilter())


async def serve(
    coordinator: Coordinator,
    host: str,
    port: int,
    outer: Sequence[Middleware] = (),
) -> tuple[web.AppRunner, str]:
    """Start serving, on the local socket too where there can be one (server/local.py);
    returns the runner (call `cleanup()` to stop) and the base URL. Raises CannotListen,
    with the reason in the operator's terms, if it cannot bind."""
    quiet_malformed_http()
    await check_bind(host, port)
    listener = local.listen(LISTEN_BACKLOG)
    # aiohttp's keep-alive timer runs from the connection's start and is not reset by
    # partial data: a client trickling its headers is dropped when it fires.
    runner = web.AppRunner(
        create_app(coordinator, outer, listener[1] if listener else ""),
        access_log=None,
        keepalive_timeout=coordinator.config.header_timeout,
    )
    try:
        await runner.setup()
    except BaseException:
        if listener:
            listener[0].close()
        raise
    site = web.TCPSite(runner, host, port, backlog=LISTEN_BACKLOG)
    try:
        await site.start()
    except BaseException as exc:
        await runner.cleanup()  # stops the coordinator: nothing may outlive a failed start
        if listener:
            listener[0].close()
        if isinstance(exc, OSError):
            raise CannotListen(bind_failure(host, port, exc)) from exc
        raise
    if listener:
        await local.start(runner, *listener)
    bound_host, bound_port = runner.addresses[0][:2]
    return runner, base_url(bound_host, bound_port)


def base_url(host: str, port: int) -> str:
    """The URL of a bound address: an IPv6 address goes in brackets (RFC 3986)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class CannotListen(Exception):
    """The server cannot listen where it was asked to."""


async def check_bind(host: str, port: int) -> None:
    """Raise CannotListen if host:port cannot be bound, before the coordinator starts (and
    before it touches its database): a probe socket binds every address of the name."""
    loop = asyncio.get_running_loop()
    try:
        addresses = await loop.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        for family, kind, proto, _, address in addresses:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server
                if family == socket.AF_INET6:
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                probe.bind(address)
    except OSError as exc:
        raise CannotListen(bind_failure(host, port, exc)) from exc


def bind_failure(host: str, port: int, exc: OSError) -> str:
    """Why binding to host:port failed, in the operator's terms."""
    where = f"cannot listen on {host}:{port}"
    if isinstance(exc, socket.gaierror):
        return f"{where}: no address for the name {host!r} ({exc.strerror})"
    reasons = {
        errno.EADDRINUSE: f"port {port} is in use (another coordinator, or another program)",
        errno.EADDRNOTAVAIL: f"{host} is not an address of this machine",
        errno.EACCES: "permission denied (ports below 1024 need privileges)",
    }
    return f"{where}: {reasons.get(exc.errno) or exc.strerror or exc}"
