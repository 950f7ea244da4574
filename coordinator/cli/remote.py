"""The command line's calls to a running coordinator by URL: every failure is one line,
and a URL where something else answers is named as such."""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.error
import urllib.request
from typing import Any

import click
import msgpack

from coordinator.work.protocol import CONTENT_TYPE
from volunteer.address import answer, check_url, is_status, not_tilehive
from volunteer.logsetup import one_line

GATEWAY = (502, 503, 504)  # a proxy's word on a coordinator behind it that is down


def url_of(value: str) -> str:
    """A coordinator URL from the command line, or one line saying what one looks like."""
    try:
        return check_url(value)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None


def unreachable(url: str, exc: OSError) -> click.ClickException:
    reason = getattr(exc, "reason", exc)
    if isinstance(reason, ssl.SSLError) and url.startswith("https://"):
        return click.ClickException(
            f"cannot reach {url}: the TLS handshake failed ({reason}): is it http://?"
        )
    return click.ClickException(f"cannot reach {url}: {reason}")


def strange(url: str, request: str, code: int, content_type: str, body: bytes) -> str:
    """The error line for a reply in no coordinator's words."""
    if code in GATEWAY:
        said = answer(code, content_type, body)
        return f"cannot reach a coordinator at {url}: {request} answered {said}"
    return not_tilehive(url, request, code, content_type, body)


def exchange(url: str, request: str | urllib.request.Request, timeout: float) -> tuple:
    """(status, content type, body) of one request to the coordinator at `url`, whatever
    the status; one line if nothing answers, or something that does not speak HTTP."""
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, reply.headers.get_content_type(), reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get_content_type(), exc.read()
    except OSError as exc:
        raise unreachable(url, exc) from None
    except http.client.HTTPException as exc:  # an answer, but not in HTTP
        raise click.ClickException(
            f"{url} is not a tilehive coordinator: it does not answer in HTTP "
            f"({type(exc).__name__}: {str(exc)[:60]!r})"
        ) from None


def status(url: str, timeout: float = 10) -> dict[str, Any]:
    """GET URL/v1/status: the coordinator's summary."""
    url = url_of(url)
    code, content_type, body = exchange(url, url + "/v1/status", timeout)
    try:
        summary = json.loads(body)
    except ValueError:
        summary = None
    said = _refusal(content_type, body)
    if code != 200 and said is not None:
        # A coordinator's own refusal: a path with nothing behind it (a proxy's prefix that
        # is not the coordinator's), say; its words, not its msgpack bytes.
        hint = ": give the URL it prints ('volunteers connect to ...')" if code == 404 else ""
        raise click.ClickException(f"{url}: the coordinator answered {code} {said}{hint}")
    if code != 200 or not is_status(summary):
        raise click.ClickException(
            strange(url, "GET /v1/status", code, content_type, body)
            + ("" if code != 200 or summary is None else ", not a tilehive status")
        )
    return summary


def _refusal(content_type: str, body: bytes) -> str | None:
    """A coordinator's {error, message} refusal, its message escaped; None for anything
    else."""
    if content_type != CONTENT_TYPE:
        return None
    try:
        message = msgpack.unpackb(body)
    except Exception:
        return None
    if not isinstance(message, dict) or not isinstance(message.get("message"), str):
        return None
    return one_line(message["message"])


def escaped(value: Any) -> Any:
    """A document from the network with every string in it on one line (a newline shown as
    `\\n`: logsetup.one_line), so that none printed on the operator's terminal can start a
    line of its own or forge one."""
    if isinstance(value, str):
        return one_line(value)
    if isinstance(value, dict):
        return {escaped(key): escaped(item) for key, item in value.items()}
    if isinstance(value, list):
        return [escaped(item) for item in value]
    return value


def admin_reply(url: str, request: str, code: int, content_type: str, body: bytes) -> dict:
    """The msgpack map a coordinator answered to an admin call; its refusal, or what else
    answered, as one line."""
    try:
        message = msgpack.unpackb(body)
    except Exception:
        message = None
    if not isinstance(message, dict):
        raise click.ClickException(strange(url, request, code, content_type, body))
    message = escaped(message)
    if code >= 400:
        raise click.ClickException(f"{code}: {message.get('message', '')}")
    return message
