"""Task and validation logs and status of a project, read without its coordinator.

The reading is coordinator.state.reader's (named read-only queries, safe while the
coordinator writes); this module shapes rows into what `tilehive logs` and `status` print.
"""

from __future__ import annotations

import json
import re
import time
from collections import defaultdict
from datetime import datetime, timedelta
from datetime import time as dt_time
from pathlib import Path
from shlex import quote
from typing import Any

from coordinator.engine.progress import host_state, no_host_states, settle_eta
from coordinator.state.integrity import has_trained
from coordinator.state.lock import holder
from coordinator.state.reader import ProjectReader
from coordinator.training import history
from coordinator.training.project import PROJECT_FILE
from coordinator.work.records import CANCELLED_STATE, WU_DECIDED, WuError, WuState, shown_state

# What `logs tasks --follow` streams: the work's events, and what changed why it flows (the
# operator's pauses and quarantines, work waiting and flowing again).
TASK_KINDS = ("gemm", "wu", "result", "project", "host", "wait")


class InspectError(ValueError):
    """No project here, or a filter that does not parse."""


def parse_since(value: str | None, now: float | None = None) -> float | None:
    """'90s', '10m', '2h', '1d' ago, a time of day (14:05 or 14:05:30: the latest such
    moment, today's or else yesterday's, as the log shows times), or an ISO date/time, as a
    Unix time."""
    if value is None:
        return None
    now = time.time() if now is None else now
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", value.strip())
    if match:
        scale = {"s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
        return now - float(match.group(1)) * scale
    if match := re.fullmatch(r"(\d{1,2}):(\d{2})(?::(\d{2}))?", value.strip()):
        return _time_of_day(*(int(part or 0) for part in match.groups()), value=value, now=now)
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError as exc:
        raise InspectError(
            f"{value!r}: use a duration like 90s, 10m, 2h, 1d, a time of day like 14:05 "
            "or an ISO time"
        ) from exc


def _time_of_day(hour: int, minute: int, second: int, *, value: str, now: float) -> float:
    """The latest moment at or before `now` whose local clock read hour:minute:second."""
    try:
        clock = dt_time(hour, minute, second)
    except ValueError:
        raise InspectError(f"{value!r}: not a time of day (00:00 to 23:59:59)") from None
    today = datetime.fromtimestamp(now).date()
    when = datetime.combine(today, clock).timestamp()
    if when > now:
        when = datetime.combine(today - timedelta(days=1), clock).timestamp()
    return when


class NotStarted(InspectError):
    """A project no coordinator has run yet: no history, though there will be."""

    @classmethod
    def of(cls, directory: Path) -> NotStarted:
        return cls(
            f"{directory} is a project whose coordinator has not run yet: "
            f"nothing to show before `tilehive coordinator {quote(str(directory))}`"
        )


class NoSuchHost(InspectError):
    """No host has registered under this name (yet: a follower may wait for it)."""


class ProjectView:
    """A project's tasks, events and status, shaped for `tilehive logs` and `status`; the
    reading itself is the state package's ProjectReader."""

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        self.db_path = self.directory / "state.db"
        # A 0-byte file is what SQLite leaves when killed before its first write (the reader
        # refuses one in a project that has trained: its state is gone).
        if not self.db_path.exists() or (
            self.db_path.stat().st_size == 0 and not has_trained(self.directory)
        ):
            if (self.directory / PROJECT_FILE).exists() and has_trained(self.directory):
                raise InspectError(
                    f"{self.directory} has trained but holds no state.db (moved away, or only "
                    "`train --local` ran): no task or validation history to show; "
                    f"`tilehive status {quote(str(self.directory))}` shows its training"
                )
            if (self.directory / PROJECT_FILE).exists():
                raise NotStarted.of(self.directory)
            raise InspectError(
                f"{self.directory} is not a project (no {PROJECT_FILE}, no state.db)"
            )
        self.reader = ProjectReader(self.db_path)
        if self.reader.is_new() and not has_trained(self.directory):
            # Made, but its tables not yet (a coordinator starting): there will be history.
            self.reader.close()
            raise NotStarted.of(self.directory)

    def close(self) -> None:
        self.reader.close()

    def host_id(self, host: str | None) -> int | None:
        """A host given by id (digits alone, as `admin` reads them) or by its name."""
        if host is None:
            return None
        if host.isascii() and host.isdigit() and len(host) <= 18:  # an id SQLite can hold
            # Unknown, it is said as an unknown name is (it matched nothing, quietly).
            if not self.reader.host_registered(int(host)):
                raise NoSuchHost(f"no host {int(host)} has registered")
            return int(host)
        ids = self.reader.host_ids_named(host)
        if not ids:
            raise NoSuchHost(f"no host named {host!r}")
        if len(ids) > 1:
            # Anyone may register a name: the newest of them is not the one meant.
            listed = ", ".join(map(str, sorted(ids)))
            raise InspectError(f"{len(ids)} hosts are named {host!r}: give the id ({listed})")
        return ids[0]

    def purged(self, step: int | None) -> bool:
        """Whether a checkpoint purged this step from the database (to the archive)."""
        if step is None:
            return False
        oldest = self.reader.oldest_step()
        return oldest is None or step < oldest

    def host_names(self) -> dict[int, str]:
        return {r["id"]: r["name"] for r in self.reader.hosts()}

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
        wus = self.reader.workunits(
            step=step, state=state, since=since, host_id=self.host_id(host), limit=limit
        )
        results: dict[str, list] = defaultdict(list)
        for r in self.reader.results_of(w["id"] for w in wus):
            results[r["wu_id"]].append(r)
        names = self.host_names()
        out = []
        for w in reversed(wus):
            mine = results[w["id"]]
            # Done when decided: a replica reported while its quorum waits is not.
            decided = w["state"] in WU_DECIDED
            finished = [r["received_time"] for r in mine if r["received_time"] and decided]
            out.append(
                {
                    "wu": w["id"],
                    "step": w["step"],
                    "gemm": w["label"],
                    "tile": [w["i0"], w["i1"], w["j0"], w["j1"]],
                    "state": shown_state(w["state"], w["error_mask"]),
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
                    "error": (
                        WuError(w["error_mask"]).reason(w["gemm_error"])
                        if w["state"] == WuState.ERROR
                        else None
                    ),
                }
            )
        return out

    def tasks_counted(self, *, limit: int, **filters: Any) -> tuple[list[dict[str, Any]], int]:
        """tasks(), and how many work units match in all (more than shown: output was cut)."""
        rows = self.tasks(limit=limit, **filters)
        if len(rows) < limit:
            return rows, len(rows)
        total = self.reader.count_workunits(
            step=filters.get("step"),
            state=filters.get("state"),
            since=filters.get("since"),
            host_id=self.host_id(filters.get("host")),
        )
        return rows, total

    def step_summary(self, record: dict[str, Any]) -> dict[str, Any]:
        """One finished step: its loss and time (train.jsonl), its work and verdicts."""
        step = record["step"]
        count = self.reader.count_workunits
        summary = {k: record.get(k) for k in ("step", "loss", "val_loss", "seconds", "time")}
        summary["workunits"] = count(step=step, state=None, since=None, host_id=None)
        summary["assimilated"] = count(step=step, state="assimilated", since=None, host_id=None)
        summary["errors"] = count(step=step, state="error", since=None, host_id=None)
        summary["cancelled"] = count(step=step, state=CANCELLED_STATE, since=None, host_id=None)
        summary["invalid"] = self.reader.newest_events(
            kinds=("validation",), step=step, states=("invalid",), limit=1
        )[1]
        return summary

    # ---- events ------------------------------------------------------------------------

    def newest_events(
        self,
        *,
        kinds: tuple[str, ...],
        step: int | None = None,
        states: list[str] | None = None,
        host: str | None = None,
        since: float | None = None,
        limit: int,
    ) -> tuple[list[dict[str, Any]], int]:
        """The newest `limit` events matching, oldest first, and how many match in all."""
        rows, total = self.reader.newest_events(
            kinds=kinds,
            step=step,
            states=states,
            host_id=self.host_id(host),
            since=since,
            limit=limit,
        )
        return self._shaped(rows), total

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
        rows = self.reader.events(
            kinds=kinds,
            after=after,
            step=step,
            state=state,
            host_id=self.host_id(host),
            since=since,
            limit=limit,
        )
        return self._shaped(rows)

    def _shaped(self, rows) -> list[dict[str, Any]]:
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
        return self.reader.last_event_id()

    # ---- status ------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The same summary the coordinator serves at /v1/status, from the files alone."""
        wus = self.reader.workunit_counts()
        results = self.reader.result_counts()
        now = time.time()
        hosts = self.reader.hosts()
        project = self.project_state()
        # A host's pause is the running coordinator's to know: told it since it started.
        since = project.pop("serving_since")
        paused = self.reader.paused_hosts(since) if since is not None else set()
        states = no_host_states()
        for h in hosts:
            # A store from before version 7 has no column `gone` (a Row's `in` reads values).
            gone = "gone" in h.keys() and bool(h["gone"])  # noqa: SIM118
            is_paused = h["id"] in paused
            contact, created = h["last_contact"], h["created"]
            states[host_state(h["quarantined"], gone, contact, now, is_paused, created)] += 1
        recent = self.reader.count_events_since("result", "success", now - 60)
        summary = {
            "workunits": wus,
            "results": results,
            "hosts": len(hosts),
            "host_states": states,
            "hosts_quarantined": states["quarantined"],
            "tiles_per_second": round(recent / 60, 2),
            "invalid": self.reader.invalid_count(),
            "training": training_progress(self.directory),
            **project,
        }
        return settle_eta(summary)

    def project_state(self) -> dict[str, Any]:
        """paused and waiting as the running coordinator last recorded them (a pause outlasts
        a restart; why work waits is known only while a coordinator runs), and since when a
        coordinator serves (None: none does)."""
        running = holder(self.directory)
        pause = self.reader.last_event("project", ("paused", "resumed"))
        wait = self.reader.last_event("wait", ("waiting", "flowing"))
        waiting = None
        serving = running is not None and running.get("command") == "coordinator"
        current = wait is not None and wait["state"] == "waiting"
        since = running["since"] - 1 if serving else None  # a second's slack: its clock
        if since is not None and current and wait["time"] >= since:
            reason = json.loads(wait["data"] or "{}").get("reason")
            waiting = {"reason": reason, "message": wait["message"], "since": wait["time"]}
        return {
            "paused": pause is not None and pause["state"] == "paused",
            "waiting": waiting,
            "coordinator": running.get("url") if running else None,
            "serving_since": since,
            "training_locally": local_trainer(running),
        }


def status_of(directory: Path) -> dict[str, Any]:
    """`tilehive status DIR`: the project's summary from its files. A project no coordinator
    has run has no work and no hosts yet, only the steps `train --local` took (the same
    train.jsonl), if any."""
    try:
        view = ProjectView(directory)
    except InspectError:
        if not (directory / PROJECT_FILE).exists():
            raise
        return settle_eta(
            {
                "workunits": {},
                "results": {},
                "hosts": 0,
                "host_states": no_host_states(),
                "hosts_quarantined": 0,
                "tiles_per_second": 0.0,
                "invalid": 0,
                "training": training_progress(directory),
                "paused": False,
                "waiting": None,
                "coordinator": None,
                "training_locally": local_trainer(holder(directory)),
            }
        )
    try:
        return view.status()
    finally:
        view.close()


def local_trainer(running: dict | None) -> int | None:
    """The pid of the `tilehive train --local` that holds the project, if one does."""
    if running is None or running.get("command") != "train --local":
        return None
    return running.get("pid")


def training_progress(directory: Path) -> dict[str, Any]:
    """Step, loss and ETA from DIR/train.jsonl and project.toml, as the coordinator has them."""
    from coordinator.training.project import ProjectError, load

    try:
        steps = load(directory).training.steps
    except ProjectError:
        steps = None
    return history.progress(history.read(directory / "train.jsonl"), steps)
