"""Reading a project without its coordinator: task and validation logs, and status.

A read-only SQLite connection to DIR/state.db (WAL lets it read while the coordinator
writes), so `tilehive logs` and `tilehive status` work while the coordinator runs, after it
stopped, and across its restarts.
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
from collections import defaultdict
from datetime import datetime
from pathlib import Path
from typing import Any

TASK_KINDS = ("gemm", "wu", "result")


class InspectError(ValueError):
    """No project here, or a filter that does not parse."""


def parse_since(value: str | None, now: float | None = None) -> float | None:
    """'90s', '10m', '2h', '1d' ago, or an ISO date/time, as a Unix time."""
    if value is None:
        return None
    now = time.time() if now is None else now
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", value.strip())
    if match:
        scale = {"s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
        return now - float(match.group(1)) * scale
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError as exc:
        raise InspectError(
            f"--since {value!r}: use a duration like 90s, 10m, 2h, 1d or an ISO time"
        ) from exc


class ProjectView:
    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        self.db_path = self.directory / "state.db"
        if not self.db_path.exists():
            raise InspectError(
                f"{self.directory} has no state.db: not a project, or its coordinator never ran"
            )
        self.db = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=10)
        self.db.row_factory = sqlite3.Row

    def close(self) -> None:
        self.db.close()

    def _rows(self, sql: str, *params: Any) -> list[sqlite3.Row]:
        return self.db.execute(sql, params).fetchall()

    def host_id(self, host: str | None) -> int | None:
        """A host given by id or by name."""
        if host is None:
            return None
        if host.isdigit():
            return int(host)
        rows = self._rows("SELECT id FROM hosts WHERE name = ? ORDER BY id", host)
        if not rows:
            raise InspectError(f"no host named {host!r}")
        return rows[-1]["id"]

    def host_names(self) -> dict[int, str]:
        return {r["id"]: r["name"] for r in self._rows("SELECT id, name FROM hosts")}

    # ---- tasks -------------------------------------------------------------------------

    def tasks(
        self,
        *,
        step: int | None = None,
        state: str | None = None,
        host: str | None = None,
        since: float | None = None,
        limit: int = 200,
    ) -> list[dict[str, Any]]:
        """Work units with their results, newest last."""
        where, params = ["1 = 1"], []
        if step is not None:
            where.append("w.step = ?")
            params.append(step)
        if state is not None:
            where.append("w.state = ?")
            params.append(state)
        if since is not None:
            where.append("w.created >= ?")
            params.append(since)
        host_id = self.host_id(host)
        if host_id is not None:
            where.append("w.id IN (SELECT wu_id FROM results WHERE host_id = ?)")
            params.append(host_id)
        wus = self._rows(
            "SELECT w.*, g.label FROM workunits w JOIN gemms g ON g.id = w.gemm_id "
            f"WHERE {' AND '.join(where)} ORDER BY w.created DESC, w.i0 DESC, w.j0 DESC "
            "LIMIT ?",
            *params,
            limit,
        )
        results: dict[str, list[sqlite3.Row]] = defaultdict(list)
        ids = [w["id"] for w in wus]
        for chunk in range(0, len(ids), 500):
            part = ids[chunk : chunk + 500]
            marks = ",".join("?" * len(part))
            for r in self._rows(f"SELECT * FROM results WHERE wu_id IN ({marks})", *part):
                results[r["wu_id"]].append(r)
        names = self.host_names()
        out = []
        for w in reversed(wus):
            mine = results[w["id"]]
            finished = [r["received_time"] for r in mine if r["received_time"]]
            out.append(
                {
                    "wu": w["id"],
                    "step": w["step"],
                    "gemm": w["label"],
                    "tile": [w["i0"], w["i1"], w["j0"], w["j1"]],
                    "state": w["state"],
                    "replicas": len(mine),
                    "valid": sum(r["validate_state"] == "valid" for r in mine),
                    "invalid": sum(r["validate_state"] == "invalid" for r in mine),
                    "hosts": [
                        names.get(r["host_id"], str(r["host_id"]))
                        for r in mine
                        if r["host_id"] is not None
                    ],
                    "canonical_host": next(
                        (names.get(r["host_id"]) for r in mine if r["id"] == w["canonical_result"]),
                        None,
                    ),
                    "created": w["created"],
                    "finished": max(finished) if finished else None,
                }
            )
        return out

    # ---- events ------------------------------------------------------------------------

    def events(
        self,
        *,
        kinds: tuple[str, ...],
        after: int = 0,
        step: int | None = None,
        state: str | None = None,
        host: str | None = None,
        since: float | None = None,
        limit: int = 10_000,
    ) -> list[dict[str, Any]]:
        where = [f"kind IN ({','.join('?' * len(kinds))})", "id > ?"]
        params: list[Any] = [*kinds, after]
        for column, value in (("step", step), ("state", state), ("host_id", self.host_id(host))):
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        if since is not None:
            where.append("time >= ?")
            params.append(since)
        rows = self._rows(
            f"SELECT * FROM events WHERE {' AND '.join(where)} ORDER BY id LIMIT ?",
            *params,
            limit,
        )
        names = self.host_names()
        out = []
        for r in rows:
            event = dict(r)
            data = event.pop("data", "")
            event["host"] = names.get(r["host_id"]) if r["host_id"] is not None else None
            event.update(json.loads(data) if data else {})
            out.append(event)
        return out

    def last_event_id(self) -> int:
        return self._rows("SELECT COALESCE(MAX(id), 0) AS n FROM events")[0]["n"]

    # ---- status ------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The same summary the coordinator serves at /v1/status, from the files alone."""
        wus = dict(self._rows("SELECT state, COUNT(*) FROM workunits GROUP BY state"))
        results = dict(self._rows("SELECT server_state, COUNT(*) FROM results GROUP BY 1"))
        now = time.time()
        hosts = self._rows("SELECT last_contact, quarantined FROM hosts")
        states = {"active": 0, "idle": 0, "quarantined": 0}
        for h in hosts:
            key = (
                "quarantined"
                if h["quarantined"]
                else ("active" if now - h["last_contact"] < 300 else "idle")
            )
            states[key] += 1
        recent = self._rows(
            "SELECT COUNT(*) FROM events WHERE kind = 'result' AND state = 'success' AND time >= ?",
            now - 60,
        )[0][0]
        invalid = self._rows("SELECT COUNT(*) FROM results WHERE validate_state = 'invalid'")[0][0]
        return {
            "workunits": wus,
            "results": results,
            "hosts": len(hosts),
            "host_states": states,
            "hosts_quarantined": states["quarantined"],
            "tiles_per_second": round(recent / 60, 2),
            "invalid": invalid,
            "training": training_progress(self.directory),
        }


def training_progress(directory: Path) -> dict[str, Any]:
    """Step, loss and ETA from DIR/train.jsonl and project.toml."""
    from coordinator.training.project import ProjectError, load

    try:
        steps = load(directory).training.steps
    except ProjectError:
        steps = None
    lines = []
    metrics = directory / "train.jsonl"
    if metrics.exists():
        lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    progress: dict[str, Any] = {"steps": steps, "step": 0}
    if lines:
        last = lines[-1]
        progress.update(step=last["step"], loss=last["loss"])
        vals = [x for x in lines if "val_loss" in x]
        if vals:
            progress["val_loss"] = vals[-1]["val_loss"]
            progress["val_step"] = vals[-1]["step"]
        recent = lines[-10:]
        per_step = sum(x["seconds"] for x in recent) / len(recent)
        if steps:
            progress["eta_seconds"] = per_step * (steps - last["step"])
    return progress
