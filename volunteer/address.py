"""A coordinator's address: what a valid URL looks like, and telling a tilehive coordinator
from something else that answers there (another web server, TLS on the wrong side)."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import ssl
from urllib.parse import urlsplit

import aiohttp
import msgpack

from volunteer.logsetup import one_line

EXAMPLE = "give http://HOST:PORT or https://HOST:PORT (e.g. http://127.0.0.1:8470)"
GATEWAY = (502, 503, 504)  # a proxy's word on a coordinator behind it that is down
REFUSAL_TYPE = "application/msgpack"  # how a coordinator words a refusal: {error, message}


class NotACoordinator(Exception):
    """Something answers at the URL, but not as a tilehive coordinator: retrying will not
    help, so a volunteer that never heard a coordinator there says so and stops."""


def check_url(url: str) -> str:
    """`url` without the spaces around it or a trailing slash; ValueError (one line) unless
    it is an http(s) URL with a host, a port in 1-65535 if it names one, and no user name,
    query or fragment. A path is a prefix the coordinator is served under (behind a reverse
    proxy), never one of the API's own (`/v1/...`)."""
    url = url.strip()  # a space or a newline pasted around it, as the client would drop it
    if not url.isprintable() or any(c.isspace() or c == "\\" for c in url):
        # urlsplit drops tabs and newlines inside before it parses: the URL it checked
        # would not be the one used (a unit file's next setting, after a newline or a
        # closing backslash).
        raise ValueError(f"{url!r} holds a space, a backslash or a control character: {EXAMPLE}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{url!r} is not a valid URL ({exc}): {EXAMPLE}") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{url!r} is not an http:// or https:// URL: {EXAMPLE}")
    if not parts.hostname:
        raise ValueError(f"{url!r} names no host: {EXAMPLE}")
    if port == 0:
        raise ValueError(f"{url!r} has port 0: {EXAMPLE}")
    if parts.username is not None or parts.password is not None:
        # Read as a host name before: "Name or service not known", for a URL that has one.
        raise ValueError(
            f"{url!r} holds a user name or password, which a coordinator does not take "
            f"(volunteers get tokens when they register): {EXAMPLE}"
        )
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        raise ValueError(f"{url!r} has a query or a fragment: {EXAMPLE}")
    if (api := _api_path(parts.path)) is not None:
        # The API's own path (copied from protocol.md or the browser): its paths go after it.
        base = f"{parts.scheme}://{parts.netloc}{parts.path[:api]}"
        raise ValueError(f"{url!r} is a path of the coordinator's API: give its base URL, {base}")
    return url.rstrip("/")


# The first segment after /v1 of each of the API's paths (docs/protocol.md).
API_PATHS = frozenset({"hosts", "work", "results", "blobs", "status", "admin"})


def _api_path(path: str) -> int | None:
    """Where in `path` the API's own part starts (`/v1`, alone or before one of its paths),
    or None. A prefix a reverse proxy serves the coordinator under may hold a `v1` of its
    own (`/v1/tilehive`): only what the API would append is refused."""
    segments = path.rstrip("/").split("/")
    for i in range(len(segments) - 1, 0, -1):
        if segments[i] == "v1" and (i == len(segments) - 1 or segments[i + 1] in API_PATHS):
            return len("/".join(segments[:i]))
    return None


def is_loopback_url(url: str) -> bool:
    """Whether the URL's host is this machine's loopback (localhost, 127.0.0.0/8, ::1)."""
    try:
        host = urlsplit(url).hostname or ""
    except ValueError:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def answer(status: int, content_type: str, body: bytes | memoryview) -> str:
    """What a server answered, in a few words for an error line."""
    start = bytes(body[:40]).decode("utf-8", "replace").strip()
    more = "..." if len(body) > 40 else ""
    return f"{status} {content_type or 'without a content type'}" + (
        f" ({start!r}{more})" if start else ""
    )


def is_status(summary: object) -> bool:
    """Whether a JSON document has the shape of a coordinator's status (what `status`
    prints reads these fields)."""
    if not isinstance(summary, dict) or not isinstance(summary.get("workunits"), dict):
        return False
    shapes = {"training": dict, "host_states": dict, "results": dict, "waiting": dict}
    return all(
        summary.get(key) is None or isinstance(summary[key], shape) for key, shape in shapes.items()
    )


def strange(url: str, request: str, code: int, content_type: str, body: bytes) -> str:
    """The error line for a reply in no coordinator's words."""
    if code in GATEWAY:
        said = answer(code, content_type, body)
        return f"cannot reach a coordinator at {url}: {request} answered {said}"
    return not_tilehive(url, request, code, content_type, body)


def refusal(content_type: str, body: bytes) -> str | None:
    """A coordinator's {error, message} refusal, its message escaped; None for anything
    else."""
    if content_type != REFUSAL_TYPE:
        return None
    try:
        message = msgpack.unpackb(body)
    except Exception:
        return None
    if not isinstance(message, dict) or not isinstance(message.get("message"), str):
        return None
    return one_line(message["message"])


def status_problem(url: str, code: int, content_type: str, body: bytes) -> tuple[str, dict]:
    """(what is wrong, as one line, or ""; the summary) of a reply to GET URL/v1/status:
    a coordinator's refusal in its words, or what else answered there."""
    try:
        summary = json.loads(body)
    except ValueError:
        summary = None
    if code == 200 and is_status(summary):
        return "", summary
    said = refusal(content_type, body)
    if code != 200 and said is not None:
        # A coordinator's own refusal: a path with nothing behind it (a proxy's prefix that
        # is not the coordinator's), say; its words, not its msgpack bytes.
        hint = ": give the URL it prints ('volunteers connect to ...')" if code == 404 else ""
        return f"{url}: the coordinator answered {code} {said}{hint}", {}
    problem = strange(url, "GET /v1/status", code, content_type, body)
    return problem + ("" if code != 200 or summary is None else ", not a tilehive status"), {}


def not_tilehive(
    url: str, request: str, status: int, content_type: str, body: bytes | memoryview
) -> str:
    """The error line for a reply that no tilehive coordinator would give."""
    said = answer(status, content_type, body)
    return f"{url} is not a tilehive coordinator: {request} answered {said}"


async def stranger(url: str, exc: BaseException) -> str | None:
    """Why the network error `exc` on `url` means no coordinator can answer there, or None
    if it may be one that is down or slow (refused, reset, timed out: retry)."""
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return f"{url}: the TLS certificate is not trusted ({exc.certificate_error})"
    if isinstance(exc, aiohttp.ClientSSLError):
        return (
            f"{url} does not speak TLS (the handshake failed): is it http:// rather than https://?"
        )
    parts = urlsplit(url)
    reset = isinstance(exc, aiohttp.ServerDisconnectedError | ConnectionResetError) or (
        isinstance(exc, aiohttp.ClientOSError) and not isinstance(exc, aiohttp.ClientConnectorError)
    )
    if parts.scheme == "http" and reset and await speaks_tls(parts.hostname, parts.port or 80):
        return f"{url} speaks TLS: use https:// rather than http://"
    return None


async def speaks_tls(host: str, port: int, timeout: float = 5.0) -> bool:
    """True if a TLS handshake with host:port succeeds (its certificate unchecked: this only
    asks which protocol the port speaks)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(host, port, ssl=context)
    except (OSError, TimeoutError):
        return False
    writer.close()
    try:
        async with asyncio.timeout(timeout):
            await writer.wait_closed()
    except (OSError, TimeoutError):
        pass
    return True
