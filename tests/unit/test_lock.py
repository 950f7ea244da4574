"""Who holds a project: the lock itself answers, not the pid its file names."""

from __future__ import annotations

import json
import os

from coordinator.state.lock import LOCK_FILE, ProjectLock, in_use


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
