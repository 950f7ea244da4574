"""What the project's operator may do to a running coordinator: pause, quarantine, cancel."""

from __future__ import annotations

import logging

from coordinator.engine.passes import Passes
from coordinator.engine.products import Products
from coordinator.engine.requests import WorkRequests
from coordinator.state.ledger import Ledger
from coordinator.work.events import Event
from coordinator.work.protocol import NotFound
from coordinator.work.records import GemmState, Host

log = logging.getLogger(__name__)


class Operator:
    def __init__(
        self, ledger: Ledger, requests: WorkRequests, passes: Passes, products: Products
    ) -> None:
        self.ledger = ledger
        self.requests = requests
        self.passes = passes
        self.products = products

    async def set_paused(self, paused: bool, now: float) -> bool:
        """Hand out no new work (results in progress are still accepted), or resume.
        Returns whether that changed anything (a second pause does not)."""
        if self.requests.paused == paused:
            return False
        self.requests.paused = paused
        state = "paused" if paused else "resumed"
        log.warning("project %s by the operator", state)
        self.ledger.log([Event(now, "project", state, f"project {state} by the operator")])
        await self.ledger.flush()
        if not paused:
            self.requests.signal_work()
        return True

    async def set_quarantined(self, host_id: int, quarantined: bool, now: float) -> Host:
        """Quarantine a host or release it; a host already so is left as it is (a release
        starts a host over, which a healthy host's record must not)."""
        host = self.ledger.hosts.get(host_id)
        if host is None:
            raise NotFound(f"no host {host_id}")
        if host.quarantined == quarantined:
            return host
        changed = host.evolve(quarantined=quarantined)
        if not quarantined:
            # A released host starts over: no trust, a small quota, and a clean invalid count,
            # no wait and no probation.
            changed = changed.evolve(invalid_count=0, consecutive_valid=0, max_in_progress=1)
            self.requests.cooling.forget(host_id)
            # What the quarantine took back from it counts as given back, which would bar
            # it from that work for good: with two volunteers and a quorum of two, the work
            # waited for a third one for ever (found by a review).
            self.requests.forgive_give_backs(host_id)
        self.ledger.put_host(changed)
        state = "quarantined" if quarantined else "released"
        log.warning("host %d %s by the operator", host_id, state)
        self.ledger.log(
            [Event(now, "host", state, f"host {host_id} {state} by the operator", host_id=host_id)]
        )
        await self.ledger.flush()
        if not quarantined:
            self.requests.signal_work()
        return changed

    async def cancel_step(self, step: int, now: float) -> dict[str, int]:
        """Stop every product of `step` still being computed: its unsent work is dropped, the
        volunteers holding its work are told to abort it, and whoever waits for a product
        (the training loop) gets GemmFailed. A restarted coordinator runs the step again."""
        async with self.passes.lock:
            gemms = [
                g
                for g in self.ledger.gemms.values()
                if g.step == step and g.state is GemmState.ACTIVE
            ]
            if not gemms:
                raise NotFound(f"step {step} has no products being computed")
            message = f"step {step} cancelled by the operator"
            counts = {"gemms": len(gemms), "workunits": 0, "aborted": 0}
            for gemm in gemms:
                workunits, aborted = self.products.drop(gemm, message, now)
                counts["workunits"] += workunits
                counts["aborted"] += aborted
                self.products.failed_here.add(gemm.id)  # not retried in this run
            log.warning(
                "%s: %d products, %d work units dropped, %d results in progress aborted",
                message,
                *counts.values(),
            )
            await self.ledger.flush()
            return counts
