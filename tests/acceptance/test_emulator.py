"""The device emulator: its profiles, its command line, and 50 emulated hosts training a
project on a real `tilehive coordinator` process, bit for bit equal to `--local`."""

from __future__ import annotations

import asyncio
import random
import re
import shutil
import subprocess
import sys
import threading
import time

import aiohttp
import numpy as np
import pytest

import kernels
from tests.factories import bits
from tests.procs import ENV, ROOT, committed, free_port, tilehive
from volunteer import profile as profiles
from volunteer.emulator import Emulation, EmulationReport, falsify, hints, run_emulation

# Fast, flaky hosts: short sessions with churn and abrupt exits, client errors, and one in
# ten a liar, so the scheduler, the transitioner and the validator all have work to do.
TEST_PROFILE = """
name = "test"
[[group]]
name = "flaky"
share = 1
gflops = { dist = "lognormal", median = 50, sigma = 0.3 }
threads = 2
max_memory_mb = 256
download_mbps = { dist = "uniform", low = 200, high = 1000 }
upload_mbps = 200
latency_ms = { dist = "uniform", low = 1, high = 5 }
session_s = { dist = "exponential", mean = 5 }
offline_s = { dist = "uniform", low = 0.1, high = 0.5 }
churn = 0.3
graceful = 0.7
error_rate = 0.02
lie_rate = { dist = "choice", values = [0.0, 0.5], weights = [0.9, 0.1] }
"""

# The project: small enough for seconds per step, with the limits an emulation needs.
PROJECT = {
    "layers": "1",
    "width": "64",
    "max_mb": "1",
    "registrations_per_hour": "100000",  # 50 hosts and their replacements, one address
    "delay_bound": "1.5",  # hosts that vanish are noticed quickly
    "max_error_results": "20",  # errors, lies and given-back work are the point here
    "max_total_results": "40",
    "adaptive_replication": "false",  # every tile quorum-checked: bitwise even vs liars
    "sizing": '"fixed"',  # many tiles of 64, not a few cut for the crowd: load is the point
}


# ---- profiles ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", profiles.BUILTIN)
def test_builtin_profiles_load_and_draw_within_their_ranges(name):
    profile = profiles.load(name)
    rng = random.Random(1)
    for _ in range(500):
        host = profile.draw(rng)
        assert host.gflops > 0 and host.download_mbps > 0 and host.upload_mbps > 0
        assert 0 <= host.lie_rate <= 1 and 0 <= host.error_rate <= 1
        assert isinstance(host.threads, int) and host.threads >= 1
        assert host.group in {g.name for g in profile.groups}


def test_mixed_profile_draws_its_groups_by_share():
    profile = profiles.load("mixed")
    rng = random.Random(2)
    groups = [profile.draw(rng).group for _ in range(4000)]
    assert 0.55 < groups.count("phone") / 4000 < 0.65
    assert 0.02 < groups.count("server") / 4000 < 0.08


def test_a_group_may_leave_traits_out():
    profile = profiles.parse("[[group]]\ngflops = 3\nlie_rate = 0.5\n")
    host = profile.draw(random.Random(0))
    assert host.gflops == 3 and host.lie_rate == 0.5 and host.error_rate == 0
    assert host.latency_ms == 0 and host.graceful == 1


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[group]\n", "not valid TOML"),
        ("name = 'x'\n", "no [[group]]"),
        ("hosts = 3\n[[group]]\n", "unknown key 'hosts'"),
        ("[[group]]\nspeed = 3\n", "group[0]: unknown key 'speed'"),
        ("[[group]]\ngflops = 'fast'\n", "group[0].gflops must be a number"),
        ("[[group]]\nlatency_ms = -5\n", "group[0].latency_ms = -5 is out of range"),
        ("[[group]]\nlie_rate = 1.5\n", "group[0].lie_rate = 1.5 is out of range"),
        ("[[group]]\ngflops = { dist = 'pareto' }\n", "group[0].gflops.dist must be one of"),
        (
            "[[group]]\ngflops = { dist = 'lognormal', median = 2 }\n",
            "group[0].gflops: a lognormal distribution needs 'sigma'",
        ),
        (
            "[[group]]\ngflops = { dist = 'uniform', low = 5, high = 2 }\n",
            "group[0].gflops: low (5) is above high (2)",
        ),
        (
            "[[group]]\nchurn = { dist = 'choice', values = [0.1, 2] }\n",
            "group[0].churn.values = 2 is out of range",
        ),
        (
            "[[group]]\nthreads = { dist = 'normal', mean = 4, sd = 1, max = 8 }\n",
            "unknown parameter 'max'",
        ),
        ("[[group]]\nshare = 0\n", "group[0].share must be > 0"),
    ],
)
def test_a_malformed_profile_names_the_key_and_what_is_wrong(text, message):
    with pytest.raises(profiles.ProfileError) as caught:
        profiles.parse(text, "p.toml")
    assert message in str(caught.value)
    assert str(caught.value).startswith("p.toml")


def test_lies_are_well_formed_wrong_and_independent():
    tile = kernels.encode_array(np.arange(64 * 64, dtype=np.float32).reshape(64, 64))
    for lie in ("big", "one_ulp", "zero", "nan"):
        wrong = falsify(tile, lie, random.Random(1))
        array = kernels.decode_array(wrong)
        assert array.shape == (64, 64) and array.dtype == np.float32
        assert wrong != tile
        # Two liars are two faulty hosts, not a conspiracy: a quorum of two must not see the
        # same wrong tile twice (a CI run once trained on two identical zero tiles).
        assert falsify(tile, lie, random.Random(2)) != wrong


async def test_a_host_does_not_count_the_wait_for_the_shared_pool_as_its_compute_time():
    """Emulated hosts share one pool of kernel threads, which no real host waits for. A
    fast host whose tile queued there behind the crowd's must still see its own speed:
    taken as slow, fast hosts asked ahead after every few tiles (volunteer/policy.py,
    ask_ahead), five times the requests real ones make, and the coordinator's benchmark
    measured those requests instead of its cost a work unit."""
    fast = profiles.parse("[[group]]\ngflops = 1000\n", "fast hosts")
    async with aiohttp.ClientSession() as session:
        emulation = Emulation(
            "http://127.0.0.1:9", 1, fast, session, real_flops=1e9, compute_threads=1,
            seed=0, invite=None, name_prefix="t", stop_timeout=1.0, long_poll=False,
        )  # fmt: skip
        host = emulation.new_host(0, 0)
        a = kernels.encode_array(np.ones((128, 128), np.float32))  # 4 MFLOP: on the pool
        tile = {"m": 128, "n": 128, "k": 128, "trans_a": 0, "trans_b": 0, "wu_id": "w"}
        release = threading.Event()
        emulation.pool.submit(release.wait)  # the crowd's tiles ahead of this one
        try:
            computing = asyncio.ensure_future(host._kernel(tile, a, a))
            queued = time.monotonic()
            await asyncio.sleep(0.3)  # the tile waits in the pool's queue meanwhile
            assert not computing.done()
            # A tile of microseconds computes at once, on the event loop, as the daemon's
            # does: the hop to the pool and back would cost more than the tile.
            small = kernels.encode_array(np.ones((8, 4), np.float32))
            tiny = {"m": 4, "n": 4, "k": 8, "trans_a": 1, "trans_b": 0, "wu_id": "t"}
            _, tiny_blob, _ = await asyncio.wait_for(host._kernel(tiny, small, small), 5)
        finally:
            release.set()
        output_hash, blob, seconds = await computing
        waited = time.monotonic() - queued
        emulation.pool.shutdown()
    assert np.array_equal(kernels.decode_array(tiny_blob), np.full((4, 4), 8, np.float32))
    assert output_hash == kernels.blob_id(blob)
    assert np.array_equal(kernels.decode_array(blob), np.full((128, 128), 128, np.float32))
    assert waited >= 0.3 and seconds < 0.1, (waited, seconds)
    # The emulation itself still says that it fell behind its hosts' model.
    assert emulation.totals.overrun >= 0.3


def test_hints_name_the_project_setting_when_registrations_are_refused():
    report = EmulationReport(
        url="http://x", profile="p", hosts=10, seconds=1.0, errors={"register 429 x": 3}
    )
    assert any("registrations_per_hour" in hint for hint in hints(report))


# ---- the command line ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["ftp://host", "--duration", "1"], "not an http:// or https:// URL"),
        (["http://host:99999", "--duration", "1"], "Port out of range"),
        (["http://127.0.0.1:9", "--duration", "1"], "cannot reach a coordinator"),
        (["http://127.0.0.1:9", "--hosts", "0"], "--hosts"),
        (["http://127.0.0.1:9", "--hosts", "many"], "--hosts"),
        (["http://127.0.0.1:9", "--profile", "tablets"], "not a built-in profile"),
    ],
)
def test_cli_errors_are_one_clear_line(args, message):
    result = tilehive("emulate", *args)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_names_the_bad_key_of_a_profile_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[[group]]\nupload_mbps = { dist = 'lognormal', median = 'x', sigma = 1 }\n")
    result = tilehive("emulate", "http://127.0.0.1:9", "--profile", str(path))
    assert result.returncode == 2
    assert "group[0].upload_mbps.median must be a number, got 'x'" in result.stderr
    assert "Traceback" not in result.stderr


# ---- end to end ----------------------------------------------------------------------------


def make_project(directory, steps: int = 1) -> None:
    made = tilehive("init", str(directory), "--steps", str(steps), "--tile", "64", "--seed", "5")
    assert made.returncode == 0, made.stderr
    path = directory / "project.toml"
    text = path.read_text()
    for key, value in PROJECT.items():
        text, count = re.subn(rf"^{key} = \S+", f"{key} = {value}", text, flags=re.M)
        assert count == 1, key
    path.write_text(text)


@pytest.fixture
def coordinator(tmp_path):
    """A `tilehive coordinator` process serving a fresh project; yields (url, directory)."""
    project = tmp_path / "project"
    make_project(project)
    log = (tmp_path / "coordinator.log").open("w")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "coordinator.cli",
            "coordinator",
            str(project),
            "--bind",
            f"127.0.0.1:{free_port()}",
            "--keep-serving",
        ],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        cwd=ROOT,
        env=ENV,
    )
    try:
        line = process.stdout.readline()
        url = re.search(r"connect to (\S+)", line)
        assert url, (tmp_path / "coordinator.log").read_text()
        yield url.group(1), project
    finally:
        process.kill()
        process.wait()
        process.stdout.close()
        log.close()


async def test_fifty_emulated_hosts_train_a_project_bit_for_bit(tmp_path, coordinator):
    url, project = coordinator
    profile = profiles.parse(TEST_PROFILE, "test profile")
    report = await run_emulation(
        url, 50, profile, until_done=True, duration=90, seed=3, ramp=0.5, interval=0.5
    )
    print("\n".join(report.lines()))
    assert report.errors == {}, report.lines()
    assert report.registered >= 50 and report.churned > 0 and report.sessions > 50
    assert report.reported > 100 and report.assigned >= report.reported
    assert report.lies > 0 and report.client_errors > 0
    assert report.vanished > 0 and report.abandoned > 0
    assert report.latency["work_poll"]["count"] > 0
    assert report.tiles_real > 0

    # The coordinator's side: every lie was found out, and nothing wrong reached the model.
    invalid = committed(project, "SELECT COUNT(*) FROM results WHERE validate_state = 'invalid'")
    assert invalid[0][0] > 0
    timed_out = committed(project, "SELECT COUNT(*) FROM results WHERE outcome = 'no_reply'")
    assert timed_out[0][0] > 0
    reference = tmp_path / "reference"
    reference.mkdir()
    shutil.copy(project / "project.toml", reference / "project.toml")
    local = await asyncio.to_thread(tilehive, "train", str(reference), "--local")
    assert local.returncode == 0, local.stderr
    ours = np.load(project / "checkpoints" / "step-000001.npz")
    theirs = np.load(reference / "checkpoints" / "step-000001.npz")
    assert sorted(ours.files) == sorted(theirs.files)
    for name in ours.files:
        assert np.array_equal(bits(ours[name]), bits(theirs[name])), name
