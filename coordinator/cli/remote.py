"""The command line's calls to a running coordinator by URL: every failure is one line,
and a URL where something else answers is named as such."""

from __future__ import annotations

import http.client
import ssl
import urllib.error
import urllib.request
from typing import Any

import click
import msgpack

from volunteer.address import check_url, status_problem, strange
from volunteer.logsetup import one_line


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
    problem, summary = status_problem(url, *exchange(url, url + "/v1/status", timeout))
    if problem:
        raise click.ClickException(problem)
    return summary


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
