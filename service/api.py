"""The HTTP API: OpenAI-compatible and native transcription, health, readiness and metrics.

``create_app(settings)`` builds everything; the model loads and warms up in the lifespan, and shutdown
stops accepting, lets queued work finish, then stops the engine. ``create_frontend_app`` serves the same routes
in a front-end process, over a link to the engine process (``service.processes``). A request's audio is read
and decoded by ``service.request_audio``, and transcribed (or streamed) by ``service.request_transcription``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Form, Query, Request, UploadFile
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import FormData
from starlette.datastructures import UploadFile as StarletteUpload

from decoding.types import Hotwords

from .batcher import Priority
from .body_buffer import BodyBufferMiddleware
from .body_limit import FORM_OVERHEAD_BYTES, BodyLimitMiddleware, BodyTooLarge
from .config import Settings
from .engine_link import EngineLink
from .formats import SubtitleLayout, to_srt, to_vtt
from .head_limit import HEAD_REFUSED
from .hotwords import split_hotwords
from .http import (
    BINARY_SCHEMA,
    ApiError,
    ApiKeyGate,
    ServiceDep,
    ServiceState,
    error_responses,
    flag,
    form_text,
    form_texts,
    install_error_handlers,
    request_hotwords,
    request_owner,
    require_api_key,
    single_fields,
    speaker_names,
    subtitle_layout,
    upload_too_large_message,
)
from .job_routes import is_multipart, job_too_large_message, json_job_too_large_message, webhooks_router
from .job_routes import router as jobs_router
from .jobs import JSON_JOB_BYTES
from .languages import language_name
from .metrics import Metrics
from .request_audio import decoded_body, decoded_upload
from .request_log import RequestLogMiddleware, observe_refused_head
from .request_transcription import stream_transcription, transcribe, while_client_waits
from .response_bodies import (
    conversation_body,
    openai_logprobs,
    openai_words,
    transcript_segments,
    word_timings,
)
from .runtime import build_frontend_stack, build_stack, load_serving_model
from .schemas import (
    ModelCard,
    ModelList,
    NativeTranscription,
    TranscriptionJSON,
    Usage,
    VerboseTranscription,
)
from .wire import EngineUnavailable

if TYPE_CHECKING:  # front-end processes serve these routes without the model (or torch)
    from models.asr_model import ASRModel

log = logging.getLogger("batchasr.api")

RESPONSE_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
STREAM_FORMATS = ("json", "text")  # as OpenAI's: the stream's events carry text only
GRANULARITIES = ("word", "segment")
INCLUDES = ("logprobs",)
LOGPROB_FORMATS = ("json", "verbose_json")  # OpenAI gives logprobs in JSON only (and in the stream's events)
# the OpenAI route's fields that take one value (the others are lists: timestamp_granularities[], include[], hotwords)
OPENAI_SINGLE_FIELDS = ("file", "model", "language", "prompt", "response_format", "temperature", "stream",
                        "skip_silence", "max_line_width", "max_line_count", "multichannel", "channel_names")


def _hotwords(service: ServiceState, values: list[str]) -> Hotwords:
    """A request's hotwords (comma-separated, or the field repeated) as tokens; 400 where they cannot be had."""
    return request_hotwords(service, split_hotwords(values))


def _hotword_fields(query: list[str], form: FormData | None) -> list[str]:
    """A transcription request's ``hotwords``: the query string's (every value: the parameter may be repeated), or
    the multipart form's (``hotwords`` or ``hotwords[]``); not both."""
    _in_one_place("hotwords", bool(query), form)
    return query or ([] if form is None else _form_list(form, "hotwords"))


def _in_one_place(name: str, in_query: bool, form: FormData | None) -> None:
    """400 for a field sent both in the query string and in the form: one was taken and the other dropped without a
    word (a form's bad hotwords were never even checked), as a repeated field would be."""
    if in_query and form is not None and (form.getlist(name) or form.getlist(f"{name}[]")):
        raise ApiError(400, f"`{name}` was sent both in the query string and in the form: send it once", param=name,
                       code="invalid_parameter")


def _check_model(service: ServiceState, requested: str | None) -> None:
    if requested is not None and requested not in {service.model_id, *service.settings.model_aliases}:
        raise ApiError(404, f"the model `{requested}` does not exist; this server serves `{service.model_id}`",
                       param="model", code="model_not_found")


def _check_language(service: ServiceState, requested: str | None) -> str:
    """The language the answer is in: the one asked for (its primary subtag: ``en-US`` is ``en``) if the model
    transcribes it, else 400; none asked for: the model's first."""
    languages = service.settings.languages
    if not requested:
        return languages[0] if languages else "en"
    code = requested.split("-")[0].split("_")[0].lower()
    if languages and code not in languages:
        raise ApiError(400, f"this model transcribes {', '.join(languages)}, not {requested!r}", param="language",
                       code="unsupported_language")
    return code


def _form_list(form: FormData, name: str) -> list[str]:
    """A repeated form field, sent as ``name[]`` (OpenAI's SDKs) or plain ``name``."""
    return form_texts(form, f"{name}[]", name)


# --- routes ------------------------------------------------------------------------------------------------

v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], tags=["transcription"],
               responses=error_responses(401))

# what a transcription route may answer
TRANSCRIBE_ERRORS = error_responses(400, 413, 415, 429, 503, 504)

TRANSCRIPTION_RESPONSES: dict[int | str, dict[str, Any]] = {200: {
    "description": "By `response_format`: `json` and `verbose_json` as JSON, `text`, `srt` and `vtt` as text; with "
                   "`stream=true`, server-sent events (`transcript.text.delta`, then `transcript.text.done`)",
    "content": {"application/json": {}, "text/plain": {}, "application/x-subrip": {}, "text/vtt": {},
                "text/event-stream": {}},
}, **TRANSCRIBE_ERRORS, **error_responses(404)}

# the native route reads its body itself (a multipart form, or the audio as it is), so FastAPI cannot see it
NATIVE_BODY = {"requestBody": {"required": True, "content": {
    "multipart/form-data": {"schema": {"type": "object", "required": ["file"], "properties": {
        "file": BINARY_SCHEMA, "multichannel": {"type": "boolean"}, "skip_silence": {"type": "boolean"},
        "channel_names": {"type": "string"}, "hotwords": {"type": "array", "items": {"type": "string"}}}}},
    **{media: {"schema": BINARY_SCHEMA} for media in ("audio/*", "video/*", "application/octet-stream")},
}}}


@v1.post("/audio/transcriptions", response_model=None, responses=TRANSCRIPTION_RESPONSES)
async def openai_transcriptions(
    request: Request,
    service: ServiceDep,
    file: UploadFile | None = None,
    model: Annotated[str | None, Form()] = None,
    language: Annotated[str | None, Form()] = None,
    prompt: Annotated[str | None, Form()] = None,  # accepted for compatibility; transducers take no prompt
    response_format: Annotated[str, Form()] = "json",
    temperature: Annotated[float, Form()] = 0.0,  # greedy decoding: accepted and ignored
    stream: Annotated[bool, Form()] = False,
    skip_silence: Annotated[bool, Form()] = False,  # ours: leave long quiet stretches out (models.silence)
    max_line_width: Annotated[int, Form()] = SubtitleLayout.max_line_width,  # srt, vtt: Whisper's layout options
    max_line_count: Annotated[int, Form()] = SubtitleLayout.max_line_count,
) -> Response:
    """OpenAI-compatible transcription (multipart); `skip_silence` (ours, e.g. the SDK's `extra_body`) leaves long
    quiet stretches out; `max_line_width` and `max_line_count` (Whisper's names) lay out srt and vtt cues."""
    form = await request.form()  # parsed by FastAPI already: its fields as they came, each value of a repeated one
    single_fields(form, *OPENAI_SINGLE_FIELDS)  # before any is judged: FastAPI took the last of each
    _check_model(service, model or None)
    spoken = _check_language(service, language)
    layout = subtitle_layout(max_line_width, max_line_count)
    if response_format not in RESPONSE_FORMATS:
        raise ApiError(400, f"response_format must be one of {', '.join(RESPONSE_FORMATS)}", param="response_format",
                       code="invalid_parameter")
    if stream and response_format not in STREAM_FORMATS:
        raise ApiError(400, f"stream=true needs response_format {' or '.join(STREAM_FORMATS)}", param="stream",
                       code="invalid_parameter")
    for native in ("multichannel", "channel_names"):  # taken by the native route only: not ignored here
        given = [v for v in (form_text(form, native), request.query_params.get(native)) if v is not None]
        # multichannel false in any of the native route's words (off, no, False...); channel_names, any name at all
        if any(flag(v, native) if native == "multichannel" else v.strip() for v in given):
            raise ApiError(400, f"`{native}` is taken by POST /v1/transcribe (a conversation's channels transcribed "
                           "apart); this route mixes the channels down", param=native, code="invalid_parameter")
    granularities = _form_list(form, "timestamp_granularities")
    if bad := [g for g in granularities if g not in GRANULARITIES]:
        raise ApiError(400, f"timestamp_granularities[] must be word or segment, not {bad[0]!r}",
                       param="timestamp_granularities[]", code="invalid_parameter")
    include = _form_list(form, "include")
    if bad := [item for item in include if item not in INCLUDES]:
        raise ApiError(400, f"include[] takes {' or '.join(INCLUDES)}, not {bad[0]!r}", param="include[]",
                       code="invalid_parameter")
    logprobs = "logprobs" in include
    if logprobs and response_format not in LOGPROB_FORMATS:
        raise ApiError(400, f"include[]=logprobs needs response_format {' or '.join(LOGPROB_FORMATS)}",
                       param="include[]", code="invalid_parameter")
    if logprobs and not service.settings.token_scores:
        raise ApiError(400, "this server does not score tokens (BATCHASR_TOKEN_SCORES is off): no logprobs",
                       param="include[]", code="logprobs_unavailable")
    hotwords = _hotwords(service, _hotword_fields(request.query_params.getlist("hotwords"), form))
    waveform = await decoded_upload(request, service, file)
    assert service.stack is not None
    tokenizer = service.stack.transcriber.tokenizer
    if stream:
        return await stream_transcription(request, service, waveform, skip_silence, logprobs, hotwords)
    result = await transcribe(request, service, waveform, skip_silence, hotwords)
    transcript = result.transcript
    usage = Usage(seconds=round(transcript.duration_s, 3))
    token_logprobs = openai_logprobs(transcript.tokens, transcript.token_logprobs, tokenizer) if logprobs else None
    if response_format == "text":
        return PlainTextResponse(transcript.text + "\n")
    if response_format == "srt":
        return PlainTextResponse(to_srt(transcript, layout), media_type="application/x-subrip")
    if response_format == "vtt":
        return PlainTextResponse(to_vtt(transcript, layout), media_type="text/vtt")
    if response_format == "json":
        return JSONResponse(TranscriptionJSON(text=transcript.text, logprobs=token_logprobs, usage=usage)
                            .model_dump(exclude_none=True))
    wants = set(granularities) or {"segment"}
    body = VerboseTranscription(
        language=language_name(spoken), duration=round(transcript.duration_s, 3), text=transcript.text, usage=usage,
        segments=transcript_segments(transcript, tokenizer) if "segment" in wants else None,
        words=openai_words(transcript.words) if "word" in wants else None, logprobs=token_logprobs,
    )
    return JSONResponse(body.model_dump(exclude_none=True))


@v1.post("/transcribe", response_model=NativeTranscription, response_model_exclude_none=True,
         responses=TRANSCRIBE_ERRORS, openapi_extra=NATIVE_BODY)
async def native_transcribe(request: Request, service: ServiceDep,
                            multichannel: Annotated[str | None, Query()] = None,
                            skip_silence: Annotated[str | None, Query()] = None,
                            channel_names: Annotated[str | None, Query()] = None,
                            hotwords: Annotated[list[str] | None, Query()] = None) -> NativeTranscription:
    """Native transcription: a multipart `file` or the raw audio as the body; full timing detail. With
    `multichannel=true` (query or form field) each channel is transcribed apart (a call's agent and customer) and
    the answer is the conversation: utterances in time order, each naming its channel (or its speaker, from
    `channel_names=agent,customer`). `skip_silence=true` leaves long quiet stretches out (no words can come from
    them; they cost nothing). `hotwords=acme,widget pro:3` (query or form field) makes those words and phrases
    likelier where the audio leaves room for them."""
    content_type = request.headers.get("content-type", "")
    form = await request.form() if content_type.lower().startswith("multipart/form-data") else None
    if form is not None:
        single_fields(form, "file", "multichannel", "skip_silence", "channel_names")
    for name, given in (("multichannel", multichannel), ("skip_silence", skip_silence),
                        ("channel_names", channel_names)):
        _in_one_place(name, given is not None, form)
    apart, skip = _option("multichannel", multichannel, form), _option("skip_silence", skip_silence, form)
    names = speaker_names(form_text(form, "channel_names") if channel_names is None and form is not None
                          else channel_names, apart)
    boosted = _hotwords(service, _hotword_fields(hotwords or [], form))
    if form is not None:
        upload = form.get("file")
        file = upload if isinstance(upload, StarletteUpload) else None
        waveform = await decoded_upload(request, service, file, apart)
    else:
        waveform = await decoded_body(request, service, apart)
    if apart:
        assert service.stack is not None
        channels = service.stack.transcriber.transcribe_channels(waveform, Priority.INTERACTIVE, skip, boosted,
                                                                 request_owner(request))
        result = await while_client_waits(request, channels)
        result.conversation.names = names
        return conversation_body(service, result)
    result = await transcribe(request, service, waveform, skip, boosted)
    t = result.transcript
    return NativeTranscription(
        model=service.model_id, text=t.text, tokens=t.tokens, token_frames=t.token_frames,
        token_logprobs=t.token_logprobs, avg_logprob=t.avg_logprob, words=word_timings(t.words),
        duration_s=round(t.duration_s, 6), queue_s=round(result.queue_s, 6), compute_s=round(result.compute_s, 6),
        rtfx=round(result.rtfx, 3), segments=result.n_segments,
    )


def _option(name: str, query_value: str | None, form: FormData | None) -> bool:
    """A true/false option from the query string, else from the multipart form; absent: false."""
    value = form_text(form, name) if query_value is None and form is not None else query_value
    return flag(value or "", name)


@v1.get("/models", response_model=ModelList)
async def list_models(service: ServiceDep) -> ModelList:
    return ModelList(data=[_model_card(service)])


@v1.get("/models/{model:path}", response_model=ModelCard, responses=error_responses(404))
async def retrieve_model(model: str, service: ServiceDep) -> ModelCard:
    """The served model (OpenAI's retrieve), by its id or one of its aliases; 404 for any other. An id may hold
    slashes (`nvidia/parakeet-tdt-0.6b-v2`): OpenAI's clients send them encoded, and the path arrives decoded."""
    _check_model(service, model)
    return _model_card(service)


def _model_card(service: ServiceState) -> ModelCard:
    assert service.stack is not None
    config, settings = service.stack.transcriber.config, service.settings
    return ModelCard(id=service.model_id, created=int(service.started_at), aliases=list(settings.model_aliases),
                     architecture=config.kind, languages=list(settings.languages),
                     decoder=config.default_decoder if settings.decoder == "auto" else settings.decoder,
                     sample_rate=config.features.sample_rate, vocab_size=config.vocab_size,
                     token_scores=settings.token_scores, max_segment_s=settings.max_segment_s)


ops = APIRouter(tags=["operations"])


@ops.head("/healthz", include_in_schema=False)  # uptime checkers and load balancers that ask with HEAD
@ops.get("/healthz", responses={**error_responses(), 503: {
    "description": "The engine failed for good: restart the process", "content": {"application/json": {}}}})
async def healthz(service: ServiceDep) -> JSONResponse:
    """Alive: the process answers, and its engine has not failed for good (a failed warm-up, a broken GPU
    context): then only a new process can serve, so a liveness probe restarts it."""
    stack = service.stack
    if stack is not None and stack.engine.failed:
        return JSONResponse({"status": "failed", "error": stack.engine.error}, 503)
    return JSONResponse({"status": "ok"})


@ops.head("/readyz", include_in_schema=False)
@ops.get("/readyz", responses={**error_responses(), 503: {
    "description": "Not ready: `problems` says why", "content": {"application/json": {}}}})
async def readyz(service: ServiceDep, redis: Literal["required", "optional"] = "required") -> JSONResponse:
    """Ready: model loaded, engine warm, Redis reachable when configured. With `redis=optional`, Redis unreachable is
    a warning and not a problem: a load balancer's probe, as transcription goes on without it (the job routes
    answer 503 `redis_unavailable` meanwhile), where a Redis restart took every replica out of service."""
    stack = service.stack
    problems, warnings = [], []
    if stack is None or not stack.engine.ready:
        problems.append(stack.engine.error if stack and stack.engine.error else "engine warming up")
    if not service.accepting:
        problems.append("shutting down")
    if service.jobs is not None and not await service.jobs.ping():
        (warnings if redis == "optional" else problems).append("redis unreachable")
    status = 503 if problems else 200
    return JSONResponse({"status": "not ready" if problems else "ready", "problems": problems,
                         **({"warnings": warnings} if warnings else {})}, status)


@ops.get("/metrics", response_class=Response, responses={  # Prometheus's text; its errors JSON, as any route's
    200: {"description": "The metrics in Prometheus's text format", "content": {"text/plain": {}}},
    **error_responses(503)})
async def metrics(service: ServiceDep) -> Response:
    if service.metrics is None:
        raise ApiError(503, "the service is starting", type="server_error", code="not_ready")
    try:
        body = await service.metrics.scrape()  # async route: on the event loop's thread, whose CPU it counts
    except EngineUnavailable as exc:
        raise ApiError(503, str(exc), type="server_error", code="engine_unavailable") from exc
    return Response(body, media_type=CONTENT_TYPE_LATEST)


# --- the app -----------------------------------------------------------------------------------------------


def model_id(settings: Settings) -> str:
    """The id clients see and may send as `model`."""
    return settings.model_name or (Path(settings.model).stem if settings.model else "batchasr-default")


def create_app(settings: Settings, model: ASRModel | None = None) -> FastAPI:
    """The API. Pass ``model`` to serve one already loaded (tests, embedding); else settings.model loads.

    With ``settings.redis_url`` the same engine also consumes bulk jobs, and the /v1/jobs routes work.
    """
    service = ServiceState(settings=settings, model_id=model_id(settings), metrics=Metrics())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        loaded = model
        if loaded is None:
            loaded = await asyncio.to_thread(load_serving_model, settings)
        stack = service.stack = build_stack(settings, loaded, service.metrics)
        if stack.jobs is not None:
            stack.start_consumer()
        try:
            yield lifespan_state(service)
        finally:
            service.accepting = False
            await stack.stop()  # finishes job items in hand and what is queued first

    return _app(service, lifespan)


def create_frontend_app(settings: Settings, engine_path: str, on_engine_lost: Callable[[], None]) -> FastAPI:
    """The API in a front-end process: requests are decoded, planned and worded here; their pieces go to the
    engine process at ``engine_path``, which also keeps the metrics. ``on_engine_lost`` is called if it goes
    away (the front end should then exit: it cannot serve without it)."""
    service = ServiceState(settings=settings, model_id=model_id(settings))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        link = await EngineLink.connect(engine_path, on_engine_lost)
        stack = service.stack = build_frontend_stack(settings, link)
        service.metrics = link
        try:
            yield lifespan_state(service)
        finally:
            service.accepting = False
            await stack.stop()  # the server has finished its requests by now

    return _app(service, lifespan)


def lifespan_state(service: ServiceState) -> dict[str, Any]:
    """The app's lifespan state (ASGI's), which uvicorn hands its protocols too: how the one that reads request
    heads counts and logs the requests it refuses before the app sees them (service.head_limit)."""
    return {HEAD_REFUSED: partial(observe_refused_head, service)}


V1_ROUTERS = (v1, jobs_router, webhooks_router)  # the API's routes, counted in the request metrics


def _app(service: ServiceState, lifespan: Callable[[FastAPI], Any]) -> FastAPI:
    app = FastAPI(title="batchasr", version="0.1.0", lifespan=lifespan,
                  description="High-throughput transcription of NeMo FastConformer models.")
    app.state.service = service
    install_error_handlers(app)
    for router in (*V1_ROUTERS, ops):
        app.include_router(router)
    app.add_middleware(BodyBufferMiddleware)  # bodies whole before a route reads them (service.body_buffer)
    app.add_middleware(BodyLimitMiddleware, limit_for=_body_limits(service.settings))
    app.add_middleware(ApiKeyGate, keys=service.settings.api_keys)  # outside the body limit: 401 before 413
    # added last: outermost, so it sees every answer (routes: to name those the middleware answered before routing)
    app.add_middleware(RequestLogMiddleware, service=service,
                       routes=[route for router in V1_ROUTERS for route in router.routes])
    return app


def _body_limits(settings: Settings) -> Callable[[str, str], BodyTooLarge]:
    """Each route's largest request body: a job submission's uploads together (a JSON one's items, which carry no
    audio: JSON_JOB_BYTES), else one upload and its form."""
    def limit_for(path: str, content_type: str) -> BodyTooLarge:
        if path.rstrip("/") == "/v1/jobs":
            if not is_multipart(content_type):
                return BodyTooLarge(JSON_JOB_BYTES, json_job_too_large_message(settings), "items", "job_too_large")
            limit = settings.max_job_upload_bytes
            return BodyTooLarge(limit + FORM_OVERHEAD_BYTES, job_too_large_message(limit), "files", "job_too_large")
        limit = settings.max_upload_bytes
        return BodyTooLarge(limit + FORM_OVERHEAD_BYTES, upload_too_large_message(limit), "file", "audio_too_large")
    return limit_for
