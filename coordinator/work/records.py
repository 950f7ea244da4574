"""The model of the work: GEMMs, work units, results and hosts, as frozen records.

Names and states follow BOINC's server (db/boinc_db_types.h) where BOINC has one, so an
operator who knows BOINC can read the logs. Every record is immutable; `evolve` returns a
changed copy, which the coordinator's state keeps and the store persists.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self, TypeVar

import msgpack
from blake3 import blake3

T = TypeVar("T")


class Policy(enum.StrEnum):
    """How the validator decides a work unit (project setting `validation.policy`)."""

    QUORUM = "quorum"  # min_quorum bit-identical output hashes
    FREIVALDS = "freivalds"  # one tile, checked against its operands
    BOTH = "both"  # a quorum, and the agreed tile passes Freivalds


class GemmState(enum.StrEnum):
    ACTIVE = "active"
    DONE = "done"
    FAILED = "failed"
    PRUNED = "pruned"  # done, and its blobs deleted after a checkpoint made them useless


class WuState(enum.StrEnum):
    ACTIVE = "active"  # results still needed or pending validation
    VALIDATED = "validated"  # canonical result chosen; its tile is a committed blob
    ASSIMILATED = "assimilated"  # tile written into its GEMM's output
    ERROR = "error"  # failed for good; error_mask says why


WU_TERMINAL = frozenset({WuState.ASSIMILATED, WuState.ERROR})
WU_DECIDED = frozenset({WuState.VALIDATED, WuState.ASSIMILATED, WuState.ERROR})


class WuError(enum.IntFlag):
    """BOINC's WU_ERROR_* bits."""

    NONE = 0
    COULDNT_SEND = 1
    TOO_MANY_ERRORS = 2
    TOO_MANY_SUCCESS = 4  # BOINC: too many successes without a quorum
    TOO_MANY_TOTAL = 8
    CANCELLED = 16  # its product was dropped: its step cancelled, or its panels lost

    def reason(self, product_error: str = "") -> str:
        """Why a work unit failed, for a person: each bit's meaning, and for a dropped
        product what its GEMM says (`product_error`)."""
        texts = dict(_WU_ERROR_TEXT)
        if product_error:
            texts[WuError.CANCELLED] = product_error
        return "; ".join(text for bit, text in texts.items() if self & bit) or "failed"


_WU_ERROR_TEXT = {
    WuError.COULDNT_SEND: "no host could be sent it",
    WuError.TOO_MANY_ERRORS: "too many client errors",
    WuError.TOO_MANY_SUCCESS: "too many results, no quorum among them",
    WuError.TOO_MANY_TOTAL: "too many results without a decision",
    WuError.CANCELLED: "its product was dropped",
}


class ServerState(enum.StrEnum):
    UNSENT = "unsent"
    IN_PROGRESS = "in_progress"
    OVER = "over"


class Outcome(enum.StrEnum):
    INIT = "init"
    SUCCESS = "success"
    CLIENT_ERROR = "client_error"
    NO_REPLY = "no_reply"  # deadline passed
    DIDNT_NEED = "didnt_need"  # cancelled before it was sent
    ABORTED = "aborted"  # cancelled while in progress: the WU was decided without it


class ValidateState(enum.StrEnum):
    INIT = "init"
    VALID = "valid"
    INVALID = "invalid"
    INCONCLUSIVE = "inconclusive"  # no quorum yet
    TOO_LATE = "too_late"  # arrived after the WU was decided; checked, never used


def drafted(cls: type[T]) -> type[T]:
    """Give a frozen, slotted dataclass an __init__ that fills a draft: an unfrozen class with
    the same slots, whose attributes the interpreter stores by its fast path for slots. The
    instance becomes a draft while it is filled and a `cls` again at the end, which Python
    allows between classes of identical layout.

    A frozen dataclass sets each field through object.__setattr__, a call and a lookup on
    the class per field: 2.0 us to build a work unit (26 fields) against 0.8 this way
    (docs/performance-history.md, the twenty-fifth round). `evolve` copies through the same
    draft. The parameters, their order and defaults are the dataclass's own; a field this
    __init__ could not honour is refused when the class is defined."""
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__}: a drafted record has no __post_init__")
    params, lines = [], []
    scope: dict[str, object] = {
        "__name__": cls.__module__,  # the generated function's __module__
        "cls": cls,
        "draft": _draft(cls),
        "object_setattr": object.__setattr__,
    }
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.default_factory is not dataclasses.MISSING or not f.init or f.kw_only:
            raise TypeError(
                f"{cls.__name__}.{f.name}: a drafted record's fields are plain parameters, "
                "their defaults values (no default_factory, init=False or kw_only)"
            )
        if f.default is dataclasses.MISSING:
            params.append(f.name)
        else:
            scope[f"default_{f.name}"] = f.default
            params.append(f"{f.name}=default_{f.name}")
        lines.append(f"    self.{f.name} = {f.name}")
    head = [
        f"def __init__(self, {', '.join(params)}):",
        "    object_setattr(self, '__class__', draft)",
    ]
    source = "\n".join([*head, *lines, "    object_setattr(self, '__class__', cls)"])
    exec(source, scope)  # our own field names: identifiers, never input
    init = scope["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"  # type: ignore[attr-defined]
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    init.__annotations__ = {f.name: f.type for f in fields} | {"return": None}
    cls.__init__ = init  # type: ignore[misc]
    cls.__init_subclass__ = classmethod(_final)  # type: ignore[assignment]
    return cls


def _final(subclass: type, **kwargs: object) -> None:
    # The draft has its record's slots only, and __init__ ends by making `self` the record:
    # a subclass would be built as its base.
    raise TypeError(f"{subclass.__name__}: a record is not subclassed")


@functools.cache
def _draft(cls: type) -> type:
    """An unfrozen class with exactly `cls`'s slots."""
    return type(f"{cls.__name__}Draft", (), {"__slots__": cls.__slots__})


@drafted
@dataclass(frozen=True, slots=True)
class Redundancy:
    """BOINC's replication fields, copied into each work unit."""

    target_nresults: int = 2
    min_quorum: int = 2
    max_error_results: int = 4  # client errors and invalid results
    max_total_results: int = 24  # every result, timeouts and hand-backs included
    delay_bound: float = 60.0

    def for_policy(self, policy: Policy) -> Redundancy:
        """Freivalds alone needs one replica; the quorum policies need min_quorum of them."""
        if policy is Policy.FREIVALDS:
            return Redundancy(
                1, 1, self.max_error_results, self.max_total_results, self.delay_bound
            )
        return self


@drafted
@dataclass(frozen=True, slots=True)
class Gemm:
    """One matrix product C = op(A) @ op(B), cut into tiles of `tile` x `tile`."""

    id: str
    step: int
    label: str
    m: int
    n: int
    k: int
    trans_a: bool
    trans_b: bool
    tile: int
    a_id: str
    b_id: str
    policy: Policy
    state: GemmState = GemmState.ACTIVE
    error: str = ""
    created: float = 0.0

    def evolve(self, **changes: object) -> Self:
        return evolve_record(self, changes)


@drafted
@dataclass(frozen=True, slots=True)
class WorkUnit:
    """C[i0:i1, j0:j1] = op(A)[i0:i1, :] @ op(B)[:, j0:j1] of one GEMM."""

    id: str
    gemm_id: str
    step: int
    i0: int
    i1: int
    j0: int
    j1: int
    k: int
    a_panel: str  # blob id of the operand panel holding op(A)[i0:i1, :] (stored as in A)
    b_panel: str  # blob id of the operand panel holding op(B)[:, j0:j1] (stored as in B)
    trans_a: bool
    trans_b: bool
    kernel_version: int
    policy: Policy
    target_nresults: int
    min_quorum: int
    max_error_results: int
    max_total_results: int
    delay_bound: float
    state: WuState = WuState.ACTIVE
    canonical_result: str | None = None
    canonical_hash: str | None = None
    error_mask: int = 0
    transition_time: float = 0.0
    accelerated: bool = False  # a spare replica was added by tail acceleration
    created: float = 0.0

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.i1 - self.i0, self.j1 - self.j0, self.k

    @property
    def flops(self) -> int:
        m, n, k = self.shape
        return 2 * m * n * k

    def evolve(self, **changes: object) -> Self:
        return evolve_record(self, changes)


@drafted
@dataclass(frozen=True, slots=True)
class Result:
    """One replica of a work unit, assigned to at most one host."""

    id: str
    wu_id: str
    host_id: int | None = None
    server_state: ServerState = ServerState.UNSENT
    outcome: Outcome = Outcome.INIT
    validate_state: ValidateState = ValidateState.INIT
    upload_tile: bool = True  # False: a check replica that reports only the tile's hash
    sent_time: float | None = None
    received_time: float | None = None
    report_deadline: float | None = None
    output_hash: str | None = None
    has_tile: bool = False  # the full tile is in the blob store under output_hash
    error: str = ""

    def evolve(self, **changes: object) -> Self:
        return evolve_record(self, changes)


@drafted
@dataclass(frozen=True, slots=True)
class Host:
    """A volunteer machine, known by the hash of its bearer token."""

    id: int
    name: str
    token_hash: str
    created: float
    last_contact: float
    gflops: float = 1.0
    threads: int = 1
    max_memory_mb: int = 0
    consecutive_valid: int = 0
    valid_count: int = 0
    invalid_count: int = 0
    error_count: int = 0
    max_in_progress: int = 4
    quarantined: bool = False
    gone: bool = False  # said it stops: not counted as connected until it asks again

    @property
    def in_service(self) -> bool:
        """Neither quarantined nor stopped: a host work may go to, and be waited for."""
        return not (self.quarantined or self.gone)

    @property
    def has_asked(self) -> bool:
        """Whether it has asked for work since it registered (has_asked)."""
        return has_asked(self.created, self.last_contact)

    def evolve(self, **changes: object) -> Self:
        return evolve_record(self, changes)


def has_asked(created: float, last_contact: float) -> bool:
    """Whether a host registered at `created` has been heard from since. A volunteer asks
    at once after registering; one that never does (killed in between, a script that only
    registers) is no volunteer at work: counted as one, the log said "work flows again" at
    its registration and, 40 s later, that it had gone quiet. Every request, report or long
    body heard moves its last contact past its registration."""
    return last_contact > created


def evolve_record(record: Any, changes: dict[str, object]) -> Any:
    """`dataclasses.replace` for the frozen, slotted records, at a fifth to a third of its
    cost (`benchmarks/records.py`): a result changes several times in a report's life, and
    replace() runs the whole __init__. The records have no __post_init__, so copying the
    slots is the same record."""
    # Keyed by the changed names in the order given: a few dozen keys, one a call site.
    try:
        copy = _COPIERS[(type(record), *changes)]
    except KeyError:
        copy = _COPIERS[(type(record), *changes)] = _copier(type(record), tuple(changes))
    return copy(record, changes)


_COPIERS: dict[tuple, Callable[[Any, dict[str, object]], Any]] = {}


def _copier(cls: type, changed: tuple[str, ...]) -> Callable[[Any, dict[str, object]], Any]:
    """A function that copies a `cls` record with new values for the fields `changed`, through
    a draft (`drafted`). Written out field by field and per set of changed names, as
    dataclasses writes __init__, with exec."""
    names = list(cls.__dataclass_fields__)
    if not set(names).issuperset(changed):
        wrong = sorted(set(changed) - set(names))[0]
        raise TypeError(f"{cls.__name__} has no field {wrong!r}")
    lines = ["def copy(record, changes):", "    copied = new(draft)"]
    for name in names:
        value = f"changes[{name!r}]" if name in changed else f"record.{name}"
        lines.append(f"    copied.{name} = {value}")
    lines += ["    copied.__class__ = cls", "    return copied"]
    scope: dict[str, object] = {"cls": cls, "draft": _draft(cls), "new": object.__new__}
    exec("\n".join(lines), scope)  # our own field names: identifiers, never input
    return scope["copy"]  # type: ignore[return-value]


def new_result_id() -> str:
    """32 hex digits: the time in steps of about a millisecond (11 digits), then 84 random
    bits. Time first, so that the results in flight are neighbours in the store's index
    rather than spread all over it (docs/performance-history.md, the eighteenth round).
    The random digits come from a system call an id: a pool of them was measured four times
    (the eighteenth, twenty-second, twenty-third and twenty-fifth rounds) at about 0.3 µs an
    id, under 0.5% of a work unit, and left out for its lock and fork handling."""
    return f"{time.time_ns() >> 20:011x}"[-11:] + secrets.token_hex(11)[:21]


def canonical_id(kind: str, fields: dict[str, object]) -> str:
    """blake3 of a canonical encoding: msgpack of the sorted fields, prefixed by a kind."""
    body = msgpack.packb([kind, sorted(fields.items())], use_bin_type=True)
    return blake3(body).hexdigest()


def gemm_id(
    *,
    step: int,
    label: str,
    a_id: str,
    b_id: str,
    trans_a: bool,
    trans_b: bool,
    policy: Policy,
    kernel_version: int,
    attempt: int = 0,
) -> str:
    """The content id of a product: the same inputs always name the same GEMM. Its tile is
    not part of it (the bits do not depend on it): a product is cut once, when published, and
    a restarted coordinator finds it however it would cut it now.

    `attempt` counts earlier runs of the same product that failed or were cancelled: a retry
    is a new GEMM with new work units, so nothing of the failed one is reused."""
    fields = {
        "step": step,
        "label": label,
        "a": a_id,
        "b": b_id,
        "trans_a": trans_a,
        "trans_b": trans_b,
        "policy": policy.value,
        "kernel_version": kernel_version,
    }
    if attempt:
        fields["attempt"] = attempt
    return canonical_id("gemm", fields)


def workunit_id(
    *,
    gemm: str,
    step: int,
    bounds: tuple[int, int, int, int],
    k: int,
    a_panel: str,
    b_panel: str,
    trans_a: bool,
    trans_b: bool,
    kernel_version: int,
) -> str:
    """The content id of a tile's work: its description, never when or where it ran.

    64 hex digits, led by the step (8) and the GEMM's id (16), then 40 of the hash of the
    whole description. The store indexes work units and their results by this id, and a
    commit writes every index page it touches whole to the WAL and again at the checkpoint:
    with bare hashes each new work unit landed on a page of its own, so a commit touched
    about one page a work unit in each of two indexes. Led by the step, a step's work units
    are neighbours at the index's end (docs/performance-history.md, the twenty-second round)."""
    digest = canonical_id(
        "wu",
        {
            "gemm": gemm,
            "step": step,
            "bounds": list(bounds),
            "k": k,
            "a": a_panel,
            "b": b_panel,
            "trans_a": trans_a,
            "trans_b": trans_b,
            "kernel_version": kernel_version,
        },
    )
    return f"{step & 0xFFFFFFFF:08x}{gemm[:16]}{digest[:40]}"


CANCELLED_STATE = "cancelled"


def counted_state(wu: WorkUnit) -> str:
    """A work unit's state as status counts it: an error whose product was dropped (its
    step cancelled, or its blobs lost to a kill, and the product run again) counts as
    `cancelled`, not as an error, which an operator would read as a failure."""
    return shown_state(wu.state, wu.error_mask)


def shown_state(state: str, error_mask: int) -> str:
    """counted_state from a stored row's state and error mask (queries.sql says the same)."""
    if state == WuState.ERROR and error_mask & WuError.CANCELLED:
        return CANCELLED_STATE
    return str(state)


def short_workunit_id(wu_id: str) -> str:
    """The 12 digits that tell a work unit from its GEMM's others in logs and tables: its
    id's last (the first are its step and GEMM, shared by all of them)."""
    return wu_id[-12:]


def tile_bounds(m: int, n: int, tile: int) -> list[tuple[int, int, int, int]]:
    """Row-major tiles (i0, i1, j0, j1) covering an m x n output; edge tiles are smaller."""
    return [
        (i0, min(m, i0 + tile), j0, min(n, j0 + tile))
        for i0 in range(0, m, tile)
        for j0 in range(0, n, tile)
    ]


def tile_workunit(
    gemm: Gemm,
    bounds: tuple[int, int, int, int],
    a_panel: str,
    b_panel: str,
    redundancy: Redundancy,
    kernel_version: int,
) -> WorkUnit:
    """The work unit of one output tile of a GEMM, named by its content."""
    i0, i1, j0, j1 = bounds
    flags = {"trans_a": gemm.trans_a, "trans_b": gemm.trans_b}
    wu_id = workunit_id(
        gemm=gemm.id,
        step=gemm.step,
        bounds=bounds,
        k=gemm.k,
        a_panel=a_panel,
        b_panel=b_panel,
        kernel_version=kernel_version,
        **flags,
    )
    return WorkUnit(
        id=wu_id,
        gemm_id=gemm.id,
        step=gemm.step,
        i0=i0,
        i1=i1,
        j0=j0,
        j1=j1,
        k=gemm.k,
        a_panel=a_panel,
        b_panel=b_panel,
        kernel_version=kernel_version,
        policy=gemm.policy,
        target_nresults=redundancy.target_nresults,
        min_quorum=redundancy.min_quorum,
        max_error_results=redundancy.max_error_results,
        max_total_results=redundancy.max_total_results,
        delay_bound=redundancy.delay_bound,
        transition_time=float("inf"),
        created=gemm.created,
        **flags,
    )
