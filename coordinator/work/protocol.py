"""The wire protocol: msgpack messages under /v1/, parsed and checked at the edge.

Nothing deeper in the coordinator sees raw bytes: a request body becomes one of the frozen
messages below or a ProtocolError carrying the HTTP status and a message for the client.
docs/protocol.md describes every endpoint, field and error.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import msgpack

from kernels import frames, is_blob_id

VERSION = 1
CONTENT_TYPE = "application/msgpack"

MAX_NAME = 64
MAX_REQUEST_ID = 64
MAX_CAPACITY = 64
MAX_CACHED = 4096
MAX_IN_PROGRESS = 1024
MAX_REPORTS = 64
MAX_ERROR_TEXT = 1000
MAX_ROUND_TRIP = 3600.0  # seconds


class ProtocolError(Exception):
    """A request the coordinator refuses: an HTTP status, a short code and a message."""

    status = 400
    code = "bad_request"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(ProtocolError):
    """The body is not a well-formed message of this endpoint."""


class Unauthorized(ProtocolError):
    """No token, or a token no host has."""

    status = 401
    code = "unauthorized"


class Forbidden(ProtocolError):
    """The host may not do this (another host's result, or it is quarantined)."""

    status = 403
    code = "forbidden"


class NotFound(ProtocolError):
    """No such blob or result."""

    status = 404
    code = "not_found"


class Gone(ProtocolError):
    """A blob of a product that is done: nobody needs the work that reads it any more."""

    status = 410
    code = "gone"


class RequestTimeout(ProtocolError):
    """The body did not arrive in time (a stalled or deliberately slow client)."""

    status = 408
    code = "request_timeout"


class RetryLater(ProtocolError):
    """A refusal for now, not for good: `retry_after` seconds until it is worth trying again
    (sent as the Retry-After header)."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class TooManyRequests(RetryLater):
    """Over a rate limit."""

    status = 429
    code = "too_many_requests"


class StorageUnavailable(RetryLater):
    """The coordinator cannot write its blob store just now; the report is worth resending."""

    status = 503
    code = "storage_unavailable"


class TooLarge(ProtocolError):
    """The body is over this endpoint's size limit."""

    status = 413
    code = "too_large"


class UnsupportedMediaType(ProtocolError):
    """The body is not msgpack."""

    status = 415
    code = "unsupported_media_type"


def loggable(value: object) -> str:
    """`value` as text that stays on one log line: every character that is not printable
    (newlines, NUL, other controls, Unicode separators) becomes a Python escape such as `\\n`,
    and a backslash is doubled so that such an escape cannot be faked. A value from the
    network can then neither start a forged log line nor make the log binary."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(
        c if c.isprintable() and c != "\\" else c.encode("unicode_escape").decode("ascii")
        for c in text
    )


def encode(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def encode_with(message: dict[str, Any], key: str, encoded: bytes) -> bytes:
    """`message` with one more field whose value is already msgpack (`encoded`): the answer
    to a work request rides in a report's reply without being decoded and encoded again."""
    packer = msgpack.Packer(use_bin_type=True)
    parts = [packer.pack_map_header(len(message) + 1)]
    for name, value in message.items():
        parts += (packer.pack(name), packer.pack(value))
    parts += (packer.pack(key), encoded)
    return b"".join(parts)


def decode(body: frames.Buffer, max_bytes: int) -> dict[str, Any]:
    """A msgpack map from a request body, or BadRequest/TooLarge."""
    if len(body) > max_bytes:
        raise TooLarge(f"body of {len(body)} bytes exceeds this endpoint's limit of {max_bytes}")
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise BadRequest(f"body is not valid msgpack: {frames.msgpack_failure(exc)}") from exc
    if not isinstance(message, dict):
        raise BadRequest(f"body must be a msgpack map, got {type(message).__name__}")
    return message


def decode_frame(body: frames.Buffer, max_bytes: int) -> dict[str, Any]:
    """A framed map from a request body (kernels/frames.py: its large binaries are views of
    the body, not copies), or BadRequest/TooLarge."""
    if len(body) > max_bytes:
        raise TooLarge(f"body of {len(body)} bytes exceeds this endpoint's limit of {max_bytes}")
    try:
        message = frames.unpack(body)
    except frames.FrameError as exc:
        raise BadRequest(f"body is not a valid frame: {exc}") from exc
    if not isinstance(message, dict):
        raise BadRequest(f"body must be a msgpack map, got {type(message).__name__}")
    return message


def _get(message: dict, key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    if key not in message:
        if default is ...:
            raise BadRequest(f"missing field {key!r}")
        return default
    value = message[key]
    if value is None and default is None:
        return None
    # bool is an int in Python; never accept it where a number is asked for.
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise BadRequest(f"field {key!r} must be {_kind_name(kind)}, got bool")
    if not isinstance(value, kind):
        raise BadRequest(f"field {key!r} must be {_kind_name(kind)}, got {type(value).__name__}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _number(message: dict, key: str, low: float, high: float, default: Any = ...) -> float:
    value = _get(message, key, (int, float), default)
    if value is None:
        return value
    if not math.isfinite(value) or not low <= value <= high:
        raise BadRequest(f"field {key!r} must be between {low} and {high}, got {value}")
    return value


def _integer(message: dict, key: str, low: int, high: int, default: Any = ...) -> int:
    """An integer field: 1.5 threads is no count to round, but a malformed request."""
    value = _get(message, key, int, default)
    if not low <= value <= high:
        raise BadRequest(f"field {key!r} must be between {low} and {high}, got {value}")
    return value


_HEX = re.compile(r"[0-9a-f]*")


def _ids(message: dict, key: str, limit: int, check: Any, length: int) -> tuple[str, ...]:
    values = _get(message, key, list, [])
    if len(values) > limit:
        raise BadRequest(f"field {key!r} lists {len(values)} entries, at most {limit} allowed")
    # All at once: a volunteer lists up to thousands of cached panels in every request,
    # and checking them one by one was about 5% of a coordinator's loop in a tiny-gpt step.
    if not values or (
        set(map(type, values)) == {str}
        and set(map(len, values)) == {length}
        and _HEX.fullmatch("".join(values))
    ):
        return tuple(values)
    bad = next(value for value in values if not check(value))
    if not isinstance(bad, str):  # say its type: the repr of some (memoryview) is an address
        raise BadRequest(f"field {key!r} holds an id of type {type(bad).__name__}, not str")
    raise BadRequest(f"field {key!r} holds a malformed id: {bad!r:.80}")


_RESULT_ID = re.compile(r"[0-9a-f]{32}")


def is_result_id(value: object) -> bool:
    # One C call, as kernels.is_blob_id: a report checks one per result (0.2 µs; the loop
    # over the digits it replaces took 0.9).
    return isinstance(value, str) and _RESULT_ID.fullmatch(value) is not None


@dataclass(frozen=True, slots=True)
class RegisterRequest:
    name: str
    gflops: float
    threads: int
    max_memory_mb: int
    invite: str | None = None


def parse_register(message: dict[str, Any]) -> RegisterRequest:
    name = _get(message, "name", str)
    if not 1 <= len(name) <= MAX_NAME or not name.isprintable():
        raise BadRequest(f"field 'name' must be 1 to {MAX_NAME} printable characters")
    if name.isascii() and name.isdigit():
        # The operator's commands read digits as a host's id: a host named "1" would have
        # `admin quarantine URL 1` act on another host.
        raise BadRequest("field 'name' must not be digits alone: digits name a host's id")
    return RegisterRequest(
        name=name,
        gflops=float(_number(message, "gflops", 0.0, 1e6, 1.0)),
        threads=_integer(message, "threads", 1, 4096, 1),
        max_memory_mb=_integer(message, "max_memory_mb", 0, 1 << 24, 0),
        invite=_get(message, "invite", str, None),
    )


@dataclass(frozen=True, slots=True)
class WorkRequest:
    request_id: str
    capacity: int
    cached: tuple[str, ...]
    in_progress: tuple[str, ...]
    gflops: float | None
    wait: bool = True  # the host may be kept waiting (long poll) until work appears
    # The host's shortest recent call, in seconds (None: not said): a host far away is
    # answered once the training loop has published what it was about to (engine/requests.py).
    round_trip: float | None = None
    # The host stops now (its last request; what it held it gave back or reported): it is
    # not counted as connected, nor waited for, until it asks again.
    leaving: bool = False
    # The host's owner is using the machine (`--idle-only`): it asks for nothing, and says
    # so now and then, until the machine is idle again (engine/waiting.py says why work waits).
    paused: bool = False
    # What the host offers for a work unit, as it registered it (None: not said): a volunteer
    # restarted with another --max-memory keeps its identity, and says so with each ask.
    max_memory_mb: int | None = None


def parse_work_request(message: dict[str, Any]) -> WorkRequest:
    request_id = _get(message, "request_id", str)
    if not 1 <= len(request_id) <= MAX_REQUEST_ID or not request_id.isprintable():
        raise BadRequest(f"field 'request_id' must be 1 to {MAX_REQUEST_ID} printable characters")
    capacity = _get(message, "capacity", int)
    if not 0 <= capacity <= MAX_CAPACITY:
        raise BadRequest(f"field 'capacity' must be between 0 and {MAX_CAPACITY}, got {capacity}")
    gflops = _number(message, "gflops", 0.0, 1e6, None)
    round_trip = _number(message, "round_trip", 0.0, MAX_ROUND_TRIP, None)
    leaving = _get(message, "leaving", bool, False)
    if leaving and capacity:
        raise BadRequest("a host that is leaving asks for no work: field 'capacity' must be 0")
    memory = message.get("max_memory_mb")
    max_memory_mb = None if memory is None else _integer(message, "max_memory_mb", 0, 1 << 24)
    paused = _get(message, "paused", bool, False)
    if paused and capacity:
        raise BadRequest("a paused host asks for no work: field 'capacity' must be 0")
    return WorkRequest(
        request_id=request_id,
        capacity=capacity,
        cached=_ids(message, "cached", MAX_CACHED, is_blob_id, 64),
        in_progress=_ids(message, "in_progress", MAX_IN_PROGRESS, is_result_id, 32),
        gflops=None if gflops is None else float(gflops),
        wait=_get(message, "wait", bool, True),
        round_trip=None if round_trip is None else float(round_trip),
        leaving=leaving,
        paused=paused,
        max_memory_mb=max_memory_mb,
    )


@dataclass(frozen=True, slots=True)
class ResultReport:
    result_id: str
    # The blake3 of the tile: None when the host reports an error, and may be None with the
    # tile (the coordinator names the tile by its own hash of the bytes).
    output_hash: str | None
    tile: bytes | memoryview | None  # the tile blob, when the assignment asked for it
    error: str | None
    seconds: float
    abandoned: bool = False  # given back uncomputed (the host is stopping): no error


@dataclass(frozen=True, slots=True)
class ReportRequest:
    results: tuple[ResultReport, ...]
    # A work request riding on the report: its answer comes back in the report's reply, so
    # a host that has just finished its queue saves a round trip per product.
    work: WorkRequest | None = None


def parse_report(message: dict[str, Any]) -> ReportRequest:
    entries = _get(message, "results", list)
    if not 1 <= len(entries) <= MAX_REPORTS:
        raise BadRequest(f"field 'results' must list 1 to {MAX_REPORTS} results")
    reports = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise BadRequest(f"results[{index}] must be a map")
        try:
            reports.append(_parse_one_report(entry))
        except BadRequest as exc:
            raise BadRequest(f"results[{index}]: {exc.message}") from exc
    ids = [r.result_id for r in reports]
    if len(set(ids)) != len(ids):
        raise BadRequest("field 'results' names a result more than once")
    work = _get(message, "work", dict, None)
    if work is not None:
        try:
            work = parse_work_request(work)
        except BadRequest as exc:
            raise BadRequest(f"work: {exc.message}") from exc
    return ReportRequest(results=tuple(reports), work=work)


def _parse_one_report(entry: dict[str, Any]) -> ResultReport:
    result_id = _get(entry, "result_id", str)
    if not is_result_id(result_id):
        raise BadRequest(f"malformed result id {result_id!r:.80}")
    error = _get(entry, "error", str, None)
    output_hash = _get(entry, "hash", str, None)
    tile = _get(entry, "tile", (bytes, memoryview), None)
    seconds = float(_number(entry, "seconds", 0.0, 1e7, 0.0))
    if _get(entry, "abandoned", bool, False):
        if error is not None or output_hash is not None or tile is not None:
            raise BadRequest("an abandoned result carries no error, hash or tile")
        return ResultReport(result_id, None, None, None, seconds, abandoned=True)
    if error is not None:
        if output_hash is not None or tile is not None:
            raise BadRequest("an error report carries no hash or tile")
        # Escaped here, once: the text goes into log lines and the event log as it is.
        return ResultReport(result_id, None, None, loggable(error[:MAX_ERROR_TEXT]), seconds)
    # With the tile, the hash may be left out: the coordinator hashes the bytes anyway, and
    # a host's own hash of a tile it uploads would only be checked against them.
    if (output_hash is not None or tile is None) and not is_blob_id(output_hash):
        raise BadRequest("field 'hash' must be the 64-hex-digit blake3 of the tile blob")
    return ResultReport(result_id, output_hash, tile, None, seconds)
