"""A volunteer's standing with its coordinator: identity, calls, and what to do when one fails.

The outer loop of every volunteer (volunteer/loop.py adds the work it does in each cycle):
register when it has no token, and survive the coordinator's failures the way BOINC's
client does: back off with jitter while it is unreachable or busy, register again when it
no longer knows us, and stop asking for good when it refuses this host (403). A URL where
something else answers (another web server, TLS on the wrong side) ends the session too, if
no coordinator has answered there yet: retrying it would never end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiohttp

from volunteer.address import NotACoordinator, stranger
from volunteer.backoff import Backoff
from volunteer.client import BAD_REPLY, NOT_TILEHIVE, CoordinatorClient, ServerRefused

log = logging.getLogger(__name__)

T = TypeVar("T")

# A call that failed on the way, not at the coordinator: try again after the backoff.
NETWORK = (aiohttp.ClientError, TimeoutError, OSError)
# What a session survives (ValueError: a reply that does not parse as the protocol says).
TRANSIENT = (*NETWORK, ValueError)


# A coordinator's word for a path it has no route for (aiohttp's reason, in the coordinator's
# {error, message} form); a 404 of its own, for an unknown result or blob, says which.
NO_ROUTE = "Not Found"


def no_route(exc: ServerRefused) -> bool:
    """Whether a coordinator's refusal says it has nothing at the path asked."""
    return exc.status == 404 and exc.message == NO_ROUTE


class Quarantined(Exception):
    """The coordinator refuses this host (403): its loop ends, as BOINC's client stops."""

    def __init__(self, refusal: ServerRefused) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


class ProjectFinished(Exception):
    """The coordinator says its project is finished: no more work will come, stop asking."""


class Stopping(Exception):
    """A call still on its way `stop_grace` seconds after a stop was cut off (`endpoint`)."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(f"the {endpoint} call in flight was cut off by a stop")
        self.endpoint = endpoint


# Seconds a stop waits, by default, for the calls in flight before cutting them off:
# longer than a long poll (the coordinator's long_poll, 2 s), far shorter than a large
# report over a slow uplink, which may take minutes (client.MIN_RATE) and is sent again,
# or given up, as the session ends (PullLoop.leave). The daemon waits its stop_timeout.
STOP_GRACE = 3.0


class CoordinatorSession:
    """Cycles of work through `client` until stopped; subclasses supply `_cycle` and
    `_identify`, and may put their own network under `_request`."""

    def __init__(
        self,
        client: CoordinatorClient,
        *,
        backoff: Backoff | None = None,
        logger: logging.Logger = log,
    ) -> None:
        self.client = client
        self.backoff = backoff or Backoff()  # while the coordinator fails us
        self.log = logger
        self.host_id: int | None = None
        self.state = "starting"
        self.note = ""  # what the volunteer is doing or waiting for
        self.heard = False  # a coordinator has answered at the URL, in its own words
        self.stop_grace = STOP_GRACE  # seconds a stop waits for a call on its way
        # Seconds a registration may take until a coordinator has answered at the URL
        # (None: the client's own timeout): an address that takes connections and says
        # nothing was minutes of silence.
        self.first_contact: float | None = None
        self._calls: set[asyncio.Task] = set()  # tasks with a call on its way
        self._cut: set[asyncio.Task] = set()  # those whose call a stop cut off

    async def _cycle(self, stop: asyncio.Event) -> None:
        """One round of work."""
        raise NotImplementedError

    async def _identify(self) -> None:
        """Get a token (`self.client.token`)."""
        raise NotImplementedError

    async def _request(self, endpoint: str, call: Callable[[], Awaitable[T]], up: int) -> T:
        """One call on the wire (`up`: the bytes it uploads): the real one by default."""
        return await call()

    def _forget(self) -> None:
        """The coordinator does not know our token: drop whatever keeps it."""

    def _failed(self, endpoint: str, exc: BaseException) -> None:
        """Something went wrong on the wire (`endpoint`: the call that failed)."""

    def _resting(self) -> None:
        """The session waits before it asks again: no work, paused, or the coordinator
        unreachable or refusing for now."""

    def _quarantined(self, endpoint: str, exc: ServerRefused) -> None:
        """The coordinator refuses this host for good; the session ends after this."""
        self._failed(endpoint, exc)
        self.state = "refused"
        self.note = exc.message
        # Refused at registration, a host is refused for its invite code, which it gives as
        # `--invite`: the coordinator's words name the protocol's field.
        invite = endpoint == "register" and exc.status == 403
        hint = " (give the project's invite code with --invite)" if invite else ""
        self.log.error("the coordinator refuses this host: %s%s", exc.message, hint)

    async def session(self, stop: asyncio.Event, until: float = math.inf) -> None:
        """Work until `stop` is set or the monotonic time `until`. Raises Quarantined, or
        ProjectFinished when the coordinator says there will be no more work, and
        NotACoordinator before a coordinator has answered."""
        cutter = asyncio.ensure_future(self._cut_off_on(stop))
        try:
            await self._cycles(stop, until)
        finally:
            cutter.cancel()

    async def _cut_off_on(self, stop: asyncio.Event) -> None:
        """After a stop, cut off the calls still on their way (the session's, or a work
        request it sent ahead), so that the session can end and leave."""
        await stop.wait()
        await asyncio.sleep(self.stop_grace)
        for task in self._calls - self._cut:
            self._cut.add(task)
            task.cancel()

    async def _cycles(self, stop: asyncio.Event, until: float) -> None:
        while not stop.is_set() and time.monotonic() < until:
            endpoint = "register"
            try:
                if self.client.token is None:
                    await self._identify()
                endpoint = "work"
                await self._cycle(stop)
            except Stopping as exc:
                self.log.info("stopping: %s", exc)
            except ProjectFinished as exc:
                self.state = "finished"
                self.note = "project finished"
                self.log.info("%s; stopping", exc)
                raise
            except ServerRefused as exc:
                if not self.heard and exc.code == NOT_TILEHIVE:
                    self._stranger(getattr(exc, "endpoint", endpoint), exc, exc.message)
                if not self.heard and no_route(exc):
                    # A coordinator, but none of its API under the URL's path: asking again
                    # would never end (a path of a proxy's that is not the coordinator's).
                    # Once the API has answered here, such a 404 is a proxy's passing
                    # mistake (a reload), retried as anything else is.
                    why = (
                        f"{self.client.url}: the coordinator has nothing at this path (404 Not "
                        "Found); give the URL it prints ('volunteers connect to ...')"
                    )
                    self._stranger(getattr(exc, "endpoint", endpoint), exc, why)
                await self._refused(getattr(exc, "endpoint", endpoint), exc, stop)
            except TRANSIENT as exc:
                if not self.heard and (why := await stranger(self.client.url, exc)):
                    self._stranger(getattr(exc, "endpoint", endpoint), exc, why)
                self._failed(getattr(exc, "endpoint", endpoint), exc)
                delay = self.backoff.next_delay()
                self.state = "offline"
                what = (
                    "a reply from the coordinator broke off or was malformed"
                    if isinstance(exc, (aiohttp.ClientPayloadError, ValueError))
                    else "cannot reach coordinator"
                )
                self.note = f"{what} ({failure(exc)}); retry in {delay:.1f}s"
                self.log.warning(self.note)
                self._resting()
                await wait(stop, delay)

    def _stranger(self, endpoint: str, exc: BaseException, why: str) -> None:
        """Something other than a coordinator answers at the URL: end the session."""
        self._failed(endpoint, exc)
        self.state = "refused"
        self.note = why
        raise NotACoordinator(why) from exc

    async def _call(self, endpoint: str, call: Callable[[], Awaitable[T]], *, up: int = 0) -> T:
        task = asyncio.current_task()
        assert task is not None
        self._calls.add(task)
        try:
            # Registration alone: a work request's answer may carry megabytes of operands
            # over a slow link, which the client's own timeout allows for by the byte.
            if self.heard or self.first_contact is None or endpoint != "register":
                reply = await self._request(endpoint, call, up)
            else:
                try:
                    async with asyncio.timeout(self.first_contact):
                        reply = await self._request(endpoint, call, up)
                except TimeoutError:
                    raise TimeoutError(f"no answer in {self.first_contact:.0f}s") from None
        except asyncio.CancelledError:
            # Cut off by a stop, and by nothing else: a cancel of its own (the session
            # being torn down) still counts, and goes on as a CancelledError.
            if task not in self._cut or task.uncancel() > 0:
                raise
            raise Stopping(endpoint) from None
        except ServerRefused as exc:
            exc.endpoint = endpoint  # the call that failed, wherever the error surfaces
            # A 404 for the path itself is a coordinator, but not proof that its API is at
            # this URL.
            said = exc.code not in (NOT_TILEHIVE, BAD_REPLY) and not no_route(exc)
            self.heard = self.heard or said
            raise
        except Exception as exc:
            exc.endpoint = endpoint
            raise
        finally:
            self._calls.discard(task)
            self._cut.discard(task)
        self.heard = True
        return reply

    async def _refused(self, endpoint: str, exc: ServerRefused, stop: asyncio.Event) -> None:
        # A registration found malformed (a name the coordinator does not take) is refused
        # the same way every time: asking again would never end. Only the coordinator's
        # own word ends the session or drops the token: a proxy's 403 or 401 page (once a
        # coordinator has answered at the URL) is retried like its 502.
        said = exc.code not in (NOT_TILEHIVE, BAD_REPLY)
        if said and (exc.status == 403 or (exc.status == 400 and endpoint == "register")):
            self._quarantined(endpoint, exc)
            raise Quarantined(exc) from exc
        self._failed(endpoint, exc)
        if said and exc.status == 401:
            self.log.warning(
                "the coordinator does not know our token (%s); registering again", exc.message
            )
            self._forget()
            self.client.token = None
            return
        delay = self.backoff.next_delay(at_least=exc.retry_after)
        self.note = f"coordinator said {exc.status} {exc.code}: {exc.message}"
        if not said:  # the words of something in between (a proxy), not the coordinator's
            self.note = f"a reply not in the coordinator's words ({exc.status}): {exc.message}"
        self.log.warning("%s; retry in %.1fs", self.note, delay)
        self._resting()
        await wait(stop, delay)


def failure(exc: BaseException) -> str:
    """A failed call in words: which address and what the system said, where it said
    something (a name not found, a connection refused), not the exception's class alone."""
    kind = type(exc).__name__
    if isinstance(exc, aiohttp.ClientConnectorError):
        error = exc.os_error
        if isinstance(error, ssl.SSLError):  # its errno (1) is no system error's
            said = error.reason or str(error)
        elif error.errno is not None and error.errno > 0:
            # asyncio words a refused connection "Connect call failed (address)"; its errno
            # says it plainly (a name's lookup has negative codes of its own, and words).
            said = os.strerror(error.errno)
        else:
            said = error.strerror or str(error)
        host = f"[{exc.host}]" if ":" in exc.host else exc.host
        return f"{kind}: {host}:{exc.port}: {said}" if said else kind
    said = str(exc)
    return f"{kind}: {said}" if said and len(said) <= 200 else kind


async def wait(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep up to `seconds`, or less if `stop` is set; True if it is."""
    if seconds <= 0:
        return stop.is_set()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    return stop.is_set()
