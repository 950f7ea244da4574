"""Which URLs name a coordinator (volunteer/address.py, check_url): refused in one line."""

from __future__ import annotations

import re

import pytest

from volunteer.address import check_url


@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("http://127.0.0.1:8470/v1/status", "http://127.0.0.1:8470"),
        ("http://v1host:8470/v1/work/", "http://v1host:8470"),  # not the first "v1" in the URL
        ("https://v1.example.org/api/v1/blobs/ab", "https://v1.example.org/api"),
        ("http://h:1/v10/x/v1", "http://h:1/v10/x"),
        ("http://[::1]:8470/v1/admin/pause", "http://[::1]:8470"),
    ],
)
def test_a_path_of_the_api_is_refused_naming_the_base_url_to_give(url, base):
    with pytest.raises(ValueError, match=f"give its base URL, {re.escape(base)}$"):
        check_url(url)


@pytest.mark.parametrize(
    "url", ["https://gw/v1/tilehive", "http://h:1/apiv1/", "http://h:1/v10", "http://[::1]:8470/"]
)
def test_a_prefix_a_proxy_serves_the_coordinator_under_is_kept(url):
    assert check_url(url) == url.rstrip("/")


def test_a_url_is_taken_without_the_spaces_around_it_and_refused_with_one_inside():
    assert check_url("  http://127.0.0.1:8470/\n") == "http://127.0.0.1:8470"
    assert check_url("http://[::1]:8470/a%20b") == "http://[::1]:8470/a%20b"
    # the API's paths go after the URL: a query there would swallow them
    with pytest.raises(ValueError, match="has a query or a fragment"):
        check_url("http://[::1]:8470/a%20b?x=1")
    for bad in ("http://127.0.0.1:8470/a b", "http://x:1/\nY=1", "http://x:1/\\", "http://x\t:1"):
        with pytest.raises(ValueError, match="a space, a backslash or a control character"):
            check_url(bad)
