"""`tilehive logs --follow`: what it asks the project for on each poll."""

from __future__ import annotations

from coordinator.cli import main as cli
from coordinator.cli.logs import InspectError, NoSuchHost


class Project:
    """A project where host "late" registers after the first poll, and a namesake after
    the second: from then on the name is ambiguous."""

    def __init__(self) -> None:
        self.polls = 0
        self.asked: list[str] = []

    def host_id(self, host: str) -> int:
        if host.isdigit():
            return int(host)
        if self.polls == 0:
            self.polls += 1
            raise NoSuchHost(f"no host named {host!r}")
        if self.polls > 1:
            raise InspectError(f"2 hosts are named {host!r}: give the id (3, 4)")
        return 3

    def events(self, *, kinds, after, host, **filters) -> list[dict]:
        self.polls += 1
        self.asked.append(host)
        if len(self.asked) == 3:
            raise KeyboardInterrupt  # the operator's Ctrl-C
        return [{"id": len(self.asked), "state": "valid", "host": host}]


def test_a_followed_host_is_pinned_by_its_id_once_it_registers(monkeypatch):
    """A namesake registering later made every poll ambiguous, and the follower died."""
    monkeypatch.setattr(cli.time, "sleep", lambda seconds: None)
    project, seen = Project(), []
    cli._follow(project, ("validation",), 0, seen.append, {"host": "late", "step": None})
    assert project.asked == ["3", "3", "3"] and len(seen) == 2
