"""Request bodies refused past their route's limit as they arrive, before anything parses or stores them.

Without this a multipart upload is spooled whole (to memory, then a temporary file) before a route sees its
size: one request of many GB fills the disk however small the upload limit. A body that says its length is
refused (413) before a byte of it is read; one that does not (chunked) is refused once it passes the limit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.datastructures import Headers

from .http import ApiError, send_error

FORM_OVERHEAD_BYTES = 1 << 20  # multipart boundaries and the form's other fields, beside the audio


class BodyTooLarge(ApiError):
    """A route's largest body (``limit`` bytes), and the 413 it answers past that."""

    def __init__(self, limit: int, message: str, param: str, code: str):
        super().__init__(413, message, param=param, code=code)
        self.limit = limit


class BodyLimitMiddleware:
    """Plain ASGI: ``limit_for(path, content_type)`` gives a route's largest body in bytes and the error it answers
    past that. Routes that read their body themselves get ``BodyTooLarge`` (an ApiError) from ``receive``;
    where FastAPI parses the body first and words the failure as its own 400, the answer is replaced with the
    413 all the same."""

    def __init__(self, app: Any, limit_for: Callable[[str, str], BodyTooLarge]):
        self.app, self.limit_for = app, limit_for

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        # the first of a repeated header, as the routes read it (Starlette's Headers): the last, here, gave a JSON
        # body followed by a second, multipart Content-Type the upload limit (1 GiB) instead of JSON's (64 MiB)
        headers = Headers(scope=scope)
        refusal = self.limit_for(scope["path"], headers.get("content-type", ""))
        limit = refusal.limit
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await send_error(send, refusal)
            return
        received = 0
        too_large = False

        async def counting_receive() -> dict:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    too_large = True
                    raise refusal
            return message

        answered = False

        async def send_or_refuse(message: dict) -> None:
            nonlocal answered
            if not too_large:
                await send(message)
            elif not answered:  # whatever the app made of the failed read, the client hears why
                answered = True
                await send_error(send, refusal)

        await self.app(scope, counting_receive, send_or_refuse)

