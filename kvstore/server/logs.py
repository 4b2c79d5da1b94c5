"""The daemon's log lines: text for people, or one JSON object per line for log pipelines
(`log_format: json`).

A JSON line carries `time` (UTC, ISO 8601 with milliseconds), `level`, `logger`, `message`,
`pid`, the exception's traceback as `exception` where there is one, and any fields a call
passed with `extra=` (for example `tier`, `namespace`), so that an operator can filter on them.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import sys

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "pid": os.getpid(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                line[key] = value if isinstance(value, str | int | float | bool | None) else repr(value)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure(level: str, log_format: str) -> None:
    """The root logger on stderr, at `level`, in `log_format` ("text" or "json")."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
