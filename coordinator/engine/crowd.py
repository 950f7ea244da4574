"""The crowd as measured lately: how many hosts, how fast, and what a tile costs them beyond
its arithmetic (a fixed part, the round trip, and a part per byte moved), its upload as
their uplinks were timed (engine/uplinks.py). Products are cut to fit it (rules/sizing.py)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace

from coordinator.engine.uplinks import Uplinks
from coordinator.rules.sizing import Crowd
from coordinator.state.ledger import Ledger
from coordinator.work.records import Host

RECENT = 30.0  # seconds: a host heard from this recently is part of the crowd
REMEMBER = 1.0  # seconds a look at the hosts is reused: 10,000 hosts cost a few ms to scan
WEIGHT = 0.1  # of each new observation in the moving averages
FIRST_OVERHEAD = 0.01  # seconds assumed before any tile is measured: a loopback round trip


class CrowdWatch:
    """Learns a tile's cost beyond its arithmetic from the results that come back, as a
    line: seconds = overhead + seconds_per_byte x bytes (the hosts' own compute seconds are
    taken out; they only ever inform this estimate).

    The line goes through each size of tile's mean cost (sizes by powers of two of their
    bytes), not through the last few tiles. A product's tiles are all of about one size,
    and their costs vary by tens of milliseconds with the hosts' queues: a line through the
    last few (moving averages of x, y, xx and xy) tilted flat at times, bytes looked free,
    and products for 100 emulated laptops went out as one tile of 512, whose megabyte took
    0.4 s to upload (docs/performance-history.md, the twenty-eighth round)."""

    def __init__(self, ledger: Ledger, uplinks: Uplinks | None = None) -> None:
        self.ledger = ledger
        self.uplinks = uplinks or Uplinks()
        # Per size (the bit length of its bytes): [mean bytes, mean seconds, count, last seen].
        self._sizes: dict[int, list[float]] = {}
        self._hosts: tuple[float, Crowd] | None = None
        self._fitted: tuple[float, int, Crowd] | None = None  # (when, sizes seen, the crowd)
        # Hosts in contact that take no work now (paused while their owners use their
        # machines): products are not cut, nor shares counted, for them.
        self.away: Callable[[int], bool] = lambda host_id: False

    def observe(
        self, turnaround: float, compute: float, nbytes: int, now: float = 0.0, upload: float = 0.0
    ) -> None:
        """A result came back at `now`, `turnaround` seconds after it was sent, `compute`
        of them spent computing (as its host says) and about `upload` uploading its tile
        (its host's uplink as timed: engine/uplinks.py), its tile having moved `nbytes`.
        The upload is taken out with the compute: a crowd's uplinks are known host by
        host, and a slow one's minute would read, one size of tile seen, as a minute every
        tile costs whatever its size (and products would go out as one large tile)."""
        y = min(max(turnaround - compute - upload, 0.0), 60.0)
        x = float(nbytes)
        size = self._sizes.setdefault(max(nbytes, 1).bit_length(), [x, y, 0.0, now])
        # A running mean at first, then a moving average: the count stops at 1 / WEIGHT.
        size[2] = min(size[2] + 1.0, 1.0 / WEIGHT)
        size[0] += (x - size[0]) / size[2]
        size[1] += (y - size[1]) / size[2]
        size[3] = now

    def cost(self, now: float = 0.0) -> tuple[float, float]:
        """(overhead seconds, seconds per byte): the line through the sizes' means, each
        weighted by how often it was seen (up to 1 / WEIGHT times). The sizes seen in the
        last RECENT seconds decide when there are two of them or more; otherwise every size
        seen does, the older ones telling the slope that one size alone cannot (a size not
        cut for a while says what the network was then). A flat line at the mean while one
        size only was ever seen."""
        if not self._sizes:
            return FIRST_OVERHEAD, 0.0
        sizes = [
            (x, y, count) for x, y, count, seen in self._sizes.values() if now - seen <= RECENT
        ]
        if len(sizes) < 2:
            sizes = [(x, y, count) for x, y, count, _ in self._sizes.values()]
        total = sum(w for _, _, w in sizes)
        mean_x = sum(x * w for x, _, w in sizes) / total
        mean_y = sum(y * w for _, y, w in sizes) / total
        var = sum(w * (x - mean_x) ** 2 for x, _, w in sizes)
        cov = sum(w * (x - mean_x) * (y - mean_y) for x, y, w in sizes)
        slope = max(cov / var, 0.0) if var > 0 else 0.0
        return max(mean_y - slope * mean_x, 0.0), slope

    def crowd(self, now: float) -> Crowd:
        """The crowd, its cost line fitted again at most every REMEMBER seconds, or at once
        when a new size of tile is seen: asked for every product and every work request,
        and the line moves little between two (a fit per product was 2% of a tiny-gpt
        step's profile)."""
        fitted = self._fitted
        if fitted is None or not 0 <= now - fitted[0] < REMEMBER or fitted[1] != len(self._sizes):
            overhead, per_byte = self.cost(now)
            seen = self._look(now)
            crowd = replace(seen, overhead=overhead, seconds_per_byte=per_byte)
            self._fitted = fitted = (now, len(self._sizes), crowd)
        return fitted[2]

    def hosts(self, now: float) -> int:
        """How many hosts the crowd has (at least 1), without fitting a tile's cost: asked
        by every work request (rules/scheduler.py, a host's share of a product)."""
        return self._look(now).hosts

    def others_working(self, now: float, host_id: int) -> bool:
        """Whether a host other than `host_id` is at work: in recent contact and not away.
        Looked at afresh (the crowd's look may be a second old, from before a pause), and
        most often settled by the first host looked at."""
        return any(h.id != host_id and self._working(h, now) for h in self.ledger.hosts.values())

    def _working(self, host: Host, now: float) -> bool:
        """In service, heard from lately, and not away: one of the crowd."""
        return host.in_service and now - host.last_contact <= RECENT and not self.away(host.id)

    def _look(self, now: float) -> Crowd:
        """The hosts in recent contact, looked at again at most every REMEMBER seconds (the
        fields of the cost line, overhead and seconds_per_byte, are not filled in)."""
        if self._hosts is None or now - self._hosts[0] >= REMEMBER:
            hosts = [h for h in self.ledger.hosts.values() if self._working(h, now)]
            memory = [h.max_memory_mb << 20 for h in hosts if h.max_memory_mb]
            upload = self.uplinks.typical(h.id for h in hosts)
            looked = Crowd(
                hosts=max(len(hosts), 1),
                gflops=statistics.median(h.gflops for h in hosts) if hosts else 1.0,
                overhead=0.0,
                memory_bytes=min(memory, default=0),
                upload_per_byte=upload,
            )
            self._hosts = (now, looked)
        return self._hosts[1]
