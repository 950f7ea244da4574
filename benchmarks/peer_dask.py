"""Peer benchmark: the same tiled products on Dask distributed and on tilehive, same machine,
same run, as the ratio of their times.

Run:  .venv/bin/python benchmarks/peer_dask.py [--quick]      (needs: pip install -e .[bench])

The products (one after another, as a training step's dependent products are) are cut into
the same tiles both ways, and every tile is computed by the same deterministic kernel
(kernels.gemm, one thread):

- Dask: a LocalCluster of N worker processes with one thread each; per product the client
  scatters the row and column panels, submits one task per tile, gathers the tiles and
  assembles the product.
- tilehive: a coordinator process (benchmarks/serve_switched.py: aiohttp on loopback,
  SQLite, blob store) and N real volunteer daemons (`tilehive volunteer start URL
  --threads 1`), with the Freivalds policy (one replica per tile, like Dask's one task, and
  a Freivalds check of it) and with the default quorum policy (two replicas per tile
  until hosts earn trust).

N is the number of cores. Both clocks start with the workers up and warm and stop when the
last product is whole; the products must be bitwise equal both ways. The two run in turn,
three rounds (one with --quick), and each ratio is the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import numpy as np  # noqa: E402

from benchmarks import serve_switched  # noqa: E402
from benchmarks.report import Row  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def tile_product(a_panel: np.ndarray, b_panel: np.ndarray) -> np.ndarray:
    import kernels

    return kernels.gemm(a_panel, b_panel, threads=1)


def warm() -> bool:
    import kernels

    x = np.ones((64, 64), np.float32)
    kernels.gemm(x, x, threads=1)
    return True


def operands(products: int, size: int, k: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        (
            rng.standard_normal((size, k)).astype(np.float32),
            rng.standard_normal((k, size)).astype(np.float32),
        )
        for _ in range(products)
    ]


def run_dask(pairs, tile: int, workers: int) -> tuple[float, list[np.ndarray]]:
    from dask.distributed import Client, LocalCluster

    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    with (
        LocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            silence_logs=40,
        ) as cluster,
        Client(cluster) as client,
    ):
        client.run(warm)
        outputs = []
        started = time.perf_counter()
        for a, b in pairs:
            m, n = a.shape[0], b.shape[1]
            rows = client.scatter(
                [np.ascontiguousarray(a[i : i + tile]) for i in range(0, m, tile)]
            )
            cols = client.scatter(
                [np.ascontiguousarray(b[:, j : j + tile]) for j in range(0, n, tile)]
            )
            futures = {
                (i, j): client.submit(tile_product, r, c, pure=False)
                for i, r in enumerate(rows)
                for j, c in enumerate(cols)
            }
            tiles = client.gather(futures)
            out = np.empty((m, n), np.float32)
            for (i, j), t in tiles.items():
                out[i * tile : (i + 1) * tile, j * tile : (j + 1) * tile] = t
            outputs.append(out)
        seconds = time.perf_counter() - started
    return seconds, outputs


def run_tilehive(workdir: Path, npz: Path, tile: int, workers: int, policy: str) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    directory = workdir / policy
    output = workdir / f"{policy}-out.npz"
    process, url = serve_switched.start(
        directory,
        "--operands",
        str(npz),
        "--tile",
        str(tile),
        "--policy",
        policy,
        "--wait-hosts",
        str(workers),
        "--output",
        str(output),
    )
    crew = []
    try:
        crew = serve_switched.start_volunteers(url, workdir / f"{policy}-volunteers", workers)
        row = serve_switched.result(process, 900)
    finally:
        serve_switched.stop_all(crew)
        serve_switched.close(process)
    with np.load(output) as data:
        row["outputs"] = [data[f"c{i}"] for i in range(len(data.files))]
    return row


def run(quick: bool = False) -> list[Row]:
    try:
        import dask.distributed  # noqa: F401
    except ImportError:
        return [
            Row(
                "peer",
                "tilehive / Dask time for the same tiled products",
                "skipped",
                note="dask not installed: pip install -e .[bench]",
            )
        ]
    workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2
    # (products, size, k, tile): large tiles, where compute weighs, and tiles of training's
    # size (128), where the cost per tile does.
    shapes = [(2, 1024, 1024, 256)] if quick else [(6, 2048, 2048, 512), (8, 1024, 512, 128)]
    policies = ["freivalds"] if quick else ["freivalds", "quorum"]
    rows = []
    for products, size, k, tile in shapes:
        rows += compare(products, size, k, tile, workers, policies, 1 if quick else 3)
    return rows


def compare(
    products: int, size: int, k: int, tile: int, workers: int, policies: list[str], repeats: int
) -> list[Row]:
    """Dask, then tilehive under each policy, `repeats` times in turn; each ratio is the
    median of the rounds' ratios (the machine may be busy with something else for a while)."""
    pairs = operands(products, size, k)
    shape = (
        f"{products} products {size}x{size}x{k} one after another, tiles of {tile} "
        f"({(size // tile) ** 2} per product), {workers} workers of 1 thread"
    )
    dask_times: list[float] = []
    ratios: dict[str, list[float]] = {p: [] for p in policies}
    last: dict[str, dict] = {}
    equal = {p: True for p in policies}
    with tempfile.TemporaryDirectory(prefix="tilehive-peer-") as tmp:
        workdir = Path(tmp)
        npz = workdir / "operands.npz"
        arrays = {}
        for i, (a, b) in enumerate(pairs):
            arrays[f"a{i}"], arrays[f"b{i}"] = a, b
        np.savez(npz, **arrays)
        for round_ in range(repeats):
            dask_seconds, reference = run_dask(pairs, tile, workers)
            dask_times.append(dask_seconds)
            for policy in policies:
                r = run_tilehive(workdir / f"round-{round_}", npz, tile, workers, policy)
                ratios[policy].append(r["seconds"] / dask_seconds)
                same = all(
                    x.tobytes() == y.tobytes()
                    for x, y in zip(r.pop("outputs"), reference, strict=True)
                )
                if not same:
                    print(f"PRODUCTS DIFFER: tilehive ({policy}) against Dask", file=sys.stderr)
                equal[policy] = equal[policy] and same
                last[policy] = r
    rounds = f"median of {repeats} rounds" if repeats > 1 else "one round"
    rows = [
        Row(
            "peer",
            f"Dask distributed seconds, tiles of {tile} (LocalCluster, kernels.gemm per tile)",
            f"{statistics.median(dask_times):.2f}",
            note=f"{shape}; {rounds}: {', '.join(f'{t:.2f}' for t in dask_times)}",
        )
    ]
    for policy in policies:
        r = last[policy]
        rows.append(
            Row(
                "peer",
                f"tilehive / Dask time, tiles of {tile}, {policy} policy",
                f"{statistics.median(ratios[policy]):.2f}x",
                note=f"{rounds}: {', '.join(f'{x:.2f}' for x in ratios[policy])}; last round "
                f"{r['seconds']:.2f}s, {r['stats']['tiles_in']} results for {r['workunits']} "
                "tiles (spares and, under quorum, replicas until hosts earn trust); products "
                f"bitwise {'equal to' if equal[policy] else 'DIFFERENT from'} Dask's",
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller products, one policy")
    args = parser.parse_args()
    for row in run(args.quick):
        print(f"{row.area} {row.measure}: {row.value}  ({row.note})")


if __name__ == "__main__":
    main()
