"""Volunteers on the coordinator's own machine, and the cores its model kernels leave them.

A host whose requests come from a loopback address or over the local socket
(coordinator/server/local.py) computes on the coordinator's machine:
the volunteers of `tilehive demo`, or a project host lending its own idle cores. Their
kernel threads and the coordinator's model kernels (the element-wise work and the attention
of every step) then share the same cores, and a model kernel thread on a core a volunteer
computes on preempts that volunteer's tile, which the step is waiting for. So while such
hosts are in contact, the model kernels use the cores they leave free, one at least
(`kernels.nn.limit_threads`; any thread count gives the same bits). On two cores with one
volunteer of one thread, tiny-gpt's step took 4-7% less in five pairs of runs of six; the
larger project's did not move (docs/performance-history.md, the twenty-eighth round).

A volunteer behind a reverse proxy on the coordinator's machine looks local too; an
operator who sets TILEHIVE_MODEL_THREADS decides the count regardless.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
from collections import OrderedDict

from coordinator.work.records import Host
from kernels import nn

log = logging.getLogger(__name__)

NEIGHBOUR_TTL = 30.0  # seconds a neighbour still counts after its last request


@functools.lru_cache(maxsize=4096)
def is_loopback(address: str | None) -> bool:
    """Whether a request's peer address is this machine's loopback (IPv4, IPv6, or IPv4
    mapped into IPv6). Cached: every ask and report asks it, twice (1.8 us a parse)."""
    try:
        ip = ipaddress.ip_address((address or "").split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def model_threads(cpus: int, neighbour_threads: int) -> int | None:
    """The cap on the coordinator's model kernels: the cores its neighbours do not compute
    on, one at least; None (no cap) when no neighbour computes."""
    if neighbour_threads <= 0:
        return None
    return max(1, cpus - neighbour_threads)


class Neighbours:
    """The hosts in recent contact from this machine, and the model kernels' cap they set.

    Every request from this machine costs the same few steps however many neighbours there
    are: the emulator's 10,000 hosts are all on the coordinator's machine, as is every
    volunteer behind a reverse proxy there, and a walk over all of them for each new one
    took a third of the coordinator's CPU at 10,000 emulated hosts (the forty-second
    round)."""

    def __init__(self, cpus: int) -> None:
        self.cpus = cpus
        # host id -> (its threads, its last request), the least recently heard from first
        self._seen: OrderedDict[int, tuple[int, float]] = OrderedDict()
        self.threads = 0  # kernel threads the neighbours in contact compute with
        self.cap: int | None = None

    def saw(self, host: Host, on_this_machine: bool, now: float) -> None:
        """A request from `host` came (from this machine or not): a new neighbour changes
        the cap at once."""
        if not on_this_machine:
            return
        before = self._seen.pop(host.id, None)
        self._seen[host.id] = (host.threads, now)
        self.threads += host.threads - (before[0] if before is not None else 0)
        if before is None:
            self.update(now)

    def update(self, now: float) -> None:
        """Forget the neighbours silent for NEIGHBOUR_TTL, and cap the model kernels for the
        rest (said once in the log when the cap changes)."""
        while self._seen:
            host_id, (threads, seen) = next(iter(self._seen.items()))
            if now - seen <= NEIGHBOUR_TTL:
                break
            del self._seen[host_id]
            self.threads -= threads
        cap = model_threads(self.cpus, self.threads)
        if cap == self.cap:
            return
        self.cap = cap
        nn.limit_threads(cap)
        if cap is None:
            log.info(
                "no volunteer computes on this machine now: the model's kernels use %d thread(s)",
                nn.default_threads(),
            )
        else:
            log.info(
                "volunteers on this machine (host%s %s) compute with %d thread(s) of its %d "
                "CPUs: the model's kernels use %d thread(s)",
                "s" if len(self._seen) > 1 else "",
                ", ".join(str(host_id) for host_id in sorted(self._seen)),
                self.threads,
                self.cpus,
                nn.default_threads(),
            )

    def close(self) -> None:
        """Lift the cap: the process may go on without this coordinator (tests, `--local`)."""
        self._seen.clear()
        self.threads = 0
        self.cap = None
        nn.limit_threads(None)
