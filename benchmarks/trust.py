"""Trust benchmark: the poisoning channel below the Freivalds bound, and what closing it costs.

Run:  .venv/bin/python benchmarks/trust.py [--quick]

1. The channel. A host trusted with lone tiles (adaptive replication) is checked by
   Freivalds only, whose tolerance must admit honest float32 rounding. The largest bias that
   a liar can add to every element of a tile and still pass, found by bisection over tiles
   of random operands at the project's default rounds, is reported as a share of the tile's
   RMS: that is how far such a host could steer every gradient it computes.
2. The cost of closing it. The default policy now replicates every tile (quorum of two, the
   second replica uploading only its hash). Honest in-process hosts compute the same
   products with adaptive replication on and off; the rows give the results computed per
   work unit and the bytes uploaded per work unit, side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import msgpack  # noqa: E402
import numpy as np  # noqa: E402

import kernels  # noqa: E402
from benchmarks.report import Row  # noqa: E402
from coordinator.engine.config import CoordinatorConfig  # noqa: E402
from coordinator.engine.coordinator import Coordinator  # noqa: E402
from coordinator.rules.scheduler import SchedulerConfig  # noqa: E402
from coordinator.state.memory import MemoryStore  # noqa: E402
from coordinator.training.project import WorkSettings  # noqa: E402
from coordinator.work.protocol import (  # noqa: E402
    RegisterRequest,
    ReportRequest,
    ResultReport,
    WorkRequest,
)
from coordinator.work.records import Policy  # noqa: E402
from validation import freivalds  # noqa: E402

ROUNDS = WorkSettings().freivalds_rounds  # the project default


def largest_passing_bias(n: int, k: int, rng: np.random.Generator) -> float:
    """The largest constant added to every element of an honest n x n tile that still
    passes the check, as a share of the tile's RMS."""
    a = rng.standard_normal((n, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    c = kernels.gemm(a, b)
    rms = float(np.sqrt(np.mean(np.square(c, dtype=np.float64))))
    key = bytes(32)

    def passes(bias: float) -> bool:
        lied = (c + np.float32(bias)).astype(np.float32)
        return freivalds.verify(a, b, lied, key=key, wu_id="w" * 64, rounds=ROUNDS).ok

    low, high = 0.0, rms
    while passes(high):
        low, high = high, 2 * high
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if passes(middle) else (low, middle)
    return low / rms


async def computed_per_workunit(adaptive: bool, products: int, hosts: int) -> tuple[float, float]:
    """Results computed and bytes uploaded per work unit by honest hosts that first earn
    trust, for one setting of adaptive replication."""
    rng = np.random.default_rng(3)
    with tempfile.TemporaryDirectory() as tmp:
        config = CoordinatorConfig(
            directory=Path(tmp),
            tile=32,
            policy=Policy.QUORUM,
            seed=1,
            long_poll=0.02,
            scheduler=SchedulerConfig(adaptive_replication=adaptive),
        )
        co = Coordinator(config, MemoryStore())
        await co.start()
        uploaded = [0]
        stop = asyncio.Event()

        async def host(name: str) -> int:
            record, _ = await co.hosts.register(RegisterRequest(name, 10.0, 1, 512), time.time())
            done = 0
            while not stop.is_set():
                request = WorkRequest(f"{name}-{done}-{time.monotonic_ns()}", 8, (), (), None)
                reply = msgpack.unpackb(
                    await co.requests.request_work(record, request, time.time())
                )
                entries = []
                for a in reply["assignments"]:
                    tile = kernels.gemm(
                        co.blobs.get_array(a["a"]),
                        co.blobs.get_array(a["b"]),
                        trans_a=a["trans_a"],
                        trans_b=a["trans_b"],
                    )
                    blob = kernels.encode_array(tile)
                    upload = blob if a["upload"] == "tile" else None
                    uploaded[0] += len(upload) if upload else 32
                    entries.append(
                        ResultReport(a["result_id"], kernels.blob_id(blob), upload, None, 0.0)
                    )
                if entries:
                    await co.reports.report(record, ReportRequest(tuple(entries)), time.time())
                    done += len(entries)
            return done

        crew = [asyncio.create_task(host(f"h{i}")) for i in range(hosts)]
        workunits = 0
        for step in range(products):
            a = rng.standard_normal((128, 64)).astype(np.float32)
            b = rng.standard_normal((64, 128)).astype(np.float32)
            await co.products.matmul(a, b, step=step)
            workunits += (128 // 32) ** 2
        stop.set()
        computed = sum(await asyncio.gather(*crew))
        await co.stop()
    return computed / workunits, uploaded[0] / workunits


def run(quick: bool = False) -> list[Row]:
    rng = np.random.default_rng(11)
    rows = []
    for n in (128,) if quick else (128, 256, 512):
        shares = [largest_passing_bias(n, n, rng) for _ in range(2 if quick else 5)]
        rows.append(
            Row(
                "trust",
                f"bias on every element of a {n}x{n}x{n} tile that passes Freivalds "
                f"({ROUNDS} rounds), share of the tile's RMS",
                f"{max(shares):.2e}",
                note=f"largest of {len(shares)} tiles of standard normal operands "
                f"(smallest {min(shares):.2e}); the channel a trusted lone host has",
            )
        )
    products = 10 if quick else 40
    on = asyncio.run(computed_per_workunit(True, products, 3))
    off = asyncio.run(computed_per_workunit(False, products, 3))
    rows.append(
        Row(
            "trust",
            "results computed per work unit: adaptive replication on / off (the default)",
            f"{on[0]:.2f} / {off[0]:.2f}",
            note=f"3 honest hosts earning trust over {products} products of 16 tiles; "
            f"off costs {off[0] / on[0]:.2f}x the compute",
        )
    )
    rows.append(
        Row(
            "trust",
            "bytes uploaded per work unit: adaptive replication on / off (the default)",
            f"{on[1]:.0f} / {off[1]:.0f}",
            note="the second replica of a quorum uploads its 32-byte hash, not the tile",
        )
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tiles and products")
    args = parser.parse_args()
    for row in run(args.quick):
        print(f"{row.area} {row.measure}: {row.value}  ({row.note})")


if __name__ == "__main__":
    main()
