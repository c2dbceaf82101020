"""JSON log lines for the service (one object per line, easy to ship and query)."""

from __future__ import annotations

import json
import logging
import time
from urllib.parse import urlsplit, urlunsplit


class JsonFormatter(logging.Formatter):
    """One JSON object per record. Structured fields come as ``extra={"fields": {...}}`` and are merged into the
    object rather than nested in the message (request lines: ``log.info("request", extra=log_fields(...))``)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
                 "level": record.levelname.lower(), "logger": record.name}
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        else:
            entry["message"] = record.getMessage()
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def redacted_url(url: str) -> str:
    """``url`` with its password (``redis://:secret@host``) as ``***``: for logs, which travel further than
    settings do."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def log_fields(**fields: object) -> dict[str, dict[str, object]]:
    """``extra=`` for a structured log line."""
    return {"fields": fields}


def configure_json_logging(level: int = logging.INFO) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = name != "uvicorn.access"  # our middleware logs each request
