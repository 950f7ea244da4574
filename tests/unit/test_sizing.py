"""Sized work: the tile a product is cut into follows the crowd, and never changes a bit."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import types

import msgpack
import numpy as np
import pytest

import kernels
from coordinator.engine.config import CoordinatorConfig
from coordinator.engine.coordinator import Coordinator
from coordinator.engine.crowd import FIRST_OVERHEAD, CrowdWatch
from coordinator.engine.uplinks import Uplinks
from coordinator.rules.sizing import Crowd, SizingConfig, choose_tile, tile_memory
from coordinator.state.memory import MemoryStore
from coordinator.work.protocol import RegisterRequest, ReportRequest, ResultReport, WorkRequest
from coordinator.work.records import Host, Policy
from tests.factories import bits, operands

CONFIG = SizingConfig()


def test_one_fast_host_gets_the_whole_product_in_one_tile():
    crowd = Crowd(hosts=1, gflops=50.0, overhead=0.01)
    assert choose_tile(512, 384, 128, 128, crowd, 1, CONFIG) == 512


def test_many_slow_hosts_over_a_slow_network_share_a_large_product():
    # 64 tiles of 256 for 100 phones: each gets about one; one tile would take minutes.
    crowd = Crowd(hosts=100, gflops=1.0, overhead=0.1)
    assert choose_tile(2048, 2048, 2048, 256, crowd, 1, CONFIG) == 256


def test_hosts_on_a_slow_uplink_share_a_small_product_that_one_would_take_whole():
    # tiny-gpt's 512x384 product, 30 ms away, 20 Mbit/s up: one host takes it whole (its
    # panels once); ten split it, each uploading a part.
    slow = 8 / 20e6
    one = Crowd(hosts=1, gflops=25.0, overhead=0.03, seconds_per_byte=slow)
    ten = Crowd(hosts=10, gflops=25.0, overhead=0.03, seconds_per_byte=slow)
    assert choose_tile(512, 384, 128, 128, one, 1, CONFIG) == 512
    assert choose_tile(512, 384, 128, 128, ten, 1, CONFIG) == 128


def test_the_crowd_watch_learns_a_fixed_and_a_per_byte_cost():
    watch = CrowdWatch(ledger=None)
    assert watch.cost() == (FIRST_OVERHEAD, 0.0)
    for nbytes in [100_000, 1_000_000, 400_000, 2_000_000] * 20:
        watch.observe(0.5 + 0.03 + nbytes * 1e-7, 0.5, nbytes)  # 0.5 s computing
    overhead, per_byte = watch.cost()
    assert abs(overhead - 0.03) < 1e-3 and abs(per_byte - 1e-7) < 1e-9
    same = CrowdWatch(ledger=None)
    for _ in range(10):
        same.observe(0.05, 0.0, 1000)  # one size only: no slope to tell, the mean
    assert same.cost() == (0.05, 0.0)


def test_a_run_of_one_size_keeps_what_the_other_sizes_told():
    # Tiles of one size, their costs up and down with the hosts' queues, after a few of
    # other sizes: the cost a byte stays, so a large tile is not taken for free.
    watch = CrowdWatch(ledger=None)
    for nbytes in [80_000, 280_000, 1_600_000, 5_800_000]:
        watch.observe(0.04 + nbytes * 8e-8, 0.0, nbytes)
    for i in range(500):
        nbytes = 80_000 + 1_000 * (i % 7)
        watch.observe(0.04 + nbytes * 8e-8 + (0.03 if i % 3 else 0.0), 0.0, nbytes)
    _, per_byte = watch.cost()
    assert 6e-8 < per_byte < 1e-7


def test_a_size_not_seen_lately_no_longer_outweighs_those_seen_since():
    # Small tiles that once waited in crowded queues (0.3 s) and have not been cut since:
    # the large tiles seen lately decide the line, the old size only once.
    watch = CrowdWatch(ledger=None)
    for _ in range(20):
        watch.observe(0.3, 0.0, 20_000, now=0.0)
    for t in range(20):
        for nbytes in (200_000, 400_000):
            watch.observe(0.04 + nbytes * 8e-8, 0.0, nbytes, now=100.0 + t)
    overhead, per_byte = watch.cost(now=120.0)
    assert per_byte > 3e-8 and overhead < 0.1
    stale, _ = watch.cost(now=0.0)  # all of them fresh: the old queues weigh as much
    assert stale > overhead


def test_the_crowd_is_fitted_again_once_a_second_or_at_once_for_a_new_size():
    # Every product asks for the crowd; its cost line moves little between two.
    watch = CrowdWatch(ledger=types.SimpleNamespace(hosts={}))
    watch.observe(0.05, 0.0, 1_000, now=0.0)
    first = watch.crowd(0.0)
    watch.observe(0.15, 0.0, 1_000, now=0.5)
    assert watch.crowd(0.5) is first
    assert watch.crowd(1.0).overhead > first.overhead  # a second on, the line moved
    watch.observe(0.5, 0.0, 1_000_000, now=1.2)  # a size never seen: the slope it tells
    assert watch.crowd(1.2).seconds_per_byte > 0


def test_a_hundred_laptops_get_tiles_smaller_than_the_projects():
    # tiny-gpt's QKV product as the emulated laptops' costs were measured (round trip and
    # host 40 ms, 0.08 s a MB): 48 tiles of 64 for 100 of them, 128 or more for ten.
    laptops = {"gflops": 25.0, "overhead": 0.04, "seconds_per_byte": 8e-8}
    assert choose_tile(512, 384, 128, 128, Crowd(hosts=100, **laptops), 1, CONFIG) == 64
    assert choose_tile(512, 384, 128, 128, Crowd(hosts=10, **laptops), 1, CONFIG) >= 128
    # Never below MIN_TILE, whatever the crowd.
    assert choose_tile(512, 384, 128, 16, Crowd(hosts=10_000, **laptops), 1, CONFIG) >= 16


def test_the_crowds_memory_caps_the_tile():
    small = tile_memory(256, 256, 4096)
    crowd = Crowd(hosts=1, gflops=50.0, overhead=0.01, memory_bytes=small)
    assert choose_tile(4096, 4096, 4096, 128, crowd, 1, CONFIG) == 256


def test_the_coordinators_own_work_per_result_keeps_tiles_from_being_tiny():
    # 10,000 hosts would each take a tile of 16, but 4,096 results cost the coordinator
    # more than the few tiles that keep it under the hosts' time.
    crowd = Crowd(hosts=10_000, gflops=10.0, overhead=0.0)
    assert choose_tile(1024, 1024, 64, 16, crowd, 1, CONFIG) > 16


def test_the_smallest_tile_when_none_fits():
    """Half the project's tile, the least any host must hold or send (the scheduler gives
    a tile too large for a host to others, or, no one else able to, to an idle one)."""
    crowd = Crowd(hosts=1, gflops=50.0, overhead=0.01, memory_bytes=1)
    assert choose_tile(1024, 1024, 1024, 64, crowd, 2, CONFIG) == 32
    slow = Crowd(hosts=1, gflops=50.0, overhead=0.01, upload_per_byte=1.0)
    capped = dataclasses.replace(CONFIG, max_upload_seconds=1.0)
    assert choose_tile(2048, 2048, 512, 256, slow, 1, capped) == 128


def test_the_typical_uplink_caps_the_tile():
    """One fast host takes a 2048 x 2048 product whole on loopback; at 100 KB/s up, its
    16 MB would take minutes to send, and tiles of 256 (2.6 s each) are the largest whose
    upload fits the cap."""
    fast = Crowd(hosts=1, gflops=50.0, overhead=0.01)
    slow = dataclasses.replace(fast, upload_per_byte=1e-5)
    capped = dataclasses.replace(CONFIG, max_upload_seconds=6.875)
    assert choose_tile(2048, 2048, 512, 256, fast, 1, capped) == 2048
    assert choose_tile(2048, 2048, 512, 256, slow, 1, capped) == 256
    # 10 KB/s: the project's tile would take 26 s; half of it, 6.6 s, fits.
    slower = dataclasses.replace(slow, upload_per_byte=1e-4)
    assert choose_tile(2048, 2048, 512, 256, slower, 1, capped) == 128


def test_a_crowd_on_slow_uplinks_shares_a_product_it_would_otherwise_take_in_few_tiles():
    """Ten hosts, compute and round trips cheap: over loopback a product goes out in a few
    large tiles; at 100 KB/s up each, its upload is what takes the time, and every host
    gets a part of it to send."""
    hosts = Crowd(hosts=10, gflops=50.0, overhead=0.01)
    uplinks = dataclasses.replace(hosts, upload_per_byte=1e-5)
    few = choose_tile(2048, 2048, 512, 256, hosts, 1, CONFIG)
    shared = choose_tile(2048, 2048, 512, 256, uplinks, 1, CONFIG)
    assert (2048 // few) ** 2 < 10 <= (2048 // shared) ** 2


def test_the_crowd_watch_takes_each_hosts_upload_out_of_what_a_tile_costs():
    """A slow uplink's minute is its own (engine/uplinks.py), not a cost every tile pays:
    left in, one size seen, it read as a minute of overhead a tile, and a product went out
    as one tile (the fewest overheads)."""
    watch = CrowdWatch(ledger=None)
    for _ in range(10):
        watch.observe(60.5 + 0.03, 0.5, 4_000_000, upload=60.0)
    assert watch.cost() == (pytest.approx(0.03), 0.0)


def test_one_slow_host_does_not_set_the_crowds_uplink():
    """A slow host (or one that makes itself look slow) does not shrink every host's tiles:
    the typical host's uplink sizes them (of two, the faster); tiles too large for the slow
    one go to others."""
    hosts = {i: Host(i, f"h{i}", f"t{i}", 0.0, last_contact=100.0, gflops=10.0) for i in (1, 2, 3)}
    uplinks = Uplinks()
    uplinks.timed(1, 1_000_000, 10.0, time.time())  # 100 KB/s
    uplinks.timed(2, 1_000_000, 1.0, time.time())  # 1 MB/s; host 3 not measured

    def crowd_of(*ids: int) -> Crowd:
        ledger = types.SimpleNamespace(hosts={i: hosts[i] for i in ids})
        return CrowdWatch(ledger, uplinks).crowd(100.0)

    assert crowd_of(1, 2, 3).upload_per_byte == pytest.approx(1e-6)
    assert crowd_of(1, 2).upload_per_byte == pytest.approx(1e-6)
    assert crowd_of(1).upload_per_byte == pytest.approx(1e-5)


async def test_a_product_cut_for_the_crowd_has_the_kernels_bits(tmp_path, rng):
    """One host: the product goes out as one tile instead of the 12 of the project's tile,
    and its bits are the kernel's."""
    config = CoordinatorConfig(
        directory=tmp_path, tile=16, tile_sizing=True, policy=Policy.FREIVALDS, long_poll=0.05
    )
    co = Coordinator(config, MemoryStore())
    await co.start()
    try:
        host, _ = await co.hosts.register(RegisterRequest("h", 10.0, 1, 512), time.time())
        a, b = operands(rng, 64, 48, 40, True, False)
        product = asyncio.create_task(co.products.matmul(a, b, trans_a=True, label="x"))
        request = WorkRequest("r1", 8, (), (), None, True)
        reply = msgpack.unpackb((await co.requests.request_work(host, request, time.time())).body)
        (assignment,) = reply["assignments"]
        assert (assignment["m"], assignment["n"]) == (64, 48)
        for panel in (assignment["a"], assignment["b"]):  # named by the operands' ids
            kernels.verify_blob(co.blobs.get(panel), panel)
        tile = kernels.gemm(
            co.blobs.get_array(assignment["a"]), co.blobs.get_array(assignment["b"]), trans_a=True
        )
        blob = kernels.encode_array(tile)
        entry = ResultReport(assignment["result_id"], kernels.blob_id(blob), blob, None, 0.001)
        await co.reports.report(host, ReportRequest((entry,)), time.time())
        result = await asyncio.wait_for(product, 30)
        np.testing.assert_array_equal(bits(result), bits(kernels.gemm(a, b, trans_a=True)))
    finally:
        await co.stop()
