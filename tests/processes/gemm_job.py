"""A real coordinator process that computes the products in an .npz with volunteers.

Used by the kill-and-restart tests: run it, SIGKILL it, run it again with the same arguments;
the second run resumes from the project directory and writes the products to OUTPUT.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

import numpy as np

from coordinator.engine.coordinator import Coordinator, CoordinatorConfig
from coordinator.server.api import serve
from coordinator.state.sqlite import SqliteStore
from coordinator.work.records import Policy, Redundancy


async def run(args: argparse.Namespace) -> None:
    coordinator = Coordinator(
        CoordinatorConfig(
            directory=args.directory,
            tile=args.tile,
            policy=Policy(args.policy),
            redundancy=Redundancy(delay_bound=args.delay_bound),
            no_work_delay=0.2,
            recent_blob_bytes=args.blob_memory,
            unwritten_blob_bytes=args.blob_memory,
        ),
        SqliteStore(Path(args.directory) / "state.db"),
    )
    runner, url = await serve(coordinator, "127.0.0.1", args.port)
    print(url, flush=True)
    queue = coordinator.products
    data = np.load(args.operands)
    count = len([name for name in data.files if name.startswith("a")])
    products = await asyncio.gather(
        *(
            queue.matmul(
                data[f"a{i}"],
                data[f"b{i}"],
                trans_a=bool(data[f"flags{i}"][0]),
                trans_b=bool(data[f"flags{i}"][1]),
                label=f"g{i}",
            )
            for i in range(count)
        )
    )
    tmp = args.output + ".tmp.npz"
    np.savez(tmp, **{f"c{i}": c for i, c in enumerate(products)})
    os.replace(tmp, args.output)
    await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("operands")
    parser.add_argument("output")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tile", type=int, default=16)
    parser.add_argument("--policy", default="quorum")
    parser.add_argument("--delay-bound", type=float, default=60.0)
    parser.add_argument("--blob-memory", type=int, default=64 << 20, help="0: serve from disk")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
