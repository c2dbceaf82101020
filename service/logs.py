"""JSON log lines for the service (one object per line, easy to ship and query)."""

from __future__ import annotations

import contextvars
import json
import logging
import time
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

# the HTTP request being handled (its id, method and path), named on every line logged while it is: a 500's
# traceback, a stream's failure, could not be matched to the id its client was given
CURRENT_REQUEST: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("batchasr_request",
                                                                                         default=None)


class JsonFormatter(logging.Formatter):
    """One JSON object per record. Structured fields come as ``extra={"fields": {...}}`` and are merged into the
    object rather than nested in the message (request lines: ``log.info("request", extra=log_fields(...))``);
    a record logged while an HTTP request is handled names it (``CURRENT_REQUEST``)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
                 "level": record.levelname.lower(), "logger": record.name}
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        else:
            entry["message"] = record.getMessage()
        for name, value in (CURRENT_REQUEST.get() or {}).items():
            entry.setdefault(name, value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


SECRET_QUERY_PARAMETERS = ("sentinel_password",)


def redacted_url(url: str) -> str:
    """``url`` with its passwords (``redis://:secret@host``, a Sentinel URL's ``?sentinel_password=secret``) as
    ``***``: for logs, which travel further than settings do."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    if parts.password is None and not any(name in SECRET_QUERY_PARAMETERS for name, _ in query):
        return url
    if parts.password is not None:
        parts = parts._replace(netloc=f"{parts.username or ''}:***@{parts.netloc.rsplit('@', 1)[1]}")
    shown = [(name, "***" if name in SECRET_QUERY_PARAMETERS else value) for name, value in query]
    return urlunsplit(parts._replace(query=urlencode(shown, safe="*")))


def log_fields(**fields: object) -> dict[str, dict[str, object]]:
    """``extra=`` for a structured log line."""
    return {"fields": fields}


def configure_json_logging(level: int = logging.INFO) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.captureWarnings(True)  # a library's warning (torch's, on a GPU) as a JSON line, not plain text among them
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = name != "uvicorn.access"  # our middleware logs each request
