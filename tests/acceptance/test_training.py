"""Training on tiles: gradients, the loss, and distributed runs equal to --local bit for bit."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from coordinator.training import project as projects
from coordinator.training.model import TinyGPT, init_params, param_shapes
from coordinator.training.project import ModelSettings
from coordinator.training.trainer import LocalBackend, Trainer
from tests.factories import SMALL, Float64Backend, checkpoint_bits, make_pair, start_coordinator
from tests.procs import ENV, ROOT, free_port, start_volunteer, stop, tilehive
from tests.volunteers import wait_until


def test_every_layers_gradient_matches_float64_finite_differences():
    settings = ModelSettings(layers=2, width=8, heads=2, context=5)
    model = TinyGPT(settings, Float64Backend())
    params = {k: v.astype(np.float64) for k, v in init_params(settings, seed=3).items()}
    rng = np.random.default_rng(0)
    # Larger weights than at init, so every path carries a signal worth checking.
    params = {k: v + rng.normal(0, 0.3, v.shape) for k, v in params.items()}
    tokens = rng.integers(0, 256, size=(3, 5))
    targets = rng.integers(0, 256, size=(3, 5))
    _, grads = asyncio.run(model.loss_and_grads(params, tokens, targets))
    assert set(grads) == set(param_shapes(settings))
    h = 1e-6
    for name, value in params.items():
        flat = value.reshape(-1)
        picks = rng.choice(flat.size, size=min(4, flat.size), replace=False)
        if name == "embed":  # only rows of tokens that occur have a gradient
            picks = [int(tokens[0, 0]) * value.shape[1] + j for j in range(3)]
        for index in picks:
            saved = flat[index]
            flat[index] = saved + h
            up = asyncio.run(model.loss(params, tokens, targets))
            flat[index] = saved - h
            down = asyncio.run(model.loss(params, tokens, targets))
            flat[index] = saved
            numeric = (up - down) / (2 * h)
            analytic = grads[name].reshape(-1)[index]
            assert abs(numeric - analytic) <= 1e-6 + 1e-5 * abs(numeric), (name, index)


def test_the_default_projects_loss_falls_in_a_short_local_run(tmp_path):
    project = projects.create(tmp_path / "p", **{"training.steps": 30})
    losses = []
    params = asyncio.run(
        Trainer(project, LocalBackend()).run(on_step=lambda r: losses.append((r.loss, r.val_loss)))
    )
    assert params
    first, (last, val) = losses[0][0], losses[-1]
    # Measured: 5.57 at step 1, about 2.9 (train) and 3.1 (validation) at step 30.
    assert first > 5.0 and last < 3.5 and val < 3.5


@pytest.mark.parametrize("tile", [16, 24])
async def test_a_distributed_run_ends_bitwise_equal_to_the_local_one(tmp_path, tile, reaper):
    local, remote = make_pair(tmp_path, steps=3, **{"work.tile": tile})
    port = free_port()
    coordinator = reaper(start_coordinator(remote, port, tmp_path / "coordinator.log"))
    url = f"http://127.0.0.1:{port}"
    crew = [reaper(start_volunteer(url, tmp_path / f"v{i}")) for i in range(3)]
    try:
        code = await asyncio.to_thread(coordinator.wait, 300)
    finally:
        for volunteer in crew:
            stop(volunteer)
    assert code == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
    for step in (3,):
        name = f"checkpoints/step-{step:06d}.npz"
        assert checkpoint_bits(remote / name) == checkpoint_bits(local / name)
    records = [json.loads(x) for x in (remote / "train.jsonl").read_text().splitlines()]
    reference = [json.loads(x)["loss"] for x in (local / "train.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in records] == reference
    # What each step cost the coordinator's host, for the operator beside its time.
    assert all(r["cpu_seconds"] > 0 and r["seconds"] > 0 for r in records)


async def test_a_coordinator_killed_mid_step_resumes_bitwise_equal(tmp_path, reaper):
    local, remote = make_pair(tmp_path, steps=5, **{"training.checkpoint_every": 2})
    port = free_port()
    log = tmp_path / "coordinator.log"
    url = f"http://127.0.0.1:{port}"
    crew = [reaper(start_volunteer(url, tmp_path / f"v{i}")) for i in range(2)]
    try:
        first = reaper(start_coordinator(remote, port, log))
        metrics = remote / "train.jsonl"
        await wait_until(
            lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, timeout=120
        )
        first.send_signal(signal.SIGKILL)
        first.wait()
        assert (remote / "checkpoints" / "step-000002.npz").exists()
        second = reaper(start_coordinator(remote, port, log))
        assert await asyncio.to_thread(second.wait, 300) == 0, log.read_text()[-3000:]
    finally:
        for volunteer in crew:
            stop(volunteer)
    name = "checkpoints/step-000005.npz"
    assert checkpoint_bits(remote / name) == checkpoint_bits(local / name)
    said = log.read_text()
    assert "resuming after step" in said
    # Step 3's blobs were held in memory when the coordinator was killed: they are made
    # again, and the log says why once, and what was made again in a line a step.
    recovered = [line for line in said.splitlines() if "gone;" in line]
    assert sum("expected after a stop" in line for line in recovered) == 1, recovered[:5]
    steps = [re.search(r" step (\d+): ", line).group(1) for line in recovered]
    assert "3" in steps and len(steps) == len(set(steps)), recovered
    # The volunteers talked to each coordinator through its local socket: the killed one's
    # name reached nothing, so they went back to TCP and took the new one's.
    names = re.findall(r"through the local socket @(tilehive-\w+)", said)
    assert len(names) == 2 and names[0] != names[1], names
    for i in range(2):
        out = (tmp_path / f"v{i}" / "out").read_text()
        assert re.findall(r"talking to it through @(tilehive-\w+)", out) == names, out[-2000:]
        assert f"local socket @{names[0]} does not answer" in out


def test_the_demo_trains_and_leaves_no_process_behind(tmp_path):
    directory = tmp_path / "demo"
    result = tilehive(
        "demo", "--steps", "3", "--volunteers", "2", "--dir", str(directory), timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "loss:" in result.stdout and "validation:" in result.stdout
    # Who set the pace: the volunteers' share of their time computing, the coordinator's
    # CPU over each step.
    assert re.search(r"volunteers were computing \d+% of the time", result.stdout)
    assert re.search(r"the coordinator's own CPU came to \d+% of each step's time", result.stdout)
    assert (directory / "checkpoints" / "step-000003.npz").exists()
    assert _processes_mentioning(str(directory)) == []


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if text in cmdline and state != "Z":
                found.append(cmdline)
    return found


async def test_ctrl_c_stops_the_demo_and_every_process_it_started(tmp_path):
    directory = tmp_path / "demo"
    projects.create(directory, **{**SMALL, "training.steps": 500})  # the demo takes it up
    demo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "coordinator.cli",
            "demo",
            "--steps",
            "500",
            "--volunteers",
            "2",
            "--dir",
            str(directory),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
        env=ENV,
        # As a shell's background job starts it: SIGINT ignored, so Python would install no
        # handler of its own. Ctrl-C must still stop the demo.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        metrics = directory / "train.jsonl"
        await wait_until(lambda: metrics.exists() and metrics.read_text().strip(), timeout=120)
        assert len(_processes_mentioning(str(directory))) >= 3  # coordinator and volunteers
        demo.send_signal(signal.SIGINT)
        assert await asyncio.to_thread(demo.wait, 60) == 130
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
            # The demo's children live in their own sessions: do not leave them behind.
            subprocess.run(["pkill", "-9", "-f", str(directory)], check=False)
    assert _processes_mentioning(str(directory)) == []


async def test_a_coordinator_whose_stdout_is_closed_serves_on_and_stops_cleanly(tmp_path):
    """The demo reads the coordinator's first line and closes the pipe. Printing to a closed
    pipe once killed the coordinator half-way, and its database thread then kept the dead
    process from exiting: the demo hung."""
    directory = tmp_path / "project"
    projects.create(directory, **SMALL)
    port = free_port()
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody will ever read what the coordinator prints
    try:
        coordinator = subprocess.Popen(
            [*COORDINATOR, str(directory), "--bind", f"127.0.0.1:{port}"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env=ENV,
        )
    finally:
        os.close(write_end)
    try:
        await wait_until(lambda: _answers(f"http://127.0.0.1:{port}/v1/status"), timeout=60)
        coordinator.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(coordinator.wait, 30) == 130
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
            coordinator.wait()
    _, said = coordinator.communicate()
    assert b"Traceback" not in said, said.decode()


COORDINATOR = [sys.executable, "-m", "coordinator.cli", "coordinator"]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


async def test_a_failed_coordinator_loop_stops_training_instead_of_hanging(
    tmp_path, monkeypatch, caplog
):
    """If the loop that validates and commits dies, `tilehive coordinator` says so and exits 1
    (the run resumes from its last checkpoint), rather than serving on with nothing moving."""
    from coordinator.cli import serve as host
    from coordinator.engine.passes import Passes

    async def broken_step(self, now: float) -> None:
        raise RuntimeError("the disk is on fire")

    monkeypatch.setattr(Passes, "step", broken_step)
    project = projects.create(tmp_path / "p", **{**SMALL, "training.steps": 2})
    code = await asyncio.wait_for(host.host_project(project, "127.0.0.1", 0, False), 60)
    assert code == 1
    assert "the disk is on fire" in caplog.text  # the loop's own traceback
    assert "training stopped: the coordinator's loop failed" in caplog.text


async def _threads_of_the_models_arithmetic(project) -> list[threading.Thread]:
    """The threads that ran the model's first layernorm while `project` was hosted."""
    from coordinator.cli import serve as host
    from coordinator.training import model

    seen: list[threading.Thread] = []
    reached = threading.Event()
    layernorm = model.layernorm

    def spying_layernorm(*args):
        seen.append(threading.current_thread())
        reached.set()
        return layernorm(*args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model, "layernorm", spying_layernorm)
        serving = asyncio.create_task(host.host_project(project, "127.0.0.1", 0, False))
        try:
            await wait_until(reached.is_set, timeout=60)
        finally:
            serving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await serving
    return seen


async def test_a_large_models_arithmetic_runs_off_the_servers_event_loop(tmp_path, monkeypatch):
    """A large model's own numpy work (here its first layernorm) runs on the training thread,
    so the server's loop answers requests while a step computes."""
    from coordinator.engine import backend

    monkeypatch.setattr(backend, "SMALL_MODEL_BYTES", 0)  # every model is large
    seen = await _threads_of_the_models_arithmetic(projects.create(tmp_path / "p", **SMALL))
    assert seen and all(t is not threading.current_thread() for t in seen)
    assert seen[0].name == "tilehive-training"


async def test_a_small_models_arithmetic_runs_on_the_servers_event_loop(tmp_path):
    """A small model's numpy work runs on the server's own loop, with no hand-off to a
    thread and back for each product."""
    seen = await _threads_of_the_models_arithmetic(projects.create(tmp_path / "p", **SMALL))
    assert seen and all(t is threading.current_thread() for t in seen)


def test_tiny_gpt_trains_on_the_servers_loop_and_a_larger_model_on_a_thread(tmp_path):
    """The defaults' arithmetic is small enough for the server's loop; a model of width 512
    (the larger project of docs/performance.md) would hold it for tens of milliseconds."""
    from coordinator.engine.backend import trains_on_server_loop

    tiny = projects.create(tmp_path / "tiny", **{"corpus.max_mb": 1})
    larger = projects.create(
        tmp_path / "larger",
        **{
            "model.layers": 4,
            "model.width": 512,
            "model.heads": 8,
            "model.context": 128,
            "training.batch_size": 32,
            "corpus.max_mb": 1,
        },
    )
    assert trains_on_server_loop(tiny)
    assert not trains_on_server_loop(larger)


@pytest.mark.parametrize("parts", [2, 4])
async def test_micro_batches_give_the_batchs_loss_and_gradients(tmp_path, parts):
    """Cut into micro-batches, the batch's mean loss and gradients are those of the whole
    batch (to float32 rounding): micro-batches change the order of sums, not the model."""
    whole = projects.create(tmp_path / "whole", **{**SMALL, "training.micro_batches": 1})
    cut = projects.create(tmp_path / "cut", **{**SMALL, "training.micro_batches": parts})
    params = init_params(whole.model, 0)
    x, y = Trainer(whole, LocalBackend())._corpus().batch(0, 1, 16, whole.model.context)
    loss, grads = await Trainer(whole, LocalBackend()).loss_and_grads(params, x, y)
    loss_cut, grads_cut = await Trainer(cut, LocalBackend()).loss_and_grads(params, x, y)
    assert loss_cut == pytest.approx(loss, rel=1e-5)
    for name, g in grads.items():
        np.testing.assert_allclose(grads_cut[name], g, rtol=1e-3, atol=1e-6)
