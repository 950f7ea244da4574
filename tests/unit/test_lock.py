"""Who holds a project: the lock itself answers, not the pid its file names."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from coordinator.state.lock import LOCK_FILE, ProjectLock, holder, in_use


def test_a_project_is_in_use_while_its_lock_is_held_and_free_after(tmp_path):
    lock = ProjectLock(tmp_path)
    lock.acquire("coordinator")
    lock.describe(url="http://127.0.0.1:8470")
    said = in_use(tmp_path)
    assert said is not None and f"(pid {os.getpid()}) serving http://127.0.0.1:8470" in said
    lock.release()
    assert in_use(tmp_path) is None


def test_a_lock_file_naming_a_running_program_it_does_not_hold_is_free(tmp_path):
    """After a reboot the pid in the file may be any program's (here: this test's)."""
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": os.getpid(), "command": "coordinator"}))
    assert in_use(tmp_path) is None
    assert in_use(tmp_path / "no-project-here") is None


def test_status_names_a_holder_only_while_it_holds_the_lock(tmp_path):
    """`status DIR` reads the lock without taking it: a coordinator killed and not yet reaped
    (a zombie, its pid still taken) and a pid reused after a reboot hold nothing."""
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": os.getpid(), "command": "coordinator"}))
    assert holder(tmp_path) is None
    serve = (
        "import sys; from coordinator.state.lock import ProjectLock; "
        "lock = ProjectLock(sys.argv[1]); lock.acquire('coordinator'); "
        "lock.describe(url='http://127.0.0.1:8470'); print('held', flush=True); sys.stdin.read()"
    )
    with subprocess.Popen(
        [sys.executable, "-c", serve, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    ) as child:
        try:
            assert child.stdout.readline() == b"held\n"
            found = holder(tmp_path)
            assert found is not None and found["pid"] == child.pid
            assert found["url"] == "http://127.0.0.1:8470"
            os.kill(child.pid, signal.SIGKILL)
            # Not reaped yet: the pid still answers kill(0), but the kernel dropped its lock.
            os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
            os.kill(child.pid, 0)
            assert holder(tmp_path) is None
        finally:
            child.kill()
