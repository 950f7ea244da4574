"""A project's training history (DIR/train.jsonl): the step reached, its loss, the ETA.

One source for every view of progress: the coordinator's status, dashboard and /metrics
(which start from this file after a restart) and `tilehive status DIR` (which reads only
the file) compute their figures here, so they cannot disagree."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ETA_WINDOW = 10  # steps whose mean duration predicts the rest


def read(path: Path) -> list[dict[str, Any]]:
    """Every step trained, oldest first; a step trained again after a restart counts once
    (its latest line). A line cut off by a crash is skipped."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def progress(records: list[dict[str, Any]], steps: int | None) -> dict[str, Any]:
    """step, steps, loss, val_loss (and val_step), the last step's seconds and CPU-seconds,
    eta_seconds and done, from the records. steps is None when the project's settings
    cannot be read."""
    summary: dict[str, Any] = {"step": 0, "steps": steps}
    if records:
        last = records[-1]
        summary.update(step=last["step"], loss=last["loss"])
        for key in ("seconds", "cpu_seconds"):  # older lines lack cpu_seconds
            if key in last:
                summary[key] = last[key]
        vals = [r for r in records if r.get("val_loss") is not None]
        if vals:
            summary["val_loss"] = vals[-1]["val_loss"]
            summary["val_step"] = vals[-1]["step"]
        recent = [r["seconds"] for r in records[-ETA_WINDOW:] if "seconds" in r]
        if steps and recent:
            summary["eta_seconds"] = sum(recent) / len(recent) * max(0, steps - last["step"])
    summary["done"] = bool(steps) and summary["step"] >= steps
    return summary
