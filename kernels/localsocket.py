"""The local socket's shared facts: how a coordinator's Unix socket is named and addressed,
and the send buffer both ends give a connection (coordinator/server/local.py says why)."""

from __future__ import annotations

import contextlib
import re
import secrets
import socket
import sys

# A body moves in pieces of 1 MB (coordinator/server/api.py, volunteer/client.py); at the
# kernel's default send buffer for a Unix socket (208 KB) each piece goes in parts.
BUFFER_BYTES = 4 << 20
NAME = re.compile(r"tilehive-[0-9a-f]{32}")  # a name as a coordinator draws it


def supported() -> bool:
    """Abstract Unix socket names are Linux's."""
    return sys.platform == "linux" and hasattr(socket, "AF_UNIX")


def new_name() -> str:
    """A fresh name: a coordinator draws one at every start, so that a name offered by one
    that has since stopped reaches nothing."""
    return f"tilehive-{secrets.token_hex(16)}"


def is_name(value: object) -> bool:
    """Whether `value` (from the network) is a local socket's name."""
    return isinstance(value, str) and NAME.fullmatch(value) is not None


def address(name: str) -> str:
    """The socket address of a name in the abstract namespace (a NUL byte first)."""
    return "\0" + name


def widen(connection: socket.socket) -> None:
    """Give a connected Unix socket BUFFER_BYTES of send buffer (as much as the system
    allows a process, if that is less; where it refuses, the default only costs speed)."""
    with contextlib.suppress(OSError):
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER_BYTES)
