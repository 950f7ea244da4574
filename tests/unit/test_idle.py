"""`--idle-only`: the volunteer pauses for its owner's programs, never for tilehive's own (the
coordinator it serves on the same machine, or a volunteer beside it)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time

import pytest

from kernels import processes
from tests.procs import ENV, ROOT, poll
from volunteer.daemon import Volunteer, VolunteerConfig
from volunteer.idle import RESCAN, WINDOW, OwnerWatch, Sample, others_share

TICK = os.sysconf("SC_CLK_TCK")


def test_the_cpu_of_tilehives_processes_is_not_the_owners():
    before = Sample(0.0, busy=100.0, ours={7: 10.0, 8: 5.0})
    after = Sample(2.0, busy=103.0, ours={7: 11.5, 8: 6.0})
    # 3 CPU-seconds in 2 s, 2.5 of them tilehive's: the owner's programs used a quarter core.
    assert others_share(before, after) == pytest.approx(0.25)
    # A process seen in one sample only (started or ended between them) is not subtracted.
    assert others_share(before, Sample(2.0, 103.0, {7: 11.5, 9: 50.0})) == pytest.approx(0.75)
    assert others_share(before, Sample(0.0, 103.0, {})) == 0.0


def fake_proc(root, busy_seconds: float, processes_cpu: dict[int, tuple[str, float]]) -> None:
    """A /proc with the machine's busy CPU and some processes' names and CPU."""
    ticks = round(busy_seconds * TICK)
    (root / "stat").write_text(f"cpu  {ticks} 0 0 99999 0 0 0 0 0 0\ncpu0 0 0 0 0\n")
    for pid, (name, seconds) in processes_cpu.items():
        (root / str(pid)).mkdir(exist_ok=True)
        (root / str(pid) / "comm").write_text(name + "\n")
        fields = ["S"] + ["0"] * 10 + [str(round(seconds * TICK)), "0"] + ["0"] * 30
        (root / str(pid) / "stat").write_text(f"{pid} ({name} x) " + " ".join(fields) + "\n")


def test_the_owner_is_busy_only_when_programs_not_tilehives_use_half_a_core(tmp_path):
    watch = OwnerWatch(proc=tmp_path)
    fake_proc(tmp_path, 100.0, {11: ("tilehive-coord", 40.0), 12: ("firefox", 5.0)})
    assert watch.busy(now=0.0) is False  # one look: nothing to compare yet
    # A second later the coordinator has used a core: tilehive's, so the owner is idle.
    fake_proc(tmp_path, 101.0, {11: ("tilehive-coord", 41.0), 12: ("firefox", 5.0)})
    assert watch.busy(now=WINDOW) is False and watch.share == pytest.approx(0.0)
    # Then the owner's browser takes a core: a second of it is a burst, two are use.
    fake_proc(tmp_path, 102.0, {11: ("tilehive-coord", 41.0), 12: ("firefox", 6.0)})
    assert watch.busy(now=2 * WINDOW) is False and watch.share == pytest.approx(1.0)
    fake_proc(tmp_path, 103.0, {11: ("tilehive-coord", 41.0), 12: ("firefox", 7.0)})
    assert watch.busy(now=3 * WINDOW) is True and watch.share == pytest.approx(1.0)
    # Looks within a window keep the last one's answer: the loop asks before every tile.
    fake_proc(tmp_path, 103.0, {11: ("tilehive-coord", 41.0), 12: ("firefox", 7.0)})
    assert watch.busy(now=3.5 * WINDOW) is True
    # A tilehive process that starts later is found at the next scan of /proc.
    fake_proc(tmp_path, 103.0, {13: ("tilehive-vol", 0.0)})
    watch.busy(now=RESCAN + 1)
    fake_proc(tmp_path, 104.0, {13: ("tilehive-vol", 1.0)})
    assert watch.busy(now=RESCAN + 1 + WINDOW) is False


def test_a_second_of_another_programs_work_is_no_owner_at_work(tmp_path):
    """A command run in a terminal, a page loading: the volunteer went on computing."""
    watch = OwnerWatch(proc=tmp_path)
    fake_proc(tmp_path, 100.0, {12: ("bash", 5.0)})
    watch.busy(now=0.0)
    fake_proc(tmp_path, 101.0, {12: ("bash", 6.0)})  # a core for one second
    assert watch.busy(now=WINDOW) is False and watch.share == pytest.approx(1.0)
    fake_proc(tmp_path, 101.1, {12: ("bash", 6.0)})  # and then the machine idle
    assert watch.busy(now=2 * WINDOW) is False and watch.share == pytest.approx(0.1)
    fake_proc(tmp_path, 102.1, {12: ("bash", 7.0)})  # another second: it starts over
    assert watch.busy(now=3 * WINDOW) is False
    # One look over a longer span of use counts at once: its share is an average.
    fake_proc(tmp_path, 105.1, {12: ("bash", 10.0)})
    assert watch.busy(now=6 * WINDOW) is True


def test_without_proc_the_owner_never_counts_as_busy(tmp_path):
    watch = OwnerWatch(proc=tmp_path / "nothing")
    assert not watch.busy(now=0.0) and not watch.busy(now=10.0) and watch.share is None


BURNER = textwrap.dedent(
    """
    import sys
    from kernels import processes
    if sys.argv[1] != "-":
        processes.name_this_process(sys.argv[1])
    print("ready", flush=True)
    while True:
        pass
    """
)


def burner(name: str) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-c", BURNER, name], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=ENV
    )
    assert process.stdout.readline() == "ready\n"
    return process


def test_a_process_named_as_tilehives_is_found_and_its_cpu_counted_as_ours(reaper):
    named = reaper(burner(processes.COORDINATOR))
    other = reaper(burner("-"))
    try:
        assert processes.process_name(named.pid) == "tilehive-coord"
        found = set(processes.ours())
        assert named.pid in found and other.pid not in found
        watch = OwnerWatch()
        before = watch.sample(time.monotonic())
        start = processes.cpu_seconds(named.pid)
        poll(lambda: processes.cpu_seconds(named.pid) >= start + 0.3, 30, "the burner's CPU")
        after = watch.sample(time.monotonic())
        assert named.pid in before.ours and other.pid not in before.ours
        assert after.ours[named.pid] - before.ours[named.pid] >= 0.3
    finally:
        for process in (named, other):
            process.kill()
            process.wait()
            process.stdout.close()


class Owner:
    """What OwnerWatch would say, as a test sets it."""

    def __init__(self) -> None:
        self.share: float | None = 0.0

    def busy(self) -> bool:
        return (self.share or 0.0) > 0.5


def test_a_pause_and_its_end_are_said_once_each_with_the_share(tmp_path, caplog):
    volunteer = Volunteer(
        VolunteerConfig(url="http://127.0.0.1:9", state_dir=tmp_path, threads=1, idle_only=True)
    )
    volunteer.owner = owner = Owner()
    caplog.set_level(logging.INFO, logger="volunteer.daemon")
    assert volunteer._paused() == 0.0
    owner.share = 0.9
    assert volunteer._paused() > 0 and volunteer._paused() > 0
    assert volunteer.state == "paused"
    assert volunteer.note == "machine busy: other programs use 90% of a core (--idle-only)"
    # The coordinator's answers to its pauses say why work waits (paused volunteers): its
    # own status still says why it pauses.
    volunteer._heard({"assignments": [], "note": "work waits for volunteers: ..."}, False)
    assert volunteer.status()["note"] == volunteer.note
    owner.share = 0.1
    assert volunteer._paused() == 0.0 and volunteer._paused() == 0.0
    said = [r.getMessage() for r in caplog.records if r.name == "volunteer.daemon"]
    assert said == [
        "pausing: other programs use 90% of a core (--idle-only)",
        "resuming: other programs use 10% of a core (--idle-only)",
    ]
