"""Every setting of a coordinator, and the project's secret key for the Freivalds check."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.rules import trust
from coordinator.rules.access import AccessConfig
from coordinator.rules.scheduler import SchedulerConfig
from coordinator.rules.sizing import SizingConfig
from coordinator.work.records import Policy, Redundancy


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    """Every setting of a coordinator; project.toml and the command line map onto these."""

    directory: Path
    policy: Policy = Policy.QUORUM
    redundancy: Redundancy = field(default_factory=Redundancy)
    tile: int = 128
    # On: each product's tile is chosen from the hosts at hand, `tile` times a power of two
    # (rules/sizing.py); off: every product is cut into tiles of `tile`.
    tile_sizing: bool = False
    sizing: SizingConfig = field(default_factory=SizingConfig)
    freivalds_rounds: int = 8
    tail_fraction: float = 0.9  # share of a GEMM's tiles done before spares are issued
    # A work unit whose every replica in progress has been out this many times what a tile
    # takes the crowd (and at least straggler_floor seconds) gets a spare replica: a host
    # that sits on a product's only tile (slow, stopped, or hoarding) holds its step up
    # seconds, not the minutes of its deadline.
    straggler_factor: float = 4.0
    straggler_floor: float = 2.0
    max_blob_bytes: int = 64 << 20
    recent_blob_bytes: int = 256 << 20  # the panels and tiles stored last, kept for readers
    # Panels and tiles held in memory, not yet written, at most: most die at the next
    # checkpoint unwritten (BlobStore), and those beyond it are written, oldest first.
    unwritten_blob_bytes: int = 1 << 30
    max_report_bytes: int = 96 << 20
    max_request_bytes: int = 1 << 20
    # Stored work replies (for retried requests) are kept this many seconds, and at most
    # `replies_per_host` of them per host; older ones are pruned as the project runs.
    reply_ttl: float = 3600.0
    replies_per_host: int = 64
    long_poll: float = 2.0  # seconds a work request may wait for work to appear
    no_work_delay: float = 1.0  # seconds a host is asked to wait when there is no work
    # Idle hosts are asked to wait longer when there are many, so that together they ask
    # for work about this often a second (rules/scheduler.py, idle_delay).
    idle_asks_per_s: float = 500.0
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    trust: trust.TrustConfig = field(default_factory=trust.TrustConfig)
    seed: int | None = None  # scheduler randomness (adaptive replication); None: from the OS
    access: AccessConfig = field(default_factory=AccessConfig)
    # A request body may take body_timeout seconds, and one more for each body_min_rate
    # bytes that have arrived: 16 KiB/s is a 128 kbit/s uplink, slower than a phone's.
    body_timeout: float = 60.0
    body_min_rate: float = 16 << 10
    # Seconds a connection may go without a complete request line and headers, from its
    # start or the end of the previous reply (slowloris); it is also the idle keep-alive.
    header_timeout: float = 20.0


def load_secret(directory: Path) -> bytes:
    """The verifier's Freivalds key: 32 random bytes in DIR/secret.key, readable only by us."""
    path = directory / "secret.key"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
            f.flush()
            os.fsync(f.fileno())
    key = path.read_bytes()
    if len(key) != 32:
        raise RuntimeError(f"{path} must hold 32 bytes; delete it to make a new key")
    return key
