"""A transcription request's audio: its body or its form's file, read within the upload limit and the process's
intake budget (service.intake), and decoded off the event loop (service.audio)."""

from __future__ import annotations

import asyncio
from typing import BinaryIO

import numpy as np
from fastapi import Request
from starlette.datastructures import UploadFile as StarletteUpload
from starlette.requests import ClientDisconnect

from .audio import AudioRequestError, decode_declared_audio
from .body_buffer import body_bytes, take_body
from .http import ApiError, ServiceState, check_upload_size, client_closed, read_upload, upload_too_large


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
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(stack.decode_pool, decode_declared_audio, data, content_type, stack.limits,
                                          multichannel)
    except AudioRequestError as exc:
        raise audio_error(exc) from exc


async def decoded_upload(service: ServiceState, upload: StarletteUpload | None, multichannel: bool = False
                         ) -> np.ndarray:
    """A multipart upload, decoded within the process's intake budget (service.intake) from the form's temporary
    file."""
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
    is room (service.body_buffer)."""
    async with service.intake.hold(body_bytes(request.scope, service.settings.max_upload_bytes)):
        content_type = request.headers.get("content-type")
        whole = take_body(request.scope)
        if whole is None:  # not received whole (or an app without the buffer): read from the client
            return await decode(service, await read_body(request, service), content_type, multichannel)
        size = body_bytes(request.scope, 0)
        limit = service.settings.max_upload_bytes
        if size > limit:
            raise upload_too_large(limit, size)
        return await decode(service, whole, content_type, multichannel)


def audio_error(exc: AudioRequestError) -> ApiError:
    """Audio the service refuses (unreadable, too long, too many pieces), as the API says it."""
    return ApiError(exc.status, str(exc), param="file", code=exc.code)
