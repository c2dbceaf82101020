"""Request heads (the request line and the headers) bounded as they arrive: past ``MAX_HEAD_BYTES`` the answer is
431 and the connection is closed.

uvicorn's httptools parser keeps whatever head a client sends until its blank line, however long (h11's limit is
16 KiB; httptools has none), and only then does the app see the request: a single connection could have the
server hold gigabytes of one header, before any API key is checked. Every HTTP server of the service runs this
protocol (``HTTP_PROTOCOL``: ``batchasr serve`` and its front ends).
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

MAX_HEAD_BYTES = 64 * 1024  # browsers and proxies send a few KiB; nginx's default buffers take 32 KiB


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, answering 431 to a request whose head passes ``MAX_HEAD_BYTES``."""

    max_head_bytes = MAX_HEAD_BYTES
    _head_bytes: int | None = None  # of the request being read, until its headers are complete

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0

    def on_headers_complete(self) -> None:
        self._head_bytes = None
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_bytes is None or self.transport.is_closing():
            return
        # the bytes of a chunk that did not complete the head are all head (or what came before it)
        self._head_bytes += len(data)
        if self._head_bytes > self.max_head_bytes:
            self._head_bytes = None
            self.logger.warning("request head over %d bytes: refused", self.max_head_bytes)
            message = b"request header fields too large"
            self.transport.write(b"".join([
                STATUS_LINE[431], b"content-type: text/plain; charset=utf-8\r\n",
                b"content-length: " + str(len(message)).encode() + b"\r\n", b"connection: close\r\n\r\n", message]))
            self.transport.close()


HTTP_PROTOCOL = BoundedHttpToolsProtocol  # uvicorn's ``http`` option, wherever the service starts a server
