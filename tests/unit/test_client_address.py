"""Who a request came from behind reverse proxies (rules/access.py)."""

from __future__ import annotations

import pytest

from coordinator.rules.access import client_address, networks

PROXIES = networks("127.0.0.1, 10.0.0.0/8, ::1")


@pytest.mark.parametrize(
    ("peer", "forwarded", "client"),
    [
        ("127.0.0.1", "203.0.113.5", "203.0.113.5"),  # one proxy
        ("127.0.0.1", "203.0.113.5, 10.1.2.3", "203.0.113.5"),  # two of ours
        ("127.0.0.1", "192.0.2.1, 203.0.113.5", "203.0.113.5"),  # the client wrote the left
        ("::1", "2001:db8::7", "2001:db8::7"),
        ("198.51.100.7", "203.0.113.5", "198.51.100.7"),  # not a proxy: its header is words
        ("127.0.0.1", None, "127.0.0.1"),  # a proxy's own request
        ("127.0.0.1", "10.9.9.9", "127.0.0.1"),  # proxies all the way
        ("127.0.0.1", "not-an-address", "127.0.0.1"),  # junk is no address
        (None, "203.0.113.5", "?"),
    ],
)
def test_the_client_is_the_last_address_no_trusted_proxy_owns(peer, forwarded, client):
    assert client_address(peer, forwarded, PROXIES) == client


def test_a_list_of_proxies_names_what_is_not_an_address():
    assert networks("") == () and len(networks(" 127.0.0.1 , 10.0.0.0/8,")) == 2
    with pytest.raises(ValueError, match=r"'proxy\.example' is not an address or a network"):
        networks("127.0.0.1, proxy.example")


async def _failure_of(url: str) -> str:
    import aiohttp

    from volunteer.session import failure

    async with aiohttp.ClientSession() as session:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)):
                pass
        except aiohttp.ClientConnectorError as exc:
            return failure(exc)
    raise AssertionError(f"{url} answered")


async def test_a_failed_connection_says_where_and_why():
    """Not only the exception's class: the address, and the system's words (a refusal), or
    TLS's own (its errno, 1, is no system error: it read "Operation not permitted")."""
    import socket
    import threading

    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    said = await _failure_of(f"http://127.0.0.1:{port}/")
    assert said == f"ClientConnectorError: 127.0.0.1:{port}: Connection refused"
    with socket.create_server(("127.0.0.1", 0)) as plain:  # speaks no TLS
        port = plain.getsockname()[1]

        def answer() -> None:
            connection, _ = plain.accept()
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            connection.close()

        threading.Thread(target=answer, daemon=True).start()
        said = await _failure_of(f"https://127.0.0.1:{port}/")
    assert said.startswith("ClientConnector") and f"127.0.0.1:{port}: " in said
    assert "Operation not permitted" not in said
    if socket.has_ipv6:
        with socket.create_server(("::1", 0), family=socket.AF_INET6) as closed6:
            port = closed6.getsockname()[1]
        said = await _failure_of(f"http://[::1]:{port}/")
        assert f"[::1]:{port}: Connection refused" in said
