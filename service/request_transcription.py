"""A transcription request's work on the engine: queued, and awaited while its client waits (dropped if it goes),
or streamed as OpenAI's server-sent events; the engine's refusals as the API words them."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from fastapi import Request
from fastapi.responses import StreamingResponse

from decoding.types import Hotwords

from .audio import AudioRequestError
from .batcher import BatcherClosed, Priority, QueueFull
from .http import ApiError, ServiceState, internal_error, request_owner
from .request_audio import audio_error, unless_client_leaves
from .request_log import report_late_failure
from .response_bodies import openai_logprobs
from .schemas import TokenLogprob
from .transcriber import QueuedRequest, RequestResult, TextDelta
from .wire import EngineUnavailable

if TYPE_CHECKING:  # front-end processes serve these routes without the model (or torch)
    from models.tokenizer import Tokenizer

log = logging.getLogger("batchasr.api")

T = TypeVar("T")


async def transcribe(request: Request, service: ServiceState, waveform: np.ndarray, skip_silence: bool = False,
                     hotwords: Hotwords = ()) -> RequestResult:
    """Queue, and await the result; drop the work if the client goes away. Each API key's requests take turns
    with the others' (batcher.WorkItem.owner)."""
    assert service.stack is not None
    transcriber = service.stack.transcriber
    return await while_client_waits(request, transcriber.transcribe(waveform, Priority.INTERACTIVE, skip_silence,
                                                                     hotwords, request_owner(request)))


# why the engine did not take or finish a request's work, each an answer of the API's (engine_error); BatcherClosed:
# its queue closed (the engine failed, or a shutdown drains it) after the request found it ready
ENGINE_REFUSALS = (QueueFull, TimeoutError, EngineUnavailable, BatcherClosed)


async def while_client_waits(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client goes away first (then it is cancelled: its queued pieces never reach the
    engine, and the answer is 499); its failures become the API's errors."""
    try:
        return await unless_client_leaves(request, work)
    except ENGINE_REFUSALS as exc:
        raise engine_error(exc) from exc
    except AudioRequestError as exc:  # more pieces than the queue holds
        raise audio_error(exc) from exc


def engine_error(exc: QueueFull | TimeoutError | EngineUnavailable | BatcherClosed) -> ApiError:
    """Why the engine did not transcribe a request, as the API says it."""
    if isinstance(exc, QueueFull):
        return ApiError(429, str(exc), type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, TimeoutError):
        # not to be sent again: it had the whole timeout, and OpenAI's clients (which retry a 5xx twice) would
        # upload it again for as long each time
        why = f": {exc}" if str(exc) else ""  # the batcher says why it dropped a piece
        return ApiError(504, f"transcription did not finish within the request timeout{why}", type="server_error",
                        code="timeout", headers={"x-should-retry": "false"})
    return ApiError(503, str(exc), type="server_error", code="engine_unavailable", headers={"Retry-After": "5"})


async def stream_transcription(request: Request, service: ServiceState, waveform: np.ndarray, skip_silence: bool,
                               logprobs: bool = False, hotwords: Hotwords = ()) -> StreamingResponse:
    """OpenAI's transcription stream (server-sent events): ``transcript.text.delta`` as the leading pieces of the
    audio finish, then ``transcript.text.done`` with the whole text (and, with ``logprobs``, every token's).
    Failures before the first event answer with their status codes, as without streaming; a later one ends the
    stream with an ``error`` event."""
    assert service.stack is not None
    try:
        queued = await service.stack.transcriber.submit(waveform, Priority.INTERACTIVE, skip_silence,
                                                        hotwords=hotwords, owner=request_owner(request))
    except ENGINE_REFUSALS as exc:
        raise engine_error(exc) from exc
    except AudioRequestError as exc:  # more pieces than the queue holds
        raise audio_error(exc) from exc
    deltas = queued.text_deltas()
    try:
        first = await while_client_waits(request, anext(deltas, None))
    except BaseException:
        queued.cancel()
        raise
    tokenizer = service.stack.transcriber.tokenizer if logprobs else None
    events = transcription_events(queued, deltas, first, tokenizer, on_failure=partial(report_late_failure, request))
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def transcription_events(queued: QueuedRequest, deltas: AsyncIterator[TextDelta], first: TextDelta | None,
                               logprobs_from: Tokenizer | None = None,
                               on_failure: Callable[[ApiError], None] = lambda error: None) -> AsyncIterator[bytes]:
    """The stream's events (with ``logprobs_from``, each carrying its tokens' logprobs). A client that goes away
    cancels this (Starlette listens for it), which drops the pieces still queued. A failure, sent as an ``error``
    event under the 200 already sent, is handed to ``on_failure`` too (for the request's metrics and log line)."""
    try:
        delta = first
        while delta is not None:
            event: dict[str, Any] = {"type": "transcript.text.delta", "delta": delta.text}
            if logprobs_from is not None:
                event["logprobs"] = _dumped(openai_logprobs(delta.tokens, delta.logprobs, logprobs_from,
                                                            starts_text=delta.first_token == 0))
            yield _event(event)
            delta = await anext(deltas, None)
        result = await queued.result()  # every piece is done by now
        transcript = result.transcript
        done: dict[str, Any] = {"type": "transcript.text.done", "text": transcript.text}
        if logprobs_from is not None:
            done["logprobs"] = _dumped(openai_logprobs(transcript.tokens, transcript.token_logprobs, logprobs_from))
        yield _event(done)
    except ENGINE_REFUSALS as exc:
        yield _failed(engine_error(exc), on_failure)
    except Exception as exc:  # a batch that failed (the headers are sent: the stream says so, as it promises)
        log.exception("transcription stream failed")
        yield _failed(internal_error(exc), on_failure)
    finally:
        queued.cancel()


def _failed(error: ApiError, on_failure: Callable[[ApiError], None]) -> bytes:
    on_failure(error)
    return _event({"type": "error", **error.body()})


def _dumped(logprobs: list[TokenLogprob]) -> list[dict[str, Any]]:
    return [p.model_dump() for p in logprobs]


def _event(data: dict[str, Any]) -> bytes:
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()
