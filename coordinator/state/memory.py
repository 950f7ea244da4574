"""The Store in memory: every named query of queries.sql answered in Python, for unit tests.

Rows are dicts shaped as SQLite returns them (enums as values, bools as integers), so the
shared `QueryStore` turns them into records the same way for both drivers."""

from __future__ import annotations

import copy
import enum
from collections import Counter
from typing import Any

from coordinator.state.queries import WRITES, Params, QueryStore, Row, columns
from coordinator.work.records import shown_state

# The columns an upsert may change on a row that exists (the rest are fixed at insert), as
# the ON CONFLICT clauses of queries.sql list them.
_MUTABLE = {
    "gemms": ("state", "error"),
    "hosts": (
        "name",
        "last_contact",
        "gflops",
        "threads",
        "max_memory_mb",
        "consecutive_valid",
        "valid_count",
        "invalid_count",
        "error_count",
        "max_in_progress",
        "quarantined",
        "gone",
    ),
    "workunits": (
        "target_nresults",
        "min_quorum",
        "state",
        "canonical_result",
        "canonical_hash",
        "error_mask",
        "transition_time",
        "accelerated",
    ),
    "results": (
        "server_state",
        "outcome",
        "validate_state",
        "upload_tile",
        "sent_time",
        "received_time",
        "report_deadline",
        "output_hash",
        "has_tile",
        "error",
    ),
}


class MemoryStore(QueryStore):
    """Tables as dicts in insertion order (SQLite's rowid order for these queries)."""

    def __init__(self) -> None:
        self.tables: dict[str, dict[Any, dict[str, Any]]] = {
            "gemms": {},
            "hosts": {},
            "workunits": {},
            "results": {},
            "events": {},
            "work_replies": {},
            "purged": {},
        }
        self.is_open = False

    async def open(self) -> None:
        self.is_open = True

    async def close(self) -> None:
        self.is_open = False

    # ---- the driver ----------------------------------------------------------------------

    async def _query(self, name: str, **values: Any) -> list[Row]:
        return [dict(row) for row in getattr(self, f"{name}_run")(**values)]

    async def _execute(self, name: str, **values: Any) -> None:
        getattr(self, f"{name}_run")(**values)

    async def _transaction(self, statements: list[tuple[str, list[Params]]]) -> None:
        saved = copy.deepcopy(self.tables)
        try:
            for name, rows in statements:
                run = getattr(self, f"{name}_run")
                for row in rows:
                    run(**(_as_stored(name, row) if name in WRITES else row))
        except BaseException:
            self.tables = saved  # all of the batch or none of it
            raise

    # ---- the named queries ---------------------------------------------------------------

    def _upsert(self, table: str, row: dict[str, Any]) -> None:
        existing = self.tables[table].get(row["id"])
        if existing is None:
            self.tables[table][row["id"]] = dict(row)
        else:
            existing.update({k: row[k] for k in _MUTABLE[table]})

    def upsert_gemm_run(self, **row: Any) -> None:
        self._upsert("gemms", row)

    def upsert_host_run(self, **row: Any) -> None:
        self._upsert("hosts", row)

    def upsert_workunit_run(self, **row: Any) -> None:
        self._upsert("workunits", row)

    def upsert_result_run(self, **row: Any) -> None:
        self._upsert("results", row)

    def insert_event_run(self, **row: Any) -> None:
        events = self.tables["events"]
        number = max(events, default=0) + 1
        events[number] = {"id": number, **row}

    def insert_reply_run(self, **row: Any) -> None:
        replies = self.tables["work_replies"]
        key = (row["host_id"], row["request_id"])
        replies.pop(key, None)  # INSERT OR REPLACE: a new row, last in order
        replies[key] = dict(row)

    def prune_replies_run(self, before: float, keep: int) -> None:
        replies = self.tables["work_replies"]
        newest: dict[int, list] = {}
        for key, row in sorted(replies.items(), key=lambda item: -item[1]["time"]):
            newest.setdefault(row["host_id"], []).append(key)
        doomed = {key for keys in newest.values() for key in keys[keep:]}
        doomed |= {key for key, row in replies.items() if row["time"] < before}
        for key in doomed:
            del replies[key]

    def count_replies_run(self) -> list[Row]:
        return [{"n": len(self.tables["work_replies"])}]

    def select_reply_run(self, host_id: int, request_id: str) -> list[Row]:
        row = self.tables["work_replies"].get((host_id, request_id))
        return [{"body": row["body"]}] if row else []

    def select_hosts_run(self) -> list[Row]:
        return list(self.tables["hosts"].values())

    def select_result_run(self, id: str) -> list[Row]:
        row = self.tables["results"].get(id)
        return [row] if row else []

    def select_gemm_run(self, id: str) -> list[Row]:
        row = self.tables["gemms"].get(id)
        return [row] if row else []

    def select_last_gemm_step_run(self) -> list[Row]:
        return [{"step": max((g["step"] for g in self.tables["gemms"].values()), default=-1)}]

    def select_active_gemms_run(self) -> list[Row]:
        return [g for g in self.tables["gemms"].values() if g["state"] == "active"]

    def select_workunits_of_gemm_run(self, gemm_id: str) -> list[Row]:
        return [w for w in self.tables["workunits"].values() if w["gemm_id"] == gemm_id]

    def select_results_of_gemm_run(self, gemm_id: str) -> list[Row]:
        wus = self.tables["workunits"]
        return [r for r in self.tables["results"].values() if wus[r["wu_id"]]["gemm_id"] == gemm_id]

    def select_events_run(
        self,
        after: int,
        kind: str | None,
        step: int | None,
        state: str | None,
        host_id: int | None,
        limit: int,
    ) -> list[Row]:
        wanted = {"kind": kind, "step": step, "state": state, "host_id": host_id}
        rows = [
            e
            for e in self.tables["events"].values()
            if e["id"] > after and all(v is None or e[k] == v for k, v in wanted.items())
        ]
        return rows[:limit]

    def count_workunits_by_state_run(self) -> list[Row]:
        counts = Counter(_counted(w) for w in self.tables["workunits"].values())
        counts.update({k: v for k, v in self.tables["purged"].items() if k != "invalid_results"})
        return [{"state": state, "n": n} for state, n in counts.items()]

    def _blobs(self, through_step: int, done_through: bool) -> list[Row]:
        gemms, wus = self.tables["gemms"], self.tables["workunits"]

        def wanted(gemm: dict[str, Any]) -> bool:
            old = gemm["step"] <= through_step
            if done_through:  # as queries.sql: products that ended, done or failed
                return old and gemm["state"] in ("done", "failed")
            return not old or gemm["state"] == "active"

        blobs = set()
        for wu in wus.values():
            if wanted(gemms[wu["gemm_id"]]):
                blobs.update((wu["a_panel"], wu["b_panel"]))
        for result in self.tables["results"].values():
            if result["has_tile"] and wanted(gemms[wus[result["wu_id"]]["gemm_id"]]):
                blobs.add(result["output_hash"])
        return [{"blob": blob} for blob in sorted(blobs)]

    def select_blobs_through_step_run(self, step: int) -> list[Row]:
        return self._blobs(step, done_through=True)

    def select_blobs_after_step_run(self, step: int) -> list[Row]:
        return self._blobs(step, done_through=False)

    def mark_gemms_pruned_run(self, step: int) -> None:
        for gemm in self.tables["gemms"].values():
            if gemm["step"] <= step and gemm["state"] == "done":
                gemm["state"] = "pruned"

    def select_recent_events_run(self, kind: str, state: str, limit: int) -> list[Row]:
        rows = [
            e for e in self.tables["events"].values() if (e["kind"], e["state"]) == (kind, state)
        ]
        return rows[::-1][:limit]

    def count_invalid_results_run(self) -> list[Row]:
        invalid = sum(r["validate_state"] == "invalid" for r in self.tables["results"].values())
        return [{"n": invalid + self.tables["purged"].get("invalid_results", 0)}]

    def select_events_through_step_run(self, step: int, before: float) -> list[Row]:
        return [e for e in self.tables["events"].values() if _through(e, step, before)]

    def select_panel_steps_run(self) -> list[Row]:
        steps: dict[str, int] = {}
        for w in self.tables["workunits"].values():
            for panel in (w["a_panel"], w["b_panel"]):
                steps[panel] = max(w["step"], steps.get(panel, w["step"]))
        return [{"panel": p, "step": s} for p, s in steps.items()]

    def select_workunits_through_step_run(self, step: int) -> list[Row]:
        rows = [w for w in self.tables["workunits"].values() if w["step"] <= step]
        return sorted(rows, key=lambda w: (w["step"], w["gemm_id"], w["i0"], w["j0"]))

    def add_purged_workunits_run(self, step: int) -> None:
        purged = self.tables["purged"]
        for w in self.tables["workunits"].values():
            if w["step"] <= step:
                state = _counted(w)
                purged[state] = purged.get(state, 0) + 1

    def add_purged_invalid_run(self, step: int) -> None:
        wus = self.tables["workunits"]
        invalid = sum(
            1
            for r in self.tables["results"].values()
            if wus[r["wu_id"]]["step"] <= step and r["validate_state"] == "invalid"
        )
        purged = self.tables["purged"]
        purged["invalid_results"] = purged.get("invalid_results", 0) + invalid

    def delete_results_through_step_run(self, step: int) -> None:
        wus = self.tables["workunits"]
        self._delete("results", lambda r: wus[r["wu_id"]]["step"] <= step)

    def delete_workunits_through_step_run(self, step: int) -> None:
        self._delete("workunits", lambda w: w["step"] <= step)

    def delete_gemms_through_step_run(self, step: int) -> None:
        self._delete("gemms", lambda g: g["step"] <= step)

    def delete_events_through_step_run(self, step: int, before: float) -> None:
        self._delete("events", lambda e: _through(e, step, before))

    def _delete(self, table: str, doomed) -> None:
        rows = self.tables[table]
        for key in [k for k, row in rows.items() if doomed(row)]:
            del rows[key]


def _as_stored(name: str, values: tuple) -> dict[str, Any]:
    """A record's row of values as SQLite stores it: enums as their text, bools as integers."""
    row = dict(zip(columns(WRITES[name]), values, strict=True))
    for key, value in row.items():
        if isinstance(value, bool):
            row[key] = int(value)
        elif isinstance(value, enum.Enum):
            row[key] = value.value
    if name == "insert_event":
        del row["id"]  # the store numbers events
    return row


def _through(event: dict[str, Any], step: int, before: float) -> bool:
    return event["step"] is not None and event["step"] <= step and event["time"] < before


def _counted(row: dict[str, Any]) -> str:
    """A work unit row's state as queries.sql counts it (records.counted_state)."""
    return shown_state(row["state"], row["error_mask"])
