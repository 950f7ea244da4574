"""Uplink benchmark: one volunteer on a slow home uplink trains the larger project.

Run:  .venv/bin/python benchmarks/uplink.py [--quick] [--rate BYTES_PER_S] [--seconds S]

A real `tilehive coordinator DIR` trains the larger project (4 layers, width 512, tiles of
256, the Freivalds policy, so that one volunteer trains it) with one real volunteer daemon
of one thread, which reaches it through a TCP proxy in this process whose upload is
RATE bytes a second (1 MB/s, an 8 Mbit/s uplink), shared by its connections as a home
uplink is; downloads are not slowed. After SECONDS it reports, from the task log:

- the products finished;
- the tiles whose deadline passed before their report arrived (each is computed and sent
  again, and the uplink's time for the first copy is lost);
- the tiles the model took over the bytes the volunteer sent: the share of the uplink that
  was work, not retries, and what the wire adds to a tile (headers, framing).

The uplink, not the coordinator or the kernel, is what a step waits for here, so these
are the measures (not seconds per step: a step of the larger project uploads about a
gigabyte). Before the coordinator timed each host's uplink (docs/architecture.md,
"Uplinks"), tiles were cut and given deadlines by compute alone: 21 products, 24 tiles timed
out and 87% of the bytes sent taken as tiles; with it, 23, none and 99% (this file run in
both trees side by side: docs/performance-history.md, the fortieth round).

The volunteer must reach the proxy at an address that is not loopback (a loopback URL
switches it to the coordinator's local socket, around the proxy): the row is not measured
on a machine with loopback alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import os
import socket
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

from benchmarks import serve_switched  # noqa: E402
from benchmarks.report import Row  # noqa: E402
from benchmarks.training import LARGER  # noqa: E402
from coordinator.training import project as projects  # noqa: E402

RATE = 1_000_000  # bytes a second up: an 8 Mbit/s home uplink
SECONDS = 240.0


class Uplink:
    """A TCP proxy to `target` whose client-to-server bytes share `rate` bytes a second."""

    def __init__(self, target_port: int, rate: float) -> None:
        self.target_port = target_port
        self.rate = rate
        self.sent = 0  # bytes passed up to the coordinator
        self._free_at = 0.0  # monotonic time the uplink is next free

    async def _pipe(self, reader, writer, paced: bool) -> None:
        loop = asyncio.get_running_loop()
        try:
            while data := await reader.read(16384):
                if paced:
                    # Each chunk takes its turn on the one link, whichever connection it is.
                    now = loop.time()
                    self._free_at = max(now, self._free_at) + len(data) / self.rate
                    await asyncio.sleep(self._free_at - now)  # the link's pace
                    self.sent += len(data)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _serve(self, client_reader, client_writer) -> None:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(
            self._pipe(client_reader, writer, True), self._pipe(reader, client_writer, False)
        )

    async def start(self, host: str) -> tuple[asyncio.Server, int]:
        server = await asyncio.start_server(self._serve, host, 0)
        return server, server.sockets[0].getsockname()[1]


def outside_address() -> str | None:
    """This machine's address on its way out (not loopback), or None when it has none."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet is sent: only the route is looked up
        address = s.getsockname()[0]
        if not ipaddress.ip_address(address).is_loopback:
            return address
    return None


def task_log(directory: Path, until: float) -> dict:
    """What the coordinator logged by `until` (the window's end, not the stop after it):
    products finished, tiles timed out, tile bytes taken."""
    with sqlite3.connect(f"file:{directory / 'state.db'}?mode=ro", uri=True) as db:
        products = db.execute(
            "SELECT COUNT(*) FROM events WHERE kind = 'gemm' AND state = 'done' AND time <= ?",
            (until,),
        ).fetchone()[0]
        timed_out = db.execute(
            "SELECT COUNT(*) FROM events WHERE kind = 'result' AND state = 'no_reply' "
            "AND time <= ?",
            (until,),
        ).fetchone()[0]
        taken = db.execute(
            "SELECT COALESCE(SUM(4 * (w.i1 - w.i0) * (w.j1 - w.j0)), 0) FROM workunits w "
            "JOIN events e ON e.wu_id = w.id AND e.kind = 'wu' AND e.state = 'validated' "
            "WHERE e.time <= ?",
            (until,),
        ).fetchone()[0]
    return {"products": products, "timed_out": timed_out, "taken": taken}


async def measure(directory: Path, address: str, rate: float, seconds: float) -> dict:
    log = directory.parent / "coordinator.log"
    coordinator, _, port = serve_switched.start_training(directory, log)
    uplink = Uplink(port, rate)
    server, proxy_port = await uplink.start(address)
    crew = []
    try:
        deadline = time.monotonic() + 120
        while "training from" not in log.read_text():
            if time.monotonic() > deadline or coordinator.poll() is not None:
                raise RuntimeError(f"the coordinator did not start: {log.read_text()[-2000:]}")
            await asyncio.sleep(0.2)  # polling with a deadline
        url = f"http://{address}:{proxy_port}"
        crew = serve_switched.start_volunteers(url, directory.parent / "volunteers", 1)
        await asyncio.sleep(seconds)  # the window measured, not a wait for anything
        ended, sent = time.time(), uplink.sent
        if coordinator.poll() is not None or crew[0].poll() is not None:
            raise RuntimeError(f"a process ended early: {log.read_text()[-2000:]}")
    finally:
        # Off the loop: the volunteer leaves through the proxy, which runs on it.
        await asyncio.to_thread(serve_switched.stop_all, crew)
        await asyncio.to_thread(serve_switched.stop_all, [coordinator])
        server.close()
    return {**task_log(directory, ended), "sent": sent}


def run(quick: bool = False, rate: float = RATE, seconds: float | None = None) -> list[Row]:
    seconds = seconds or (60.0 if quick else SECONDS)
    address = outside_address()
    if address is None:
        return [Row("uplink", "not measured", "-", note="no address but loopback here")]
    with tempfile.TemporaryDirectory(prefix="tilehive-uplink-") as tmp:
        directory = Path(tmp) / "project"
        projects.create(
            directory,
            **{
                **LARGER,
                "work.policy": "freivalds",
                "training.steps": 100_000,
                "training.checkpoint_every": 100_000,
                "training.eval_every": 100_000,
                "corpus.max_mb": 1,
            },
        )
        got = asyncio.run(measure(directory, address, rate, seconds))
    setup = (
        f"the larger project, freivalds, 1 volunteer daemon of 1 thread whose uplink is "
        f"{rate / 1e6:g} MB/s, {seconds:g} s"
    )
    return [
        Row(
            "uplink",
            f"products finished in {seconds:g} s / tiles whose deadline passed on the way",
            f"{got['products']} / {got['timed_out']}",
            note=setup,
        ),
        Row(
            "uplink",
            "tile bytes the model took / bytes the volunteer sent",
            f"{got['taken'] / max(got['sent'], 1):.0%}",
            note=f"{got['taken'] / 1e6:.0f} MB of tiles taken of {got['sent'] / 1e6:.0f} MB "
            f"sent ({got['sent'] / seconds / rate:.0%} of the uplink's {seconds:g} s)",
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rate", type=float, default=RATE, help="bytes a second up")
    parser.add_argument("--seconds", type=float, default=None)
    args = parser.parse_args()
    for row in run(args.quick, args.rate, args.seconds):
        print(json.dumps(row.__dict__))


if __name__ == "__main__":
    main()
