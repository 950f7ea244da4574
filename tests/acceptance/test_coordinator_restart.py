"""Crash safety: a coordinator process killed with SIGKILL mid-GEMM resumes and finishes it."""

from __future__ import annotations

import asyncio
import signal
import time

import numpy as np
import pytest

import kernels
from tests.factories import bits, operands, volunteers
from tests.procs import committed, free_port, save_operands, start_job, url_of
from tests.volunteers import Behaviour, wait_until


@pytest.mark.parametrize("policy", ["quorum", "freivalds"])
async def test_a_coordinator_killed_mid_gemm_resumes_and_finishes_it_exactly(
    tmp_path, rng, policy, reaper
):
    flags = [(False, False), (True, False)]
    products = [operands(rng, 80, 64, 40, ta, tb) for ta, tb in flags]
    npz = tmp_path / "operands.npz"
    save_operands(npz, [(a, b, *f) for (a, b), f in zip(products, flags, strict=True)])
    directory, output, port = tmp_path / "project", tmp_path / "out.npz", free_port()
    log = tmp_path / "coordinator.log"
    first = reaper(start_job(directory, npz, output, port, log, "--policy", policy))
    url = await url_of(first)
    assert url.startswith("http://"), log.read_text()
    slow = Behaviour(capacity=1, seconds_per_tile=0.02)
    async with volunteers(url, [slow, slow]) as crew:
        query = "SELECT id FROM workunits WHERE state IN ('validated', 'assimilated')"
        await wait_until(lambda: len(committed(directory, query)) >= 8, timeout=60)
        first.send_signal(signal.SIGKILL)
        await asyncio.to_thread(first.wait)
        killed_at = time.time()
        validated_before = {row[0] for row in committed(directory, query)}
        total = committed(directory, "SELECT COUNT(*) FROM workunits")[0][0]
        assert 8 <= len(validated_before) < total, "kill landed after the end"
        second = reaper(start_job(directory, npz, output, port, log, "--policy", policy))
        assert await url_of(second) == url, log.read_text()
        code = await crew.finish(asyncio.to_thread(second.wait, 120), timeout=120)
    assert code == 0, log.read_text()
    results = np.load(output)
    for i, ((a, b), (ta, tb)) in enumerate(zip(products, flags, strict=True)):
        assert np.array_equal(
            bits(results[f"c{i}"]), bits(kernels.gemm(a, b, trans_a=ta, trans_b=tb))
        )
    reissued = committed(
        directory,
        f"SELECT wu_id FROM results WHERE sent_time > {killed_at}",
    )
    assert not validated_before & {row[0] for row in reissued}, "validated tiles were re-issued"
