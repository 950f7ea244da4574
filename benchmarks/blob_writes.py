"""Blob write benchmark: the CPU a coordinator spends writing large blobs to DIR/blobs,
around the page cache (O_DIRECT through an aligned buffer, the default) against through it.

Run:  .venv/bin/python benchmarks/blob_writes.py [--rounds N]

Each round writes the same 64 tiles of 16 MB (1 GB) into a fresh blob store under the
system's temporary folder, once each way, alternately; the figures are the medians of the
rounds' CPU seconds (this process's, kernel time included) and wall seconds.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import numpy as np  # noqa: E402

import kernels  # noqa: E402
from benchmarks.report import Row, run_alone  # noqa: E402
from coordinator.state.blobs import BlobStore  # noqa: E402

TILES, SIDE = 64, 2048  # 64 tiles of 2048 x 2048 float32: 1 GB


def write_all(blobs: list[tuple[bytes, str]], direct: bool) -> tuple[float, float, bool]:
    """CPU and wall seconds to write `blobs` into a fresh store; whether it wrote direct."""
    root = tempfile.mkdtemp(prefix="tilehive-blob-writes-")
    try:
        store = BlobStore(root, max_blob_bytes=64 << 20, memory_bytes=0)
        store.direct = direct
        cpu, wall = time.process_time(), time.perf_counter()
        for data, blob in blobs:
            store.put_many([(data, blob)], verified=True)
        return time.process_time() - cpu, time.perf_counter() - wall, store.direct
    finally:
        shutil.rmtree(root)


def run(rounds: int = 3) -> list[Row]:
    rng = np.random.default_rng(0)
    tile = kernels.encode_array(rng.standard_normal((SIDE, SIDE), dtype=np.float32))
    # Distinct ids for the same bytes: a store trusts ids given as verified.
    blobs = [(tile, f"{i:04x}" + kernels.blob_id(tile)[4:]) for i in range(TILES)]
    gigabytes = TILES * len(tile) / 1e9
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    direct_taken = True
    for _ in range(rounds):
        for direct in (False, True):
            cpu, wall, taken = write_all(blobs, direct)
            times[direct].append((cpu, wall))
            direct_taken = direct_taken and (taken or not direct)
    (cpu_b, wall_b), (cpu_d, wall_d) = (
        (statistics.median(c for c, _ in times[d]), statistics.median(w for _, w in times[d]))
        for d in (False, True)
    )
    where = "" if direct_taken else "; this file system refused O_DIRECT, both were buffered"
    return [
        Row(
            "blob writes",
            f"CPU to write {gigabytes:.1f} GB of 16 MB blobs: around the page cache / through it",
            f"{cpu_d / cpu_b:.2f}x",
            note=f"{cpu_d:.2f} against {cpu_b:.2f} CPU-s; wall {wall_d:.2f} against "
            f"{wall_b:.2f} s; medians of {rounds} alternating rounds{where}",
        )
    ]


def main() -> None:
    run_alone(__doc__, run, rounds=3)


if __name__ == "__main__":
    main()
