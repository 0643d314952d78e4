"""Structured logs: one JSON object per line (for log collectors) or text with key=value fields.

Call sites pass their fields as `extra={"fields": {...}}` (or use `log()`), so the same record
reads well in both formats and a collector can filter on `code`, `method`, `request_id`, ...
"""

from __future__ import annotations

import json
import logging


def log(logger: logging.Logger, level: int, message: str, **fields) -> None:
    logger.log(level, message, extra={"fields": fields})


class JsonFormatter(logging.Formatter):
    """Time, level, logger, message and the record's fields, as one JSON object."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """The usual line, with the record's fields appended as key=value."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", {})
        return " ".join([line, *(f"{k}={v}" for k, v in fields.items())]) if fields else line


def configure_logging(fmt: str = "json", level: int = logging.INFO) -> None:
    """Sends every logger's records to stderr in `fmt` ("json" or "text")."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
