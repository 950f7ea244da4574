"""Transfer benchmark: a 32 MB body between two processes on loopback, whole or in pieces.

Run:  .venv/bin/python benchmarks/transfer.py [--quick]

A panel going down to a volunteer and a report of tiles coming up are the largest bodies
tilehive moves (a larger project's product is tens of MB each way). The server is an aiohttp
app in a child process; this process is the client. Each way is timed the way aiohttp does
it by default (one whole write; the reader joins the chunks) and the way tilehive does it
(coordinator/server/api.py and volunteer/client.py: written a piece at a time, read into one
buffer as the chunks arrive), side by side in one run, as the median of ROUNDS transfers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402

from benchmarks.report import Row  # noqa: E402
from benchmarks.serve_switched import free_port  # noqa: E402
from coordinator.server import api  # noqa: E402
from volunteer import client  # noqa: E402

SIZE = 32 << 20
ROUNDS = 10


async def serve(port: int) -> None:
    """The server side: GET /whole and /pieces send SIZE bytes; POST to either reads them."""
    data = os.urandom(SIZE)

    async def download(request: web.Request) -> web.StreamResponse:
        if request.match_info["how"] == "pieces":
            return await api.send_in_pieces(request, [data], "application/octet-stream")
        return web.Response(body=data)

    async def upload(request: web.Request) -> web.Response:
        if request.match_info["how"] == "pieces":
            body = await api.read_into(request.content, request.content_length)
        else:
            body = await request.content.readexactly(request.content_length)
        return web.Response(text=str(len(body)))

    app = web.Application(client_max_size=2 * SIZE)
    app.router.add_get("/{how}", download)
    app.router.add_post("/{how}", upload)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print("ready", flush=True)
    await asyncio.Event().wait()


async def measure(url: str, rounds: int) -> dict[str, float]:
    """Seconds per transfer, median of `rounds`, for each way and direction."""
    body = os.urandom(SIZE)
    times: dict[str, list[float]] = {}
    async with aiohttp.ClientSession() as session:
        for _ in range(rounds):
            for how in ("whole", "pieces"):
                started = time.perf_counter()
                async with session.get(f"{url}/{how}") as resp:
                    if how == "pieces":
                        got = await client.read_into(resp.content, resp.content_length)
                    else:
                        got = await resp.read()
                assert len(got) == SIZE
                times.setdefault(f"down {how}", []).append(time.perf_counter() - started)
                started = time.perf_counter()
                data = client.in_pieces([body]) if how == "pieces" else body
                headers = {"Content-Length": str(SIZE)}
                async with session.post(f"{url}/{how}", data=data, headers=headers) as resp:
                    assert await resp.text() == str(SIZE)
                times.setdefault(f"up {how}", []).append(time.perf_counter() - started)
    return {key: statistics.median(values) for key, values in times.items()}


def run(quick: bool = False) -> list[Row]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError("the transfer benchmark's server did not start")
        figures = asyncio.run(measure(f"http://127.0.0.1:{port}", 3 if quick else ROUNDS))
    finally:
        server.kill()
        server.wait()
    rows = []
    mb = SIZE / (1 << 20)
    ways = (("down", "a blob to a volunteer"), ("up", "a report to the coordinator"))
    for direction, what in ways:
        whole, pieces = figures[f"{direction} whole"], figures[f"{direction} pieces"]
        rows.append(
            Row(
                "transfer",
                f"{mb:.0f} MB, {what}, loopback: time in pieces / whole",
                f"{pieces / whole:.2f}x",
                note=f"{1000 * pieces:.0f} ms ({mb / pieces:.0f} MB/s) in pieces against "
                f"{1000 * whole:.0f} ms ({mb / whole:.0f} MB/s) whole; median of "
                f"{3 if quick else ROUNDS}",
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve))
        return
    for row in run(args.quick):
        print(f"{row.area} {row.measure}: {row.value}  ({row.note})")


if __name__ == "__main__":
    main()
