"""One JSON log line, the request metrics and an ``x-request-id`` header for every HTTP request."""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from starlette.requests import Request
from starlette.routing import BaseRoute, Match

from .http import ApiError, ServiceState, error_json, internal_error, send_error
from .logs import CURRENT_REQUEST, log_fields

log = logging.getLogger("batchasr.api")

LATE_FAILURE = "batchasr.late_failure"  # the scope's key for report_late_failure's error
UNMATCHED = "unmatched"  # the route label of a request no route can be named for
MAX_ERROR_BODY = 64 * 1024  # an error body past this is not read for the log line (ours are a few hundred bytes)
ERROR_LOGGED = 300  # chars of an error's message in the request's log line
_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")
# a URL as a refusal may quote one, up to the punctuation that ends its sentence
_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s'\"<>]*[^\s'\"<>:,.;)]", re.IGNORECASE)


class RequestLogMiddleware:
    """A request id on every response, one JSON log line and the request metrics per request.

    Plain ASGI rather than BaseHTTPMiddleware, which would hide client disconnects from the routes.
    """

    def __init__(self, app: Any, service: ServiceState, routes: list[BaseRoute]):
        self.app, self.service, self.routes = app, service, routes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        request_id = _client_request_id(headers.get(b"x-request-id", b"")) or uuid.uuid4().hex
        # not reset on the way out: Starlette's outermost handler logs an unhandled error after this returns, and
        # each request runs in a task of its own, whose context ends with it
        CURRENT_REQUEST.set({"request_id": request_id, "method": scope["method"], "path": scope["path"]})
        started = time.perf_counter()
        status, answered, refusal = 500, False, {}

        async def send_with_id(message: dict) -> None:
            nonlocal status, answered, refusal
            if message["type"] == "http.response.start":
                status, answered = message["status"], True
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode("latin-1"))]
            elif status >= 400 and not refusal:  # the error's code and message, for the request's log line
                refusal = _error_of(message.get("body", b""))
            await send(message)

        scope[LATE_FAILURE] = None
        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            # answered here: Starlette's outermost middleware would send its 500 past this one, without the id
            if not answered:
                await send_error(send_with_id, internal_error(exc))
            raise  # for that middleware's handler and the server to log it
        finally:
            elapsed = time.perf_counter() - started
            if (late := scope[LATE_FAILURE]) is not None:  # a stream's error event, under the 200 it began with
                status, refusal = late.status, {**_error_of(error_json(late)), "streamed": True}
            route_path = _route_path(scope.get("route")) or self._route_of(scope)
            if route_path.startswith("/v1") and self.service.metrics is not None:
                self.service.metrics.observe_request(route_path, status, elapsed)
            log.info("request", extra=log_fields(event="request", request_id=request_id, method=scope["method"],
                                                 path=scope["path"], status=status,
                                                 duration_ms=round(elapsed * 1000, 2), **refusal))

    def _route_of(self, scope: dict) -> str:
        """The route of a request answered before routing (a 401 from ApiKeyGate, a 413 from BodyLimitMiddleware):
        counted as its route's like any other refusal; "unmatched" where no route has its path."""
        for route in self.routes:
            if route.matches(scope)[0] is not Match.NONE:
                return _route_path(route) or UNMATCHED
        return UNMATCHED


def report_late_failure(request: Request, error: ApiError) -> None:
    """A failure a response tells in its body after its head went with a 200 (a stream's ``error`` event): the
    request is counted and logged with the error's status and code, as it would have been before its head."""
    request.scope[LATE_FAILURE] = error


def observe_refused_head(service: ServiceState, error: ApiError, request_id: str, duration_s: float) -> None:
    """A request the server refused before its head was whole or could be parsed (service.head_limit: 431, 408, or
    400), which the app never saw: counted under route "unmatched", since no route was matched, and logged as any
    request is (a warning: a client that sends such heads may be an attack)."""
    if service.metrics is not None:
        service.metrics.observe_request(UNMATCHED, error.status, duration_s)
    log.warning("request", extra=log_fields(event="request", request_id=request_id, method=None, path=None,
                                            status=error.status, code=error.code,
                                            duration_ms=round(duration_s * 1000, 2)))


def _client_request_id(value: bytes) -> str | None:
    """A client's ``X-Request-ID``, kept where it is an id (at most 128 of ``A-Z a-z 0-9 . _ : -``): anything else
    would be copied into every log line of its request (a 60 KB one, or one of bytes no log index reads)."""
    return value.decode("ascii") if _REQUEST_ID.fullmatch(value) else None


def _error_of(body: bytes) -> dict[str, str]:
    """An error response's ``code`` and ``error`` (its message, cut to ERROR_LOGGED chars), from the body every
    refusal has (service.http); nothing from any other body."""
    if len(body) > MAX_ERROR_BODY:
        return {}
    try:
        error = json.loads(body)["error"]
        return {**({"code": str(error["code"])} if error.get("code") else {}),
                "error": _URL.sub(_without_secrets, str(error["message"]))[:ERROR_LOGGED]}
    except (ValueError, KeyError, TypeError, AttributeError):  # not JSON, or not an error's shape (/healthz's)
        return {}


def _without_secrets(url: re.Match) -> str:
    """A URL quoted in a refusal, for the log: its user and password, and its query (a pre-signed URL's
    credentials and signature), as ``***``."""
    try:
        parts = urlsplit(url.group())
    except ValueError:  # not one urlsplit can read (an unclosed IPv6 bracket): none of it
        return "***"
    netloc = parts.netloc if "@" not in parts.netloc else "***@" + parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=netloc, query="***" if parts.query else "", fragment=""))


def _route_path(route: Any) -> str | None:
    """A route's path as its metrics label: without parameter types (``/v1/models/{model}``, not ``{model:path}``),
    as the OpenAPI spec writes it."""
    return getattr(route, "path_format", None) or getattr(route, "path", None)
