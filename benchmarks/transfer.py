"""Transfer benchmark: a 32 MB body between two processes on loopback, whole or in pieces.

Run:  .venv/bin/python benchmarks/transfer.py [--quick]

A panel going down to a volunteer and a report of tiles coming up are the largest bodies
tilehive moves (a larger project's product is tens of MB each way). The server is an aiohttp
app in a child process; this process is the client. Each way is timed the way aiohttp does
it by default (one whole write; the reader joins the chunks) and the way tilehive does it
(coordinator/server/api.py and volunteer/client.py: written a piece at a time, read into one
buffer as the chunks arrive), side by side in one run, as the median of ROUNDS transfers.
In pieces it is also timed through the server's local socket (coordinator/server/local.py),
as a volunteer on the coordinator's machine sends and receives, beside loopback TCP; the
client's CPU time of each way is in the note.
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
from coordinator.server import api, local  # noqa: E402
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
    listener = local.listen(backlog=16)
    if listener:
        await local.start(runner, *listener)
    print("ready", listener[1] if listener else "", flush=True)
    await asyncio.Event().wait()


async def measure(url: str, name: str, rounds: int) -> dict[str, tuple[float, float]]:
    """(seconds, client CPU-seconds) per transfer, medians of `rounds`, for each way and
    direction: whole and in pieces over TCP, in pieces over the local socket `name` (if
    any)."""
    body = os.urandom(SIZE)
    times: dict[str, list[tuple[float, float]]] = {}
    ways = [("whole", "tcp"), ("pieces", "tcp")] + ([("pieces", "local")] if name else [])

    def timed(key: str, started: tuple[float, float]) -> None:
        wall, cpu = time.perf_counter() - started[0], time.process_time() - started[1]
        times.setdefault(key, []).append((wall, cpu))

    async with (
        aiohttp.ClientSession() as tcp,
        aiohttp.ClientSession(connector=client.LocalConnector(name) if name else None) as near,
    ):
        for _ in range(rounds):
            for how, over in ways:
                session = near if over == "local" else tcp
                started = (time.perf_counter(), time.process_time())
                async with session.get(f"{url}/{how}") as resp:
                    if how == "pieces":
                        got = await client.read_into(resp.content, resp.content_length)
                    else:
                        got = await resp.read()
                assert len(got) == SIZE
                timed(f"down {how} {over}", started)
                started = (time.perf_counter(), time.process_time())
                data = client.in_pieces([body]) if how == "pieces" else body
                headers = {"Content-Length": str(SIZE)}
                async with session.post(f"{url}/{how}", data=data, headers=headers) as resp:
                    assert await resp.text() == str(SIZE)
                timed(f"up {how} {over}", started)
    return {
        key: (statistics.median(w for w, _ in values), statistics.median(c for _, c in values))
        for key, values in times.items()
    }


def run(quick: bool = False) -> list[Row]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        said, _, name = server.stdout.readline().strip().partition(" ")
        if said != "ready":
            raise RuntimeError("the transfer benchmark's server did not start")
        figures = asyncio.run(measure(f"http://127.0.0.1:{port}", name, 3 if quick else ROUNDS))
    finally:
        server.kill()
        server.wait()
    rows = []
    mb = SIZE / (1 << 20)
    ways = (("down", "a blob to a volunteer"), ("up", "a report to the coordinator"))
    rounds = 3 if quick else ROUNDS
    for direction, what in ways:
        whole, _ = figures[f"{direction} whole tcp"]
        pieces, cpu = figures[f"{direction} pieces tcp"]
        rows.append(
            Row(
                "transfer",
                f"{mb:.0f} MB, {what}, loopback: time in pieces / whole",
                f"{pieces / whole:.2f}x",
                note=f"{1000 * pieces:.0f} ms ({mb / pieces:.0f} MB/s) in pieces against "
                f"{1000 * whole:.0f} ms ({mb / whole:.0f} MB/s) whole; median of {rounds}",
            )
        )
        if f"{direction} pieces local" not in figures:
            continue
        near, near_cpu = figures[f"{direction} pieces local"]
        rows.append(
            Row(
                "transfer",
                f"{mb:.0f} MB, {what}, in pieces: the local socket / loopback TCP",
                f"{near / pieces:.2f}x",
                note=f"{1000 * near:.0f} ms ({mb / near:.0f} MB/s) against {1000 * pieces:.0f} "
                f"ms; the client's CPU {1000 * near_cpu:.0f} ms against {1000 * cpu:.0f}; "
                f"median of {rounds}",
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
