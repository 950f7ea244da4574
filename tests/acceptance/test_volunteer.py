"""The volunteer daemon end to end: real `tilehive volunteer` processes, a real coordinator."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

import kernels
from tests.factories import bits, operands
from tests.procs import (
    ENV,
    ROOT,
    committed,
    free_port,
    save_operands,
    start_job,
    start_volunteer,
    stop,
    tilehive,
    url_of,
    volunteer_status,
)
from tests.volunteers import wait_until
from volunteer.cli import alive
from volunteer.idle import OwnerWatch
from volunteer.state import StateDir


@pytest.fixture
def job(tmp_path, rng):
    """Start a coordinator process computing products; yields a starter, kills leftovers."""
    started = []

    async def start(shapes, *options, port=None, project="project"):
        products = []
        for m, n, k, ta, tb in shapes:
            products.append((*operands(rng, m, n, k, ta, tb), ta, tb))
        npz, output = tmp_path / "operands.npz", tmp_path / "out.npz"
        save_operands(npz, products)
        port = port or free_port()
        process = start_job(
            tmp_path / project, npz, output, port, tmp_path / "coordinator.log", *options
        )
        started.append(process)
        url = await url_of(process)
        assert url, (tmp_path / "coordinator.log").read_text()
        return process, url, products, output

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait()


def expect_products(output, products) -> None:
    results = np.load(output)
    for i, (a, b, ta, tb) in enumerate(products):
        assert np.array_equal(
            bits(results[f"c{i}"]), bits(kernels.gemm(a, b, trans_a=ta, trans_b=tb))
        )


async def test_daemon_start_status_second_start_and_stop(tmp_path, job):
    process, url, products, output = await job(
        [(96, 64, 32, False, False)], "--tile", "32", "--policy", "freivalds"
    )
    state = tmp_path / "vol"
    started = tilehive(
        "volunteer", "start", url, "--daemon", "--state-dir", str(state), "--threads", "1"
    )
    assert started.returncode == 0, started.stderr
    pid = int(re.search(r"pid (\d+)", started.stdout).group(1))
    try:
        await _check_daemon(state, url, pid, process, products, output)
    finally:
        tilehive("volunteer", "stop", "--state-dir", str(state))


async def _check_daemon(state, url, pid, process, products, output) -> None:
    again = tilehive("volunteer", "start", url, "--daemon", "--state-dir", str(state))
    assert again.returncode != 0
    assert "already runs" in again.stderr and str(pid) in again.stderr
    code = await asyncio.to_thread(process.wait, 60)
    assert code == 0
    expect_products(output, products)
    await wait_until(lambda: volunteer_status(state).get("tiles") == 6)  # 3 x 2 tiles
    status = tilehive("volunteer", "status", "--state-dir", str(state))
    assert status.returncode == 0 and f"pid {pid}" in status.stdout
    assert "6 tiles" in status.stdout, status.stdout
    stopped = tilehive("volunteer", "stop", "--state-dir", str(state))
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    assert not alive(pid)
    assert not (state / "volunteer.pid").exists()
    assert (state / "identity.json").stat().st_mode & 0o777 == 0o600
    after = tilehive("volunteer", "status", "--state-dir", str(state))
    assert after.returncode == 3 and "not running" in after.stdout


async def test_a_volunteer_killed_with_sigkill_has_its_work_redone_by_another(
    tmp_path, job, reaper
):
    process, url, products, output = await job(
        [(512, 512, 64, False, True)],
        "--tile",
        "16",
        "--policy",
        "freivalds",
        "--delay-bound",
        "2",
    )
    project = tmp_path / "project"
    held = "SELECT wu_id FROM results WHERE host_id = 1 AND server_state = 'in_progress'"
    done = "SELECT COUNT(*) FROM results WHERE host_id = 1 AND outcome = 'success'"
    ended = "SELECT wu_id FROM results WHERE host_id = 1 AND outcome IN ('no_reply', 'aborted')"

    def lost() -> set[str]:
        """Work the first volunteer held and never returned (a late report is accepted)."""
        late = {w for (w, _) in valid_results(project, host=1)}
        return {w for (w,) in committed(project, ended)} - late

    first = reaper(start_volunteer(url, tmp_path / "first"))
    while True:
        await wait_until(lambda: committed(project, done)[0][0] >= 20 and committed(project, held))
        # Stopped, it returns nothing more: a deadline passing on work it holds proves that work
        # lost. The database lags the coordinator's memory, and a report already on its way may
        # have returned all it held; then nothing expires, so it goes on and is stopped again.
        first.send_signal(signal.SIGSTOP)
        await wait_until(lambda: lost() or not committed(project, held), 60)
        if lost():
            break
        first.send_signal(signal.SIGCONT)
    first.send_signal(signal.SIGKILL)
    first.wait()
    # Its status file still says what it last wrote; status says it ended without a word.
    said = tilehive("volunteer", "status", "--state-dir", str(tmp_path / "first"))
    assert said.returncode == 3 and "ended without a word while" in said.stdout, said
    as_json = tilehive("volunteer", "status", "--json", "--state-dir", str(tmp_path / "first"))
    assert json.loads(as_json.stdout)["state"] == "not_running"
    second = reaper(start_volunteer(url, tmp_path / "second"))
    try:
        assert await asyncio.to_thread(process.wait, 120) == 0
    finally:
        stop(second)
    expect_products(output, products)
    # Held work ends: it times out, or is aborted when a spare replica (tail acceleration)
    # finished it first; either way the second volunteer's result is the valid one.
    assert lost(), "the killed volunteer held work it never returned"
    assert lost() <= {w for (w, host) in valid_results(project) if host == 2}


def valid_results(project, host: int | None = None) -> list[tuple[str, int]]:
    rows = committed(project, "SELECT wu_id, host_id FROM results WHERE validate_state = 'valid'")
    return [(w, h) for (w, h) in rows if host is None or h == host]


async def test_a_corrupt_blob_is_rejected_and_reported_never_computed(tmp_path, job, reaper):
    # Served from disk (not from the coordinator's memory), where the test corrupts it.
    process, url, _, _ = await job(
        [(64, 64, 32, False, False)], "--tile", "32", "--blob-memory", "0"
    )
    count = "SELECT COUNT(*) FROM workunits"
    await wait_until(lambda: committed(tmp_path / "project", count)[0][0] == 4)
    blobs = sorted((tmp_path / "project" / "blobs").rglob("*"))
    panels = [p for p in blobs if p.is_file() and not p.name.startswith(".")]
    assert len(panels) == 4  # two row panels, two column panels
    bad = panels[0]
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))
    volunteer = reaper(start_volunteer(url, tmp_path / "vol"))
    project = tmp_path / "project"
    query = "SELECT error FROM results WHERE outcome = 'client_error'"
    try:
        await wait_until(lambda: committed(project, query), timeout=60)
    finally:
        assert stop(volunteer) == 0
    # Work still queued at the stop is abandoned and reported as such; the rest is the blob.
    errors = [e for (e,) in committed(project, query) if e != "volunteer stopped"]
    assert all("corrupt blob" in e and bad.name in e for e in errors), errors
    used_bad = committed(
        project,
        f"SELECT results.id FROM results JOIN workunits ON results.wu_id = workunits.id "
        f"WHERE results.outcome = 'success' AND '{bad.name}' IN (a_panel, b_panel)",
    )
    assert used_bad == []  # nothing was computed from the corrupt panel
    log = (tmp_path / "vol" / "out").read_text()
    assert "operand blob is corrupt" in log and "Traceback" not in log
    process.kill()


async def test_the_volunteer_backs_off_while_the_coordinator_is_down_then_resumes(
    tmp_path, job, reaper
):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    volunteer = reaper(start_volunteer(url, tmp_path / "vol"))
    try:
        await wait_until(
            lambda: (
                volunteer_status(tmp_path / "vol").get("state") == "offline"
                and volunteer_status(tmp_path / "vol").get("backoff", 0) > 0
            ),
            timeout=30,
        )
        process, _, products, output = await job(
            [(64, 96, 48, True, False)], "--tile", "32", "--policy", "freivalds", port=port
        )
        assert await asyncio.to_thread(process.wait, 60) == 0
        expect_products(output, products)
    finally:
        assert stop(volunteer) == 0
    assert volunteer_status(tmp_path / "vol")["tiles"] > 0


async def test_max_memory_too_small_is_refused_with_a_clear_message(tmp_path, job, reaper):
    tiny = tilehive(
        "volunteer",
        "start",
        "http://127.0.0.1:9",
        "--max-memory",
        "1",
        "--state-dir",
        str(tmp_path / "tiny"),
    )
    assert tiny.returncode == 1 and "Traceback" not in tiny.stderr
    assert tiny.stderr.count("is too small") == 1, tiny.stderr  # said once
    match = re.search(r"already uses (\d+) MB", tiny.stderr)
    assert match, tiny.stderr
    footprint = int(match.group(1))
    # Each 256 x 8192 panel is 8 MB: a work unit needs about 17 MB, more than we allow.
    process, url, _, _ = await job([(256, 256, 8192, False, False)], "--tile", "256")
    volunteer = reaper(start_volunteer(url, tmp_path / "vol", "--max-memory", str(footprint + 30)))
    try:
        await wait_until(
            lambda: "raise --max-memory" in volunteer_status(tmp_path / "vol").get("note", ""),
            timeout=30,
        )
        assert volunteer.poll() is None  # still running, politely idle
        status = volunteer_status(tmp_path / "vol")
        assert status["tiles"] == 0
        # One work unit, however many replicas; and the limit that would do, not only "raise".
        assert status["note"].startswith("1 work unit(s) need more memory"), status["note"]
        advised = re.search(r"start this volunteer with --max-memory (\d+)\)", status["note"])
        assert advised, status["note"]
    finally:
        assert stop(volunteer) == 0
    larger = reaper(start_volunteer(url, tmp_path / "v2", "--max-memory", advised.group(1)))
    try:
        await wait_until(lambda: volunteer_status(tmp_path / "v2").get("tiles", 0) > 0, timeout=60)
    finally:
        assert stop(larger) == 0
    process.kill()


async def test_a_url_whose_path_has_no_coordinator_behind_it_ends_the_volunteer(tmp_path, job):
    """A path before the API is kept (a proxy may serve the coordinator under one), so a
    wrong one reaches the coordinator, which answers 404: one line and exit 1, not retries
    for ever."""
    process, url, _, _ = await job([(16, 16, 16, False, False)])
    wrong = url.rstrip("/") + "/tilehive"
    result = await asyncio.to_thread(
        tilehive, "volunteer", "start", wrong, "--state-dir", str(tmp_path / "vol"), timeout=60
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert errors == [
        f"Error: {wrong}: the coordinator has nothing at this path (404 Not Found); give the "
        "URL it prints ('volunteers connect to ...')"
    ], result.stderr
    process.kill()


async def test_peak_memory_computing_512_tiles_stays_under_max_memory(tmp_path, job, reaper):
    process, url, products, output = await job(
        [(1024, 1024, 512, False, False)], "--tile", "512", "--policy", "freivalds"
    )
    volunteer = reaper(start_volunteer(url, tmp_path / "vol", "--max-memory", "200"))
    try:
        assert await asyncio.to_thread(process.wait, 120) == 0
    finally:
        assert stop(volunteer) == 0
    expect_products(output, products)
    status = volunteer_status(tmp_path / "vol")  # written last at exit
    assert status["tiles"] == 4
    assert status["peak_rss_mb"] < 200


async def test_a_volunteer_unknown_to_a_new_coordinator_registers_again(tmp_path, job, reaper):
    port = free_port()
    first, url, _, _ = await job(
        [(32, 32, 16, False, False)], "--tile", "16", "--policy", "freivalds", port=port
    )
    volunteer = reaper(start_volunteer(url, tmp_path / "vol"))
    try:
        assert await asyncio.to_thread(first.wait, 60) == 0
        old = json.loads((tmp_path / "vol" / "identity.json").read_text())
        # A new project at the same address has never heard of this host's token.
        second, _, products, output = await job(
            [(48, 32, 16, False, False)],
            "--tile",
            "16",
            "--policy",
            "freivalds",
            port=port,
            project="another",
        )
        assert await asyncio.to_thread(second.wait, 60) == 0
        expect_products(output, products)
    finally:
        assert stop(volunteer) == 0
    new = json.loads((tmp_path / "vol" / "identity.json").read_text())
    assert new["token"] != old["token"]
    assert "registering again" in (tmp_path / "vol" / "out").read_text()


def test_a_volunteer_asks_for_work_when_its_queue_is_down_to_half():
    from volunteer.policy import time_to_ask

    assert not time_to_ask(queued=5, capacity=3)  # wants 8, holds 5: not yet
    assert time_to_ask(queued=4, capacity=4)  # down to half: ask for 4
    assert time_to_ask(queued=0, capacity=1)
    assert not time_to_ask(queued=2, capacity=0)  # full
    # The last ask got less than it wanted: the coordinator has no more for now, so the
    # next ask waits for an empty queue (a long poll), not one more request per tile.
    assert not time_to_ask(queued=4, capacity=4, short=True)
    assert time_to_ask(queued=0, capacity=4, short=True)


def test_a_volunteer_asks_ahead_only_for_tiles_that_outlast_two_round_trips():
    from volunteer.policy import ask_ahead

    assert ask_ahead(compute_seconds=0.050, round_trip=0.010)  # the answer comes in time
    assert not ask_ahead(compute_seconds=0.001, round_trip=0.004)  # it would still be out
    assert not ask_ahead(compute_seconds=0.015, round_trip=0.010)  # and the report's too
    assert not ask_ahead(compute_seconds=10.0, round_trip=None)  # no call measured yet


def test_a_volunteer_computes_only_tiles_of_a_millisecond_or_two_on_its_event_loop():
    from volunteer.policy import computes_inline

    assert computes_inline(0.0005)  # the hop to a thread costs as much as the tile
    assert not computes_inline(0.050)  # the loop would be held for the whole tile
    assert not computes_inline(None)  # speed not measured yet


def test_reports_go_out_in_batches_bounded_in_results_and_bytes():
    from volunteer.policy import REPORT_BATCH, REPORT_BYTES, report_batch, report_due

    small = [{"result_id": f"r{i}", "hash": "h", "tile": b"x" * 1000} for i in range(100)]
    assert report_batch(small) == small[:REPORT_BATCH]
    assert not report_due(small[:3], queued=5)  # more to compute: wait for a fuller batch
    assert report_due(small[:3], queued=0)  # nothing left to compute: send what there is
    assert report_due(small[:REPORT_BATCH], queued=5)
    big = [{"result_id": f"r{i}", "tile": b"x" * (REPORT_BYTES // 4)} for i in range(6)]
    assert report_batch(big) == big[:4]  # no report over REPORT_BYTES of tiles
    assert not report_due(big[:3], queued=5)
    assert report_due(big[:4], queued=5)
    huge = [{"result_id": "r", "tile": b"x" * (REPORT_BYTES + 1)}]
    assert report_batch(huge) == huge  # one tile larger than a batch still goes out


def test_on_a_slow_uplink_a_report_holds_what_it_moves_in_a_few_seconds():
    """Every tile waits for the whole report it rides in, and its deadline is seconds: at
    100 KB/s an 8 MB report (80 s) would let every tile in it miss its deadline."""
    from volunteer.policy import REPORT_BYTES, REPORT_SECONDS, report_batch, report_bytes

    assert report_bytes(None) == REPORT_BYTES  # not yet measured
    assert report_bytes(1e9) == REPORT_BYTES  # loopback, a LAN
    slow = report_bytes(100_000)
    assert slow == int(100_000 * REPORT_SECONDS)
    tiles = [{"result_id": f"r{i}", "tile": b"x" * (256 << 10)} for i in range(8)]
    assert len(report_batch(tiles, slow)) == 1  # a tile of 256 KB is about 2.6 s there


async def test_tiles_that_share_a_panel_download_it_once():
    import asyncio

    from volunteer.cache import Downloads

    downloads, calls, release = Downloads(), [], asyncio.Event()

    async def download() -> bytes:
        calls.append(1)
        await release.wait()
        return b"panel"

    waiters = [asyncio.ensure_future(downloads.get("p", download)) for _ in range(5)]
    await asyncio.sleep(0)
    waiters[0].cancel()  # one tile dropped meanwhile: the others still get the panel
    release.set()
    results = await asyncio.gather(*waiters[1:])
    assert results == [b"panel"] * 4 and calls == [1]
    assert await downloads.get("p", download) == b"panel" and calls == [1, 1]  # done: anew


def test_panels_inside_a_framed_answer_are_cached_each_in_memory_of_its_own():
    """A framed answer's panels are read apart and cached as they came: letting one go
    frees what the cache counted for it (a view of the whole answer would keep the other
    panels, and the answer, alive)."""
    from volunteer.cache import BlobCache
    from volunteer.client import CoordinatorClient
    from volunteer.loop import PullLoop

    rng = np.random.default_rng(3)
    big, small = (
        kernels.encode_array(rng.standard_normal(n, dtype=np.float32)) for n in (60_000, 20_000)
    )
    ids = {kernels.blob_id(big): big, kernels.blob_id(small): small}
    from kernels import frames

    body = b"".join(bytes(part) for part in frames.pack({"blobs": ids}))
    answer = asyncio.run(_read_framed(body, len(body), chunk=1000))
    loop = PullLoop(CoordinatorClient("http://127.0.0.1:9"), name="v", cache=BlobCache(1 << 30))
    loop._keep_inline(answer["blobs"])
    cached = {blob_id: loop.cache.get(blob_id, count=False) for blob_id in ids}
    assert {k: bytes(v) for k, v in cached.items()} == ids
    held = [memoryview(v).obj for v in cached.values()]
    assert [memoryview(h).nbytes for h in held] == [len(big), len(small)]  # nothing else
    assert loop.cache.bytes == len(big) + len(small)
    # A framed answer of no announced length is read whole, its panels views of it: copied.
    loop.cache = BlobCache(1 << 30)
    loop._keep_inline(frames.unpack(body)["blobs"])
    assert all(isinstance(loop.cache.get(blob_id, count=False), bytes) for blob_id in ids)


async def _read_framed(body: bytes, size: int, chunk: int) -> dict:
    """A framed answer of `size` bytes as the volunteer's client reads it, from a stream
    that delivers `body` `chunk` bytes at a time (chunks straddle the binaries' ends)."""
    from unittest import mock

    import aiohttp

    from volunteer.client import read_framed

    stream = aiohttp.StreamReader(mock.Mock(_reading_paused=False), 1 << 16)
    for start in range(0, len(body), chunk):
        stream.feed_data(body[start : start + chunk])
    stream.feed_eof()
    return await read_framed(stream, size, "POST /v1/work")


def test_a_framed_answer_cut_short_or_lying_is_a_broken_reply():
    import aiohttp
    import msgpack

    from kernels import frames

    panel = b"\x05" * frames.BIG_BINARY
    body = b"".join(bytes(part) for part in frames.pack({"blobs": {"p": panel}}))
    with pytest.raises(aiohttp.ClientPayloadError, match="ended after"):
        asyncio.run(_read_framed(body[:-10], len(body), chunk=4096))
    # A binary claiming more than the body holds: refused before anything is allocated.
    huge = msgpack.ExtType(1, (0).to_bytes(8, "little") + (1 << 40).to_bytes(8, "little"))
    document = msgpack.packb({"blobs": {"p": huge}})
    lying = b"THF1" + len(document).to_bytes(4, "little") + document
    with pytest.raises(aiohttp.ClientPayloadError, match="runs past the body"):
        asyncio.run(_read_framed(lying, len(lying), chunk=4096))


def test_the_cache_hit_rate_counts_operands_that_cost_no_download_of_their_own():
    from volunteer.cache import BlobCache

    cache = BlobCache(max_bytes=10)
    assert cache.get("a") is None  # a miss
    cache.put("a", b"12345")
    assert cache.get("a") == b"12345"  # a hit
    assert cache.get("b", count=False) is None
    cache.count(hit=True)  # another tile's download was bringing it
    cache.put("b", b"678901")  # over 10 bytes in all: the least recently used goes
    assert cache.get("a", count=False) is None and cache.ids() == ["b"]
    assert cache.hit_rate == 2 / 3


def test_a_daemon_with_a_relative_state_dir_starts_and_stops(tmp_path):
    """`--state-dir v --daemon` from the directory that holds v: the daemon leaves the
    working directory, so the state directory must be made absolute first."""
    env = {**ENV, "PYTHONPATH": str(ROOT)}  # run from tmp_path, not the checkout
    command = [sys.executable, "-m", "coordinator.cli", "volunteer"]
    started = subprocess.run(
        [*command, "start", "http://127.0.0.1:9", "--state-dir", "v", "--daemon"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        assert "Traceback" not in started.stderr
        assert (tmp_path / "v" / "volunteer.log").exists()
    finally:
        subprocess.run([*command, "stop", "--state-dir", "v"], cwd=tmp_path, env=env, timeout=60)


async def test_the_daemon_hashes_only_the_tiles_whose_assignment_needs_the_hash(tmp_path):
    # An uploaded tile is named by the coordinator's hash of the bytes it receives: hashing
    # it here as well would only hold the report back. A hash-only replica sends its hash,
    # and so does every report to a coordinator that does not say `hash_needed` (an older
    # one refuses a tile without its hash, and counts the host a liar).
    from volunteer.daemon import Volunteer, VolunteerConfig

    daemon = Volunteer(VolunteerConfig(url="http://127.0.0.1:9", state_dir=tmp_path, threads=1))
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((8, 4), np.float32), rng.standard_normal((4, 8), np.float32)
    expected = kernels.encode_array(kernels.gemm(a, b))
    base = {"result_id": "r", "m": 8, "n": 8, "k": 4, "trans_a": False, "trans_b": False}
    reports = {}
    for name, fields in {
        "tile": {"upload": "tile", "hash_needed": False},
        "hash": {"upload": "hash", "hash_needed": True},
        "older coordinator": {"upload": "tile"},
    }.items():
        assignment = {**base, **fields}
        blobs = kernels.encode_array(a), kernels.encode_array(b)
        output_hash, tile, seconds = await daemon._kernel(assignment, *blobs)
        reports[name] = daemon.report_of(assignment, output_hash, tile, seconds)
    assert "hash" not in reports["tile"] and bytes(reports["tile"]["tile"]) == bytes(expected)
    assert reports["hash"]["hash"] == kernels.blob_id(expected) and "tile" not in reports["hash"]
    older = reports["older coordinator"]
    assert older["hash"] == kernels.blob_id(expected) and bytes(older["tile"]) == bytes(expected)


async def test_the_daemon_computes_a_tiny_tile_on_its_loop_and_a_long_one_on_a_thread(
    tmp_path, monkeypatch
):
    """A tile of microseconds is computed where the daemon's loop runs, with no hop to a
    worker thread and back; one expected to take longer goes to a thread, so the loop can
    send reports and asks meanwhile. The bits are the kernel's either way."""
    import threading

    from volunteer import client as volunteer_client
    from volunteer.daemon import Volunteer, VolunteerConfig

    threads = []
    compute_tile = volunteer_client.compute_tile

    def spying(*args, **kwargs):
        threads.append(threading.current_thread())
        return compute_tile(*args, **kwargs)

    monkeypatch.setattr("volunteer.daemon.compute_tile", spying)
    daemon = Volunteer(VolunteerConfig(url="http://127.0.0.1:9", state_dir=tmp_path, threads=1))
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((8, 4), np.float32), rng.standard_normal((4, 8), np.float32)
    assignment = {"result_id": "r", "m": 8, "n": 8, "k": 4, "trans_a": False, "trans_b": False}
    blobs = kernels.encode_array(a), kernels.encode_array(b)
    expected = kernels.encode_array(kernels.gemm(a, b))
    for gflops in (50.0, 1e-6):  # 256 flops: 5 ns, or 256 s at a millionth of a GFLOPS
        daemon.gflops = gflops
        _, tile, _ = await daemon._kernel({**assignment, "hash_needed": False}, *blobs)
        assert bytes(tile) == bytes(expected)
    assert threads[0] is threading.current_thread()
    assert threads[1] is not threading.current_thread()


async def test_a_daemon_whose_state_directory_is_deleted_stops(tmp_path):
    """Deleted under it, the state directory takes the daemon's pid file with it: `status`
    and `stop` could no longer find it. It stops, rather than running on unseen."""
    state = tmp_path / "vol"
    started = tilehive(
        "volunteer", "start", "http://127.0.0.1:9", "--daemon", "--state-dir", str(state)
    )
    assert started.returncode == 0, started.stderr
    pid = int(re.search(r"pid (\d+)", started.stdout).group(1))
    try:
        shutil.rmtree(state)
        await wait_until(lambda: not alive(pid), timeout=30)
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_volunteer_leaving_a_directory_made_anew_leaves_the_new_pid_file(tmp_path):
    """Its state directory deleted and made again by a new volunteer meanwhile, the old one
    exits without deleting the newcomer's pid file (which would stop the newcomer too)."""
    old = StateDir(tmp_path / "v")
    old_lock = old.lock()
    shutil.rmtree(tmp_path / "v")
    new = StateDir(tmp_path / "v")
    new_lock = new.lock()
    old.release(old_lock)
    try:
        assert new.holds(new_lock) and new.running_pid() == os.getpid()
    finally:
        new.release(new_lock)


async def skip_if_the_owner_is_busy() -> None:
    """Skip a test of `--idle-only` on a machine whose other programs already use a quarter
    of a core: a pause there would be theirs."""
    watch = OwnerWatch()
    watch.busy()
    await wait_until(lambda: watch.busy() or watch.share is not None, 10)
    if watch.share > 0.25:
        pytest.skip(f"other programs use {watch.share:.0%} of a core: a pause would be theirs")


async def test_an_idle_only_volunteer_beside_its_coordinator_trains_and_names_them_tilehives(
    tmp_path, reaper
):
    """A project host lending its idle cores (`--idle-only` on the coordinator's machine):
    the coordinator's work is tilehive's, not the owner's, so it does not pause the volunteer.
    It did: each tile the volunteer computed kept the coordinator busy, which paused it, and
    a tiny-gpt step took about 30 s instead of a tenth of one."""
    from coordinator.training import project as projects
    from kernels import processes
    from tests.factories import SMALL, start_coordinator

    await skip_if_the_owner_is_busy()
    directory = tmp_path / "project"
    projects.create(directory, **{**SMALL, "training.steps": 2, "work.policy": "freivalds"})
    port = free_port()
    log = tmp_path / "coordinator.log"
    coordinator = reaper(start_coordinator(directory, port, log))
    state_dir = tmp_path / "v"
    volunteer = reaper(start_volunteer(f"http://127.0.0.1:{port}", state_dir, "--idle-only"))
    try:
        await wait_until(lambda: volunteer_status(state_dir).get("tiles", 0) > 0, 120)
        assert processes.process_name(coordinator.pid) == processes.COORDINATOR
        assert processes.process_name(volunteer.pid) == processes.VOLUNTEER
        # So the volunteer's look at the machine counts the coordinator's CPU as tilehive's.
        assert coordinator.pid in OwnerWatch().sample(0.0).ours
        assert await asyncio.to_thread(coordinator.wait, 300) == 0, log.read_text()[-3000:]
    finally:
        stop(volunteer)
    assert (directory / "checkpoints" / "step-000002.npz").exists()
    # Its coordinator's work never paused it (it did, every tile: two steps took a minute).
    assert "pausing:" not in (state_dir / "out").read_text()


async def test_an_idle_only_volunteer_pauses_for_its_owner_and_the_coordinator_says_why(
    tmp_path, reaper
):
    """A program of the owner's takes a core: the volunteer pauses, says so to the
    coordinator now and then, and the operator reads why work waits (not that no volunteer
    is connected). The program done, training goes on."""
    from coordinator.cli import remote
    from coordinator.cli.logs import status_of
    from coordinator.training import project as projects
    from tests.factories import SMALL, start_coordinator

    await skip_if_the_owner_is_busy()
    directory = tmp_path / "project"
    projects.create(directory, **{**SMALL, "training.steps": 5000, "work.policy": "freivalds"})
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    reaper(start_coordinator(directory, port, tmp_path / "coordinator.log"))
    state_dir = tmp_path / "v"
    reaper(start_volunteer(url, state_dir, "--idle-only"))
    await wait_until(lambda: volunteer_status(state_dir).get("tiles", 0) > 0, 120)
    owner = reaper(subprocess.Popen([sys.executable, "-c", "while True: pass"], cwd=ROOT, env=ENV))

    def reason() -> str | None:
        said = tilehive("status", url, "--json")
        return (json.loads(said.stdout).get("waiting") or {}).get("reason")

    def hosts(where: str) -> dict[str, int]:
        return json.loads(tilehive("status", where, "--json").stdout)["host_states"]

    # After the owner's program, what `status DIR` and `status URL` read is read in this
    # process: a `tilehive status` process is half a second of a core, which the
    # volunteer takes for its owner at work again.
    def paused_in_files() -> int:
        return status_of(directory)["host_states"]["paused"]

    def paused_at_the_coordinator() -> int:
        return remote.status(url)["host_states"]["paused"]

    await wait_until(lambda: reason() == "hosts_paused", 120)
    assert "machine busy: other programs use" in volunteer_status(state_dir)["note"]
    # The operator sees the host paused, not active, and why: from the coordinator, from
    # the project's files (once the pause is committed), and on the dashboard.
    assert hosts(url) == {"active": 0, "paused": 1, "idle": 0, "quarantined": 0}
    said = tilehive("status", url).stdout
    assert "hosts: 0 active, 1 paused (its owner uses the machine: --idle-only)" in said
    await wait_until(lambda: paused_in_files() == 1, 60)
    assert hosts(str(directory))["paused"] == 1
    page = await asyncio.to_thread(_read, url + "/")
    assert "paused: its owner uses the machine (--idle-only)" in page
    assert "hosts 0 active, 1 paused" in page
    owner.kill()
    owner.wait()
    tiles = volunteer_status(state_dir)["tiles"]
    await wait_until(lambda: volunteer_status(state_dir).get("tiles", 0) > tiles, 120)
    out = (state_dir / "out").read_text()
    assert "pausing: other programs use" in out and "resuming: other programs use" in out
    assert paused_at_the_coordinator() == 0
    await wait_until(lambda: paused_in_files() == 0, 60)
    # The task log says each once a pause: when it began, and when it ended.
    said = [m for (m,) in committed(directory, "SELECT message FROM events WHERE kind = 'host'")]
    pauses = out.count("pausing: other programs use")
    assert sum("paused: its owner is using the machine" in m for m in said) == pauses, said
    assert sum("resumed: its owner's machine is idle again" in m for m in said) == pauses, said


def _read(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.read().decode()
