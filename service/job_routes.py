"""Bulk job routes: submit (uploads, paths under the input roots, URLs under the input URL prefixes), list, status,
results (all, or one item's as text or subtitles), cancel, retry.

A job belongs to the API key that submitted it: only requests with that key see it, list it or cancel it (another
key gets 404, as for a job that does not exist). Without API keys every client is one owner.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, Field, ValidationError, model_validator
from starlette.datastructures import UploadFile as StarletteUpload
from starlette.exceptions import HTTPException

from models.audio_io import MAX_STRETCH_S, WHOLE, Stretch

from .body_buffer import body_bytes
from .config import Settings
from .formats import SubtitleLayout, from_record, render
from .hotwords import split_hotwords
from .http import (
    BINARY_SCHEMA,
    ApiError,
    ServiceDep,
    ServiceState,
    check_upload_size,
    error_responses,
    flag,
    form_text,
    form_texts,
    request_hotwords,
    request_owner,
    require_api_key,
    single_fields,
    speaker_names,
    subtitle_layout,
)
from .job_types import (
    ANONYMOUS,
    MAX_QUEUED_ITEMS_HEADER,
    IdempotencyKeyReused,
    ItemInput,
    JobInputError,
    JobNotFound,
    JobOptions,
    JobPriority,
    JobStatus,
    TooManyQueued,
    UploadTooLarge,
    deleted_job,
    resolve_input_path,
)
from .jobs import JSON_JOB_BYTES, JobStore, request_fingerprint
from .redis_outages import REDIS_ERRORS, REDIS_FULL, outage
from .url_inputs import check_input_url
from .url_rules import UrlRefused
from .webhooks import check_webhook_url, owner_secret

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_IDEMPOTENCY_KEY_CHARS = 255  # as Stripe's: room for a UUID and a client's own prefix
QUEUED_RETRY_AFTER_S = 30  # a key at its limit of items queued: when to try again (a batch at a time drains it)

router = APIRouter(prefix="/v1/jobs", dependencies=[Depends(require_api_key)], tags=["jobs"],
                   responses=error_responses(401, 503))


# the longest path, URL or webhook URL a job may name (Linux's PATH_MAX is 4096; signed URLs run to a few thousand):
# each is kept in the job's records, and a failed item's in its error and dead letter, for days, which the queued-items
# limit does not count (a 30 MiB URL failing at once made 200 MB of Redis)
MAX_INPUT_CHARS = 8192


class JobItem(BaseModel):
    """A file the server can read, under its input roots, or an http(s) URL under its input URL prefixes; of it,
    the stretch from `offset` seconds, `duration` seconds long (a NeMo manifest's; default: all of it)."""

    path: Annotated[str | None, Field(max_length=MAX_INPUT_CHARS)] = None
    url: Annotated[str | None, Field(max_length=MAX_INPUT_CHARS)] = None
    offset: Annotated[float, Field(ge=0.0, le=MAX_STRETCH_S, allow_inf_nan=False)] = 0.0
    duration: Annotated[float | None, Field(gt=0.0, le=MAX_STRETCH_S, allow_inf_nan=False)] = None

    @property
    def stretch(self) -> Stretch | None:
        stretch = Stretch(self.offset, self.duration)
        return None if stretch.whole else stretch

    @model_validator(mode="after")
    def _one_source(self) -> JobItem:
        if (self.path is None) == (self.url is None):
            raise ValueError("an item has either a `path` or a `url`")
        return self


class JobCreate(BaseModel):
    """JSON submission: audio the server reads itself (files under its input roots, URLs under its prefixes)."""

    items: list[JobItem] = Field(min_length=1)
    # POSTed to when the job finishes (service.webhooks): under the server's webhook URL prefixes, or public
    webhook_url: Annotated[str | None, Field(max_length=MAX_INPUT_CHARS)] = None
    priority: JobPriority = JobPriority.NORMAL  # workers take high before normal, normal before low
    multichannel: bool = False  # each channel transcribed apart: every item's result is a conversation
    skip_silence: bool = False  # long quiet stretches left out (models.silence)
    channel_names: list[str] | None = None  # with multichannel: the speakers, one a channel in order
    hotwords: list[str] | None = None  # words and phrases made likelier (decoding.boosting)


def _inlined(schema: dict[str, Any]) -> dict[str, Any]:
    """A model's JSON schema with its ``$defs`` written where they are used: a schema in ``openapi_extra`` adds
    nothing to the spec's components for its references to name."""
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            own = {key: inline(value) for key, value in node.items() if key != "$ref"}
            return {**inline(defs[node["$ref"].rsplit("/", 1)[1]]), **own} if "$ref" in node else own
        return [inline(value) for value in node] if isinstance(node, list) else node

    return inline(schema)


# the route reads its body itself (JSON items, or a multipart form of uploads), so FastAPI cannot see it
JOB_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": _inlined(JobCreate.model_json_schema())},
    "multipart/form-data": {"schema": {"type": "object", "required": ["files"], "properties": {
        "files": {"type": "array", "items": BINARY_SCHEMA}, "webhook_url": {"type": "string"},
        "priority": {"type": "string", "enum": [p.value for p in JobPriority]}, "multichannel": {"type": "boolean"},
        "skip_silence": {"type": "boolean"}, "channel_names": {"type": "string"},
        "hotwords": {"type": "array", "items": {"type": "string"}}}}},
}}}


def _store(service: ServiceState) -> JobStore:
    if service.jobs is None:
        raise ApiError(503, "bulk jobs are not enabled on this server (start it with --redis-url)",
                       type="server_error", code="jobs_disabled")
    return service.jobs


def is_multipart(content_type: str) -> bool:
    """A submission of uploads (multipart), rather than JSON items."""
    return content_type.lower().startswith("multipart/form-data")


def json_job_too_large_message(settings: Settings) -> str:
    return (f"a JSON job's body may be at most {JSON_JOB_BYTES} bytes, and its items at most {settings.max_job_items} "
            "(BATCHASR_MAX_JOB_ITEMS): submit more as several jobs")


def job_too_large_message(limit: int) -> str:
    return (f"a job's uploads may total at most {limit} bytes (BATCHASR_MAX_JOB_UPLOAD_BYTES); submit larger sets "
            "as several jobs, or as paths or URLs")


async def _form_uploads(request: Request, service: ServiceState) -> tuple[list[StarletteUpload], JobOptions]:
    """The uploads of a multipart submission (parsed: each in its temporary file), and its other fields."""
    # the body is limited as it arrives (service.body_limit): the files, their boundaries and the other fields
    limit = service.settings.max_job_items
    try:
        form = await request.form(max_files=limit)
    except HTTPException as exc:  # Starlette's 400; too many files is the same refusal as a JSON job's 413
        if "Too many files" not in str(exc.detail):
            raise
        raise ApiError(413, f"a job may have at most {limit} items (BATCHASR_MAX_JOB_ITEMS): submit more as "
                       "several jobs", param="files", code="too_many_items") from exc
    uploads = [f for key in ("files", "file", "files[]") for f in form.getlist(key) if isinstance(f, StarletteUpload)]
    if not uploads:
        raise ApiError(400, "no audio: send one or more multipart `files` fields", param="files", code="missing_file")
    most_bytes = service.settings.max_job_upload_bytes
    if sum(upload.size or 0 for upload in uploads) > most_bytes:  # the audio alone, exactly
        raise ApiError(413, job_too_large_message(most_bytes), param="files", code="job_too_large")
    single_fields(form, "webhook_url", "priority", "multichannel", "skip_silence", "channel_names")  # one value each
    webhook, priority = form_text(form, "webhook_url"), form_text(form, "priority") or JobPriority.NORMAL.value
    try:
        priority = JobPriority(priority)
    except ValueError as exc:
        raise ApiError(400, f"priority must be one of {', '.join(p.value for p in JobPriority)}", param="priority",
                       code="invalid_priority") from exc
    multichannel, skip_silence = (flag(form_text(form, name) or "", name) for name in ("multichannel", "skip_silence"))
    names = speaker_names(form_text(form, "channel_names"), multichannel)
    hotwords = _job_hotwords(service, form_texts(form, "hotwords", "hotwords[]"))  # both, as the routes take them
    return uploads, JobOptions(webhook, priority, multichannel, skip_silence,
                               owner=request_owner(request), channel_names=tuple(names), hotwords=hotwords)


def _upload_items(uploads: list[StarletteUpload], service: ServiceState) -> list[ItemInput]:
    """The items of a form's files: each read from its temporary file as the job is written (service.job_uploads),
    not into memory first."""
    items = []
    for upload in uploads:
        check_upload_size(upload, service, param="files")  # the form's parser counted each file's bytes
        items.append(ItemInput(audio=upload.filename or f"item{len(items)}", upload=upload.file))
    return items


def _job_hotwords(service: ServiceState, values: list[str]) -> tuple[str, ...]:
    """A job's hotwords, checked now (400) so that no item fails on them later; kept as text."""
    phrases = split_hotwords(values)
    request_hotwords(service, phrases)
    return tuple(phrases)


def _invalid_job(exc: ValidationError) -> ApiError:
    """A JSON job's first problem as a 400 naming its place (``items.3.path``), and how many more there are."""
    problems = exc.errors(include_url=False)
    first = problems[0]
    where = ".".join(str(part) for part in first["loc"])
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    message = f"invalid job: {where + ': ' if where else ''}{first['msg']}{more}"
    return ApiError(400, message, param=where or None, code="invalid_job")


async def _json_items(request: Request, service: ServiceState) -> tuple[list[ItemInput], JobOptions]:
    raw = await request.body()  # at most JSON_JOB_BYTES (service.body_limit)
    try:  # off the event loop: a large job takes seconds to validate, and every other request would wait
        body = await asyncio.to_thread(JobCreate.model_validate_json, raw)
    except ValidationError as exc:  # the first problem, where it is, in a line (pydantic's dump named no field)
        raise _invalid_job(exc) from exc
    except ValueError as exc:
        raise ApiError(400, f"invalid job: {exc}", code="invalid_job") from exc
    if len(body.items) > service.settings.max_job_items:
        raise ApiError(413, json_job_too_large_message(service.settings), param="items", code="too_many_items")
    items = [ItemInput(audio=(item.stretch or WHOLE).label(item.path or str(item.url)), path=item.path,
                       url=None if item.url is None else str(item.url), stretch=item.stretch) for item in body.items]
    names = speaker_names(body.channel_names, body.multichannel)
    hotwords = _job_hotwords(service, body.hotwords or [])
    return items, JobOptions(body.webhook_url, body.priority, body.multichannel, body.skip_silence,
                             owner=request_owner(request), channel_names=tuple(names), hotwords=hotwords)


def _check_inputs(items: list[ItemInput], settings: Settings) -> None:
    """Refuse paths and URLs the workers would not read now, not when a worker gets there."""
    for item in items:
        if item.path is not None:
            resolve_input_path(item.path, settings.input_roots)
        elif item.url is not None:
            check_input_url(item.url, settings.input_url_prefixes)


def _check_webhook(url: str | None, settings: Settings) -> None:
    """Refuse a webhook the workers could not sign or would not post to."""
    if url is None:
        return
    if len(url) > MAX_INPUT_CHARS:  # a form's field is not the JSON model's, which also says so
        raise ApiError(400, f"a webhook URL is at most {MAX_INPUT_CHARS} characters, not {len(url)}",
                       param="webhook_url", code="invalid_webhook_url")
    if not settings.webhook_secret:
        raise ApiError(400, "webhooks are disabled: the server has no webhook secret (BATCHASR_WEBHOOK_SECRET)",
                       param="webhook_url", code="webhooks_disabled")
    try:
        check_webhook_url(url, settings.webhook_url_prefixes)
    except UrlRefused as exc:
        raise ApiError(400, str(exc), param="webhook_url", code="invalid_webhook_url") from exc


@router.post("", status_code=202, openapi_extra=JOB_BODY, responses={
    200: {"description": "The job an earlier submission with this `Idempotency-Key` made",
          "content": {"application/json": {}}}, **error_responses(400, 413, 429)})
async def create_job(request: Request, service: ServiceDep,
                     idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None) -> JSONResponse:
    """Submit a job: multipart `files` uploads, or JSON `{"items": [{"path": ...} | {"url": ...}]}` for audio the
    server reads itself."""
    if idempotency_key is not None and len(idempotency_key) > MAX_IDEMPOTENCY_KEY_CHARS:
        # it becomes a Redis key, kept as long as the job's results: a client's to size, not a megabyte a job
        raise ApiError(400, f"Idempotency-Key: at most {MAX_IDEMPOTENCY_KEY_CHARS} characters",
                       param="Idempotency-Key", code="invalid_idempotency_key")
    store = _store(service)
    # parsed and written to Redis in turn (service.intake): a form's fields, and its files of up to 1 MiB each
    # (larger ones wait on disk), are held in memory from the moment it is parsed, and so are a JSON job's items
    async with service.intake.hold(body_bytes(request.scope, service.settings.max_job_upload_bytes)):
        if not is_multipart(request.headers.get("content-type", "")):
            items, options = await _json_items(request, service)
            _check_webhook(options.webhook_url, service.settings)
            return await _submit(store, service.settings, items, options, idempotency_key)
        uploads, options = await _form_uploads(request, service)
        _check_webhook(options.webhook_url, service.settings)  # before the uploads are read
        items = _upload_items(uploads, service)
        return await _submit(store, service.settings, items, options, idempotency_key)


async def _submit(store: JobStore, settings: Settings, items: list[ItemInput], options: JobOptions,
                  idempotency_key: str | None) -> JSONResponse:
    try:
        # a retry is answered with its job before the inputs are checked again: a file may have gone since
        if idempotency_key and (job := await store.submitted_under(
                idempotency_key, options.owner, request_fingerprint(items, options))) is not None:
            return JSONResponse(job.to_dict(), status_code=200)
        await asyncio.to_thread(_check_inputs, items, settings)  # a path each: the file system, off the event loop
        job, created = await store.submit(items, idempotency_key, options)
    except UploadTooLarge as exc:  # larger than its Redis stores in one value: the form's limits let it through
        raise ApiError(413, str(exc), param="files", code="audio_too_large") from exc
    except TooManyQueued as exc:
        if exc.never_fits:  # the limit in a header: batchasr submit sends such a job as smaller ones
            raise ApiError(413, str(exc), param="items", code="too_many_items",
                           headers={MAX_QUEUED_ITEMS_HEADER: str(exc.limit)}) from exc
        raise _at_queued_limit(exc) from exc
    except IdempotencyKeyReused as exc:
        raise ApiError(400, str(exc), param="Idempotency-Key", code="idempotency_key_reused") from exc
    except JobInputError as exc:
        raise ApiError(400, str(exc), param="items", code="invalid_input") from exc
    except REDIS_ERRORS as exc:
        raise _redis_down(exc) from exc
    except REDIS_FULL as exc:  # nothing of the job was written: the same request (and key) can be sent again
        raise _store_full("nothing was queued") from exc
    return JSONResponse(job.to_dict(), status_code=202 if created else 200)


@router.get("", responses=error_responses(400))
async def list_jobs(request: Request, service: ServiceDep, limit: Annotated[int, Query(ge=1, le=100)] = 20,
                    after: str | None = None, status: JobStatus | None = None) -> dict[str, Any]:
    """Your jobs, newest first, `limit` at a time (of one `status`, if given): pass the page's `last_id` as `after`
    for the next page, while `has_more`. With them, your items queued or in progress now (`queued_items`, as the
    server's limit counts them) and that limit (`max_queued_items`; null: none), so a backfill can be paced."""
    store, owner = _store(service), request_owner(request)
    try:
        # at once: two round trips' time, not one after the other
        (jobs, more), queued = await asyncio.gather(store.list_jobs(owner, limit, after, status),
                                                    store.queued_items(owner))
    except JobNotFound as exc:
        raise ApiError(400, f"`after` names no job in your list: `{after}` (it may have expired)", param="after",
                       code="invalid_cursor") from exc
    except REDIS_ERRORS as exc:
        raise _redis_down(exc) from exc
    data = [job.to_dict() for job in jobs]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more, "queued_items": queued,
            "max_queued_items": store.max_queued_items}


@router.get("/{job_id}", responses=error_responses(404))
async def get_job(job_id: str, request: Request, service: ServiceDep) -> dict[str, Any]:
    return (await _from_store(job_id, _store(service).get(job_id, request_owner(request)))).to_dict()


@router.get("/{job_id}/results", response_class=Response, responses={
    200: {"description": "A JSON line per item", "content": {"application/x-ndjson": {}}}, **error_responses(404)})
async def job_results(job_id: str, request: Request, service: ServiceDep,
                      start: Annotated[int, Query(ge=0)] = 0) -> Response:
    """One JSON line per item, in submission order, streamed a page of items at a time; from item `start` on (from
    0), so a download cut short goes on from the lines it has."""
    store = _store(service)
    await _from_store(job_id, store.get(job_id, request_owner(request)))
    records = store.iter_results(job_id, start=start)
    # the job's absence (404) or Redis's (503) still answer with a status: they come before the first record
    first = await _from_store(job_id, anext(records, None))
    if first is None:
        return Response("", media_type="application/x-ndjson")

    async def lines() -> AsyncIterator[bytes]:
        yield _line(first)
        try:
            async for record in records:
                yield _line(record)
        except JobNotFound:  # purged or expired meanwhile: the stream is cut off, not ended as if whole
            log.warning("job %s is gone: its results stream is cut off", job_id)
            raise

    return StreamingResponse(lines(), media_type="application/x-ndjson")


# one item's transcript as a file of its own: the media types of /v1/audio/transcriptions's formats
ITEM_MEDIA_TYPES = {"text": "text/plain", "srt": "application/x-subrip", "vtt": "text/vtt"}


@router.get("/{job_id}/results/{index}", response_class=Response, responses={
    200: {"description": "The item's record (json), or its transcript as text, SRT or WebVTT",
          "content": {"application/json": {}, **{media: {} for media in ITEM_MEDIA_TYPES.values()}}},
    **error_responses(400, 404, 409)})
async def job_item_result(job_id: str, index: int, request: Request, service: ServiceDep,
                          response_format: str = "json", max_line_width: int = SubtitleLayout.max_line_width,
                          max_line_count: int = SubtitleLayout.max_line_count) -> Response:
    """One item's result (`index`: its place in the job, from 0): its record, as its line of `/results` gives it
    (`json`, whatever its state), or its transcript as `text`, `srt` or `vtt` (cues laid out by Whisper's
    `max_line_width` and `max_line_count`), which an item not completed has none of (409 `item_not_completed`, saying
    its state and error)."""
    layout = subtitle_layout(max_line_width, max_line_count)
    if response_format not in ("json", *ITEM_MEDIA_TYPES):
        raise ApiError(400, f"response_format must be one of json, {', '.join(ITEM_MEDIA_TYPES)}",
                       param="response_format", code="invalid_parameter")
    try:
        record = await _from_store(job_id, _store(service).result(job_id, index, request_owner(request)))
    except IndexError as exc:
        raise ApiError(404, str(exc), param="index", code="item_not_found") from exc
    if response_format == "json":
        return JSONResponse(record)
    if record["status"] != "completed":
        error = f" ({record['error']})" if record.get("error") else ""
        raise ApiError(409, f"item {index} is {record['status']}{error}: it has no transcript", param="index",
                       code="item_not_completed")
    return PlainTextResponse(render(from_record(record), record["audio"] or "", response_format, layout),
                             media_type=ITEM_MEDIA_TYPES[response_format])


def _line(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, ensure_ascii=False) + "\n").encode()


@router.delete("/{job_id}", responses=error_responses(400, 404))
async def cancel_job(job_id: str, request: Request, service: ServiceDep, purge: bool = False) -> dict[str, Any]:
    """Cancel: items not finished are dropped, those queued at once and those workers hold within about a second
    (one in a batch being computed too: its result is dropped). With `purge=true`, delete the job now: its
    records, results and uploaded audio (the items workers hold are dropped the same way)."""
    store = _store(service)
    if purge:
        await _from_store(job_id, store.delete(job_id, request_owner(request)))
        return deleted_job(job_id)
    await _from_store(job_id, store.get(job_id, request_owner(request)))
    job, ended = await _from_store(job_id, store.cancel(job_id))
    if ended and service.metrics is not None:  # no item was in progress: no consumer finishes it, or counts it
        service.metrics.count_job(job.status.value)
    return job.to_dict()


@router.post("/{job_id}/retry", responses=error_responses(404, 429, 503))
async def retry_job(job_id: str, request: Request, service: ServiceDep) -> dict[str, Any]:
    """Queue the job's failed items again, each from a first attempt: those of a path or a URL (an uploaded item's
    audio is not kept past its failure: submit it again), as many as the key's queued-items limit has room for
    (none: 429). The job is in progress until they finish, and its webhook is sent again then. Answers the job,
    with `retried_items` (queued again), `unretried_items` (failed uploads, left as they were) and `deferred_items`
    (left failed for want of room under the limit: retry again once some have finished)."""
    store = _store(service)
    try:
        retried = await _from_store(job_id, store.retry_failed(job_id, request_owner(request)))
    except TooManyQueued as exc:
        raise _at_queued_limit(exc) from exc
    except REDIS_FULL as exc:
        raise _store_full("failed items not queued again by then are left as they were") from exc
    return retried.to_dict()


webhooks_router = APIRouter(prefix="/v1/webhooks", dependencies=[Depends(require_api_key)], tags=["jobs"],
                            responses=error_responses(401))


@webhooks_router.get("/secret", responses=error_responses(400))
async def webhook_secret(request: Request, service: ServiceDep) -> dict[str, str]:
    """The secret your jobs' webhooks are signed with (Standard Webhooks' `whsec_...`): each API key has its own,
    so no other key's holder can sign a webhook your receiver would take."""
    secret = service.settings.webhook_secret
    if not secret:
        raise ApiError(400, "webhooks are disabled: the server has no webhook secret (BATCHASR_WEBHOOK_SECRET)",
                       code="webhooks_disabled")
    owner = request_owner(request)
    if owner == ANONYMOUS:  # no API keys: signed with the server's own secret, which is its operator's to give
        raise ApiError(400, "this server has no API keys: its webhooks are signed with its own "
                       "BATCHASR_WEBHOOK_SECRET, which its operator gives out", code="no_api_keys")
    return {"object": "webhook_secret", "secret": owner_secret(secret, owner)}


async def _from_store(job_id: str, work: Awaitable[T]) -> T:
    """``work`` on one job in the store, its failures as the API words them."""
    try:
        return await work
    except JobNotFound as exc:
        raise ApiError(404, f"no job `{job_id}` (it may have expired)", param="job_id", code="job_not_found") from exc
    except REDIS_ERRORS as exc:
        raise _redis_down(exc) from exc
    except REDIS_FULL as exc:  # a write of some step Redis refused for memory (a 500 before): done, or not, in part
        raise _store_full("the request may have been carried out in part: send it again") from exc


def _at_queued_limit(exc: TooManyQueued) -> ApiError:
    return ApiError(429, str(exc), type="rate_limit_error", code="too_many_queued_items",
                    headers={"Retry-After": str(QUEUED_RETRY_AFTER_S)})


def _store_full(what_happened: str) -> ApiError:
    return ApiError(503, f"the job store (Redis) is out of memory; {what_happened}, retry later", type="server_error",
                    code="job_store_full", headers={"Retry-After": "30"})


def _redis_down(exc: Exception) -> ApiError:
    # the client hears that, not where: Redis's address (and its errors' other detail) is the operator's, in the log
    log.warning("job store %s: %s", outage(exc), exc)
    return ApiError(503, f"the job store (Redis) is {outage(exc)}; retry later", type="server_error",
                    code="redis_unavailable", headers={"Retry-After": "5"})
