"""Request bodies received whole, into a temporary file, before the app reads them.

A route reads its upload within the process's intake budget (service.intake), and read from the client, a body
comes as fast as the client sends it: one that declared a large body and sent nothing held its share of the
budget for as long as it liked, and a dozen such connections stopped every upload of the process (job
submissions too). Likewise a multipart form cut off part way sat half-parsed in memory (its fields, and its files
of up to 1 MiB each) for as long as its client kept the connection open. Received here first, in memory up to
``spool.SPOOL_MEMORY_BYTES`` and on disk past that, a body reaches its route only once it is whole: a stalled client
holds a connection and a file for a while, never room in the budget or a parser's memory.

The app sees what it would have seen from the client, only later: the body's bytes, then its end, or the refusal
of a body past its limit (service.body_limit) or the client's leaving, at the point where they came. A body that
stops arriving for ``BODY_IDLE_TIMEOUT_S`` is answered 408 and its connection closed, rather than kept for good.
A route may instead take a whole body's file (``take_body``) and read it where it lies: an audio upload is decoded
from it, not first copied into memory whole.

A multipart form whose body ended before its closing boundary is refused (400 ``invalid_body``) where the app first
reads it: Starlette's parser took it as a whole form of the parts before the cut, and the fields past it were lost
without a word (``multichannel``, ``language``), or a file cut short was missing.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from email.message import Message
from typing import Any, BinaryIO

from starlette.datastructures import Headers, UploadFile

from .http import ApiError, no_room_for_body, send_error
from .spool import spooled_file

REPLAY_CHUNK_BYTES = 1 << 20
NO_BODY_METHODS = ("GET", "HEAD", "OPTIONS", "DELETE")
BODY_IDLE_TIMEOUT_S = 60.0  # between two pieces of a body (nginx's client_body_timeout)
BODY_BYTES = "batchasr.body_bytes"  # the scope's key for the size of the body received (``body_bytes``)
BODY_FILE = "batchasr.body_file"  # the scope's key for a body received whole (``take_body``)
FORM_TAIL_BYTES = 64 << 10  # where a form's closing boundary is looked for first: clients end the body with it


@dataclass
class WholeBody:
    """A body that arrived whole, in its temporary file; once taken, the app is not sent its bytes as well."""

    file: BinaryIO
    taken: bool = False


def take_body(scope: dict) -> BinaryIO | None:
    """The request's body as a file, at its start, to be read (not closed) before the request ends; None where it
    did not arrive whole (past its limit, or its client left: the body's messages say so) or was taken already."""
    whole: WholeBody | None = scope.pop(BODY_FILE, None)
    if whole is None:
        return None
    whole.taken = True
    whole.file.seek(0)
    return whole.file


def body_bytes(scope: dict, otherwise: int) -> int:
    """How many bytes the request's body has, received whole (``otherwise`` where it was not, as in a test's own
    app)."""
    return scope.get(BODY_BYTES, otherwise)


class BodyBufferMiddleware:
    """Plain ASGI, inside the body limit (which refuses a body past its route's limit as it arrives)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in NO_BODY_METHODS:
            await self.app(scope, receive, send)
            return
        body = UploadFile(spooled_file(), size=0)  # closed below
        end: dict | Exception | None = {"type": "http.request", "body": b"", "more_body": False}
        try:
            while True:
                try:
                    message = await asyncio.wait_for(receive(), BODY_IDLE_TIMEOUT_S)
                except TimeoutError:
                    await send_error(send, ApiError(408, f"the request body stopped arriving for "
                                                         f"{BODY_IDLE_TIMEOUT_S:g} s", code="request_timeout"))
                    return
                except Exception as exc:  # past the route's limit: the app meets the refusal where it came
                    end = exc
                    break
                if message["type"] != "http.request":  # the client left part way
                    end = message
                    break
                try:
                    await body.write(message.get("body", b""))
                except OSError as exc:  # the disk is full: the client may send it again once others' are done
                    if (refusal := no_room_for_body(exc)) is None:
                        raise
                    await send_error(send, refusal)
                    return
                if not message.get("more_body", False):
                    break
            left = scope[BODY_BYTES] = body.size or 0  # routes hold room for it in the intake budget
            whole = WholeBody(body.file)
            if isinstance(end, dict) and end["type"] == "http.request":
                if (cut := await _cut_off_form(scope, body)) is not None:
                    end, left = cut, 0  # met at the app's first read: nothing of the form is parsed
                else:
                    scope[BODY_FILE] = whole
            await body.seek(0)

            async def replay() -> dict:
                nonlocal left, end
                if whole.taken:
                    left = 0
                if left:
                    chunk = await body.read(min(left, REPLAY_CHUNK_BYTES))
                    left = left - len(chunk) if chunk else 0
                    return {"type": "http.request", "body": chunk, "more_body": True}
                if end is None:  # the body is done: what comes now is the client's (a disconnect)
                    return await receive()
                last, end = end, None
                if isinstance(last, Exception):
                    raise last
                return last

            await self.app(scope, replay, send)
        finally:
            await body.close()


async def _cut_off_form(scope: dict, body: UploadFile) -> ApiError | None:
    """The 400 for a multipart form whose body lacks its close delimiter (CRLF ``--boundary--``, RFC 2046 5.1.1),
    where python-multipart's parser ends a form (it took a body without one as whole); None for a whole form, or any
    other body. Looked for in the body's tail, where clients put it; past it may come an epilogue, which the parser
    ignores, so where the tail lacks it, anywhere in the body."""
    header = Message()  # the standard library's reading of a MIME header: a quoted boundary unquoted
    header["content-type"] = Headers(scope=scope).get("content-type", "")
    boundary = header.get_param("boundary")
    if header.get_content_type() != "multipart/form-data" or not isinstance(boundary, str) or not boundary:
        return None  # not a form, or Starlette's own 400 (no boundary)
    close = b"\r\n--" + boundary.encode("latin-1") + b"--"
    size = body.size or 0
    start = max(0, size - FORM_TAIL_BYTES)
    await body.seek(start)
    if close in (b"\r\n" if start == 0 else b"") + await body.read():  # a form of no parts is its close alone
        return None
    await body.seek(0)
    seen = b"\r\n"
    while chunk := await body.read(REPLAY_CHUNK_BYTES):
        seen = seen[-len(close):] + chunk
        if close in seen:
            return None
    return ApiError(400, f"the multipart form ends before its closing boundary (--{boundary}--): "
                    "the body was cut off, and the fields past the cut would be lost", code="invalid_body")
