"""Sized work: a product's tile follows the crowd that will compute it.

The kernel is tiling-invariant (each output element is reduced over K in an order that
depends on K alone), so the tile decides how a product is cut and never a bit of its result.
What it does decide is the time: every tile costs a round trip, its panels' download and its
upload on top of its arithmetic, and the coordinator's own bookkeeping per result. A few
fast hosts finish a product soonest in a few large tiles; many slow ones, in more, smaller
tiles that all of them can work on at once.

`choose_tile` estimates a product's time for each candidate tile (the project's tile times
a power of two, from half of it up to one tile for the whole product) and takes the
largest tile within `SLACK` of the best estimate: fewer tiles cost the coordinator and the
wire less.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

SLACK = 1.10  # a larger tile is taken when its estimate is within 10% of the best
# A crowd may get tiles down to the project's tile halved this many times, never below
# MIN_TILE: 100 emulated laptops trained tiny-gpt 25% faster in tiles of 64 than of its 128;
# halved twice, tiles of 32 crowded the hosts' queues and the coordinator (2.9-5.4 s a step
# against 1.3: docs/performance-history.md, the twenty-eighth round).
HALVINGS = 1
MIN_TILE = 16


@dataclass(frozen=True, slots=True)
class Crowd:
    """The hosts a product will meet, as measured lately."""

    hosts: int  # hosts in recent contact, not quarantined (at least 1 is assumed)
    gflops: float  # their median measured speed
    overhead: float  # seconds a tile costs a host beyond its arithmetic and its bytes
    memory_bytes: int = 0  # the smallest memory for work among them; 0: no limit given
    seconds_per_byte: float = 0.0  # moving a tile's panels down (and the round trip's rest)
    # Uploading a tile, a byte, at the typical host's uplink as the coordinator timed its
    # reports (engine/uplinks.py).
    upload_per_byte: float = 0.0


@dataclass(frozen=True, slots=True)
class SizingConfig:
    # The coordinator's own work per result (issue, check, commit, assimilate), which no
    # number of hosts shares: measured at about 1 ms (docs/performance.md).
    coordinator_seconds: float = 0.001
    max_tile_bytes: int = 16 << 20  # the largest output tile, whatever the crowd
    # Seconds the typical host's uplink may take to upload one tile: a share of what the
    # scheduler lets a host queue (rules/scheduler.py, upload_budget), so that it holds a
    # few tiles (infinite: no cap).
    max_upload_seconds: float = math.inf


def tile_memory(tm: int, tn: int, k: int) -> int:
    """Bytes a volunteer needs for a tm x tn tile over k: both panels and the tile three
    times (as the volunteer counts it, volunteer/policy.py: the tile being computed and
    finished ones on their way, which it holds within its work half)."""
    return 4 * (tm * k + k * tn) + 12 * tm * tn


def tile_bytes(tm: int, tn: int, k: int, upload: bool = True) -> int:
    """Bytes a tile moves: both panels down and (`upload`) the tile up, float32; also what
    a Freivalds check of it reads."""
    return 4 * (tm * k + k * tn + (tm * tn if upload else 0))


def tile_seconds(tm: int, tn: int, k: int, crowd: Crowd) -> float:
    """Seconds a tm x tn tile over k takes a host of the crowd's median speed, round trip,
    panels and upload included."""
    return (
        2.0 * tm * tn * k / (max(crowd.gflops, 1e-3) * 1e9)
        + crowd.overhead
        + crowd.seconds_per_byte * tile_bytes(tm, tn, k)
        + crowd.upload_per_byte * 4 * tm * tn
    )


def estimate(
    m: int, n: int, k: int, tile: int, crowd: Crowd, replicas: int, config: SizingConfig
) -> float:
    """Seconds for the product cut into tiles of `tile`: the hosts work in waves of one tile
    each, unless the coordinator's own work per result is the longer."""
    tm, tn = min(tile, m), min(tile, n)
    tiles = math.ceil(m / tile) * math.ceil(n / tile)
    results = tiles * replicas
    per_tile = tile_seconds(tm, tn, k, crowd)
    waves = math.ceil(results / max(crowd.hosts, 1))
    return max(waves * per_tile, results * config.coordinator_seconds)


# A step asks for a handful of shapes, and the crowd is fitted again once a second at most
# (engine/crowd.py): the same question comes back for every product.
@functools.lru_cache(maxsize=1024)
def choose_tile(
    m: int, n: int, k: int, floor: int, crowd: Crowd, replicas: int, config: SizingConfig
) -> int:
    """The tile for an m x n x k product: `floor` (the project's tile) times a power of two,
    from `floor` / 2**HALVINGS (at least MIN_TILE) to no larger than the product, its blob
    limit, the crowd's memory or its typical uplink allow; the smallest of them when none
    fits."""
    candidates = [floor >> i for i in range(HALVINGS, 0, -1) if floor >> i >= MIN_TILE]
    candidates.append(floor)
    while candidates[-1] < max(m, n):
        candidates.append(candidates[-1] * 2)

    def fits(tile: int) -> bool:
        tm, tn = min(tile, m), min(tile, n)
        if 4 * tm * tn > config.max_tile_bytes:
            return False
        if 4 * tm * tn * crowd.upload_per_byte > config.max_upload_seconds:
            return False
        return not crowd.memory_bytes or tile_memory(tm, tn, k) <= crowd.memory_bytes

    usable = [t for t in candidates if fits(t)] or candidates[:1]
    times = {t: estimate(m, n, k, t, crowd, replicas, config) for t in usable}
    best = min(times.values())
    return max(t for t, seconds in times.items() if seconds <= best * SLACK)
