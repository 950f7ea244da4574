"""What `tilehive status` prints from a summary, whichever way it was read."""

from __future__ import annotations

from coordinator.cli.main import status_lines


def test_a_project_whose_steps_were_lowered_below_those_trained_says_so():
    """It read `step 3 of 2`, which looked like a counting bug."""
    summary = {"training": {"step": 3, "steps": 2, "done": True}}
    first = status_lines("p", summary)[0]
    assert first == "p: step 3 of 2 (project.toml's steps lowered to 2 after step 3 was trained)"
    assert status_lines("p", {"training": {"step": 2, "steps": 2}})[0] == "p: step 2 of 2"
