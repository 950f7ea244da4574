"""Fuzzing every endpoint: malformed input gets a 4xx, never a 5xx or a hang, and work goes on."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from collections import Counter
from urllib.parse import quote

import msgpack
import numpy as np
import pytest
from aiohttp.http_exceptions import HttpProcessingError
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import kernels
from coordinator.engine.coordinator import Coordinator, CoordinatorConfig
from coordinator.rules.access import AccessConfig
from coordinator.rules.trust import TrustConfig
from coordinator.server.api import serve
from coordinator.state.sqlite import SqliteStore
from coordinator.work.records import Policy, Redundancy
from tests.factories import bits
from tests.volunteers import Behaviour, ScriptedVolunteer, wait_until
from volunteer.client import CoordinatorClient

REPLY_TIMEOUT = 10.0  # seconds; a request with no answer by then is a hang
EXAMPLES = 600  # per hypothesis test; the whole module runs in about 20 s on 2 cores
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
CASES: Counter = Counter()  # requests sent, by endpoint: the figure printed at the end
STATUSES: Counter = Counter()


@pytest.fixture(scope="module", autouse=True)
def summary():
    yield
    if CASES:
        print(
            f"\nfuzz: {sum(CASES.values())} requests (malformed or mutated): no 5xx seen, no hang"
        )
        for endpoint, count in sorted(CASES.items()):
            print(f"  {endpoint:16} {count}")
        print("  replies: " + ", ".join(f"{s}: {n}" for s, n in sorted(STATUSES.items(), key=str)))


class Errors(logging.Handler):
    """Collects ERROR records: aiohttp logs an exception escaping a handler (the 500) so.

    aiohttp's HTTP parser also logs a traceback at ERROR for a request line it cannot parse
    (it still answers 400); those are only counted, in STATUSES."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError) and 400 <= (error.code or 0) < 500:
            STATUSES["parser traceback logged"] += 1
        else:
            self.records.append(record)


class Server:
    """The real coordinator and aiohttp server on its own event loop in a background thread,
    so hypothesis drives it from plain synchronous tests; one host is registered and holds
    real assignments, so reports reach the tile checks."""

    def __init__(self, directory) -> None:
        self.directory = directory
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.errors = Errors()

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __enter__(self) -> Server:
        logging.getLogger().addHandler(self.errors)
        self.thread.start()
        self.run(self._start())
        return self

    async def _start(self) -> None:
        config = CoordinatorConfig(
            directory=self.directory,
            policy=Policy.QUORUM,
            tile=8,
            long_poll=0.05,
            no_work_delay=0.05,
            redundancy=Redundancy(delay_bound=600.0),
            # Limits so high they never answer first: every case reaches the parsers (the
            # limits themselves are tested in test_access.py).
            access=AccessConfig(host_rate=1e6, host_burst=1e6, registrations_per_hour=10**6),
            # Nor is the fuzzer quarantined by its refused reports (a quarantined host's
            # reports are refused before they are parsed).
            trust=TrustConfig(quarantine_after=10**9),
        )
        self.co = Coordinator(config, SqliteStore(config.directory / "state.db"))
        self.queue = self.co.products
        self.runner, self.url = await serve(self.co, "127.0.0.1", 0)
        self.port = int(self.url.rsplit(":", 1)[1])
        rng = np.random.default_rng(5)
        a = rng.standard_normal((48, 16)).astype(np.float32)
        b = rng.standard_normal((16, 48)).astype(np.float32)
        self.pending = asyncio.ensure_future(self.queue.matmul(a, b, label="fuzzed"))
        await wait_until(lambda: self.co.ledger.unsent)  # published
        async with CoordinatorClient(self.url) as client:
            self.host_id = await client.register("fuzzer", threads=16)
            self.token = client.token
            reply = await client.request_work("setup", capacity=32)
        self.assignments = reply["assignments"]
        assert self.assignments, "the fuzzing host got no work to report on"
        self.blob_ids = sorted({x for a in self.assignments for x in (a["a"], a["b"])})
        self.admin = (self.directory / "admin.token").read_text().strip()

    def __exit__(self, *exc: object) -> None:
        try:
            self.run(self._stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()
            logging.getLogger().removeHandler(self.errors)

    async def _stop(self) -> None:
        self.pending.cancel()
        await self.runner.cleanup()

    def drained(self) -> None:
        """Wait until the server has finished with every connection (and logged about it)."""

        async def idle() -> None:
            await wait_until(lambda: not self.runner.server.connections, timeout=REPLY_TIMEOUT)

        self.run(idle())

    def unhandled(self) -> list[str]:
        """Exceptions that escaped a handler since the last call (each one a 500 or a
        traceback in the operator's log)."""
        self.drained()
        found = [f"{r.getMessage()}: {r.exc_info[1]!r}" for r in self.errors.records]
        self.errors.records.clear()
        return found

    def healthy_and_working(self, seed: int) -> None:
        """The status page answers and two normal volunteers complete a new product."""
        status, body = send(self, "GET", b"/v1/status")
        assert status == 200 and "workunits" in json.loads(body.split(b"\r\n\r\n", 1)[1])
        self.run(self._product(seed))
        assert self.unhandled() == []

    async def _product(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        a = rng.standard_normal((24, 12)).astype(np.float32)
        b = rng.standard_normal((12, 20)).astype(np.float32)
        stop = asyncio.Event()
        crew = [ScriptedVolunteer(self.url, f"normal{seed}-{i}", Behaviour()) for i in range(2)]
        tasks = [asyncio.create_task(v.run(stop)) for v in crew]
        try:
            got = await asyncio.wait_for(self.queue.matmul(a, b, label=f"after{seed}"), 30)
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        assert np.array_equal(bits(got), bits(kernels.gemm(a, b)))
        assert all(v.done for v in crew)


@pytest.fixture
def server(tmp_path):
    """A fresh server per test function, shared by its examples; when they are done the
    server must still be healthy and a normal volunteer must complete a product."""
    with Server(tmp_path / "project") as running:
        yield running
        running.healthy_and_working(seed=len(CASES))


def send(
    server: Server,
    method: str,
    path: bytes,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    *,
    content_length: int | str | None = None,
    raw: bytes | None = None,
    half_close: bool = False,
) -> tuple[int | None, bytes]:
    """One request on a fresh connection; (status or None if the server just closed, reply).
    A reply that does not come within REPLY_TIMEOUT fails the test as a hang."""
    if raw is None:
        lines = [method.encode() + b" " + path + b" HTTP/1.1", b"Host: 127.0.0.1"]
        lines.append(b"Connection: close")
        for name, value in (headers or {}).items():
            lines.append(f"{name}: ".encode() + value.encode("utf-8", "surrogateescape"))
        length = len(body) if content_length is None else content_length
        lines.append(f"Content-Length: {length}".encode())
        raw = b"\r\n".join(lines) + b"\r\n\r\n" + body
    with socket.create_connection(("127.0.0.1", server.port), timeout=REPLY_TIMEOUT) as s:
        try:
            s.sendall(raw)
            if half_close:
                s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server refused before reading everything: its reply follows
        reply = bytearray()
        try:
            while chunk := s.recv(1 << 16):
                reply += chunk
        except TimeoutError:
            pytest.fail(f"no reply within {REPLY_TIMEOUT}s to {raw[:200]!r}: the server hung")
        except ConnectionResetError:
            pass
    if not reply:
        return None, b""
    status = int(reply.split(b" ", 2)[1])
    STATUSES[status] += 1
    return status, bytes(reply)


def refused(status: int | None, reply: bytes, *, may_close: bool = False) -> None:
    """A 4xx with a message (msgpack from the API, text from aiohttp's own parser)."""
    if status is None and may_close:
        return
    assert status is not None and 400 <= status < 500, reply[:500]


def answered(status: int | None, reply: bytes) -> None:
    """Anything but a server error: a well-formed message may be accepted."""
    assert status is not None and status < 500, reply[:500]


def auth(server: Server) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.token}", "Content-Type": "application/msgpack"}


# ---- strategies ----------------------------------------------------------------------------

huge_ints = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([-1, -(2**63), 2**63 - 1, 2**64 - 1, 2**31, -(2**31) - 1, 10**18]),
)
weird_floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), -1.0, 1e308, -0.0, 5e-324]),
)
weird_text = st.one_of(
    st.text(max_size=80),
    st.sampled_from(["", "\x00", "\u202e", "../..", "a" * 10_000, "\ud7ff", "é" * 70]),
)
scalars = st.one_of(
    st.none(), st.booleans(), huge_ints, weird_floats, weird_text, st.binary(max_size=64)
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=20,
)


def deep(depth: int) -> bytes:
    """A msgpack array nested `depth` levels deep (fixarray of one, repeated)."""
    return b"\x91" * depth + b"\xc0"


garbage_bodies = st.one_of(
    st.binary(max_size=512),
    st.builds(deep, st.integers(100, 200_000)),
    st.sampled_from(
        [
            b"",
            b"\xc1",  # never used in msgpack
            b"\xdd\xff\xff\xff\xff\x01",  # an array of 4G elements, one given
            b"\xdf\xff\xff\xff\xff",  # a map of 4G pairs, none given
            b"\xc6\xff\xff\xff\xff",  # 4 GiB of bin announced
            b"\xd4\x01\x00",  # an ext type
            b"\xd6\xff\x00\x00\x00\x01",  # a timestamp
            msgpack.packb({1: 2}),  # a non-string key
            msgpack.packb({b"name": "x"}),  # a bytes key
        ]
    ),
)


def mutated(valid: dict, extra_keys: list[str]):
    """A valid message with one field replaced, removed, or an unknown field added."""
    keys = sorted(valid) + extra_keys

    @st.composite
    def build(draw):
        message = dict(valid)
        key = draw(st.sampled_from(keys))
        if draw(st.booleans()) and key in message:
            del message[key]
        else:
            message[key] = draw(values)
        return message

    return build()


def truncated(message: dict):
    body = msgpack.packb(message, use_bin_type=True)
    return st.integers(0, len(body) - 1).map(lambda n: body[:n])


# ---- the tests -----------------------------------------------------------------------------

ENDPOINTS = [b"/v1/hosts", b"/v1/work", b"/v1/results"]
VALID = {
    b"/v1/hosts": {"name": "ok", "gflops": 1.0, "threads": 1, "max_memory_mb": 0},
    b"/v1/work": {"request_id": "r", "capacity": 0, "cached": [], "in_progress": [], "wait": False},
    b"/v1/results": {"results": [{"result_id": "0" * 32, "hash": "0" * 64, "seconds": 0.1}]},
}


@SETTINGS
@given(data=st.data())
def test_garbage_bodies_get_a_4xx_on_every_post_endpoint(server, data):
    path = data.draw(st.sampled_from(ENDPOINTS), label="endpoint")
    body = data.draw(st.one_of(garbage_bodies, truncated(VALID[path]).filter(bool)), label="body")
    status, reply = send(server, "POST", path, body, auth(server))
    CASES[path.decode()] += 1
    refused(status, reply)


@SETTINGS
@given(data=st.data())
def test_wrong_types_huge_numbers_and_unknown_fields_never_get_a_5xx(server, data):
    path = data.draw(st.sampled_from(ENDPOINTS), label="endpoint")
    shapes = [mutated(VALID[path], ["junk", ""]), values]
    if path == b"/v1/results":  # one entry of the batch mutated, naming a real result or not
        entry = dict(VALID[path]["results"][0])
        entry["result_id"] = data.draw(
            st.sampled_from([entry["result_id"], *(a["result_id"] for a in server.assignments)])
        )
        shapes.append(mutated(entry, ["tile", "error"]).map(lambda e: {"results": [e]}))
    message = data.draw(st.one_of(shapes), label="message")
    try:
        body = msgpack.packb(message, use_bin_type=True)
    except (OverflowError, ValueError, msgpack.PackException):
        assume(False)
    status, reply = send(server, "POST", path, body, auth(server))
    CASES[path.decode()] += 1
    answered(status, reply)
    if not isinstance(message, dict):
        refused(status, reply)


@st.composite
def bad_tiles(draw, m: int, n: int):
    """Tile blobs that are not a float32 m x n array: garbage, other dtypes, shapes and
    dimensions, lying headers, truncated data."""
    kind = draw(st.sampled_from(["garbage", "array", "header", "truncated"]))
    if kind == "garbage":
        return draw(st.binary(max_size=2 * 4 * m * n))
    if kind == "array":
        dtype = draw(st.sampled_from(["<f4", "<f8", "<i4", "<i8", "|u1"]))
        shape = draw(st.lists(st.integers(0, 2 * max(m, n)), min_size=0, max_size=4))
        assume(not (dtype == "<f4" and tuple(shape) == (m, n)))
        assume(int(np.prod(shape)) <= 4 * m * n)
        return kernels.encode_array(np.zeros(shape, dtype=dtype))
    if kind == "header":
        ndim = draw(st.integers(0, 2**32 - 1))
        dims = draw(st.lists(st.integers(0, 2**64 - 1), min_size=0, max_size=5))
        code = draw(st.sampled_from([b"<f4\0", b"<f8\0", b"xxxx", b"\0\0\0\0"]))
        header = kernels.hashing.MAGIC + code + ndim.to_bytes(4, "little")
        header += b"".join(d.to_bytes(8, "little") for d in dims)
        return header + draw(st.binary(max_size=64))
    good = kernels.encode_array(np.zeros((m, n), np.float32))
    return good[: draw(st.integers(0, len(good) - 1))]


@SETTINGS
@given(data=st.data())
def test_malformed_tiles_for_real_assignments_get_a_400(server, data):
    assignment = data.draw(st.sampled_from(server.assignments), label="assignment")
    tile = data.draw(bad_tiles(assignment["m"], assignment["n"]), label="tile")
    hashed = data.draw(st.sampled_from(["matches", "differs", "left out"]), label="hash")
    entry = {
        "result_id": assignment["result_id"],
        "hash": kernels.blob_id(tile) if hashed == "matches" else kernels.blob_id(b"x" + tile),
        "tile": tile,
        "seconds": data.draw(st.one_of(st.just(0.1), weird_floats), label="seconds"),
    }
    if hashed == "left out":  # then only decoding it (dtype, shape, length) can refuse it
        del entry["hash"]
    if data.draw(st.booleans(), label="drop the tile"):
        del entry["tile"]
        if assignment["upload"] != "tile":
            entry["hash"] = "not a hash"
    status, reply = send(
        server, "POST", b"/v1/results", msgpack.packb({"results": [entry]}), auth(server)
    )
    CASES["/v1/results tile"] += 1
    refused(status, reply)
    assert status in (400, 413), reply[:500]


PATH_TRICKS = [
    "../state.db",
    "..%2fstate.db",
    "%2e%2e%2fstate.db",
    "%2e%2e/%2e%2e/etc/passwd",
    "..%252f..%252fstate.db",
    "..",
    ".",
    "%2e%2e",
    "....//state.db",
    "/etc/passwd",
    "%2fetc%2fpasswd",
    "secret.key",
    "..%2fsecret.key",
    "state.db",
    "%00",
    "0" * 64 + "%00",
    "A" * 64,
    "0" * 63,
    "0" * 65,
    "0" * 64,
    "%30" * 64,
    "a" * 100_000,
    "%ff%fe",
    "\u2025\u2025%2fstate.db",
]


@st.composite
def blob_paths(draw, known: list[str]):
    kind = draw(st.sampled_from(["trick", "text", "known"]))
    if kind == "trick":
        name = draw(st.sampled_from(PATH_TRICKS))
    elif kind == "text":
        text = draw(st.text(min_size=1, max_size=300))
        name = quote(text, safe="") if draw(st.booleans()) else text
    else:  # a real blob under a twisted path
        blob = draw(st.sampled_from(known))
        name = draw(
            st.sampled_from(
                [f"../blobs/{blob[:2]}/{blob}", f"{blob[:2]}%2f{blob}", f"{blob}/..", blob.upper()]
            )
        )
    return b"/v1/blobs/" + name.encode("utf-8", "surrogatepass")


@SETTINGS
@given(data=st.data())
def test_blob_paths_never_escape_the_blob_store(server, data):
    path = data.draw(blob_paths(server.blob_ids), label="path")
    token = data.draw(st.sampled_from([True, False]), label="with token")
    headers = auth(server) if token else {}
    status, reply = send(server, "GET", path, headers=headers)
    CASES["/v1/blobs"] += 1
    answered(status, reply)
    body = reply.split(b"\r\n\r\n", 1)[-1]
    assert b"SQLite format 3" not in body
    assert (server.directory / "secret.key").read_bytes() not in body
    if status == 200:
        kernels.verify_blob(body, kernels.blob_id(body))
        assert kernels.blob_id(body) in server.blob_ids, path[:200]
    else:
        refused(status, reply)


METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "FOO", "G\x00T"]
PATHS = [
    b"/v1/hosts",
    b"/v1/work",
    b"/v1/results",
    b"/v1/blobs/x",
    b"/v1/admin/pause",
    b"/v1/nope",
    b"/v2/hosts",
]


@SETTINGS
@given(data=st.data())
def test_broken_http_and_headers_get_a_4xx_or_a_close(server, data):
    kind = data.draw(st.sampled_from(["request", "length", "auth", "method"]))
    path = data.draw(st.sampled_from(ENDPOINTS), label="endpoint")
    body = msgpack.packb(VALID[path])
    if kind == "request":  # not HTTP at all, or a broken request line
        raw = data.draw(
            st.one_of(
                st.binary(min_size=1, max_size=300),
                st.builds(lambda b: b"POST " + b + b" HTTP/1.1\r\n\r\n", st.binary(max_size=80)),
            )
        )
        status, reply = send(server, "", b"", raw=raw + b"\r\n\r\n", half_close=True)
        CASES["raw http"] += 1
        if status is not None:  # or the server hung up on it, which is fine
            answered(status, reply)
    elif kind == "length":  # a Content-Length that lies or is not a number
        length = data.draw(
            st.sampled_from(["-1", "abc", "99999999999999999999", "1e3", " 5", "0x10", ""])
        )
        status, reply = send(server, "POST", path, body, auth(server), content_length=length)
        CASES["content-length"] += 1
        refused(status, reply, may_close=True)
    elif kind == "auth":
        value = data.draw(
            st.one_of(
                st.sampled_from(["", "Bearer", "Bearer ", "Basic abc", "bearer x", "Bearer " * 50]),
                st.text(max_size=200).map(lambda t: "Bearer " + t),
            )
        )
        value = value.replace("\r", "").replace("\n", "")
        headers = {"Authorization": value, "Content-Type": "application/msgpack"}
        status, reply = send(server, "POST", path, body, headers)
        CASES["authorization"] += 1
        if path == b"/v1/hosts":
            answered(status, reply)
        else:
            refused(status, reply)
    else:
        method = data.draw(st.sampled_from(METHODS))
        where = data.draw(st.sampled_from(PATHS))
        content_type = data.draw(
            st.sampled_from(["application/msgpack", "application/json", "text/plain", ""])
        )
        headers = {**auth(server), "Content-Type": content_type}
        status, reply = send(server, method, where, body, headers)
        CASES["methods"] += 1
        answered(status, reply)
        if method not in ("GET", "POST") or where in PATHS[-2:]:
            refused(status, reply)


@st.composite
def admin_paths(draw):
    host = draw(
        st.one_of(
            st.sampled_from(
                ["1", "0", "-1", "99999999999999999999999", "9" * 5000, "1e3", "%201", "١", "%31"]
            ),
            st.text(min_size=1, max_size=40).map(lambda t: quote(t, safe="")),
        )
    )
    action = draw(st.sampled_from(["quarantine", "release", "pause", "resume", "delete", ""]))
    where = draw(st.sampled_from(["host", "project"]))
    if where == "project":
        return f"/v1/admin/{action}".encode()
    return f"/v1/admin/hosts/{host}/{action}".encode()


@SETTINGS
@given(data=st.data())
def test_the_admin_api_refuses_strangers_and_odd_host_ids_with_a_4xx(server, data):
    path = data.draw(admin_paths(), label="path")
    who = data.draw(st.sampled_from(["admin", "host", "nobody", "forged"]), label="token")
    token = {
        "admin": server.admin,
        "host": server.token,
        "forged": server.admin[:-1] + ("1" if server.admin.endswith("0") else "0"),
    }
    headers = {"Content-Type": "application/msgpack"}
    if who in token:
        headers["Authorization"] = f"Bearer {token[who]}"
    body = data.draw(st.one_of(st.just(b""), garbage_bodies), label="body")
    status, reply = send(server, "POST", path, body, headers)
    CASES["/v1/admin"] += 1
    answered(status, reply)
    if who != "admin":  # never an action without the admin token
        refused(status, reply)
        assert not server.co.paused
        assert not any(h.quarantined for h in server.co.ledger.hosts.values())
    elif status == 200 and path.endswith(b"/quarantine"):
        send(server, "POST", path[: -len(b"quarantine")] + b"release", b"", headers)
    if status == 200 and path.endswith(b"/pause"):  # leave the project running
        send(server, "POST", b"/v1/admin/resume", b"", {"Authorization": f"Bearer {server.admin}"})


def test_a_client_that_hangs_up_mid_body_costs_one_log_line_not_a_traceback(server):
    """Every cut of a valid body of each endpoint, the client closing its side after it."""
    for path in ENDPOINTS:
        body = msgpack.packb(VALID[path])
        for cut in range(len(body)):
            status, reply = send(
                server,
                "POST",
                path,
                body[:cut],
                auth(server),
                content_length=len(body),
                half_close=True,
            )
            CASES["truncated"] += 1
            refused(status, reply, may_close=True)
    unhandled = server.unhandled()
    assert unhandled == [], f"{len(unhandled)} tracebacks, e.g. {unhandled[0]}"


def test_a_normal_volunteer_completes_a_product_right_after_garbage(server):
    for path in ENDPOINTS:
        for body in (deep(100_000), b"\xc1", msgpack.packb([1, 2])):
            status, reply = send(server, "POST", path, body, auth(server))
            CASES[path.decode()] += 1
            refused(status, reply)
    server.healthy_and_working(seed=99)
