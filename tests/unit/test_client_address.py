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
