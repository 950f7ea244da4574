"""Records: content ids that keep a step's work units together in the store, result ids,
and the copies `evolve` makes."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest

from coordinator.work.records import (
    Gemm,
    Host,
    Outcome,
    Policy,
    Redundancy,
    Result,
    ServerState,
    ValidateState,
    drafted,
    new_result_id,
    short_workunit_id,
    tile_bounds,
    tile_workunit,
)


def workunits(step: int, gemm_digit: str) -> list:
    gemm = Gemm(
        gemm_digit * 64, step, "l0", 16, 16, 4, False, False, 4, "a" * 64, "b" * 64, Policy.QUORUM
    )
    return [
        tile_workunit(gemm, bounds, "a" * 64, "b" * 64, Redundancy(), 1)
        for bounds in tile_bounds(gemm.m, gemm.n, gemm.tile)
    ]


def test_work_unit_ids_name_their_content_and_sort_by_step():
    earlier = workunits(7, "e") + workunits(7, "1")
    later = workunits(8, "0")
    ids = [wu.id for wu in earlier + later]
    assert all(re.fullmatch(r"[0-9a-f]{64}", i) for i in ids)
    assert len(set(ids)) == len(ids)
    # The same description names the same work unit: a restarted coordinator finds it.
    assert [wu.id for wu in workunits(8, "0")] == [wu.id for wu in later]
    # A step's work units are neighbours in the store's indexes, after the steps before
    # (a commit writes the pages it touches whole: docs/performance-history.md,
    # the twenty-second round), and a GEMM's work units are neighbours within its step.
    assert max(wu.id for wu in earlier) < min(wu.id for wu in later)
    in_order = sorted(earlier, key=lambda wu: wu.id)
    assert len({wu.gemm_id for wu in in_order[:16]}) == 1
    assert len({wu.gemm_id for wu in in_order[16:]}) == 1


def test_the_short_id_in_logs_tells_a_products_tiles_apart():
    tiles = workunits(3, "c")
    assert len({short_workunit_id(wu.id) for wu in tiles}) == len(tiles) == 16


RECORDS = [
    Gemm("g" * 64, 3, "l0", 16, 16, 4, False, True, 4, "a" * 64, "b" * 64, Policy.QUORUM),
    workunits(3, "g")[0],
    Result("r" * 32, "w" * 64, host_id=7),
    Host(7, "laptop", "t" * 64, 1.0, 2.0),
]


def fields_of(record) -> dict:
    return {name: getattr(record, name) for name in record.__dataclass_fields__}


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_evolve_changes_the_named_fields_of_a_copy_and_leaves_it_frozen(record):
    before = fields_of(record)
    names = list(before)
    for changed in (names[:1], names[-2:], names):
        changes = {name: f"new {name}" for name in changed}
        evolved = record.evolve(**changes)
        assert type(evolved) is type(record)
        assert fields_of(evolved) == {**before, **changes}
        assert evolved == type(record)(**{**before, **changes})
        assert hash(evolved) == hash(type(record)(**{**before, **changes}))
        assert fields_of(record) == before
        with pytest.raises(dataclasses.FrozenInstanceError):
            evolved.id = "changed"  # type: ignore[misc]


def test_a_record_is_built_from_positions_keywords_and_defaults_and_stays_frozen():
    result = Result("r" * 32, "w" * 64, 7, received_time=2.5)
    assert fields_of(result) == {
        "id": "r" * 32,
        "wu_id": "w" * 64,
        "host_id": 7,
        "server_state": ServerState.UNSENT,
        "outcome": Outcome.INIT,
        "validate_state": ValidateState.INIT,
        "upload_tile": True,
        "sent_time": None,
        "received_time": 2.5,
        "report_deadline": None,
        "output_hash": None,
        "has_tile": False,
        "error": "",
    }
    assert type(result) is Result
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.outcome = Outcome.SUCCESS  # type: ignore[misc]
    with pytest.raises(TypeError, match="wu_id"):
        Result("r" * 32)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="colour"):
        Result("r" * 32, "w" * 64, colour="red")  # type: ignore[call-arg]


def test_evolve_names_a_field_the_record_does_not_have():
    with pytest.raises(TypeError, match="Result has no field 'colour'"):
        RECORDS[2].evolve(outcome=Outcome.SUCCESS, colour="red")


def test_result_ids_differ_between_a_forked_child_and_its_parent():
    read, write = os.pipe()
    new_result_id()  # the parent holds a block of random digits when it forks
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's side
        status = 1
        try:
            os.write(write, new_result_id().encode())
            status = 0
        finally:
            os._exit(status)  # never back into pytest
    os.close(write)  # a child that wrote nothing leaves the read below empty, not blocked
    _, status = os.waitpid(child, 0)
    theirs = os.read(read, 64).decode()
    os.close(read)
    assert os.waitstatus_to_exitcode(status) == 0
    mine = new_result_id()
    assert re.fullmatch(r"[0-9a-f]{32}", theirs)
    assert theirs[11:] != mine[11:]


@pytest.mark.parametrize(
    "field",
    [
        dataclasses.field(default_factory=list),
        dataclasses.field(default=0, init=False),
        dataclasses.field(default=0, kw_only=True),
    ],
    ids=["default_factory", "init=False", "kw_only"],
)
def test_a_record_refuses_a_field_its_init_could_not_honour(field):
    with pytest.raises(TypeError, match=r"Odd\.extra: a drafted record's fields are plain"):

        @drafted
        @dataclasses.dataclass(frozen=True, slots=True)
        class Odd:
            id: str
            extra: object = field


def test_a_record_refuses_a_post_init():
    with pytest.raises(TypeError, match="Odd: a drafted record has no __post_init__"):

        @drafted
        @dataclasses.dataclass(frozen=True, slots=True)
        class Odd:
            id: str

            def __post_init__(self) -> None:
                pass


def test_a_record_is_not_subclassed():
    with pytest.raises(TypeError, match="a record is not subclassed"):

        class Special(Result):  # its definition is what fails
            pass
