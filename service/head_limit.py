"""Request heads (the request line and the headers) bounded as they arrive: past ``MAX_HEAD_BYTES`` the answer is
431, and a head not complete ``HEAD_TIMEOUT_S`` after the connection opened (or after its first byte came) ends the
connection (408 if part of it came). Both answer in the API's error shape (service.http), with an ``x-request-id``
that the log line names, and close the connection; so does a request httptools cannot parse (400).

uvicorn's httptools parser keeps whatever head a client sends until its blank line, however long (h11's limit is
16 KiB; httptools has none), and only then does the app see the request: a single connection could have the
server hold gigabytes of one header, before any API key is checked. Nor does uvicorn time out a connection that
has sent nothing, or half a head: each such connection was kept for good, so a client could hold open every file
descriptor the process may have. Every HTTP server of the service runs this protocol (``HTTP_PROTOCOL``:
``batchasr serve`` and its front ends).

The app never sees these requests (one whose chunked body the parser fails in is, to the app, a client that left).
To count and log them as it does the others, it puts a ``HeadRefused`` in its lifespan state (ASGI's, which uvicorn
hands its protocols) under ``HEAD_REFUSED`` (service.request_log).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from .http import ApiError, error_json

MAX_HEAD_BYTES = 64 * 1024  # browsers and proxies send a few KiB; nginx's default buffers take 32 KiB
HEAD_TIMEOUT_S = 60.0  # nginx's client_header_timeout
HEAD_REFUSED = "batchasr.head_refused"  # the lifespan state's key for a ``HeadRefused``
HeadRefused = Callable[[ApiError, str, float], None]  # (the refusal, its request id, seconds since the head began)


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, answering 431 to a request whose head passes ``MAX_HEAD_BYTES``, ending a
    connection whose head does not come whole within ``HEAD_TIMEOUT_S``, and answering its parser's 400 in the API's
    error shape."""

    max_head_bytes = MAX_HEAD_BYTES
    head_timeout_s = HEAD_TIMEOUT_S
    _head_bytes: int | None = None  # of the head being read (None: its headers are complete, a body may come)
    _head_timer: asyncio.TimerHandle | None = None
    _head_started = 0.0  # the loop's time at the head's first byte

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_bytes = 0
        self._start_head_timer()  # a connection that never sends a byte is ended too

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._start_head_timer()

    def on_headers_complete(self) -> None:
        self._head_bytes = None
        self._stop_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._head_bytes = 0  # what comes next on the connection is the next request's head

    def data_received(self, data: bytes) -> None:
        # counted before the parser sees them: a head may come whole in one read (a client's writes coalesce), and
        # once parsed it would have been held and passed on, however long
        if self._head_bytes is not None and not self.transport.is_closing():
            if not self._head_bytes:  # a head's first byte: timed from here, whether or not it begins a request
                self._begin_head()
            end = data.find(b"\r\n\r\n")  # a read may hold the head's end and the body's start
            self._head_bytes += len(data) if end < 0 else end + 4
            if self._head_bytes > self.max_head_bytes:
                self._refuse(ApiError(431, f"the request head (request line and headers) exceeds "
                                           f"{self.max_head_bytes} bytes", code="request_head_too_large"))
                return
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        # uvicorn's answer to what its parser cannot read (a request line, a header, a chunk; Content-Length with
        # Transfer-Encoding): plain text, where every other refusal is in the API's error shape
        self._refuse(ApiError(400, "the request is not valid HTTP/1.1: its request line, headers or chunked body "
                                   "could not be parsed", code="invalid_http_request"))

    def _begin_head(self) -> None:
        # uvicorn's keep-alive timer is cancelled by any byte that comes, and the parser skips the CRLFs between
        # requests without beginning a message: without this, a connection that sent "\r\n" after a request was
        # timed by nothing. Not started at on_message_complete, where it would run while the app answers.
        self._head_started = self.loop.time()
        self._start_head_timer()

    def _start_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self._head_bytes:  # part of a head came: say why it ends
            self._refuse(ApiError(408, f"the request head did not arrive within {self.head_timeout_s:g} s",
                                  code="request_timeout"))
        else:
            self.transport.close()

    def _refuse(self, error: ApiError) -> None:
        """``error`` written as the whole answer (the app never saw the request), then the connection closed."""
        self._head_bytes = None
        self._stop_head_timer()
        request_id = uuid.uuid4().hex  # no head was read whole: a client's own id cannot be trusted to be in it
        observe: HeadRefused | None = self.app_state.get(HEAD_REFUSED)
        if observe is not None:
            observe(error, request_id, self.loop.time() - self._head_started)
        else:  # an app without the service's lifespan
            self.logger.warning("request refused before its head was whole: %d %s (request id %s)", error.status,
                                error.code, request_id)
        body = error_json(error)
        self.transport.write(b"".join([
            STATUS_LINE[error.status], b"content-type: application/json\r\n",
            b"content-length: " + str(len(body)).encode() + b"\r\n", b"connection: close\r\n",
            b"x-request-id: " + request_id.encode() + b"\r\n\r\n", body]))
        self.transport.close()


HTTP_PROTOCOL = BoundedHttpToolsProtocol  # uvicorn's ``http`` option, wherever the service starts a server
