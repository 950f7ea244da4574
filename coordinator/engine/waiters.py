"""Work requests waiting for work (long polls), woken oldest first and only as many as needed.

With thousands of idle hosts holding a long poll, waking every one of them for each new result
makes each re-plan and all but a few go back to waiting: a thundering herd that costs the
coordinator O(hosts) per result. Here a new result wakes one waiter more than are already
awake and re-planning, so the work done per result stays O(1).
"""

from __future__ import annotations

import asyncio


class Waiters:
    def __init__(self) -> None:
        # Insertion-ordered: the oldest waiter is first; a waiter that times out removes
        # itself in O(1).
        self._waiting: dict[asyncio.Future, None] = {}
        self._woken = 0  # woken, not yet back from re-planning
        self._of_host: dict[int, asyncio.Future] = {}  # each host's waiting request

    def __len__(self) -> int:
        return len(self._waiting)

    @property
    def hosts(self) -> int:
        """Requests waiting for work or woken and re-planning: hosts that want work now."""
        return len(self._waiting) + self._woken

    async def wait(self, timeout: float, host_id: int | None = None) -> bool:
        """Wait until woken (True) or for `timeout` seconds (False); `host_id`: whose request
        this is, so that `wake_host` can find it."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiting[waiter] = None
        if host_id is not None:
            self._of_host[host_id] = waiter
        try:
            await asyncio.wait_for(waiter, timeout)
            return True
        except TimeoutError:
            return False
        finally:
            self._waiting.pop(waiter, None)
            if host_id is not None and self._of_host.get(host_id) is waiter:
                del self._of_host[host_id]
            if waiter.done() and not waiter.cancelled():
                self._woken -= 1

    def wake_host(self, host_id: int) -> None:
        """Wake this host's waiting request, if it has one: what it may take has changed."""
        waiter = self._of_host.get(host_id)
        if waiter is not None and waiter in self._waiting:
            del self._waiting[waiter]
            if not waiter.done():
                waiter.set_result(None)
                self._woken += 1

    def wake(self, available: int) -> None:
        """Wake the oldest waiters, so that at most `available` are awake at once."""
        while self._woken < available and self._waiting:
            waiter = next(iter(self._waiting))
            del self._waiting[waiter]
            if not waiter.done():
                waiter.set_result(None)
                self._woken += 1

    def wake_all(self) -> None:
        self.wake(len(self._waiting) + self._woken)
