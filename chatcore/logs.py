"""Logging set-up for `chatcore serve`: text lines, or one JSON object per line (`log_format=json`).

In JSON, a record's `extra` fields are keys of its object beside time, level, logger and message, so
a turn's tenant, tokens and timings (`chatcore.turnlog`) need no parsing of the message.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any, Literal, TextIO

LogFormat = Literal["text", "json"]
TEXT_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"  # the level first: `grep ^ERROR` finds errors
# A LogRecord's own attributes, and uvicorn's ANSI-coloured copy of its message: not extra fields.
_RECORD_FIELDS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName", "color_message"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message, the record's extra fields,
    and the traceback as `exception` when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update({k: v for k, v in vars(record).items() if k not in _RECORD_FIELDS and not k.startswith("_")})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")


def configure_logging(log_format: LogFormat, stream: TextIO | None = None) -> None:
    """The root logger at INFO, writing `log_format` lines to `stream` (default stderr), Python warnings
    included. uvicorn's loggers lose any handlers of their own (a uvicorn configured earlier in the
    process leaves some) and propagate to it; uvicorn is then started with no logging configuration
    (`log_config=None`)."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    logging.captureWarnings(True)  # Python warnings become `py.warnings` records in the same format
    for name in UVICORN_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True

