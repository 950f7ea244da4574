"""Reading a project's state.db without its coordinator, through named read-only queries.

A read-only SQLite connection (WAL lets it read while the coordinator writes), so `tilehive
logs`, `tilehive status` and the demo summary work while the coordinator runs, after it
stopped, and across its restarts. The queries are named blocks of queries.sql, beside the
store's, so the two cannot drift apart.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from coordinator.state import integrity
from coordinator.state.sqlite import load_queries


class ProjectReader:
    """Read-only access to one state.db; every method is one named query."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        integrity.check_empty(self.path)
        self._sql = load_queries()
        self._db = self._open()
        self._db.row_factory = sqlite3.Row

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(integrity.database_uri(self.path, "ro"), uri=True, timeout=10)
        try:
            with integrity.reported(self.path):
                db.execute("SELECT count(*) FROM sqlite_master").fetchone()
            return db
        except sqlite3.OperationalError:
            db.close()
            if Path(f"{self.path}-wal").exists():
                raise
        except BaseException:
            db.close()
            raise
        # A folder this user cannot write (another's project, read-only media): SQLite
        # cannot make the shared-memory file a reader of a WAL database needs. With no WAL
        # file no writer has the database open, so it is read as the file it is.
        uri = integrity.database_uri(self.path, "ro", immutable=True)
        return sqlite3.connect(uri, uri=True, timeout=10)

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> ProjectReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _rows(self, query: str, /, **params: Any) -> list[sqlite3.Row]:
        try:
            with integrity.reported(self.path):
                return self._db.execute(self._sql[query], params).fetchall()
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):
                raise integrity.DamagedState(
                    self.path, "it is a SQLite database, but not a tilehive project's state"
                ) from exc
            raise

    def is_new(self) -> bool:
        """No table yet: a coordinator starting this very moment, not a damaged file."""
        return self._db.execute(self._sql["count_tables"]).fetchone()["n"] == 0

    def oldest_step(self) -> int | None:
        """The oldest step with work units still in the database, or None."""
        return self._rows("select_oldest_step")[0]["n"]

    # ---- hosts -------------------------------------------------------------------------

    def host_ids_named(self, name: str) -> list[int]:
        """The ids of the hosts registered under `name`, oldest first."""
        return [r["id"] for r in self._rows("select_host_ids_named", name=name)]

    def host_registered(self, host_id: int) -> bool:
        return bool(self._rows("select_host_registered", id=host_id)[0]["registered"])

    def hosts(self) -> list[sqlite3.Row]:
        return self._rows("select_hosts")

    def host_totals(self) -> list[sqlite3.Row]:
        """name, valid_count, invalid_count, error_count of every host, by id."""
        return self._rows("select_host_totals")

    # ---- work units and results ----------------------------------------------------------

    def workunits(
        self,
        *,
        step: int | None,
        state: str | None,
        since: float | None,
        host_id: int | None,
        limit: int,
    ) -> list[sqlite3.Row]:
        """The newest work units matching the filters (None: any), newest first, with their
        GEMM's label."""
        return self._rows(
            "select_workunits_for_log",
            step=step,
            state=state,
            since=since,
            host_id=host_id,
            limit=limit,
        )

    def results_of(self, wu_ids: Iterable[str]) -> list[sqlite3.Row]:
        return self._rows("select_results_of_workunits", wu_ids=json.dumps(list(wu_ids)))

    def workunit_counts(self) -> dict[str, int]:
        return {r["state"]: r["n"] for r in self._rows("count_workunits_by_state")}

    def result_counts(self) -> dict[str, int]:
        """Results by server state."""
        return {r["server_state"]: r["n"] for r in self._rows("count_results_by_server_state")}

    def result_verdicts(self) -> dict[str, int]:
        """Results by what became of them: valid, invalid, pending, failed, not needed."""
        return {r["verdict"]: r["n"] for r in self._rows("count_results_by_verdict")}

    def invalid_count(self) -> int:
        return self._rows("count_invalid_results")[0]["n"]

    def product_counts(self) -> tuple[int, int]:
        """(GEMMs, work units) ever created."""
        row = self._rows("count_products")[0]
        return row["gemms"], row["workunits"]

    # ---- events ------------------------------------------------------------------------

    def events(
        self,
        *,
        kinds: Iterable[str],
        after: int = 0,
        step: int | None = None,
        state: str | None = None,
        host_id: int | None = None,
        since: float | None = None,
        limit: int = 10_000,
    ) -> list[sqlite3.Row]:
        """Events of these kinds after id `after` matching the filters, oldest first."""
        return self._rows(
            "select_events_of_kinds",
            kinds=json.dumps(list(kinds)),
            after=after,
            step=step,
            state=state,
            host_id=host_id,
            since=since,
            limit=limit,
        )

    def newest_events(
        self,
        *,
        kinds: Iterable[str],
        step: int | None = None,
        states: Iterable[str] | None = None,
        host_id: int | None = None,
        since: float | None = None,
        limit: int,
    ) -> tuple[list[sqlite3.Row], int]:
        """The newest `limit` events matching the filters, oldest first, and how many match."""
        filters = {
            "kinds": json.dumps(list(kinds)),
            "step": step,
            "state": json.dumps(list(states)) if states is not None else None,
            "host_id": host_id,
            "since": since,
        }
        rows = self._rows("select_newest_events_of_kinds", **filters, limit=limit)
        total = self._rows("count_events_of_kinds", **filters)[0]["n"]
        return rows[::-1], total

    def count_workunits(
        self, *, step: int | None, state: str | None, since: float | None, host_id: int | None
    ) -> int:
        """How many work units match the filters of `workunits`."""
        return self._rows(
            "count_workunits_for_log", step=step, state=state, since=since, host_id=host_id
        )[0]["n"]

    def last_event(self, kind: str, states: Iterable[str]) -> sqlite3.Row | None:
        """The newest event of `kind` in one of `states` (project: paused or resumed; wait:
        waiting or flowing)."""
        rows = self._rows("select_last_event_in_states", kind=kind, states=json.dumps(list(states)))
        return rows[0] if rows else None

    def paused_hosts(self, since: float) -> set[int]:
        """The hosts whose last word since `since` was that their owners use their machines
        (`--idle-only`): a `paused` host event with no `resumed` or `left` after it."""
        paused: set[int] = set()
        for row in self._rows("select_host_pauses_since", since=since):
            (paused.add if row["state"] == "paused" else paused.discard)(row["host_id"])
        return paused

    def last_event_id(self) -> int:
        return self._rows("select_last_event_id")[0]["n"]

    def count_events_since(self, kind: str, state: str, since: float) -> int:
        return self._rows("count_events_since", kind=kind, state=state, since=since)[0]["n"]
