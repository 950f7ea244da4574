"""Volunteers on the coordinator's machine get the cores its model kernels leave them."""

from __future__ import annotations

import logging

import pytest

from coordinator.engine.neighbours import NEIGHBOUR_TTL, Neighbours, is_loopback, model_threads
from coordinator.work.records import Host
from kernels import nn


@pytest.fixture
def four_cpus(monkeypatch):
    monkeypatch.delenv(nn.THREADS_ENV, raising=False)
    monkeypatch.setattr(nn, "cpu_count", lambda: 4)
    yield
    nn.limit_threads(None)


def host(host_id: int, threads: int = 1) -> Host:
    return Host(host_id, f"h{host_id}", "x" * 64, 0.0, 0.0, threads=threads)


@pytest.mark.parametrize(
    ("address", "local"),
    [
        ("127.0.0.1", True),
        ("127.0.3.4", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("192.168.1.20", False),
        ("2001:db8::1", False),
        ("::ffff:10.0.0.1", False),
        (None, False),
        ("", False),
        ("unix-socket", False),
    ],
)
def test_a_loopback_peer_is_on_this_machine(address, local):
    assert is_loopback(address) is local


def test_the_model_kernels_take_the_cores_neighbours_leave_and_one_at_least():
    assert model_threads(4, 0) is None  # nobody here: no cap
    assert model_threads(4, 1) == 3
    assert model_threads(2, 1) == 1
    assert model_threads(2, 3) == 1  # oversubscribed: the training still needs a thread


def test_a_volunteer_on_this_machine_caps_the_model_kernels_until_it_goes_quiet(four_cpus, caplog):
    neighbours = Neighbours(cpus=4)
    assert nn.default_threads() == 4
    with caplog.at_level(logging.INFO, logger="coordinator.engine.neighbours"):
        neighbours.saw(host(1, threads=2), True, now=100.0)
        assert nn.default_threads() == 2
        neighbours.saw(host(1, threads=2), True, now=101.0)  # the same host: no change
        neighbours.saw(host(2), False, now=101.0)  # far away: its cores are its own
        assert nn.default_threads() == 2
        neighbours.saw(host(3), True, now=102.0)
        assert nn.default_threads() == 1
        neighbours.update(now=101.0 + NEIGHBOUR_TTL + 0.5)  # host 1 silent, host 3 not yet
        assert nn.default_threads() == 3
        neighbours.update(now=102.0 + NEIGHBOUR_TTL + 0.5)
        assert nn.default_threads() == 4 and neighbours.cap is None
    said = [r.getMessage() for r in caplog.records]
    # Once a change, and saying what the kernels use now.
    assert len(said) == 4, said
    assert "host 1" in said[0] and "2 thread(s) of its 4 CPUs" in said[0]
    assert said[0].endswith("use 2 thread(s)")
    assert (
        said[-1] == "no volunteer computes on this machine now: the model's kernels use 4 thread(s)"
    )


def test_closing_lifts_the_cap(four_cpus):
    neighbours = Neighbours(cpus=4)
    neighbours.saw(host(1, threads=4), True, now=0.0)
    assert nn.default_threads() == 1
    neighbours.close()
    assert nn.default_threads() == 4


def test_the_operators_thread_setting_is_never_capped(four_cpus, monkeypatch):
    monkeypatch.setenv(nn.THREADS_ENV, "3")
    Neighbours(cpus=4).saw(host(1, threads=4), True, now=0.0)
    assert nn.default_threads() == 3


def test_only_the_neighbours_silent_for_the_ttl_are_forgotten(four_cpus):
    """Each request moves its host to the back of the line: the one heard from again stays
    when one heard from before it, and silent since, is forgotten."""
    neighbours = Neighbours(cpus=4)
    neighbours.saw(host(1, threads=1), True, now=0.0)
    neighbours.saw(host(2, threads=1), True, now=1.0)
    neighbours.saw(host(1, threads=1), True, now=2.0)
    neighbours.update(now=1.0 + NEIGHBOUR_TTL + 0.5)
    assert neighbours.threads == 1 and neighbours.cap == 3
    neighbours.update(now=2.0 + NEIGHBOUR_TTL + 0.5)
    assert neighbours.threads == 0 and neighbours.cap is None
