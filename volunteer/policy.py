"""The pull loop's pure rules: when to ask for work, how much, what fits, when to report."""

from __future__ import annotations

from typing import Any

MB = 1 << 20
WORKSPACE_PER_THREAD = 2 * MB  # the kernel's packing buffers, with room to spare
# What the daemon's own memory grows by once it works (Python's objects, answers and
# reports being read and written, the sockets' buffers), beyond its footprint at start
# and the budget: 11-13 MB at the larger project's peaks (docs/performance-history.md,
# the twentieth round).
GROWTH = 16 * MB
MAX_CAPACITY = 64  # tiles queued at most: as many as a trusted host may hold
REPORT_BATCH = 64  # results per report at most
REPORT_BYTES = 8 * MB  # tile bytes per report: a report is sent once this much is waiting
# On a slow uplink a report holds at most what it moves in this many seconds: each tile
# waits for the whole report it rides in, and the coordinator gives a tile a deadline of
# seconds (5 s and 20x its compute: rules/scheduler.py, report_deadline).
REPORT_SECONDS = 4.0
UPLOAD_SAMPLE_BYTES = 256 << 10  # reports this large measure the uplink (smaller: the trip)
MAX_CACHED_IDS = 4096  # the protocol's limit on a work request's `cached`
UNSIZED_BLOB = 64 * MB  # the download limit of an operand whose size the assignment omits
QUEUE_SECONDS = 2.0  # the work a host asks for, in seconds of its own compute
INLINE_SECONDS = 0.002  # a tile expected to compute in less runs on the event loop
# Downloads of a tile's operands that may not match their names before the tile is
# reported as an error (which costs this host trust): the first are the network's fault.
CORRUPT_FETCHES = 3


def time_to_ask(queued: int, capacity: int, short: bool = False) -> bool:
    """Ask for work once the queue is down to half of what we want (BOINC's work-fetch
    hysteresis): one request then brings several tiles, not one request per tile.

    `short`: the last answer brought fewer tiles than asked for. Then the coordinator has
    nothing more for now, and asking again after every tile would be a spin (hundreds of
    requests a second with small tiles); the next ask waits for an empty queue, as a long
    poll."""
    if capacity <= 0 or (short and queued > 0):
        return False
    return queued <= (queued + capacity) // 2


def capacity(queued: int, gflops: float, tile_flops: float, most: int = MAX_CAPACITY) -> int:
    """How many more tiles to ask for: about QUEUE_SECONDS of work at `gflops`, judged by
    the last tile's size (two before any tile is known), at most `most` queued."""
    if tile_flops and gflops:
        wanted = int(QUEUE_SECONDS * gflops * 1e9 / tile_flops) + 1
    else:
        wanted = 2
    return max(0, min(most, wanted) - queued)


def ask_ahead(compute_seconds: float, round_trip: float | None) -> bool:
    """Ask for the next work while this tile computes (the answer then waits in the queue
    when the tile is done) when the tile takes longer than two round trips: one to ask,
    one for the coordinator to apply the report riding on the ask. With shorter tiles the
    ask would still be out when the tile is done, and its report would need a call of its
    own: twice the calls for the same work. No round trip measured yet: not yet."""
    return round_trip is not None and compute_seconds > 2 * round_trip


def computes_inline(compute_seconds: float | None) -> bool:
    """Compute a tile on the event loop rather than on a worker thread when it is expected
    to take under INLINE_SECONDS: the hop to the thread and back (its wake-up, the loop's
    self-pipe, and the GIL won back from the loop) costs as much as a tiny tile, and the
    loop is held for a millisecond or two at most. Speed not yet measured: on the thread."""
    return compute_seconds is not None and compute_seconds < INLINE_SECONDS


def report_bytes(upload_rate: float | None) -> int:
    """Tile bytes per report: REPORT_BYTES, or what the host's measured uplink (bytes a
    second; None: not yet measured) moves in REPORT_SECONDS, if less. Unmeasured, a host
    sends full reports: a fast one never needs the measure, a slow one has it after one."""
    if not upload_rate:
        return REPORT_BYTES
    return max(1, min(REPORT_BYTES, int(upload_rate * REPORT_SECONDS)))


def report_batch(
    pending: list[dict[str, Any]], max_bytes: int = REPORT_BYTES
) -> list[dict[str, Any]]:
    """The reports to send next: the oldest, up to REPORT_BATCH of them and `max_bytes` of
    tiles (at least one). One report per product share rather than per few tiles: each
    report is a round trip, and the coordinator commits it to disk before it answers."""
    size = 0
    for count, report in enumerate(pending[:REPORT_BATCH]):
        size += len(report.get("tile", b""))
        if size > max_bytes and count:
            return pending[:count]
    return pending[:REPORT_BATCH]


def report_due(pending: list[dict[str, Any]], queued: int, max_bytes: int = REPORT_BYTES) -> bool:
    """Send reports when nothing is left to compute, or when a full batch is waiting."""
    if not pending:
        return False
    return not queued or len(pending) >= REPORT_BATCH or waiting_bytes(pending) >= max_bytes


def tile_memory(assignment: dict[str, Any], threads: int) -> int:
    """Bytes one assignment needs beyond the operand cache: the kernel's per-thread packing
    workspace and the tile three times over. The kernel writes the tile into its blob and
    the report sends that blob uncopied, so the other two make room for finished tiles
    still on their way to the coordinator while this one computes (room_to_compute)."""
    return 3 * output_bytes(assignment) + threads * WORKSPACE_PER_THREAD


def output_bytes(assignment: dict[str, Any]) -> int:
    """The bytes of an assignment's float32 output tile."""
    return 4 * assignment["m"] * assignment["n"]


def waiting_bytes(reports: list[dict[str, Any]]) -> int:
    """The tile bytes these reports hold (a report in error holds none)."""
    return sum(len(r.get("tile", b"")) for r in reports)


def room_to_compute(
    assignment: dict[str, Any], threads: int, budget: int | None, reports: list[dict[str, Any]]
) -> bool:
    """Whether a tile may be computed now beside the tiles of `reports` not yet delivered:
    those tiles, this one and the kernel's workspace within the work half of `budget`
    (None: no limit). A report's tile stays in memory until the coordinator has answered
    it, and on an uplink slower than the kernel finished tiles would pile up past the
    memory limit. With nothing waiting, always: memory_refusal has judged the tile alone."""
    if budget is None:
        return True
    waiting = waiting_bytes(reports)
    need = output_bytes(assignment) + threads * WORKSPACE_PER_THREAD
    return not waiting or waiting + need <= budget // 2


def work_budget_mb(budget: int | None, threads: int) -> int:
    """What a host tells the coordinator it can hold for one work unit: half its memory
    budget (the other half caches operands), less the kernel's workspace; 0: no limit."""
    if budget is None:
        return 0
    return max(1, int((budget // 2 - threads * WORKSPACE_PER_THREAD) / MB))


def budget_for(work_mb: int, threads: int) -> int:
    """The memory budget of a host that offers `work_mb` for one work unit (the inverse
    of work_budget_mb)."""
    return 2 * (work_mb * MB + threads * WORKSPACE_PER_THREAD)


def memory_refusal(assignment: dict[str, Any], threads: int, budget: int | None, limit: str) -> str:
    """Why an assignment does not fit half of `budget` (the other half caches operands),
    in words naming the `limit`; "" if it fits or there is no budget."""
    if budget is None:
        return ""
    need = tile_memory(assignment, threads) + assignment["a_bytes"] + assignment["b_bytes"]
    if need <= budget // 2:
        return ""
    return (
        f"insufficient memory: the tile needs {need / MB:.1f} MB, {limit} "
        f"leaves {budget / 2 / MB:.1f} MB for work"
    )
