"""A transcription request's audio: its body or its form's file, read within the upload limit and the process's
intake budget (service.intake), and decoded off the event loop (service.audio)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any, BinaryIO, TypeVar

import numpy as np
from fastapi import Request
from starlette.datastructures import UploadFile as StarletteUpload
from starlette.requests import ClientDisconnect

from .audio import AudioRequestError, decode_declared_audio
from .body_buffer import body_bytes, take_body
from .http import ApiError, ServiceState, check_upload_size, client_closed, read_upload, upload_too_large

T = TypeVar("T")


async def read_body(request: Request, service: ServiceState) -> bytes:
    """The raw body, read from the client up to the upload limit (413 past it, declared or not)."""
    limit = service.settings.max_upload_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise upload_too_large(limit, int(declared))
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise upload_too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:  # gone mid-upload: nothing to answer, and not the server's failure
        raise client_closed() from None
    return b"".join(chunks)


async def decode(service: ServiceState, data: bytes | BinaryIO, content_type: str | None,
                 multichannel: bool = False) -> np.ndarray:
    """An upload's waveform (or, with ``multichannel``, one per channel), decoded off the event loop, once the
    service takes requests."""
    stack = service.stack
    if not service.accepting or stack is None or not stack.engine.ready:
        raise ApiError(503, "the service is not ready", type="server_error", code="not_ready",
                       headers={"Retry-After": "5"})
    try:
        return await _off_the_loop(stack.decode_pool, decode_declared_audio, data, content_type, stack.limits,
                                   multichannel)
    except AudioRequestError as exc:
        raise audio_error(exc) from exc


async def _off_the_loop(pool: Executor, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args, stop=...)`` in ``pool``. Cancelled (its client left), a call not started is dropped: the uploads
    of clients gone were all decoded, in turn, ahead of those still waiting; one started is told to stop (a decode
    gives up at its next block) and waited for, as its file and its room in the intake budget are in use until it
    ends."""
    stop = threading.Event()
    call = pool.submit(fn, *args, stop=stop)
    try:
        return await asyncio.wrap_future(call)
    except asyncio.CancelledError:
        if not call.cancel():
            stop.set()
            with contextlib.suppress(Exception):
                await asyncio.shield(asyncio.wrap_future(call))
        raise


async def unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client goes away first: then it is cancelled, and the answer is 499 once it has
    ended (a decode under way stops at its next block: the request's file is closed after it, not under it). Only
    once the request's body is read: the disconnect is the next message the server sends (``wait_for_disconnect``)."""
    task = asyncio.ensure_future(work)
    client_gone = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, client_gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
            raise client_closed()
        return task.result()
    finally:
        for pending in (task, client_gone):
            if not pending.done():
                pending.cancel()


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client goes away. With the body read, the server's next message is the disconnect, so
    one waiting receive replaces polling (which cost the event loop a wake-up per request every 100 ms)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def decoded_upload(request: Request, service: ServiceState, upload: StarletteUpload | None,
                         multichannel: bool = False) -> np.ndarray:
    """A multipart upload (the form parsed: its body read), decoded within the process's intake budget
    (service.intake) from the form's temporary file; given up if the client leaves meanwhile."""
    return await unless_client_leaves(request, _decoded_upload(service, upload, multichannel))


async def _decoded_upload(service: ServiceState, upload: StarletteUpload | None, multichannel: bool) -> np.ndarray:
    size = 0 if upload is None else service.settings.max_upload_bytes if upload.size is None else upload.size
    async with service.intake.hold(size):
        if upload is not None and upload.size is not None:  # the form is parsed: the file is whole, its size known
            check_upload_size(upload, service)
            await upload.seek(0)
            return await decode(service, upload.file, upload.content_type, multichannel)
        data, content_type = await read_upload(upload, service)
        return await decode(service, data, content_type, multichannel)


async def decoded_body(request: Request, service: ServiceState, multichannel: bool = False) -> np.ndarray:
    """The raw audio body, decoded within the intake budget from the temporary file it waits in, whole, until there
    is room (service.body_buffer); given up if the client leaves meanwhile."""
    content_type = request.headers.get("content-type")
    # taken first: watching for the client's leaving receives the messages that would replay an untaken body (read
    # from its file, while a decoding thread might read that file too)
    whole = take_body(request.scope)
    if whole is None:  # not received whole (or an app without the buffer): read from the client, unwatched
        async with service.intake.hold(service.settings.max_upload_bytes):
            return await decode(service, await read_body(request, service), content_type, multichannel)
    size = body_bytes(request.scope, 0)
    limit = service.settings.max_upload_bytes
    if size > limit:
        raise upload_too_large(limit, size)
    return await unless_client_leaves(request, _decoded_file(service, whole, size, content_type, multichannel))


async def _decoded_file(service: ServiceState, body: BinaryIO, size: int, content_type: str | None,
                        multichannel: bool) -> np.ndarray:
    async with service.intake.hold(size):
        return await decode(service, body, content_type, multichannel)


def audio_error(exc: AudioRequestError) -> ApiError:
    """Audio the service refuses (unreadable, too long, too many pieces), as the API says it."""
    return ApiError(exc.status, str(exc), param="file", code=exc.code)
