"""What every route shares: the service state, the OpenAI error shape, API-key auth, bounded uploads."""

from __future__ import annotations

import hashlib
import hmac
import logging
import tempfile
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Annotated, Any, Protocol

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import FormData
from starlette.datastructures import UploadFile as StarletteUpload
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from decoding.types import Hotwords
from models.conversation import parse_names
from models.tokenizer import HotwordsUnavailable, hotword_tokens

from .config import Settings
from .formats import SubtitleLayout
from .intake import IntakeBudget
from .job_keys import owner_of
from .job_types import ANONYMOUS
from .jobs import JobStore
from .runtime import FrontendStack, Stack
from .schemas import ErrorResponse
from .spool import disk_full

log = logging.getLogger("batchasr.api")


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The error in OpenAI's shape, ``{"error": {...}}``."""
        return _error_body(self.message, self.type, self.param, self.code)


def client_closed() -> ApiError:
    """What a request whose client left before it was whole is answered (nobody reads it) and counted as."""
    return ApiError(499, "client closed the request", code="client_closed")


NO_ROOM_RETRY_S = 10


def no_room_for_body(exc: OSError) -> ApiError | None:
    """A 503 for a request body the server had no disk to hold (the temporary files' disk full, or its quota used;
    other requests' bodies are let go as they finish, so it may fit when sent again), logged; None for another
    failure."""
    if not disk_full(exc):
        return None
    log.warning("no room for a request body in %s: %s", tempfile.gettempdir(), exc.strerror)
    return ApiError(503, "the server has no disk space left to receive the request body; send it again later",
                    type="server_error", code="no_space", headers={"Retry-After": str(NO_ROOM_RETRY_S)})


def internal_error(exc: BaseException) -> ApiError:
    """A failure of the server's own: the client hears its kind, the log has the rest."""
    return ApiError(500, f"internal error: {type(exc).__name__}", type="server_error", code="internal_error")


def error_json(error: ApiError) -> bytes:
    """``error``'s body as the app's handlers send it (JSONResponse's compact JSON), for the refusals written
    before the app runs: the same bytes whoever answers."""
    return JSONResponse(error.body()).body


class MetricsSink(Protocol):
    """Where the routes count requests and read the exposition: ``Metrics`` in the engine's process, or a
    front-end process's link to it."""

    def observe_request(self, route: str, code: int, duration_s: float) -> None: ...

    def observe_intake_wait(self, seconds: float) -> None: ...

    def count_job(self, status: str) -> None: ...

    async def scrape(self) -> bytes: ...


def request_hotwords(service: ServiceState, phrases: list[str]) -> Hotwords:
    """A request's or a job's hotwords as the model's tokens: 400 where this server cannot boost them (no
    vocabulary) or they are refused (too many, too long)."""
    assert service.stack is not None
    try:
        return hotword_tokens(phrases, service.stack.transcriber.tokenizer)
    except HotwordsUnavailable as exc:
        raise ApiError(400, str(exc), param="hotwords", code="hotwords_unavailable") from exc
    except ValueError as exc:
        raise ApiError(400, str(exc), param="hotwords", code="invalid_parameter") from exc


@dataclass
class ServiceState:
    """Everything the routes share; lives on ``app.state.service``."""

    settings: Settings
    model_id: str
    metrics: MetricsSink | None = None  # a front end's arrives with its engine link
    stack: Stack | FrontendStack | None = None
    accepting: bool = True
    started_at: float = field(default_factory=time.time)  # when this process began serving (the model's `created`)
    intake: IntakeBudget = field(init=False)  # upload bytes read and not yet decoded, this process

    def __post_init__(self) -> None:
        self.intake = IntakeBudget(self.settings.max_intake_bytes, self._observe_intake_wait)

    def _observe_intake_wait(self, seconds: float) -> None:
        if self.metrics is not None:  # a front end's arrives with its engine link
            self.metrics.observe_intake_wait(seconds)

    @property
    def jobs(self) -> JobStore | None:
        return self.stack.jobs if self.stack is not None else None


ERROR_DESCRIPTIONS = {
    400: "A parameter, a form field or the audio is refused, or the body cannot be parsed (FastAPI's validation "
         "errors too: never a 422), or the request is not HTTP the server can parse (the connection is closed)",
    401: "An API key is required (`Authorization: Bearer <key>`) and none valid was sent",
    404: "No such model, job or job item",
    405: "A method the path does not take: `Allow` names those it does",
    408: "The request head did not arrive whole in time, or the body stopped arriving: the connection is closed",
    413: "The body or the audio exceeds a limit",
    409: "A job item with no transcript yet, or none to give: not completed (queued, running, failed or "
         "cancelled)",
    415: "The upload is not audio",
    429: "The queue is full (a job: the key's items queued at once are at their limit): retry after `Retry-After` "
         "seconds",
    431: "The request head (request line and headers) is too large: the connection is closed",
    500: "A failure of the server's own: its kind in the message, the rest in the log",
    503: "Not ready, the engine or the job store (Redis) unavailable, or no disk left for the request body: retry "
         "after `Retry-After` seconds",
    504: "The transcription did not finish within the request timeout",
}
# what every route may answer: a request head too large or too slow, or one the server cannot parse, is refused
# before routing (service.head_limit), and any route may fail. A route that takes a body lists 413 itself
# (service.body_limit); its body's 408 (service.body_buffer) is the head's
EVERY_ROUTE_ERRORS = (400, 408, 431, 500)
# an uploaded file, as FastAPI writes an UploadFile's, for the routes that read their bodies themselves
BINARY_SCHEMA = {"type": "string", "contentMediaType": "application/octet-stream"}


def subtitle_layout(max_line_width: int, max_line_count: int) -> SubtitleLayout:
    """Whisper's srt and vtt layout options (``max_line_width``, ``max_line_count``); 400 for one out of range."""
    try:
        return SubtitleLayout(max_line_width, max_line_count)
    except ValueError as exc:
        raise ApiError(400, str(exc), param=str(exc).split()[0], code="invalid_parameter") from exc


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """A route's errors for its OpenAPI spec, with ``EVERY_ROUTE_ERRORS``, each in the OpenAI shape. "4XX" stands
    for a 405, answered for a path rather than a route, and keeps FastAPI from declaring its 422, which this API
    never sends."""
    return {**{status: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status]}
               for status in (*statuses, *EVERY_ROUTE_ERRORS)},
            "4XX": {"model": ErrorResponse, "description": "Another client error: 405 for a method the path does not "
                                                           "take (`Allow` names those it does)"}}


def _error_body(message: str, type: str, param: str | None, code: str | None) -> dict[str, Any]:
    return ErrorResponse.model_validate({"error": {"message": message, "type": type, "param": param,
                                                   "code": code}}).model_dump()


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), exc.status, headers=exc.headers)

    # a client gone while its form was read (the routes that parse their own forms meet it as it is, FastAPI's
    # parsing as its 400 for a malformed body): nothing to answer, and not the server's failure nor the client's
    @app.exception_handler(ClientDisconnect)
    async def client_gone(_: Request, exc: ClientDisconnect) -> JSONResponse:
        return await api_error(_, client_closed())

    # a form's file that found its disk full as it was parsed: by the route, or by FastAPI (as its 400)
    @app.exception_handler(OSError)
    async def os_error(request: Request, exc: OSError) -> JSONResponse:
        if (refusal := no_room_for_body(exc)) is not None:
            return await api_error(request, refusal)
        return await unexpected(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, ClientDisconnect):
            return await api_error(request, client_closed())
        if isinstance(exc.__cause__, OSError) and (refusal := no_room_for_body(exc.__cause__)) is not None:
            return await api_error(request, refusal)
        if isinstance(exc.__cause__, ApiError):  # a refusal met as FastAPI read the body (service.body_buffer)
            return await api_error(request, exc.__cause__)
        if exc.status_code == 405:
            return _method_not_allowed(app, request)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        message = f"no route {request.method} {request.url.path}" if exc.status_code == 404 else str(exc.detail)
        return JSONResponse(_error_body(message, kind, None, starlette_error_code(exc.status_code)), exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = str(first.get("loc", ["", ""])[-1]) or None
        message = f"{param}: {first.get('msg', 'invalid request')}" if param else "invalid request"
        return JSONResponse(_error_body(message, "invalid_request_error", param, "invalid_parameter"), 400)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return await api_error(request, internal_error(exc))


# the refusals Starlette and FastAPI raise themselves: the router's for a path no route has, and the 400 of a body
# that cannot be parsed (a malformed multipart form, a part past the form's limits); 405 has its own handler
STARLETTE_ERROR_CODES = {400: "invalid_body", 404: "route_not_found"}


def starlette_error_code(status: int) -> str:
    """The ``code`` of a refusal Starlette raised: ours where it has one, else the status's name
    (``request_entity_too_large``), never null."""
    if status in STARLETTE_ERROR_CODES:
        return STARLETTE_ERROR_CODES[status]
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")
    except ValueError:
        return f"http_{status}"


HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def _method_not_allowed(app: FastAPI, request: Request) -> JSONResponse:
    """405 naming every method the path takes: Starlette's Allow lists only the first route matching the path, so
    PUT /v1/jobs answered "Allow: POST" although GET lists jobs (RFC 9110 asks for all of them)."""
    routes = app.router.routes
    allowed = [method for method in HTTP_METHODS
               if any(route.matches({**request.scope, "method": method})[0] == Match.FULL for route in routes)]
    message = f"{request.method} is not allowed on {request.url.path}; it takes {', '.join(allowed)}"
    return JSONResponse(_error_body(message, "invalid_request_error", None, "method_not_allowed"), 405,
                        headers={"Allow": ", ".join(allowed)})


async def _service(request: Request) -> ServiceState:  # async: a sync dependency costs a thread hop
    return request.app.state.service


ServiceDep = Annotated[ServiceState, Depends(_service)]


async def require_api_key(request: Request, service: ServiceDep) -> None:
    """With API keys set, a request needs one (401); its key says whose jobs it sees (``request.state.owner``)."""
    request.state.owner = ANONYMOUS
    keys = service.settings.api_keys
    if not keys:
        return
    key = valid_api_key(request.headers.get("authorization", ""), keys)
    if key is None:
        raise missing_api_key()
    request.state.owner = owner_of(key)


def valid_api_key(authorization: str, keys: list[str]) -> str | None:
    """The key an ``Authorization: Bearer <key>`` header gives, if it is one of ``keys``.

    Compared in constant time, and with every key: ``token in keys`` stops at the first differing character, so
    the time a refusal takes would tell a client how much of a key it has guessed right."""
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    digest = hashlib.sha256(token.encode()).digest()  # equal lengths: compare_digest's time then hides the key's
    matches = [hmac.compare_digest(digest, hashlib.sha256(key.encode()).digest()) for key in keys]
    # an empty token is never a key, whatever ``keys`` holds (settings drop blank ones; a caller's list may not)
    return token if token and scheme.lower() == "bearer" and any(matches) else None


def missing_api_key() -> ApiError:
    return ApiError(401, "a valid API key is required (Authorization: Bearer <key>)", type="authentication_error",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


class ApiKeyGate:
    """Plain ASGI: with API keys set, a ``/v1`` request without a valid one is answered 401 before a byte of its
    body is read. FastAPI parses a form before a route's dependencies run, so without this anyone could have an
    upload of the full size spooled to disk just to be told they may not send it."""

    def __init__(self, app: Any, keys: list[str]):
        self.app, self.keys = app, keys

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.keys and scope["path"].startswith("/v1"):
            authorization = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
            if valid_api_key(authorization, self.keys) is None:
                await send_error(send, missing_api_key())
                return
        await self.app(scope, receive, send)


async def send_error(send: Any, error: ApiError) -> None:
    """``error`` as a whole plain-ASGI response, from middleware that answers before the app runs; the connection
    closes, since the request's body may be left unread."""
    body = error_json(error)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close"), *((k.lower().encode(), v.encode()) for k, v in error.headers.items())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def request_owner(request: Request) -> str:
    """Whose jobs this request may see and change (set by ``require_api_key``)."""
    return getattr(request.state, "owner", ANONYMOUS)


# --- shared request handling -------------------------------------------------------------------------------

TRUE_WORDS, FALSE_WORDS = {"true", "1", "yes", "on"}, {"false", "0", "no", "off", ""}


def speaker_names(value: object, multichannel: bool, param: str = "channel_names") -> list[str]:
    """Speaker names, one a channel in order (``agent,customer``); none when absent. 400 for a bad name, or for
    names without ``multichannel``."""
    if not value:
        return []
    if not multichannel:
        raise ApiError(400, f"`{param}` names the channels of a multichannel request: add multichannel=true",
                       param=param, code="invalid_parameter")
    try:
        return parse_names(value if isinstance(value, str) else list(value))
    except (ValueError, TypeError) as exc:
        raise ApiError(400, f"`{param}`: {exc}", param=param, code="invalid_parameter") from exc


def form_texts(form: FormData, *names: str) -> list[str]:
    """A multipart form's values under ``names`` (a repeated field, or its ``name[]`` spelling too), in order; 400
    where one came as a file: a text field sent with a filename was else dropped (a webhook URL, silently) or read
    as the file object's description."""
    values = []
    for name in names:
        for value in form.getlist(name):
            if not isinstance(value, str):
                raise ApiError(400, f"`{name}` is a text field, not a file: send it without a filename", param=name,
                               code="invalid_parameter")
            values.append(value)
    return values


def single_fields(form: FormData, *names: str) -> None:
    """400 for a field of ``names`` (each taking one value) that a multipart form repeats: one value was taken (the
    last, as FastAPI and ``form.get`` take it) and the others dropped without a word; a second `file` was a
    recording sent and never transcribed."""
    for name in names:
        if (count := len(form.getlist(name))) < 2:
            continue
        if name == "file":
            raise ApiError(400, f"one file per request, not {count}: submit several as a job (POST /v1/jobs)",
                           param=name, code="invalid_parameter")
        raise ApiError(400, f"`{name}` came {count} times: it takes one value", param=name, code="invalid_parameter")


def form_text(form: FormData, name: str) -> str | None:
    """A multipart form's text field (its last value, as ``form.get``), or None; 400 where it came as a file."""
    values = form_texts(form, name)
    return values[-1] if values else None


def flag(value: object, param: str) -> bool:
    """A form field or query parameter that is true or false (as FastAPI reads booleans); else 400."""
    word = value.strip().lower() if isinstance(value, str) else None
    if word in TRUE_WORDS or word in FALSE_WORDS:
        return word in TRUE_WORDS
    raise ApiError(400, f"`{param}` must be true or false", param=param, code="invalid_parameter")


async def read_upload(upload: StarletteUpload | None, service: ServiceState, param: str = "file"
                      ) -> tuple[bytes, str | None]:
    """An uploaded file's bytes, refused (413) past the upload limit whether or not it declared its size."""
    if upload is None:
        raise ApiError(400, f"no audio: send a multipart `{param}` field", param=param, code="missing_file")
    check_upload_size(upload, service, param)
    limit = service.settings.max_upload_bytes
    data = await upload.read(limit + 1)
    if len(data) > limit:
        raise upload_too_large(limit, name=upload.filename, param=param)
    return data, upload.content_type


def check_upload_size(upload: StarletteUpload, service: ServiceState, param: str = "file") -> None:
    """413 for an uploaded file whose size is known and past the upload limit."""
    limit = service.settings.max_upload_bytes
    if upload.size is not None and upload.size > limit:
        raise upload_too_large(limit, upload.size, upload.filename, param)


def upload_too_large(limit: int, size: int | None = None, name: str | None = None, param: str = "file"
                     ) -> ApiError:
    """The 413 of an upload past MAX_UPLOAD_BYTES (of ``size`` bytes, where that is known; a form's file by its
    ``name``)."""
    prefix = f"{name}: " if name else ""
    return ApiError(413, prefix + upload_too_large_message(limit, size), param=param, code="audio_too_large")


def upload_too_large_message(limit: int, size: int | None = None) -> str:
    """An upload past MAX_UPLOAD_BYTES (of ``size`` bytes, where it said), and where a longer recording can go."""
    upload = "upload" if size is None else f"upload of {size} bytes"
    return (f"{upload} exceeds the limit of {limit} bytes (BATCHASR_MAX_UPLOAD_BYTES); a longer recording can go as "
            "a job item by path, which only the duration limit bounds")
