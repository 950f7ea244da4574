"""Log lines for people (text) or machines (one JSON object per line), for every command."""

from __future__ import annotations

import json
import logging
import time

_STANDARD = set(vars(logging.makeLogRecord({})))


class JsonFormatter(logging.Formatter):
    """time, level, logger, message, and any `extra=` fields of the record."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": round(record.created, 3),
            "iso": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created)),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def one_line(text: str) -> str:
    """`text` with every character that is not printable escaped (a newline as `\\n`), so
    that no message, whatever value from the network it carries, can split its log line or
    forge another. Backslashes are left alone: a message whose values were already escaped
    where it was made (the coordinator's `protocol.loggable`) passes unchanged."""
    if text.isprintable():
        return text
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text
    )


class TextFormatter(logging.Formatter):
    """time, level and the message, on one line whatever the message holds (values from the
    network reach messages); a traceback follows on lines of its own."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = one_line(record.message)
        return super().formatMessage(record)


class LineClearing(logging.Formatter):
    """Another formatter's lines, each first clearing the terminal's line: a volunteer in
    the foreground redraws its status line there (no newline after it), and a log line
    written over it would start in the middle of it."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        return "\r\x1b[K" + self.inner.format(record)


def configure(
    log_format: str = "text", level: int = logging.INFO, clear_line: bool = False
) -> None:
    """Log lines on stderr, as text or JSON; `clear_line`: each clears the terminal's line
    first (a status line is redrawn on it)."""
    handler = logging.StreamHandler()
    formatter: logging.Formatter
    if log_format == "json":
        formatter = JsonFormatter()
    else:
        formatter = TextFormatter("%(asctime)s %(levelname)s %(message)s")
    # Not in JSON: its lines are for machines, which read no terminal's escapes.
    handler.setFormatter(
        LineClearing(formatter) if clear_line and log_format == "text" else formatter
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
