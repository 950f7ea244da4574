"""The read-only dashboard at `/`: what an operator sees of a running project.

Banners (done, paused, why work waits, and "coordinator unreachable" once the page goes
stale), progress, each product's pipeline, the task stream, loss, tiles/s, hosts and the
recent rejections.

Server-rendered HTML with inline SVG charts (no script libraries, nothing fetched from the
internet); a few lines of script re-fetch the live part every two seconds. Host names come
from volunteers, so everything shown is escaped; no token or secret is ever shown.
"""

from __future__ import annotations

import asyncio
import html
import itertools
import math
import time
from typing import TYPE_CHECKING

from coordinator.engine.progress import duration, eta, host_state
from coordinator.engine.waiting import clock
from coordinator.rules.cooling import PROBATION_TILES
from coordinator.work.records import (
    GemmState,
    Host,
    Outcome,
    Result,
    ServerState,
    WorkUnit,
    WuState,
    short_workunit_id,
)

if TYPE_CHECKING:
    from coordinator.engine.coordinator import Coordinator

REFRESH_MS = 2000
PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>tilehive: {title}</title>
<style>
body {{ font: 14px system-ui, sans-serif; margin: 2em; color: #222; }}
h1 {{ font-size: 1.4em; }} h2 {{ font-size: 1.1em; margin-top: 1.5em; }}
table {{ border-collapse: collapse; }} td, th {{ padding: 2px 10px; text-align: right; }}
th {{ border-bottom: 1px solid #999; }} td.l, th.l {{ text-align: left; }}
.cards span {{ display: inline-block; margin-right: 2em; }}
svg {{ background: #fafafa; border: 1px solid #ddd; }}
.banner {{ padding: 0.6em 1em; margin: 0.5em 0; border-radius: 4px; font-weight: 600; }}
.done {{ background: #e3f4e3; }} .paused {{ background: #fff1c2; }}
.waiting {{ background: #fff1c2; }} .unreachable {{ background: #f8d0d0; }}
tr.quarantined td {{ background: #f8d0d0; }} tr.totals td {{ border-top: 1px solid #999; }}
</style></head>
<body><h1>tilehive coordinator: {title}</h1>
<div id="stale" class="banner unreachable" hidden></div>
<main id="live">{body}</main>
<script>
let lastSeen = new Date();
function stale(why) {{
  const banner = document.getElementById("stale");
  banner.textContent = "coordinator unreachable since " + lastSeen.toLocaleTimeString()
    + " (" + why + "): this page shows the last view it sent";
  banner.hidden = false;
}}
// Relative to this page: a proxy may serve the coordinator under a path.
setInterval(async () => {{
  try {{
    const reply = await fetch("?fragment=1", {{ signal: AbortSignal.timeout({refresh}) }});
    if (!reply.ok) {{ stale("HTTP " + reply.status); return; }}
    document.getElementById("live").innerHTML = await reply.text();
    lastSeen = new Date();
    document.getElementById("stale").hidden = true;
  }} catch (e) {{ stale(e.name === "TimeoutError" ? "no answer" : "cannot connect"); }}
}}, {refresh});
</script></body></html>
"""

HOSTS_SHOWN = 50  # rows of the host table; the totals row counts them all
STREAM_SECONDS = 60.0  # the task stream's window
STREAM_HOSTS = 16  # rows of the task stream: the hosts that reported most recently
PRODUCTS_SHOWN = 6  # products in the pipeline table


def chart(series: list[list[tuple[float, float]]], colors: list[str], label: str) -> str:
    """A line chart of one or more (x, y) series, as inline SVG."""
    width, height, pad = 560, 180, 36
    points = [p for s in series for p in s]
    if len(points) < 2:
        return (
            f'<svg width="{width}" height="{height}" role="img" aria-label="{label}">'
            f'<text x="20" y="90">{label}: not enough data yet</text></svg>'
        )
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)

    def at(x: float, y: float) -> str:
        px = pad + (x - x0) / (x1 - x0) * (width - 2 * pad)
        py = height - pad + (y0 - y) / (y1 - y0) * (height - 2 * pad)
        return f"{px:.1f},{py:.1f}"

    lines = [
        f'<polyline fill="none" stroke="{color}" stroke-width="2" '
        f'points="{" ".join(at(x, y) for x, y in s)}"/>'
        + "".join(
            f'<circle r="2.5" fill="{color}" cx="{at(x, y).split(",")[0]}" '
            f'cy="{at(x, y).split(",")[1]}"/>'
            for x, y in s
        )
        for s, color in zip(series, colors, strict=True)
        if s
    ]
    axes = (
        f'<text x="4" y="{pad - 8}">{y1:.3g}</text>'
        f'<text x="4" y="{height - pad + 4}">{y0:.3g}</text>'
        f'<text x="{pad}" y="{height - 8}">{x0:.3g}</text>'
        f'<text x="{width - pad - 20}" y="{height - 8}">{x1:.3g}</text>'
    )
    return (
        f'<svg width="{width}" height="{height}" role="img" aria-label="{label}">'
        + axes
        + "".join(lines)
        + "</svg>"
    )


def banners(co: Coordinator, status: dict) -> str:
    """Done, paused, and why work waits: what an operator must see first."""
    e = html.escape
    training = status.get("training") or {}
    out = []
    if training.get("done"):
        out.append(
            f"<div class='banner done' id='banner-done'>Training finished: all "
            f"{training.get('steps')} steps done; checkpoints in "
            f"{e(str(co.directory / 'checkpoints'))}</div>"
        )
    if status.get("paused"):
        out.append(
            "<div class='banner paused' id='banner-paused'>Paused by the operator: no new work "
            "goes out (tilehive admin resume URL --project DIR)</div>"
        )
    waiting = status.get("waiting")
    if waiting and waiting["reason"] != "paused" and not training.get("done"):
        since = clock(waiting["since"])
        out.append(
            f"<div class='banner waiting' id='banner-waiting'>Waiting since {since}: "
            f"{e(waiting['message'])}</div>"
        )
    return "".join(out)


def pipeline(co: Coordinator) -> str:
    """Per product being computed: its work units by where they are (BOINC's server status)."""
    ledger = co.ledger
    active = [g for g in ledger.gemms.values() if g.state is GemmState.ACTIVE]
    active = sorted(active, key=lambda g: (g.step, g.created))[-PRODUCTS_SHOWN:]
    if not active:
        return "<p id='pipeline'>No product is being computed.</p>"
    rows = []
    for gemm in active:
        counts = dict.fromkeys(PIPELINE, 0)
        for wu in ledger.workunits_for(gemm.id):
            counts[_stage(wu, ledger.results_for(wu.id))] += 1
        cells = "".join(f"<td>{counts[k]}</td>" for k in PIPELINE)
        rows.append(
            f"<tr><td class='l'>{html.escape(gemm.label)}</td><td>{gemm.step}</td>{cells}</tr>"
        )
    head = "".join(f"<th>{k}</th>" for k in PIPELINE)
    return (
        "<table id='pipeline'><tr><th class='l'>product</th><th>step</th>"
        + head
        + "</tr>"
        + "".join(rows)
        + "</table>"
    )


PIPELINE = ("unsent", "in progress", "awaiting validation", "assimilated", "errors")


def _stage(wu: WorkUnit, results: list[Result]) -> str:
    if wu.state is WuState.ERROR:
        return "errors"
    if wu.state in (WuState.VALIDATED, WuState.ASSIMILATED):
        return "assimilated"
    if any(r.server_state is ServerState.IN_PROGRESS for r in results):
        return "in progress"
    if any(r.outcome is Outcome.SUCCESS for r in results):
        return "awaiting validation"
    return "unsent"


def task_stream(co: Coordinator, now: float) -> str:
    """A row per host, a bar per tile from sent to reported, over the last minute: the gaps
    are the hosts' idle time (Dask's task stream)."""
    start = now - STREAM_SECONDS
    recent = [r for r in co.ledger.reported if r[2] >= start]
    width, row, left = 720, 14, 150
    if not recent:
        return (
            f"<svg id='task-stream' width='{width}' height='40' role='img' "
            "aria-label='task stream'><text x='10' y='25'>no tiles reported in the last "
            f"{STREAM_SECONDS:.0f}s</text></svg>"
        )
    last: dict[int, float] = {}
    for host_id, _, received, _ in recent:
        last[host_id] = max(last.get(host_id, 0.0), received)
    hosts = sorted(last, key=lambda h: -last[h])[:STREAM_HOSTS]
    index = {h: i for i, h in enumerate(sorted(hosts, key=lambda h: _name(co, h)))}
    height = row * len(index) + 24
    scale = (width - left - 10) / STREAM_SECONDS
    parts = [
        f"<svg id='task-stream' width='{width}' height='{height}' role='img' "
        "aria-label='task stream'>"
    ]
    for host_id, i in index.items():
        parts.append(
            f"<text x='4' y='{i * row + 11}' font-size='11'>"
            f"{html.escape(_name(co, host_id)[:22])}</text>"
        )
    for host_id, sent, received, outcome in recent:
        if host_id not in index:
            continue
        x0 = left + max(0.0, sent - start) * scale
        x1 = max(x0 + 1.0, left + (received - start) * scale)
        color = "#2ca02c" if outcome == "success" else "#d62728"
        parts.append(
            f"<rect class='task' x='{x0:.1f}' y='{index[host_id] * row + 2}' "
            f"width='{x1 - x0:.1f}' height='{row - 4}' fill='{color}'/>"
        )
    parts.append(
        f"<text x='{left}' y='{height - 6}' font-size='11'>-{STREAM_SECONDS:.0f}s</text>"
        f"<text x='{width - 40}' y='{height - 6}' font-size='11'>now</text></svg>"
    )
    return "".join(parts)


def _name(co: Coordinator, host_id: int | None) -> str:
    host = co.ledger.hosts.get(host_id) if host_id is not None else None
    return host.name if host is not None else str(host_id)


def uplink(rate: float | None) -> str:
    """A host's uplink as timed by the coordinator, for the hosts table."""
    if rate is None:
        return "-"
    return f"{rate / 1e6:.1f} MB/s" if rate >= 1e6 else f"{rate / 1e3:.0f} KB/s"


def host_condition(co: Coordinator, h: Host, now: float) -> tuple[str, str]:
    """(its row's class, what its state column says): why a host takes no work, if it
    takes none."""
    paused = h.id in co.requests.owner_busy
    state = host_state(h.quarantined, h.gone, h.last_contact, now, paused, h.created)
    if state == "quarantined":
        return "quarantined", "QUARANTINED"
    if state == "idle":
        if h.gone:
            return "ok", "stopped"
        return "ok", "not heard from lately" if h.has_asked else "registered; has not asked yet"
    if state == "paused":
        return "paused", "paused: its owner uses the machine (--idle-only)"
    cooling = co.requests.cooling.left(h.id, now)
    if cooling > 0:
        return "ok", f"no new work for {math.ceil(cooling)}s: it sat on a tile"
    if co.requests.cooling.used_up(h.id):
        return "ok", f"on probation: took {PROBATION_TILES} tiles and computed none; no new work"
    if co.requests.cooling.on_probation(h.id):
        return "ok", "on probation: it sat on a tile; each it takes gets a spare"
    return "ok", "ok"


def host_table(co: Coordinator, now: float) -> str:
    """The hosts, most valid results first, the first HOSTS_SHOWN of them, and totals."""
    e = html.escape
    every = sorted(co.ledger.hosts.values(), key=lambda h: (-h.valid_count, h.name, h.id))
    conditions = {h.id: host_condition(co, h, now) for h in every[:HOSTS_SHOWN]}
    rows = "".join(
        f"<tr class='{conditions[h.id][0]}'>"
        f"<td class='l'>{e(h.name)}</td><td>{h.id}</td><td>{h.gflops:.1f}</td>"
        f"<td>{uplink(co.uplinks.rate(h.id))}</td>"
        f"<td>{h.consecutive_valid}</td><td>{h.valid_count}</td><td>{h.invalid_count}</td>"
        f"<td>{h.error_count}</td><td>{h.max_in_progress}</td>"
        f"<td>{max(0.0, now - h.last_contact):.0f}s ago</td>"  # a contact as this page is made
        f"<td class='l'>{conditions[h.id][1]}</td></tr>"
        for h in every[:HOSTS_SHOWN]
    )
    more = (
        f"<tr><td class='l' colspan='11'>... and {len(every) - HOSTS_SHOWN} more hosts</td></tr>"
        if len(every) > HOSTS_SHOWN
        else ""
    )
    quarantined = sum(1 for h in every if h.quarantined)
    totals = (
        f"<tr class='totals'><td class='l'>all {len(every)} hosts</td><td></td>"
        f"<td>{sum(h.gflops for h in every):.1f}</td><td></td><td></td>"
        f"<td>{sum(h.valid_count for h in every)}</td>"
        f"<td>{sum(h.invalid_count for h in every)}</td>"
        f"<td>{sum(h.error_count for h in every)}</td><td></td><td></td>"
        f"<td class='l'>{quarantined} quarantined</td></tr>"
    )
    return (
        "<table id='hosts'><tr><th class='l'>name</th><th>id</th>"
        "<th title='measured by the volunteer when it started'>benchmark GFLOPS</th>"
        "<th title='timed from the reports of 64 KB or more it sent and the coordinator "
        "took'>uplink</th>"
        "<th>trust (CV)</th><th>valid</th><th>invalid</th><th>errors</th>"
        "<th>quota</th><th>last contact</th><th class='l'>state</th></tr>"
        + rows
        + more
        + totals
        + "</table>"
    )


# A page is made at most this often, however many ask: it is open to anyone, and each
# costs the event loop about 20 ms with a few dozen hosts (a review's 50 requests a second
# took training from 65 steps in 20 s to 6). It refreshes itself every REFRESH_MS anyway.
RENDER_EVERY = REFRESH_MS / 1000


class Pages:
    """The dashboard's page and fragment, each made again once RENDER_EVERY has passed;
    the requests in between, and those that come while one is being made, share it."""

    def __init__(self) -> None:
        self._made: dict[bool, tuple[float, asyncio.Future[str]]] = {}

    async def get(self, co: Coordinator, fragment: bool) -> str:
        now = time.monotonic()
        made = self._made.get(fragment)
        failed = made is not None and made[1].done() and made[1].exception() is not None
        if made is None or failed or now - made[0] >= RENDER_EVERY:
            made = (now, asyncio.ensure_future(render(co, fragment)))
            self._made[fragment] = made
        return await asyncio.shield(made[1])


async def render(co: Coordinator, fragment: bool = False) -> str:
    status = co.progress.full_status()
    training = status.get("training") or {}
    e = html.escape
    step = training.get("step", 0)
    steps = training.get("steps") or "?"
    loss = f"{training['loss']:.4f}" if "loss" in training else "-"
    seconds, why_none = eta(status)
    hosts = status["host_states"]
    paused = f"{hosts['paused']} paused, " if hosts["paused"] else ""  # said when there are some
    cards = [
        f"<span id='step'>step <b>{step}</b> of {steps}</span>",
        f"<span>loss <b>{loss}</b></span>",
        f"<span>ETA {duration(seconds) if seconds is not None else e(why_none)}</span>",
        f"<span>{status['tiles_per_second']:.1f} tiles/s</span>",
        f"<span>hosts {hosts['active']} active, {paused}"
        f"{status['hosts_quarantined']} quarantined</span>",
        f"<span>{status['invalid']} invalid results</span>",
    ]
    loss_points = [(h["step"], h["loss"]) for h in co.progress.history]
    val = [(h["step"], h["val_loss"]) for h in co.progress.history if h.get("val_loss") is not None]
    samples = list(co.progress.rates)
    rates = [
        (t1 - samples[0][0], (n1 - n0) / (t1 - t0))
        for (t0, n0), (t1, n1) in itertools.pairwise(samples)
        if t1 > t0
    ]
    now = time.time()
    failures = await co.store.recent_events("validation", "invalid", 10)
    rejected = (
        "".join(
            f"<tr><td class='l'>{clock(ev.time)}</td>"
            f"<td>{'-' if ev.step is None else ev.step}</td>"
            f"<td class='l'>{e(short_workunit_id(ev.wu_id or ''))}</td>"
            f"<td class='l'>{e(_name(co, ev.host_id))}</td>"
            f"<td class='l'>{e(ev.message)}</td></tr>"
            for ev in failures
        )
        or "<tr><td class='l' colspan='5'>none</td></tr>"
    )
    body = (
        f"<div id='banners'>{banners(co, status)}</div>"
        f"<div class='cards'>{''.join(cards)}</div>"
        "<h2>Products being computed (work units)</h2>"
        + pipeline(co)
        + "<h2>Task stream: one row per host, a bar per tile from sent to reported "
        "(green: a result, red: an error); gaps are idle time</h2>"
        + task_stream(co, now)
        + "<h2>Loss (train: blue, validation: orange)</h2>"
        + chart([loss_points, val], ["#1f77b4", "#ff7f0e"], "loss curve")
        + "<h2>Tiles per second</h2>"
        + chart([rates], ["#2ca02c"], "tiles per second")
        + "<h2>Hosts (most valid results first)</h2>"
        + host_table(co, now)
        + "<h2>Recent validation failures</h2><table><tr><th class='l'>time</th><th>step</th>"
        "<th class='l'>work unit</th><th class='l'>host</th><th class='l'>reason</th></tr>"
        + rejected
        + "</table>"
    )
    if fragment:
        return body
    return PAGE.format(title=e(str(co.directory.name)), body=body, refresh=REFRESH_MS)
