"""The command line's calls to a running coordinator by URL: every failure is one line,
and a URL where something else answers is named as such."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from typing import Any

import click
import msgpack

from volunteer.address import answer, check_url, not_tilehive

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


def status(url: str, timeout: float = 10) -> dict[str, Any]:
    """GET URL/v1/status: the coordinator's summary."""
    url = url_of(url)
    try:
        with urllib.request.urlopen(url + "/v1/status", timeout=timeout) as reply:
            code, content_type, body = reply.status, reply.headers.get_content_type(), reply.read()
    except urllib.error.HTTPError as exc:
        code, content_type, body = exc.code, exc.headers.get_content_type(), exc.read()
    except OSError as exc:
        raise unreachable(url, exc) from None
    try:
        summary = json.loads(body)
    except ValueError:
        summary = None
    if code != 200 or not isinstance(summary, dict) or "workunits" not in summary:
        raise click.ClickException(
            strange(url, "GET /v1/status", code, content_type, body)
            + ("" if code != 200 or summary is None else ", not a tilehive status")
        )
    return summary


def admin_reply(url: str, request: str, code: int, content_type: str, body: bytes) -> dict:
    """The msgpack map a coordinator answered to an admin call; its refusal, or what else
    answered, as one line."""
    try:
        message = msgpack.unpackb(body)
    except Exception:
        message = None
    if not isinstance(message, dict):
        raise click.ClickException(strange(url, request, code, content_type, body))
    if code >= 400:
        raise click.ClickException(f"{code}: {message.get('message', '')}")
    return message
