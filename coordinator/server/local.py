"""The API on a Unix socket, for volunteers on the coordinator's own machine.

Over loopback TCP every byte of a panel or a tile is copied through the TCP stack on both
ends, and a step of the larger project moves about 1.3 GB: the loopback socket was 17% of
the coordinator's busy samples (`py-spy --native`: sending 11%, receiving 6%). A Unix
socket moves the same bytes for about 0.24 CPU-seconds a gigabyte, both ends together,
against 0.31-0.35 (docs/performance-history.md, the twenty-ninth round), when its send
buffer is as large as the pieces a body is written in: at the kernel's default (208 KB)
each 1 MB piece is sent in parts, and tiny-gpt's step took 20% longer than over TCP.

The socket is in Linux's abstract namespace, under a name drawn afresh at every start:
- it is reachable exactly where 127.0.0.1 is (abstract names belong to the network
  namespace, as the loopback interface does), so it opens nothing TCP did not;
- no file is left behind by a coordinator killed with SIGKILL, and no path can be too long;
- a stale name fails to connect, and the volunteer goes back to TCP (volunteer/client.py).
The coordinator names it in its answers to requests that came over loopback TCP
(`local_socket`, docs/protocol.md); a volunteer whose URL is a loopback address moves to it.
"""

from __future__ import annotations

import logging
import socket

from aiohttp import web

from kernels import localsocket

log = logging.getLogger(__name__)

PEER = "the local socket"  # what a request over it has for an address, in logs


class _Listener(socket.socket):
    """A listening socket whose accepted connections get localsocket.BUFFER_BYTES of send
    buffer (Linux gives an accepted Unix socket the system's default, not its listener's)."""

    def accept(self) -> tuple[socket.socket, object]:
        connection, address = super().accept()
        localsocket.widen(connection)
        return connection, address


def listen(backlog: int) -> tuple[socket.socket, str] | None:
    """A listening socket under a fresh name, and the name; None (and why, in the log) where
    there can be none."""
    if not localsocket.supported():
        return None
    name = localsocket.new_name()
    sock = _Listener(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(localsocket.address(name))
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        log.warning("no local socket for volunteers on this machine (%s): they use TCP", exc)
        return None
    return sock, name


async def start(runner: web.AppRunner, sock: socket.socket, name: str) -> None:
    """Serve the runner's application on `sock` too. Should that fail, volunteers offered
    the name find nothing there and stay on TCP."""
    try:
        await web.SockSite(runner, sock).start()
    except OSError as exc:
        sock.close()
        log.warning("no local socket for volunteers on this machine (%s): they use TCP", exc)
        return
    log.info("volunteers on this machine connect through the local socket @%s", name)


def is_local(request: web.Request) -> bool:
    """Whether the request came over the local socket."""
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    return sock is not None and sock.family == getattr(socket, "AF_UNIX", None)


def peer(request: web.Request) -> str | None:
    """The request's peer address: PEER for the local socket, whose peers have none."""
    return PEER if is_local(request) else request.remote
