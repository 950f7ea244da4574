"""The read-only dashboard at `/`: progress, loss curve, tiles/s, hosts, recent rejections.

Server-rendered HTML with inline SVG charts (no script libraries, nothing fetched from the
internet); a few lines of script re-fetch the live part every two seconds. Host names come
from volunteers, so everything shown is escaped; no token or secret is ever shown.
"""

from __future__ import annotations

import html
import itertools
import time
from typing import TYPE_CHECKING

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
</style></head>
<body><h1>tilehive coordinator: {title}</h1>
<main id="live">{body}</main>
<script>
setInterval(async () => {{
  try {{
    const reply = await fetch("/?fragment=1");
    if (reply.ok) document.getElementById("live").innerHTML = await reply.text();
  }} catch (e) {{ /* the coordinator is gone or restarting; keep the last view */ }}
}}, {refresh});
</script></body></html>
"""


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


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds // 60 % 60:02d}m"
        if seconds >= 3600
        else f"{seconds // 60}m{seconds % 60:02d}s"
    )


async def render(co: Coordinator, fragment: bool = False) -> str:
    status = co.progress.status()
    training = status.get("training") or {}
    e = html.escape
    step = training.get("step", 0)
    steps = training.get("steps", "?")
    cards = [
        f"<span id='step'>step <b>{step}</b> of {steps}</span>",
        f"<span>loss <b>{training.get('loss', float('nan')):.4f}</b></span>",
        f"<span>ETA {_duration(training.get('eta_seconds'))}</span>",
        f"<span>{status['tiles_per_second']:.1f} tiles/s</span>",
        f"<span>hosts {status['host_states']['active']} active, "
        f"{status['hosts_quarantined']} quarantined</span>",
        f"<span>{status['invalid']} invalid results</span>",
    ]
    loss = [(h["step"], h["loss"]) for h in co.progress.history]
    val = [(h["step"], h["val_loss"]) for h in co.progress.history if h.get("val_loss") is not None]
    samples = list(co.progress.rates)
    rates = [
        (t1 - samples[0][0], (n1 - n0) / (t1 - t0))
        for (t0, n0), (t1, n1) in itertools.pairwise(samples)
        if t1 > t0
    ]
    now = time.time()
    hosts = "".join(
        f"<tr><td>{h.id}</td><td class='l'>{e(h.name)}</td><td>{h.gflops:.1f}</td>"
        f"<td>{h.consecutive_valid}</td><td>{h.valid_count}</td><td>{h.invalid_count}</td>"
        f"<td>{h.error_count}</td><td>{h.max_in_progress}</td>"
        f"<td>{now - h.last_contact:.0f}s ago</td>"
        f"<td class='l'>{'quarantined' if h.quarantined else 'ok'}</td></tr>"
        for h in sorted(co.ledger.hosts.values(), key=lambda h: h.id)
    )
    failures = await co.store.recent_events("validation", "invalid", 10)
    rejected = (
        "".join(
            f"<tr><td class='l'>{time.strftime('%H:%M:%S', time.localtime(ev.time))}</td>"
            f"<td>{ev.step}</td><td class='l'>{e((ev.wu_id or '')[:12])}</td><td>{ev.host_id}</td>"
            f"<td class='l'>{e(ev.message)}</td></tr>"
            for ev in failures
        )
        or "<tr><td class='l' colspan='5'>none</td></tr>"
    )
    body = (
        f"<div class='cards'>{''.join(cards)}</div>"
        "<h2>Loss (train: blue, validation: orange)</h2>"
        + chart([loss, val], ["#1f77b4", "#ff7f0e"], "loss curve")
        + "<h2>Tiles per second</h2>"
        + chart([rates], ["#2ca02c"], "tiles per second")
        + "<h2>Hosts</h2><table id='hosts'><tr><th>id</th><th class='l'>name</th>"
        "<th>GFLOPS</th><th>trust (CV)</th><th>valid</th><th>invalid</th><th>errors</th>"
        "<th>quota</th><th>last contact</th><th class='l'>state</th></tr>" + hosts + "</table>"
        "<h2>Recent validation failures</h2><table><tr><th class='l'>time</th><th>step</th>"
        "<th class='l'>work unit</th><th>host</th><th class='l'>reason</th></tr>"
        + rejected
        + "</table>"
    )
    if fragment:
        return body
    return PAGE.format(title=e(str(co.directory.name)), body=body, refresh=REFRESH_MS)
