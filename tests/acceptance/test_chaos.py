"""Chaos with real processes: killed volunteers, a killed coordinator, a blob store that fails."""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import gzip
import itertools
import json
import os
import signal
import sqlite3
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from coordinator.work.records import Policy
from tests.factories import checkpoint_bits, make_pair, operands, running, start_coordinator
from tests.procs import committed, free_port, start_volunteer, stop, tilehive
from tests.volunteers import wait_until
from volunteer.client import CoordinatorClient, ServerRefused, compute_tile

# One fast variant of each fault runs by default; the long variants (marked slow, several
# minutes on 2 cores) run with --runslow.


RUN_TIMEOUT = 240  # seconds for one distributed training run
FIGURES: Counter = Counter()  # volunteers killed, coordinator restarts: printed at the end


@pytest.fixture(scope="module", autouse=True)
def summary():
    yield
    if FIGURES:
        print("\nchaos: " + ", ".join(f"{k} {v}" for k, v in sorted(FIGURES.items())))


def settings(**extra) -> dict:
    """A small model cut into 16-wide tiles (fixed: many tiles in flight to kill, not a few
    cut for the crowd); a killed volunteer's work times out in 2 s."""
    return {"work.tile": 16, "work.sizing": "fixed", "work.delay_bound": 2.0, **extra}


def integrity(directory: Path) -> str:
    """PRAGMA integrity_check of a project's state.db (the coordinator has exited)."""
    db = sqlite3.connect(directory / "state.db")
    try:
        return db.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        db.close()


def assert_same_checkpoints(local: Path, remote: Path, steps: int) -> int:
    """Every checkpoint of the distributed run equals the local one bit for bit."""
    names = sorted(p.name for p in (local / "checkpoints").glob("step-*.npz"))
    names = [n for n in names if not n.endswith(".opt.npz")]
    assert f"step-{steps:06d}.npz" in names
    for name in names:
        assert checkpoint_bits(remote / "checkpoints" / name) == checkpoint_bits(
            local / "checkpoints" / name
        ), name
    return len(names)


def losses(directory: Path) -> dict[int, float]:
    """Step -> loss from train.jsonl (empty before the first step is done)."""
    metrics = directory / "train.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return {json.loads(x)["step"]: json.loads(x)["loss"] for x in lines}


def decided(directory: Path, step: int | None = None) -> dict[str, str]:
    """Committed work units with a canonical tile: id -> canonical hash, those that a
    checkpoint purged from the database (from their archive) included."""
    where = "" if step is None else f" AND step = {step}"
    rows = committed(
        directory,
        "SELECT id, canonical_hash FROM workunits "
        f"WHERE state IN ('validated', 'assimilated'){where}",
    )
    archived = directory / "logs" / "workunits.jsonl.gz"
    if archived.exists():
        with gzip.open(archived, "rt") as f:
            for line in f:
                wu = json.loads(line)
                if wu["state"] in ("validated", "assimilated") and step in (None, wu["step"]):
                    rows.append((wu["id"], wu["canonical_hash"]))
    return dict(rows)


def started(directory: Path, step: int) -> bool:
    """Some tile of this step is committed (False while the database is being created)."""
    try:
        return bool(decided(directory, step))
    except sqlite3.OperationalError:  # no file or no schema yet
        return False


def signal_all(processes: list[subprocess.Popen], sig: signal.Signals) -> None:
    """SIGSTOP freezes volunteers so that a kill or an operator's command lands mid-product
    (a product takes milliseconds); SIGCONT lets them go on."""
    for process in processes:
        process.send_signal(sig)


def working_on(directory: Path, step: int) -> bool:
    """Some tile of this step is committed and another is out on a volunteer."""
    if not started(directory, step):
        return False
    out = committed(
        directory,
        "SELECT COUNT(*) FROM results JOIN workunits ON workunits.id = results.wu_id "
        f"WHERE workunits.step = {step} AND results.server_state = 'in_progress'",
    )
    return out[0][0] > 0


async def finish(coordinator: subprocess.Popen, log: Path, timeout: float = RUN_TIMEOUT) -> None:
    code = await asyncio.to_thread(coordinator.wait, timeout)
    assert code == 0, log.read_text()[-4000:]


# ---- churn -------------------------------------------------------------------------------


def host_of(state_dir: Path) -> int | None:
    """The host id a volunteer registered as (None if it died before registering)."""
    try:
        return json.loads((state_dir / "identity.json").read_text())["host_id"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return None


# How long the coordinator may take to commit a report that was already on its way.
REPORTS_IN = 1.0


def holds_work(project: Path, state_dir: Path) -> bool:
    host = host_of(state_dir)
    if host is None:
        return False
    held = committed(
        project,
        f"SELECT COUNT(*) FROM results WHERE host_id = {host} AND server_state = 'in_progress'",
    )
    return held[0][0] > 0


async def next_victim(live: dict, order: list[int], project: Path, pace: float) -> int:
    """The slot of a volunteer that holds work, looked for during up to `pace` seconds, or the
    longest-lived if none gets any; all volunteers are left frozen. A product takes
    milliseconds, so every volunteer is frozen (SIGSTOP) before each look. A report sent just
    before the freeze still shows as work held until the coordinator commits it: only work
    still held once the reports on their way are in counts."""
    processes = [process for process, _ in live.values()]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + pace

    def holding() -> list[int]:
        return [slot for slot in order if holds_work(project, live[slot][1])]

    while True:
        signal_all(processes, signal.SIGSTOP)
        if holding():
            with contextlib.suppress(TimeoutError):
                await wait_until(lambda: not holding(), timeout=REPORTS_IN)
            held = holding()
            if held:
                return held[0]
        if loop.time() > deadline:
            return order[0]
        signal_all(processes, signal.SIGCONT)
        with contextlib.suppress(TimeoutError):
            await wait_until(lambda: bool(holding()), timeout=deadline - loop.time())


async def churn(tmp_path: Path, reaper, steps: int, pace: float, crew: int) -> None:
    """A volunteer is killed with SIGKILL as soon as one holds work, then every `pace`
    seconds, one holding work if any gets some soon (else the longest-lived), and a new one
    started: half of them new hosts, half back with their old identity (the coordinator
    resends what it still holds for them)."""
    local, remote = make_pair(tmp_path, steps, **settings())
    port = free_port()
    url, log = f"http://127.0.0.1:{port}", tmp_path / "coordinator.log"
    coordinator = reaper(start_coordinator(remote, port, log))
    starts = Counter()

    def volunteer(slot: int) -> tuple[subprocess.Popen, Path]:
        starts[slot] += 1
        same = starts[slot] % 2 == 0
        state = tmp_path / f"v{slot}-{starts[slot] // 2 if same else starts[slot]}"
        return reaper(start_volunteer(url, state)), state

    live = {slot: volunteer(slot) for slot in range(crew)}
    order = list(range(crew))  # oldest first
    kills: list[tuple[int | None, float]] = []
    try:
        while coordinator.poll() is None:
            slot = await next_victim(live, order, remote, pace)
            process, state = live[slot]
            process.send_signal(signal.SIGKILL)
            process.wait()
            kills.append((host_of(state), time.time()))
            signal_all([p for s, (p, _) in live.items() if s != slot], signal.SIGCONT)
            live[slot] = volunteer(slot)
            order.remove(slot)
            order.append(slot)
            assert len(kills) < 10 * RUN_TIMEOUT / pace, "training does not end"
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(coordinator.wait, pace)  # the killer's pace
                break
    finally:
        for process, _ in live.values():
            stop(process)
    assert coordinator.wait() == 0, log.read_text()[-4000:]
    FIGURES["volunteers killed"] += len(kills)
    assert len(kills) >= 2, f"only {len(kills)} kills: the run ended too soon to mean anything"
    compared = assert_same_checkpoints(local, remote, steps)
    FIGURES["checkpoints equal to --local"] += compared
    assert losses(remote) == losses(local)
    assert integrity(remote) == "ok"
    # The kills mattered: tiles were in flight on killed volunteers, and were redone.
    in_flight = sum(
        committed(
            remote,
            f"SELECT COUNT(*) FROM results WHERE host_id = {host} AND sent_time <= {at} "
            f"AND (received_time IS NULL OR received_time > {at})",
        )[0][0]
        for host, at in kills
        if host is not None
    )
    FIGURES["tiles in flight on a killed volunteer"] += in_flight
    assert in_flight >= 1


async def test_volunteers_killed_every_second_leave_the_model_bitwise_equal(tmp_path, reaper):
    # The first kill as soon as a volunteer holds work, then one a second: a machine whose
    # kernel runs 230 GFLOPS ends the ten steps in about three seconds.
    await churn(tmp_path, reaper, steps=10, pace=1.0, crew=3)


@pytest.mark.slow
async def test_volunteers_killed_every_two_seconds_over_twenty_steps(tmp_path, reaper):
    await churn(tmp_path, reaper, steps=20, pace=2.0, crew=4)


# ---- the coordinator killed mid-step -----------------------------------------------------


async def kill_coordinator_mid_steps(tmp_path: Path, reaper, steps: int, kill_in: list[int]):
    local, remote = make_pair(tmp_path, steps, **settings(**{"training.checkpoint_every": 2}))
    port = free_port()
    url, log = f"http://127.0.0.1:{port}", tmp_path / "coordinator.log"
    crew = [reaper(start_volunteer(url, tmp_path / f"v{i}")) for i in range(2)]
    kept: dict[str, str] = {}
    try:
        for step in kill_in:
            coordinator = reaper(start_coordinator(remote, port, log))
            signal_all(crew, signal.SIGCONT)
            # Mid-step: some tiles of this step are committed, others are out on volunteers,
            # frozen so that their product cannot finish before the kill lands (a product
            # takes milliseconds).
            await wait_until(lambda s=step: working_on(remote, s), timeout=RUN_TIMEOUT)
            signal_all(crew, signal.SIGSTOP)
            coordinator.send_signal(signal.SIGKILL)
            coordinator.wait()
            FIGURES["coordinator kills survived"] += 1
            assert not (remote / "checkpoints" / f"step-{step:06d}.npz").exists()
            assert max(losses(remote), default=0) < step, "the kill landed after the step"
            kept.update(decided(remote))
            assert integrity(remote) == "ok"
        coordinator = reaper(start_coordinator(remote, port, log))
        signal_all(crew, signal.SIGCONT)
        await finish(coordinator, log)
    finally:
        signal_all(crew, signal.SIGCONT)
        for volunteer in crew:
            stop(volunteer)
    compared = assert_same_checkpoints(local, remote, steps)
    FIGURES["checkpoints equal to --local"] += compared
    assert losses(remote) == losses(local)
    assert integrity(remote) == "ok"
    # Nothing committed was lost or redone: every tile decided before a kill is still the
    # canonical one, and none of those work units was handed out again.
    after = decided(remote)
    assert {wu: after.get(wu) for wu in kept} == kept
    said = log.read_text()
    assert said.count("resuming") >= len(kill_in)
    # The tiles made again are said a step at a time, not a line each.
    assert "recomputing it" not in said and "were gone; recomputed" in said


async def test_a_coordinator_killed_mid_step_twice_resumes_bitwise_equal(tmp_path, reaper):
    await kill_coordinator_mid_steps(tmp_path, reaper, steps=4, kill_in=[2, 3])


@pytest.mark.slow
async def test_a_coordinator_killed_in_five_steps_out_of_eight_resumes_bitwise_equal(
    tmp_path, reaper
):
    await kill_coordinator_mid_steps(tmp_path, reaper, steps=8, kill_in=[1, 3, 4, 6, 8])


def launch(tmp_path: Path, reaper, steps: int):
    """The local reference run, and two volunteers for the distributed one (checkpoint at
    every step); the caller starts the coordinator."""
    local, remote = make_pair(tmp_path, steps, **settings(**{"training.checkpoint_every": 1}))
    port = free_port()
    url, log = f"http://127.0.0.1:{port}", tmp_path / "coordinator.log"
    crew = [reaper(start_volunteer(url, tmp_path / f"v{i}")) for i in range(2)]
    return local, remote, port, url, log, crew


# ---- the operator cancels a step ---------------------------------------------------------


async def test_a_cancelled_step_stops_training_and_a_restart_runs_it_again_bitwise_equal(
    tmp_path, reaper
):
    steps = 3
    local, remote, port, url, log, crew = launch(tmp_path, reaper, steps)
    try:
        coordinator = reaper(start_coordinator(remote, port, log))
        await wait_until(lambda: started(remote, 2), timeout=RUN_TIMEOUT)
        # Frozen, the volunteers cannot finish step 2 before the operator's command lands
        # (a step takes a fraction of a second, starting the command about as long).
        signal_all(crew, signal.SIGSTOP)
        try:
            cancelled = await asyncio.to_thread(
                tilehive, "admin", "cancel-step", url, "2", "--project", str(remote)
            )
        finally:
            signal_all(crew, signal.SIGCONT)
        assert cancelled.returncode == 0, cancelled.stderr
        assert "step 2 cancelled" in cancelled.stdout
        assert await asyncio.to_thread(coordinator.wait, RUN_TIMEOUT) == 1
        said = log.read_text()
        assert "training stopped: step 2 cancelled by the operator" in said
        assert "Traceback" not in said, said[-3000:]
        assert not (remote / "checkpoints" / "step-000002.npz").exists()
        # The task log says why its work units failed, in the table and in --json.
        listed = tilehive("logs", "tasks", str(remote), "--failures", "--json")
        failed = [json.loads(line) for line in listed.stdout.splitlines()]
        assert failed and {r["error"] for r in failed} == {"step 2 cancelled by the operator"}
        table = tilehive("logs", "tasks", str(remote), "--failures").stdout
        assert table.count("step 2 cancelled by the operator") == len(failed)
        # Counted as cancelled, not as errors an operator would take for failures.
        counts = json.loads(tilehive("status", str(remote), "--json").stdout)["workunits"]
        assert counts.get("cancelled") == len(failed) and "error" not in counts, counts
        for state, expected in (("cancelled", len(failed)), ("error", 0)):
            listed = tilehive("logs", "tasks", str(remote), "--state", state, "--json").stdout
            rows = [json.loads(line) for line in listed.splitlines()]
            assert len(rows) == expected and all(r["state"] == state for r in rows), state
        coordinator = reaper(start_coordinator(remote, port, log))
        await finish(coordinator, log)
    finally:
        for volunteer in crew:
            stop(volunteer)
    assert "running it again (attempt 2)" in log.read_text()
    counts = json.loads(tilehive("status", str(remote), "--json").stdout)["workunits"]
    assert counts.get("cancelled") == len(failed) and "error" not in counts, counts
    FIGURES["checkpoints equal to --local"] += assert_same_checkpoints(local, remote, steps)
    assert losses(remote) == losses(local)
    assert integrity(remote) == "ok"


async def test_a_damaged_last_checkpoint_moved_aside_is_trained_again_bitwise_equal(
    tmp_path, reaper
):
    """The coordinator says which checkpoint is damaged and what to do; done, training goes
    back to the checkpoint before it and runs the step again, though that step's products
    were let go (pruned) once its checkpoint was written."""
    steps = 3
    local, remote, port, url, log, crew = launch(tmp_path, reaper, steps)
    last = remote / "checkpoints" / f"step-{steps:06d}.npz"
    try:
        await finish(reaper(start_coordinator(remote, port, log)), log)
        with last.open("r+b") as cut:
            cut.truncate(1000)
        said = tilehive("coordinator", str(remote), "--bind", f"127.0.0.1:{port}", timeout=120)
        assert said.returncode == 1 and "Traceback" not in said.stderr
        assert f"{last} is damaged" in said.stderr and "move it and its other half" in said.stderr
        aside = tmp_path / "aside"
        aside.mkdir()
        for half in (last, last.with_suffix(".opt.npz")):
            half.rename(aside / half.name)
        # Told the project was finished, the first volunteers have stopped.
        crew += [reaper(start_volunteer(url, tmp_path / f"w{i}")) for i in range(2)]
        await finish(reaper(start_coordinator(remote, port, log)), log)
    finally:
        for volunteer in crew:
            stop(volunteer)
    assert "was let go after a checkpoint that is gone; running it again" in log.read_text()
    FIGURES["checkpoints equal to --local"] += assert_same_checkpoints(local, remote, steps)
    assert integrity(remote) == "ok"


# ---- a blob store that cannot be written -------------------------------------------------

FS_IOC_GETFLAGS, FS_IOC_SETFLAGS, FS_IMMUTABLE_FL = 0x80086601, 0x40086602, 0x10
OUTAGE = 4.0  # seconds the blob store stays unwritable once the coordinator has met it


def set_immutable(path: Path, on: bool) -> None:
    """`chattr +i` / `-i` without chattr (not installed here), through the ioctl it uses."""
    fd = os.open(path, os.O_RDONLY)
    try:
        flags = array.array("i", [0])
        fcntl.ioctl(fd, FS_IOC_GETFLAGS, flags, True)
        flags[0] = flags[0] | FS_IMMUTABLE_FL if on else flags[0] & ~FS_IMMUTABLE_FL
        fcntl.ioctl(fd, FS_IOC_SETFLAGS, flags, True)
    finally:
        os.close(fd)


# Blobs are held in memory until more than --blob-memory waits, and a project this small
# never needs to write one: the blob store's faults are met when blobs are written.
WRITE_AT_ONCE = ("--blob-memory", "0")


@contextlib.contextmanager
def unwritable(blobs: Path):
    """Make a blob store refuse every new file, even to root.

    Tests run as root, and root ignores permission bits (CAP_DAC_OVERRIDE): a chmod'ed
    read-only directory is still writable. The immutable inode flag is not a permission:
    nobody, root included, can create, rename or delete entries in an immutable directory,
    while the files in it stay readable. So the store and each of its fan-out directories
    are made immutable: every blob write fails with EPERM in the real filesystem, exactly as
    on a disk remounted read-only, and reads of committed blobs still work. Skips where the
    filesystem or the process cannot set the flag."""
    directories = [blobs, *sorted(p for p in blobs.iterdir() if p.is_dir())]
    flagged: list[Path] = []
    try:
        try:
            for directory in directories:
                set_immutable(directory, True)
                flagged.append(directory)
        except OSError as exc:
            pytest.skip(f"cannot make {blobs} immutable here: {exc}")
        try:
            (blobs / "probe").write_bytes(b"x")
        except PermissionError:
            pass
        else:
            pytest.skip("an immutable directory still takes new files here")
        yield
    finally:
        for directory in flagged:
            set_immutable(directory, False)


async def test_an_unwritable_blob_store_loses_nothing_and_a_restart_finishes_bitwise_equal(
    tmp_path, reaper
):
    steps = 4
    local, remote, port, _, log, crew = launch(tmp_path, reaper, steps)
    try:
        coordinator = reaper(start_coordinator(remote, port, log, *WRITE_AT_ONCE))
        await wait_until(lambda: started(remote, 2), timeout=RUN_TIMEOUT)
        before = decided(remote)
        mark = log.stat().st_size  # before the fault: the coordinator may meet it at once
        with unwritable(remote / "blobs"):
            # The coordinator meets the fault (an error in its log, or it exits); the fault
            # then lasts OUTAGE more seconds, longer than a result's deadline.
            await wait_until(
                lambda: coordinator.poll() is not None or "error" in log.read_text()[mark:].lower(),
                timeout=RUN_TIMEOUT,
            )
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(coordinator.wait, OUTAGE)
            during = log.read_text()[mark:]
            assert integrity(remote) == "ok" if coordinator.poll() is not None else True
            assert {wu: decided(remote).get(wu) for wu in before} == before
        if coordinator.poll() is not None:  # it stopped: the operator restarts it
            FIGURES["blob store outages: coordinator stopped and restarted"] += 1
            coordinator = reaper(start_coordinator(remote, port, log, *WRITE_AT_ONCE))
        else:
            FIGURES["blob store outages: coordinator waited them out"] += 1
        await finish(coordinator, log)
    finally:
        for volunteer in crew:
            stop(volunteer)
    assert "Operation not permitted" in during, during[-3000:]
    compared = assert_same_checkpoints(local, remote, steps)
    FIGURES["checkpoints equal to --local"] += compared
    assert losses(remote) == losses(local)
    assert integrity(remote) == "ok"
    after = decided(remote)
    assert {wu: after.get(wu) for wu in before} == before


async def test_a_coordinator_that_cannot_write_its_blob_store_stops_with_one_clear_line(
    tmp_path, reaper
):
    """The fault from the start: the first product's operand panels cannot be stored. The
    coordinator may stop (non-zero) or wait and retry; either way it says so in one line
    naming the blob store, and once the fault is gone it trains on, bitwise equal."""
    local, remote = make_pair(tmp_path, 1, **settings())
    port = free_port()
    url, log = f"http://127.0.0.1:{port}", tmp_path / "coordinator.log"
    (remote / "blobs").mkdir()
    crew = [reaper(start_volunteer(url, tmp_path / f"v{i}")) for i in range(2)]
    try:
        with unwritable(remote / "blobs"):
            coordinator = reaper(start_coordinator(remote, port, log, *WRITE_AT_ONCE))
            await wait_until(
                lambda: coordinator.poll() is not None or "not permitted" in log.read_text(),
                timeout=RUN_TIMEOUT,
            )
            with contextlib.suppress(subprocess.TimeoutExpired):  # stopping, or retrying?
                await asyncio.to_thread(coordinator.wait, OUTAGE)
            said = log.read_text()
        if coordinator.poll() is not None:
            if coordinator.returncode == 0:
                pytest.fail("the coordinator exited 0 without training")
            coordinator = reaper(start_coordinator(remote, port, log, *WRITE_AT_ONCE))
        code = await asyncio.to_thread(coordinator.wait, RUN_TIMEOUT)
    finally:
        for volunteer in crew:
            stop(volunteer)
    # What must hold whatever the coordinator chose (a failure here is no expected one).
    if code != 0 or integrity(remote) != "ok":
        pytest.fail(f"no recovery after the fault: exit {code}\n{log.read_text()[-3000:]}")
    if checkpoint_bits(remote / "checkpoints/step-000001.npz") != checkpoint_bits(
        local / "checkpoints/step-000001.npz"
    ):
        pytest.fail("the checkpoint differs from --local")
    # What the operator reads.
    assert str(remote / "blobs") in said and "Operation not permitted" in said
    assert "Traceback" not in said, said[-3000:]


async def test_an_unwritable_blob_store_is_a_clear_refusal_and_one_log_line(tmp_path, rng, caplog):
    """Tiles are written behind: the writer meets the fault and says so in one line naming
    the blob store; from then on reports are refused with a clear error (the volunteer sends
    them again later), and once the disk is back they go through."""
    async with running(tmp_path, policy=Policy.FREIVALDS, tile=8, unwritten_blob_bytes=0) as (
        co,
        queue,
        url,
    ):
        a, b = operands(rng, 16, 16, 8, False, False)
        product = asyncio.ensure_future(queue.matmul(a, b))
        await wait_until(lambda: co.ledger.unsent)
        assert await asyncio.to_thread(co.blobs.drain, 30)  # the panels are on disk
        async with CoordinatorClient(url) as client:
            await client.register("honest")
            first, second, *_ = (await client.request_work("w", capacity=2))["assignments"]
            reports = [await computed(client, assignment) for assignment in (first, second)]
            root = str(co.blobs.root)
            with unwritable(co.blobs.root):
                with contextlib.suppress(ServerRefused):
                    await client.report([reports[0]])  # taken into memory, or refused
                await wait_until(lambda: any(root in r.getMessage() for r in caplog.records))
                with pytest.raises(ServerRefused) as refusal:
                    await client.report([reports[1]])
            await wait_until(lambda: co.blobs.failure is None)  # the writer got through
            accepted = await client.report([reports[1]])
        product.cancel()
    assert accepted["accepted"] == [second["result_id"]]
    tracebacks = [r for r in caplog.records if r.exc_info]
    # The volunteer is told what happened in a protocol error body, and the operator gets
    # one line naming the blob store, not a traceback.
    assert refusal.value.code != "bad_reply", refusal.value
    assert "blob" in refusal.value.message
    assert tracebacks == [], tracebacks[0].getMessage()
    assert sum(1 for r in caplog.records if root in r.getMessage()) <= 2  # once, and cleared


# ---- liveness with a lopsided crew -------------------------------------------------------


async def computed(client: CoordinatorClient, assignment: dict) -> dict:
    blobs = [await client.fetch_blob(assignment[k], max_bytes=1 << 20) for k in "ab"]
    output_hash, tile = compute_tile(assignment, *blobs)
    report = {"result_id": assignment["result_id"], "hash": output_hash}
    if assignment["upload"] == "tile":
        report["tile"] = tile
    return report


async def test_a_slow_host_may_complete_the_quorum_of_a_tail_accelerated_work_unit(tmp_path, rng):
    """Once a GEMM is 90% done its last work units get a spare replica for fast hosts only;
    the replica the quorum needs must still go to a slower host (with two volunteers this
    was a deadlock: the faster already held a replica, the slower was below the median)."""
    async with running(tmp_path, policy=Policy.QUORUM, tile=8) as (co, queue, url):
        a, b = operands(rng, 40, 16, 8, False, False)  # 10 work units
        product = asyncio.ensure_future(queue.matmul(a, b))
        await wait_until(lambda: co.ledger.unsent)
        async with CoordinatorClient(url) as fast, CoordinatorClient(url) as slow:
            await fast.register("fast", gflops=100.0, threads=4)
            await slow.register("slow", gflops=1.0, threads=4)
            mine = (await fast.request_work("f0", capacity=10, wait=False))["assignments"]
            theirs = (await slow.request_work("s0", capacity=9, wait=False))["assignments"]
            # Nine work units decided (90%); the fast host still computes the tenth, whose
            # second replica nobody has taken yet.
            await slow.report([await computed(slow, x) for x in theirs])
            await fast.report([await computed(fast, x) for x in mine[:-1]])
            await wait_until(lambda: any(wu.accelerated for wu in co.ledger.wus.values()))
            await fast.report([await computed(fast, mine[-1])])
            # Both keep asking (each ask long-polls up to 0.2 s) for a few seconds.
            loop = asyncio.get_running_loop()
            deadline, asks = loop.time() + 5.0, itertools.count()
            while not product.done() and loop.time() < deadline:
                for client in (slow, fast):
                    reply = await client.request_work(f"ask{next(asks)}", capacity=2)
                    if reply["assignments"]:
                        await client.report(
                            [await computed(client, x) for x in reply["assignments"]]
                        )
            stuck = [
                [(r.host_id, r.server_state.value) for r in co.ledger.results_for(wu.id)]
                for wu in co.ledger.wus.values()
                if wu.state.value == "active"
            ]
        product.cancel()
    assert product.done() and not product.cancelled(), f"waiting forever for {stuck}"
