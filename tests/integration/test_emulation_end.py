"""The end of an emulation: every host stops at once, with `stop_timeout` to report."""

from __future__ import annotations

import asyncio

from tests.factories import operands, running
from tests.volunteers import wait_until
from volunteer.emulator import run_emulation
from volunteer.profile import parse

# The traits left out take their defaults: no latency, no limits, nothing going wrong.
QUICK_HOSTS = "[[group]]\ngflops = 1000\n"


async def test_reports_cut_off_by_the_emulations_end_are_counted_apart_not_as_errors(tmp_path, rng):
    """A coordinator swamped by a whole crowd stopping at once answers some of their last
    reports too late. Those hosts are cut off by the emulation's own end, not failed by
    the coordinator: counted apart, not as errors (on a slow machine they made the
    10,000-host row read thousands of errors, all in its last seconds)."""
    async with running(tmp_path, tile=16) as (co, queue, url):
        a, b = operands(rng, 256, 256, 16, False, False)  # 256 tiles
        product = asyncio.ensure_future(queue.matmul(a, b))
        swamped, given_up = asyncio.Event(), asyncio.Event()
        report = co.reports.report

        async def late_once_swamped(host, message, now):
            if swamped.is_set():
                await given_up.wait()  # answered only after the hosts gave up
            return await report(host, message, now)

        co.reports.report = late_once_swamped
        stop = asyncio.Event()

        async def stop_mid_product() -> None:
            await wait_until(lambda: co.stats.get("tiles_in", 0) >= 8)
            swamped.set()
            stop.set()

        ending = asyncio.ensure_future(stop_mid_product())
        emulated = await run_emulation(
            url, 4, parse(QUICK_HOSTS), stop=stop, stop_timeout=0.5, seed=1, ramp=0.1
        )
        given_up.set()
        await ending
        product.cancel()
    assert emulated.errors == {}, emulated.lines()
    assert emulated.cut_off > 0 and emulated.reported >= 8
