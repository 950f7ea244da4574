"""Long polls: new work wakes the oldest waiters, no more of them than there is work for."""

from __future__ import annotations

import asyncio

from coordinator.engine.waiters import Waiters
from tests.volunteers import wait_until


async def test_work_wakes_the_oldest_waiters_and_only_as_many_as_it_can_feed():
    waiters = Waiters()
    tasks = [asyncio.create_task(waiters.wait(30)) for _ in range(1000)]
    await wait_until(lambda: len(waiters) == 1000)
    waiters.wake(3)
    waiters.wake(3)  # the same three results again: the woken are still re-planning
    await wait_until(lambda: sum(t.done() for t in tasks) == 3)
    assert [t.done() for t in tasks[:4]] == [True, True, True, False]
    assert all(t.result() for t in tasks[:3])
    waiters.wake(1)  # the three are back: one more result wakes the next in line
    await wait_until(lambda: tasks[3].done())
    waiters.wake_all()
    assert all(await asyncio.gather(*tasks))
    assert len(waiters) == 0


async def test_a_waiter_that_times_out_leaves_the_queue():
    waiters = Waiters()
    assert await waiters.wait(0.01) is False
    assert len(waiters) == 0
    waiter = asyncio.create_task(waiters.wait(30))
    await wait_until(lambda: len(waiters) == 1)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert len(waiters) == 0
    waiters.wake(5)  # nobody to wake: nothing happens, nothing is counted as awake
    late = asyncio.create_task(waiters.wait(30))
    await wait_until(lambda: len(waiters) == 1)
    waiters.wake(1)
    assert await late is True
