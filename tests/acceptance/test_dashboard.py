"""The dashboard in a real browser (Debian's chromium): banners, each product's pipeline,
the task stream, the host table, and what a page shows once its coordinator is gone."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import subprocess
import time
import urllib.request

import aiohttp
import pytest
from aiohttp import web

from coordinator.training import project as projects
from tests.factories import SMALL, operands
from tests.procs import first_url, start_coordinator, tilehive

pytestmark = pytest.mark.skipif(
    shutil.which("chromium") is None, reason="Debian's chromium not installed"
)


async def browse(target: str, profile, *extra: str) -> str:
    """The page's DOM after chromium loaded it (and ran its script, with extra flags)."""
    command = [
        "chromium",
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        *extra,
        "--dump-dom",
        target,
    ]
    shown = await asyncio.to_thread(
        subprocess.run, command, capture_output=True, text=True, timeout=120
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    return shown.stdout


async def test_the_dashboard_shows_pipeline_task_stream_hosts_and_paused(worked, tmp_path, rng):
    co, url, _, _, liar = worked
    a, b = operands(rng, 32, 32, 16, False, False)
    await co.operator.set_paused(True, time.time())
    waiting = asyncio.ensure_future(co.products.matmul(a, b, step=9, label="l9.fwd"))
    try:
        await co.ledger.flush()
        await co.operator.set_quarantined(liar.host_id, True, time.time())
        page = await browse(url + "/", tmp_path / "chrome")
    finally:
        waiting.cancel()
        with contextlib.suppress(BaseException):
            await waiting
    assert 'id="banner-paused"' in page and "Paused by the operator" in page
    # The pipeline: the new product's 4 work units (tiles of 16) wait unsent while paused.
    assert '<td class="l">l9.fwd</td><td>9</td><td>4</td><td>0</td>' in page
    assert page.count('class="task"') >= 7  # a bar per tile reported in the last minute
    assert 'id="task-stream"' in page
    assert "QUARANTINED" in page and 'class="quarantined"' in page
    hosts = len(co.ledger.hosts)
    assert f"all {hosts} hosts" in page and "1 quarantined" in page
    assert "benchmark GFLOPS" in page
    # Rejections name the host as the operator knows it.
    rejected = page[page.index("Recent validation failures") :]
    assert f'<td class="l">{liar.name}</td>' in rejected


async def test_a_page_whose_coordinator_is_gone_says_so(worked, tmp_path):
    _, url, _, _, _ = worked
    async with aiohttp.ClientSession() as session, session.get(url + "/") as reply:
        saved = await reply.text()
    copy = tmp_path / "dashboard.html"
    copy.write_text(saved)  # its script's fetches now reach no coordinator
    page = await browse(
        copy.as_uri(), tmp_path / "chrome", "--virtual-time-budget=6000", "--allow-file-access"
    )
    shown = '<div id="stale" class="banner unreachable">coordinator unreachable since'
    assert shown in page  # the banner, not the script's words for it
    assert "this page shows the last view it sent</div>" in page
    assert 'id="hosts"' in page  # the last view stays


@contextlib.asynccontextmanager
async def under_a_path(url: str, prefix: str, asked: list[str]):
    """A reverse proxy serving the coordinator at `url` under `prefix` (as the docs' TLS
    proxy may, /tilehive/ beside other sites); yields the proxy's URL of the dashboard.
    What it forwards is appended to `asked`."""

    async def forward(request: web.Request) -> web.Response:
        asked.append(request.path_qs)
        target = url + "/" + request.match_info["tail"]
        async with (
            aiohttp.ClientSession() as session,
            session.get(target, params=request.query) as reply,
        ):
            body = await reply.read()
            return web.Response(body=body, status=reply.status, content_type=reply.content_type)

    app = web.Application()
    app.router.add_get(prefix + "/{tail:.*}", forward)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}{prefix}/"
    finally:
        await runner.cleanup()


async def test_the_dashboard_refreshes_behind_a_proxy_that_serves_it_under_a_path(worked, tmp_path):
    """Its script asks for the next view relative to the page, not at the server's root,
    where the proxy serves something else."""
    _, url, _, _, _ = worked
    asked: list[str] = []
    async with under_a_path(url, "/tilehive", asked) as page_url:
        page = await browse(page_url, tmp_path / "chrome", "--virtual-time-budget=6000")
    assert "/tilehive/?fragment=1" in asked  # refreshed through the proxy
    assert '<div id="stale" class="banner unreachable" hidden=""></div>' in page


def test_a_finished_project_restarted_shows_its_figures_everywhere(tmp_path, reaper):
    project = tmp_path / "project"
    projects.create(project, **{**SMALL, "training.steps": 2, "work.tile": 16})
    assert tilehive("train", str(project), "--local", timeout=300).returncode == 0
    coordinator = reaper(
        start_coordinator(project, "127.0.0.1:0", tmp_path / "c.log", "--keep-serving")
    )
    url = first_url(coordinator)
    from_dir = json.loads(tilehive("status", str(project), "--json").stdout)["training"]
    from_url = json.loads(tilehive("status", url, "--json").stdout)["training"]
    for key in ("step", "steps", "loss", "val_loss", "done"):
        assert from_dir[key] == from_url[key], key
    assert from_url["step"] == 2 and from_url["steps"] == 2 and from_url["done"]
    with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
        metrics = reply.read().decode()
    assert "tilehive_step 2.0" in metrics and "tilehive_loss nan" not in metrics
    said = tilehive("status", url).stdout
    assert "step 2 of 2, loss" in said and "training finished" in said
    # What the last step took, in time and in the trainer's CPU (here --local's).
    assert from_url["cpu_seconds"] > 0
    assert re.search(r"last step: \d+\.\d{3} s, \d+\.\d{3} s of the training process.s CPU", said)
    paused = tilehive("admin", "pause", url, "--project", str(project))
    assert paused.returncode == 0
    for target in (url, str(project)):
        assert "PAUSED by the operator" in tilehive("status", target).stdout
    page = asyncio.run(browse(url + "/", tmp_path / "chrome"))
    assert "step <b>2</b> of 2" in page and "nan" not in page
    assert "Training finished: all 2 steps done" in page and "Paused by the operator" in page
