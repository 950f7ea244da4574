"""Seeing what happens: logs tasks/validation, status, /metrics and the dashboard."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time

import aiohttp
import pytest

from tests.factories import metric_values, operands, running, volunteers
from tests.procs import ENV, ROOT, following
from tests.volunteers import Behaviour, wait_until
from volunteer.client import CoordinatorClient

ARTIFACTS = ROOT / "test-artifacts"


def tilehive(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "coordinator.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=ENV,
        timeout=timeout,
    )


async def test_logs_validation_shows_the_forged_tile_with_its_reason(worked):
    co, _, _, project, liar = worked
    await co.ledger.flush()
    result = tilehive("logs", "validation", str(project), "--host", str(liar.host_id), "--json")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    invalid = [r for r in rows if r["state"] == "invalid"]
    assert invalid and all(r["host_id"] == liar.host_id for r in rows)
    assert all("hash mismatch" in r["message"] for r in invalid)
    assert all(r["method"] == "quorum" and r["trust_after"] == 0 for r in invalid)
    table = tilehive("logs", "validation", str(project), "--state", "invalid")
    assert "hash mismatch" in table.stdout and "quorum" in table.stdout


async def test_logs_tasks_lists_every_tile_and_filters(worked):
    co, _, _, project, _ = worked
    await co.ledger.flush()
    every = tilehive("logs", "tasks", str(project), "--json")
    rows = [json.loads(line) for line in every.stdout.splitlines()]
    assert len(rows) == 3 * 2 + 1  # 48x32 in tiles of 16, then one 16x16 tile
    assert {r["state"] for r in rows} == {"assimilated"}
    step2 = tilehive("logs", "tasks", str(project), "--step", "2", "--json")
    (only,) = [json.loads(line) for line in step2.stdout.splitlines()]
    assert only["gemm"] == "l0.dx" and only["tile"] == [0, 16, 0, 16]
    table = tilehive("logs", "tasks", str(project), "--state", "assimilated")
    assert "l0.fwd" in table.stdout and "[0:16,0:16]" in table.stdout
    bad = tilehive("logs", "tasks", str(project), "--since", "yesterday-ish")
    assert bad.returncode == 2 and "--since" in bad.stderr and "Traceback" not in bad.stderr


async def test_a_tile_waiting_for_its_quorum_is_not_shown_done(tmp_path, rng):
    async with running(tmp_path, tile=16) as (co, queue, url):
        a, b = operands(rng, 16, 16, 8, False, False)
        product = asyncio.ensure_future(queue.matmul(a, b, step=1, label="alone"))
        try:
            async with volunteers(url, [Behaviour()]) as crew:  # one of the quorum's two
                await wait_until(lambda: crew[0].done >= 1)
            await co.ledger.flush()
            every = tilehive("logs", "tasks", str(tmp_path / "project"), "--json")
            (row,) = [json.loads(line) for line in every.stdout.splitlines()]
            assert row["state"] == "active" and row["hosts"] == ["v0"]  # reported, undecided
            assert row["finished"] is None
        finally:
            product.cancel()
            with contextlib.suppress(BaseException):
                await product


async def test_logs_follow_shows_an_event_that_happens_after_it_started(tmp_path, rng):
    async with running(tmp_path, tile=16) as (co, queue, url):
        a, b = operands(rng, 16, 16, 8, False, False)
        async with volunteers(url, [Behaviour()] * 2) as crew:
            await crew.finish(queue.matmul(a, b, step=1, label="first"))
            await co.ledger.flush()
            project = str(tmp_path / "project")
            with following("logs", "tasks", project, "--follow", "--json", "--step", "7") as f:
                ready = await asyncio.wait_for(asyncio.to_thread(f.stderr.readline), 30)
                assert "following new events" in ready
                await crew.finish(queue.matmul(b, a, step=7, label="later"))
                line = await asyncio.wait_for(asyncio.to_thread(f.stdout.readline), 30)
                event = json.loads(line)
                assert event["type"] == "event" and event["step"] == 7
                assert event["kind"] == "gemm" and "later" in event["message"]


async def test_logs_follow_shows_what_the_operator_did(tmp_path):
    async with running(tmp_path, tile=16) as (co, _, _):
        await co.ledger.flush()
        project = str(tmp_path / "project")
        with following("logs", "tasks", project, "--follow", "--json") as f:
            ready = await asyncio.wait_for(asyncio.to_thread(f.stderr.readline), 30)
            assert "following new events" in ready
            await co.operator.set_paused(True, time.time())
            line = await asyncio.wait_for(asyncio.to_thread(f.stdout.readline), 30)
            event = json.loads(line)
            assert (event["kind"], event["state"]) == ("project", "paused")
            assert event["message"] == "project paused by the operator"


async def test_status_from_the_directory_and_from_the_url(worked):
    co, url, _, project, _ = worked
    await co.ledger.flush()
    for target in (str(project), url):
        # In a thread: the coordinator answering the URL runs on this event loop.
        result = await asyncio.to_thread(tilehive, "status", target, "--json")
        assert result.returncode == 0, result.stderr
        summary = json.loads(result.stdout)
        assert summary["workunits"] == {"assimilated": 7}
        assert summary["host_states"]["quarantined"] + summary["host_states"]["active"] == 3
    text = tilehive("status", str(project))
    assert "validation failures" in text.stdout and "hosts:" in text.stdout
    down = tilehive("status", "http://127.0.0.1:9")
    assert down.returncode == 1 and "cannot reach" in down.stderr


async def test_status_of_a_trained_project_without_its_settings_says_so(worked, tmp_path):
    """Its project.toml gone, a project that trained cannot run: its progress is shown all
    the same, and that said (exit 1), as the coordinator would refuse it."""
    from coordinator.training import project as projects
    from tests.factories import SMALL

    co, _, _, project, _ = worked
    await co.ledger.flush()
    local = tmp_path / "local"
    projects.create(local, **{**SMALL, "training.steps": 1})
    trained = await asyncio.to_thread(tilehive, "train", str(local), "--local", timeout=300)
    assert trained.returncode == 0, trained.stderr
    shutil.copy(local / "train.jsonl", project / "train.jsonl")  # a state.db, no settings
    gone = await asyncio.to_thread(tilehive, "status", str(project))
    assert "step 1 of" in gone.stdout and gone.returncode == 1, gone
    assert gone.stderr.strip() == (
        f"Error: {project / 'project.toml'} not found: the coordinator and train refuse this "
        "project without it"
    )


async def test_metrics_parse_and_move_during_a_run(worked):
    _, url, before, _, _ = worked
    after = await metric_values(url)
    success = ("tilehive_results_reported_total", (("outcome", "success"),))
    assert before.get(success, 0) == 0 and after[success] >= 7 * 2
    invalid = ("tilehive_validations_total", (("method", "quorum"), ("outcome", "invalid")))
    assert after[invalid] >= 1
    assert after[("tilehive_bytes_total", (("direction", "in"),))] > 0
    assert after[("tilehive_hosts", (("state", "active"),))] >= 2
    assert any(name == "tilehive_request_seconds_count" for name, _ in after)


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian's chromium not installed")
async def test_the_dashboard_renders_in_a_real_browser(worked, tmp_path):
    co, url, _, _, _ = worked
    co.progress.record_step({"step": 1, "loss": 5.5, "seconds": 0.5, "cpu_seconds": 0.4}, 3)
    co.progress.record_step({"step": 2, "loss": 4.9, "val_loss": 4.8, "seconds": 0.4}, 3)
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    common = [
        "chromium",
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'chrome'}",
        "--enable-logging=stderr",
        "--v=0",
        "--window-size=1200,1000",
    ]
    dom = await asyncio.to_thread(
        subprocess.run,
        [*common, "--dump-dom", url + "/"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "step <b>2</b> of 3" in dom.stdout
    assert 'aria-label="loss curve"' in dom.stdout and "<polyline" in dom.stdout
    assert 'id="hosts"' in dom.stdout and "v0" in dom.stdout
    console_errors = [
        line for line in dom.stderr.splitlines() if "CONSOLE" in line and "ERROR" in line
    ]
    assert console_errors == []
    picture = await asyncio.to_thread(
        subprocess.run,
        [*common, f"--screenshot={shot}", url + "/"],
        capture_output=True,
        timeout=120,
    )
    assert picture.returncode == 0 and shot.stat().st_size > 1000
    os.environ.get("CI") and print(f"dashboard screenshot: {shot}")


async def test_the_dashboard_escapes_what_volunteers_send(worked):
    _, url, _, _, _ = worked
    async with CoordinatorClient(url) as client:
        await client.register("<script>alert(1)</script>")
    async with aiohttp.ClientSession() as session, session.get(url + "/") as reply:
        page = await reply.text()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<script>alert(1)" not in page
