"""Volunteers on the coordinator's machine talk to it through its local socket: the real
server, real sockets, the protocol client."""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from unittest import mock

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from coordinator.server import local
from coordinator.server.api import LOCAL_SOCKET, local_offer
from kernels import localsocket
from tests.factories import running
from volunteer.address import is_loopback_url
from volunteer.client import CoordinatorClient

pytestmark = pytest.mark.skipif(not localsocket.supported(), reason="abstract sockets: Linux")


async def test_a_client_on_this_machine_moves_to_the_local_socket(tmp_path, caplog):
    async with running(tmp_path) as (co, _queue, url), CoordinatorClient(url) as client:
        await client.register("here", threads=2)
        with caplog.at_level(logging.INFO):
            answer = await client.request_work("w1", capacity=0)  # over loopback TCP
            assert localsocket.is_name(answer["local_socket"])
            assert client.local == answer["local_socket"]
            # The next calls go through it, and the coordinator counts the host as local.
            again = await client.request_work("w2", capacity=0)
            assert "local_socket" not in again  # offered only over TCP
            await CoordinatorClient(url, session=client.session).register("its neighbour")
        said = [r.getMessage() for r in caplog.records]
        assert f"talking to it through @{client.local}" in "\n".join(said)
        assert any("'its neighbour' from the local socket" in line for line in said), said
        assert co.neighbours.threads == 2


async def test_a_local_socket_that_is_gone_sends_the_client_back_to_tcp_for_good(tmp_path, caplog):
    async with running(tmp_path) as (_co, _queue, url), CoordinatorClient(url) as client:
        await client.register("here")
        gone = localsocket.new_name()  # as a coordinator that has stopped had offered
        client.offered_local_socket(gone)
        assert client.local == gone
        with caplog.at_level(logging.INFO, logger="volunteer.client"):
            # The call could not be sent there: it goes over TCP at once, and succeeds; its
            # answer offers the live coordinator's own socket.
            answer = await client.request_work("w1", capacity=0)
            assert client.local == answer["local_socket"] != gone
            await client.request_work("w2", capacity=0)
        said = [r.getMessage() for r in caplog.records if "does not answer" in r.getMessage()]
        assert len(said) == 1 and f"@{gone}" in said[0] and "back to TCP" in said[0]


@pytest.mark.parametrize(
    "url, name",
    [
        ("http://203.0.113.9:8470", localsocket.new_name()),  # another machine
        ("http://127.0.0.1:8470", "tilehive-../../etc"),  # not a name a coordinator draws
        ("http://127.0.0.1:8470", 7),
        ("http://127.0.0.1:8080/tilehive", localsocket.new_name()),  # a proxy's sub-path
    ],
)
async def test_a_client_ignores_an_offer_it_cannot_trust(url, name):
    async with CoordinatorClient(url) as client:
        client.offered_local_socket(name)
        assert client.local is None


async def test_a_client_on_a_shared_session_stays_on_it():
    # The emulator's thousands of hosts share one session and its connection pool.
    async with CoordinatorClient("http://127.0.0.1:8470") as owner:
        client = CoordinatorClient(owner.url, session=owner.session)
        client.offered_local_socket(localsocket.new_name())
        assert client.local is None and client.session is owner.session


def request_from(peer: object, family: socket.AddressFamily) -> web.Request:
    sock = mock.Mock(family=family)
    extra = {"peername": peer, "socket": sock}
    transport = mock.Mock()
    transport.get_extra_info = lambda key, default=None: extra.get(key, default)
    app = web.Application()
    app[LOCAL_SOCKET] = "tilehive-" + "0" * 32
    return make_mocked_request("POST", "/v1/work", app=app, transport=transport)


def test_the_coordinator_offers_its_local_socket_only_to_loopback_tcp_peers():
    assert local_offer(request_from(("127.0.0.1", 5000), socket.AF_INET))
    assert local_offer(request_from(("::1", 5000, 0, 0), socket.AF_INET6))
    assert not local_offer(request_from(("203.0.113.9", 5000), socket.AF_INET))
    assert not local_offer(request_from("", socket.AF_UNIX))  # already through it
    request = request_from("", socket.AF_UNIX)
    assert local.peer(request) == local.PEER


def test_the_local_sockets_connections_get_a_send_buffer_a_piece_fits_in():
    listener, name = local.listen(backlog=4)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.setblocking(True)
        client.connect(localsocket.address(name))
        connection, _ = listener.accept()
        # Linux doubles what it is given, up to twice what the system allows a process.
        allowed = int(Path("/proc/sys/net/core/wmem_max").read_text())
        want = 2 * min(localsocket.BUFFER_BYTES, allowed)
        assert connection.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == want
        connection.close()
    finally:
        client.close()
        listener.close()


def test_loopback_urls():
    assert is_loopback_url("http://127.0.0.1:8470")
    assert is_loopback_url("http://localhost:8470")
    assert is_loopback_url("http://[::1]:8470")
    assert not is_loopback_url("http://203.0.113.9:8470")
    assert not is_loopback_url("https://example.org")
