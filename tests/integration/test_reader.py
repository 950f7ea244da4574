"""The read-only reader behind `tilehive logs`, `status` and the demo: one database path."""

from __future__ import annotations

import ast
import sqlite3
from pathlib import Path

import pytest

from coordinator.cli.logs import InspectError, NotStarted, ProjectView
from coordinator.state.reader import ProjectReader
from coordinator.state.sqlite import SqliteStore, load_queries
from coordinator.state.store import Batch
from coordinator.work.events import Event
from coordinator.work.records import (
    Gemm,
    Host,
    Outcome,
    Policy,
    Result,
    ServerState,
    ValidateState,
    WorkUnit,
    WuState,
)

HASH = "ab" * 32
CLI = Path(__file__).parents[2] / "coordinator" / "cli"


def workunit(name: str, step: int, i0: int, created: float, state: WuState) -> WorkUnit:
    return WorkUnit(
        name * 64, "g" * 64, step, i0, i0 + 4, 0, 4, 4, HASH, HASH, False, False, 1,
        Policy.QUORUM, 2, 2, 4, 8, 60.0, state=state, created=created,
    )  # fmt: skip


@pytest.fixture
async def state_db(tmp_path) -> Path:
    path = tmp_path / "state.db"
    gemm = Gemm("g" * 64, 1, "l0.fwd", 8, 4, 4, False, False, 4, HASH, HASH, Policy.QUORUM)
    hosts = {
        1: Host(1, "alice", "a" * 64, 1.0, 2.0, valid_count=1),
        2: Host(2, "bob", "b" * 64, 1.0, 2.0),
    }
    first = workunit("a", 1, 0, 10.0, WuState.ASSIMILATED)
    second = workunit("b", 1, 4, 20.0, WuState.ACTIVE)
    results = [
        Result("1" * 32, first.id, host_id=1, server_state=ServerState.OVER,
               outcome=Outcome.SUCCESS, validate_state=ValidateState.VALID, received_time=15.0),
        Result("2" * 32, first.id, host_id=2, server_state=ServerState.OVER,
               outcome=Outcome.SUCCESS, validate_state=ValidateState.INVALID),
        Result("3" * 32, second.id, host_id=2, server_state=ServerState.IN_PROGRESS),
    ]  # fmt: skip
    events = [
        Event(10.0, "wu", "created", "m", 1, gemm.id, first.id),
        Event(15.0, "validation", "valid", "ok", 1, gemm.id, first.id, "1" * 32, 1),
        Event(16.0, "validation", "invalid", "hash mismatch", 1, gemm.id, first.id, "2" * 32, 2),
        Event(17.0, "result", "success", "m", 1, gemm.id, second.id, "3" * 32, 2),
    ]
    store = SqliteStore(path)
    await store.open()
    await store.commit(
        Batch(
            {gemm.id: gemm},
            {first.id: first, second.id: second},
            {r.id: r for r in results},
            hosts,
            events,
        )
    )
    await store.close()
    return path


def test_the_reader_answers_every_filter_of_logs_and_status(state_db):
    with ProjectReader(state_db) as reader:
        assert reader.host_ids_named("bob") == [2] and reader.host_ids_named("eve") == []
        every = dict(step=None, state=None, since=None, host_id=None, limit=10)
        assert [w["id"][0] for w in reader.workunits(**every)] == ["b", "a"]
        assert reader.workunits(**every)[0]["label"] == "l0.fwd"
        assert [w["id"][0] for w in reader.workunits(**{**every, "state": "active"})] == ["b"]
        assert [w["id"][0] for w in reader.workunits(**{**every, "since": 15.0})] == ["b"]
        assert [w["id"][0] for w in reader.workunits(**{**every, "host_id": 1})] == ["a"]
        assert reader.workunits(**{**every, "step": 2}) == []
        assert len(reader.workunits(**{**every, "limit": 1})) == 1
        assert len(reader.results_of(["a" * 64])) == 2 and reader.results_of([]) == []
        kinds = ("validation",)
        assert [e["state"] for e in reader.events(kinds=kinds)] == ["valid", "invalid"]
        assert [e["state"] for e in reader.events(kinds=kinds, host_id=2)] == ["invalid"]
        assert [e["state"] for e in reader.events(kinds=kinds, since=16.0)] == ["invalid"]
        assert [e["kind"] for e in reader.events(kinds=("wu", "result"), after=1)] == ["result"]
        assert reader.last_event_id() == 4
        assert reader.count_events_since("result", "success", 17.0) == 1
        assert reader.workunit_counts() == {"assimilated": 1, "active": 1}
        assert reader.result_counts() == {"over": 2, "in_progress": 1}
        assert reader.result_verdicts() == {"valid": 1, "invalid": 1, "pending": 1}
        assert reader.invalid_count() == 1
        assert reader.product_counts() == (1, 2)
        assert [tuple(h) for h in reader.host_totals()] == [("alice", 1, 0, 0), ("bob", 0, 0, 0)]


def test_the_reader_cannot_write(state_db):
    import sqlite3

    with (
        ProjectReader(state_db) as reader,
        pytest.raises(sqlite3.OperationalError, match="readonly"),
    ):
        reader._db.execute("DELETE FROM hosts")


def test_every_query_the_reader_names_is_a_block_of_queries_sql():
    source = (CLI.parent / "state" / "reader.py").read_text()
    named = {
        node.args[0].value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and getattr(node.func, "attr", None) == "_rows"
        and isinstance(node.args[0], ast.Constant)
    }
    assert named and named <= set(load_queries())


def test_the_command_line_holds_no_sql():
    for module in CLI.glob("*.py"):
        text = module.read_text()
        assert "sqlite3" not in text, module
        for keyword in ("SELECT ", "INSERT ", "UPDATE ", "DELETE "):
            assert keyword not in text, (module, keyword)


async def test_logs_refuse_a_host_name_two_hosts_share_rather_than_pick_the_newest(state_db):
    # Anyone may register a name: a newcomer named "alice" must not hide alice's history.
    store = SqliteStore(state_db)
    await store.open()
    await store.commit(Batch({}, {}, {}, {3: Host(3, "alice", "c" * 64, 1.0, 2.0)}, []))
    await store.close()
    view = ProjectView(state_db.parent)
    try:
        assert view.host_id("bob") == 2 and view.host_id("1") == 1
        with pytest.raises(InspectError, match=r"2 hosts are named 'alice': give the id \(1, 3\)"):
            view.host_id("alice")
    finally:
        view.close()


def test_a_database_whose_tables_are_not_made_yet_is_a_project_not_started(tmp_path):
    """What a starting coordinator leaves for an instant (WAL mode set, no table yet): a
    follower started first opened it then, and called it damaged, saying to move it away."""
    with sqlite3.connect(tmp_path / "state.db") as db:
        db.execute("PRAGMA journal_mode=WAL")
    with pytest.raises(NotStarted, match="coordinator has not run yet"):
        ProjectView(tmp_path)
