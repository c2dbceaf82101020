"""A body received whole into its temporary file: a route may take that file and read it where it lies, and then
is not sent the body's bytes as well; a body that did not arrive whole is never offered as a file."""

from __future__ import annotations

import asyncio

import pytest

from service.body_buffer import FORM_TAIL_BYTES, REPLAY_CHUNK_BYTES, BodyBufferMiddleware, take_body
from service.http import ApiError

CHUNK = b"x" * (256 << 10)


def _client(chunks: list[bytes], then: str):
    """ASGI receive for a client that sends ``chunks`` and then ends its body (``then="end"``) or leaves
    (``"leave"``); after that only the disconnect comes."""
    messages = [{"type": "http.request", "body": c, "more_body": True} for c in chunks]
    messages.append({"type": "http.request", "body": b"", "more_body": False} if then == "end"
                    else {"type": "http.disconnect"})

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    return receive


def _run(chunks: list[bytes], then: str) -> dict:
    """What a route saw: the file it could take (its bytes), and the messages it then received."""
    seen: dict = {}

    async def route(scope: dict, receive, send) -> None:
        taken = take_body(scope)
        seen["taken"] = None if taken is None else taken.read()
        seen["again"] = take_body(scope)
        seen["received"] = [await receive() for _ in range(2)] if taken is not None else []
        if taken is None:
            while (message := await receive())["type"] == "http.request" and message.get("more_body"):
                seen["received"].append(message)
            seen["received"].append(message)

    async def send(message: dict) -> None:
        pass

    receive = _client(chunks, then)
    scope = {"type": "http", "method": "POST", "path": "/v1/transcribe", "headers": []}
    asyncio.run(BodyBufferMiddleware(route)(scope, receive, send))
    return seen


def test_a_whole_body_is_taken_as_its_file_and_its_bytes_are_not_sent_again():
    chunks = [CHUNK] * 12  # 3 MiB: on disk past the spool's first MiB
    seen = _run(chunks, "end")
    assert seen["taken"] == b"".join(chunks)
    assert seen["again"] is None  # taken once
    # the route listens for the client's leaving next: it hears the end, then the disconnect, not 3 MiB more
    assert [m["type"] for m in seen["received"]] == ["http.request", "http.disconnect"]
    assert seen["received"][0]["body"] == b"" and not seen["received"][0]["more_body"]


def test_a_body_whose_client_left_part_way_is_not_offered_as_a_file():
    seen = _run([CHUNK] * 3, "leave")
    assert seen["taken"] is None
    received = seen["received"]
    assert b"".join(m.get("body", b"") for m in received[:-1]) == CHUNK * 3
    assert received[-1]["type"] == "http.disconnect"  # the route meets the leaving where it came


def _form_seen(body: bytes) -> bytes | ApiError:
    """What a route reading a multipart ``body`` (sent in 64 KiB pieces) met: its bytes, or the refusal."""
    seen: list[bytes | ApiError] = []

    async def route(scope: dict, receive, send) -> None:
        received = b""
        try:
            while (message := await receive())["type"] == "http.request":
                received += message.get("body", b"")
                if not message.get("more_body"):
                    break
        except ApiError as exc:
            seen.append(exc)
            return
        seen.append(received)

    async def send(message: dict) -> None:
        pass

    scope = {"type": "http", "method": "POST", "path": "/v1/transcribe",
             "headers": [(b"content-type", b'multipart/form-data; boundary="b b"')]}
    receive = _client([body[i:i + 65536] for i in range(0, len(body), 65536)], "end")
    asyncio.run(BodyBufferMiddleware(route)(scope, receive, send))
    return seen[0]


@pytest.mark.parametrize("epilogue", [b"\r\n", b"", b"\r\n" + b"x" * FORM_TAIL_BYTES, b"\r\n" + b"x" * (2 << 20)],
                         ids=["crlf", "none", "past the tail", "past the tail, several reads"])
def test_a_form_is_whole_with_its_closing_boundary_whatever_epilogue_follows(epilogue):
    """RFC 2046 5.1.1: past the close delimiter an epilogue, which the parser ignores. Its file part sized so that
    the close lies across two of the reads that look for it past the tail."""
    head = b'--b b\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\n'
    form = head + b"x" * (2 * REPLAY_CHUNK_BYTES - len(head) - 4) + b"\r\n--b b--"
    assert _form_seen(form + epilogue) == form + epilogue


def test_a_form_without_its_closing_boundary_is_refused_at_the_first_read():
    """Starlette's parser takes a form cut off after a part as whole, without the fields past the cut."""
    part = b'--b b\r\nContent-Disposition: form-data; name="language"\r\n\r\nfr\r\n'
    for cut in (part, part[:-2], part + b"--b b-", part + b"--b b--"[:-1], CHUNK * 8 + b"--b b--"):
        refusal = _form_seen(cut)
        assert isinstance(refusal, ApiError) and (refusal.status, refusal.code) == (400, "invalid_body"), cut[-20:]
