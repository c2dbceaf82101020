"""A body received whole into its temporary file: a route may take that file and read it where it lies, and then
is not sent the body's bytes as well; a body that did not arrive whole is never offered as a file."""

from __future__ import annotations

import asyncio

from service.body_buffer import BodyBufferMiddleware, take_body

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
