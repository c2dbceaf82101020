"""Every kind of refusal the service answers, driven over real sockets: each in OpenAI's error shape, with a code
a client can match on, an X-Request-ID, and the same compact JSON whoever wrote it (a route, FastAPI's handlers,
the middleware that answers before the app, or the protocol that reads request heads)."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from models import load_model
from service.config import Settings
from service.head_limit import MAX_HEAD_BYTES
from service.http import ERROR_DESCRIPTIONS
from tests.servers import run_server

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
UPLOAD_LIMIT = 200_000
CODE = re.compile(r"[a-z]+(_[a-z]+)*")


@dataclass
class Answer:
    """An HTTP answer as it came off the wire: status, headers (lowercased names) and body."""

    status: int
    headers: dict[str, str]
    body: bytes


@pytest.fixture(scope="module")
def hybrid(parity_dir):
    return load_model(parity_dir / "tdt_ctc_hybrid.nemo", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def server(hybrid):
    with run_server(Settings(api_keys=[KEY], max_upload_bytes=UPLOAD_LIMIT, max_wait_ms=5), hybrid) as running:
        yield running


@pytest.fixture(scope="module")
def spec(server) -> dict:
    return httpx.get(f"{server.url}/openapi.json").json()


@pytest.fixture(scope="module")
def clip(parity_audio) -> bytes:
    return Path(parity_audio[0]).read_bytes()


def check_refusal(answer: Answer | httpx.Response, status: int, code: str) -> dict:
    """The error of a refusal, checked: its status, OpenAI's shape with ``code``, an X-Request-ID, and the bytes
    JSONResponse writes (a middleware's answer once had spaces after its separators)."""
    if isinstance(answer, httpx.Response):
        answer = Answer(answer.status_code, dict(answer.headers), answer.content)
    assert answer.status == status, answer.body
    assert answer.headers["content-type"] == "application/json"
    assert answer.headers.get("x-request-id"), answer.headers
    body = json.loads(answer.body)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert error["code"] == code and CODE.fullmatch(code), error
    assert error["message"] and error["type"] in ("invalid_request_error", "authentication_error", "server_error")
    assert answer.body == json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    return error


def check_documented(spec: dict, method: str, path: str, status: int) -> None:
    """``status`` described in the OpenAPI document, and listed on the route that answered it (if one did: an
    unknown path, or a method the path does not take, has none)."""
    assert status in ERROR_DESCRIPTIONS, status
    for template, operations in spec["paths"].items():
        if re.fullmatch(re.sub(r"\{[^}]+\}", "[^/]+", template), path) and method.lower() in operations:
            assert str(status) in operations[method.lower()]["responses"], (method, path, status)


def _transcription(url: str, form: dict, file: tuple | None = None, **kwargs) -> httpx.Response:
    files = {"file": file} if file else None
    return httpx.post(f"{url}/v1/audio/transcriptions", data=form, files=files, headers=AUTH, timeout=60, **kwargs)


# (what, request(url, clip), status, code, param)
Request = Callable[[str, bytes], httpx.Response]
CASES: list[tuple[str, Request, int, str, str | None]] = [
    ("undecodable audio", lambda url, clip: httpx.post(
        f"{url}/v1/transcribe", content=np.random.default_rng(0).bytes(20_000),
        headers={**AUTH, "content-type": "audio/wav"}), 400, "invalid_audio", "file"),
    ("no file", lambda url, clip: _transcription(url, {"model": "whisper-1"}), 400, "missing_file", "file"),
    ("a field FastAPI validates (never a 422)", lambda url, clip: _transcription(
        url, {"temperature": "warm"}, ("a.wav", clip, "audio/wav")), 400, "invalid_parameter", "temperature"),
    ("unknown response_format", lambda url, clip: _transcription(
        url, {"response_format": "xml"}, ("a.wav", clip, "audio/wav")), 400, "invalid_parameter", "response_format"),
    ("stream with timings", lambda url, clip: _transcription(
        url, {"stream": "true", "response_format": "srt"}, ("a.wav", clip, "audio/wav")), 400, "invalid_parameter",
     "stream"),
    ("unknown granularity", lambda url, clip: _transcription(
        url, {"response_format": "verbose_json", "timestamp_granularities[]": "sentence"},
        ("a.wav", clip, "audio/wav")), 400, "invalid_parameter", "timestamp_granularities[]"),
    ("unknown include", lambda url, clip: _transcription(
        url, {"include[]": "everything"}, ("a.wav", clip, "audio/wav")), 400, "invalid_parameter", "include[]"),
    ("logprobs as text", lambda url, clip: _transcription(
        url, {"include[]": "logprobs", "response_format": "text"}, ("a.wav", clip, "audio/wav")), 400,
     "invalid_parameter", "include[]"),
    ("subtitle layout out of range", lambda url, clip: _transcription(
        url, {"response_format": "srt", "max_line_count": "11"}, ("a.wav", clip, "audio/wav")), 400,
     "invalid_parameter", "max_line_count"),
    ("a hotword's boost out of range", lambda url, clip: httpx.post(
        f"{url}/v1/transcribe", params={"hotwords": "acme:99"}, content=clip,
        headers={**AUTH, "content-type": "audio/wav"}), 400, "invalid_parameter", "hotwords"),
    ("a text field sent as a file", lambda url, clip: httpx.post(
        f"{url}/v1/transcribe", files=[("file", ("a.wav", clip, "audio/wav")), ("multichannel", ("f.txt", b"true"))],
        headers=AUTH), 400, "invalid_parameter", "multichannel"),
    ("unsupported language", lambda url, clip: _transcription(
        url, {"language": "xx"}, ("a.wav", clip, "audio/wav")), 400, "unsupported_language", "language"),
    ("a form FastAPI cannot parse", lambda url, clip: httpx.post(
        f"{url}/v1/audio/transcriptions", content=b"--x\r\nnot a form", headers={
            **AUTH, "content-type": "multipart/form-data"}), 400, "invalid_body", None),
    ("a form the native route cannot parse", lambda url, clip: httpx.post(
        f"{url}/v1/transcribe", content=b"--x\r\nnot a form", headers={
            **AUTH, "content-type": "multipart/form-data"}), 400, "invalid_body", None),
    ("two files in one request", lambda url, clip: httpx.post(
        f"{url}/v1/audio/transcriptions", files=[("file", ("a.wav", clip, "audio/wav")),
                                                 ("file", ("b.wav", clip, "audio/wav"))], headers=AUTH), 400,
     "invalid_parameter", "file"),
    ("two files to the native route", lambda url, clip: httpx.post(
        f"{url}/v1/transcribe", files=[("file", ("a.wav", clip, "audio/wav")), ("file", ("b.wav", clip, "audio/wav"))],
        headers=AUTH), 400, "invalid_parameter", "file"),
    ("a field sent twice", lambda url, clip: _transcription(
        url, {"language": ["fr", "en"]}, ("a.wav", clip, "audio/wav")), 400, "invalid_parameter", "language"),
    ("a native option sent twice", lambda url, clip: httpx.post(
        f"{url}/v1/transcribe", files={"file": ("a.wav", clip, "audio/wav")}, data={"multichannel": ["true", "false"]},
        headers=AUTH), 400, "invalid_parameter", "multichannel"),
    ("no API key", lambda url, clip: httpx.get(f"{url}/v1/models"), 401, "invalid_api_key", None),
    ("a wrong API key", lambda url, clip: httpx.post(
        f"{url}/v1/transcribe", content=clip, headers={"Authorization": "Bearer nope", "content-type": "audio/wav"}),
     401, "invalid_api_key", None),
    ("no such route", lambda url, clip: httpx.get(f"{url}/v1/nope", headers=AUTH), 404, "route_not_found", None),
    ("no such route outside /v1", lambda url, clip: httpx.get(f"{url}/nope"), 404, "route_not_found", None),
    ("no such model", lambda url, clip: httpx.get(f"{url}/v1/models/gpt-9", headers=AUTH), 404, "model_not_found",
     "model"),
    ("a method the path does not take", lambda url, clip: httpx.put(f"{url}/v1/jobs", headers=AUTH), 405,
     "method_not_allowed", None),
    ("a declared body past the limit", lambda url, clip: httpx.post(
        f"{url}/v1/transcribe", content=bytes(UPLOAD_LIMIT + (2 << 20)), headers={**AUTH, "content-type": "audio/wav"}),
     413, "audio_too_large", "file"),
    ("audio past the upload limit", lambda url, clip: httpx.post(
        f"{url}/v1/transcribe", content=bytes(UPLOAD_LIMIT + 1), headers={**AUTH, "content-type": "audio/wav"}),
     413, "audio_too_large", "file"),
    ("not audio", lambda url, clip: _transcription(url, {}, ("notes.txt", b"plain text\n" * 50, "text/plain")), 415,
     "unsupported_media_type", "file"),
    ("jobs without Redis", lambda url, clip: httpx.post(
        f"{url}/v1/jobs", json={"items": [{"path": "/a.wav"}]}, headers=AUTH), 503, "jobs_disabled", None),
]


@pytest.mark.parametrize(("request_", "status", "code", "param"), [case[1:] for case in CASES],
                         ids=[case[0] for case in CASES])
def test_each_refusal_has_the_error_shape_a_code_and_a_request_id(server, spec, clip, request_, status, code, param):
    answer = request_(server.url, clip)
    error = check_refusal(answer, status, code)
    assert error["param"] == param
    check_documented(spec, answer.request.method, answer.request.url.path, status)


def test_the_401_names_its_scheme_and_the_405_its_methods(server):
    refused = httpx.get(f"{server.url}/v1/models")
    assert check_refusal(refused, 401, "invalid_api_key")["type"] == "authentication_error"
    assert refused.headers["www-authenticate"] == "Bearer"
    not_allowed = httpx.put(f"{server.url}/v1/jobs", headers=AUTH)
    assert not_allowed.headers["allow"] == "GET, POST"


def test_a_failure_of_the_server_is_a_500_with_its_code_and_request_id(server, spec, hybrid, clip):
    """The 500 Starlette's outermost middleware wrote went past the one that adds X-Request-ID."""
    decode = hybrid.decode

    def failing(*args, **kwargs):
        raise RuntimeError("CUDA error: out of memory")

    hybrid.decode = failing
    try:
        answer = httpx.post(f"{server.url}/v1/transcribe", content=clip, headers={**AUTH, "content-type": "audio/wav"},
                            timeout=60)
    finally:
        hybrid.decode = decode
    error = check_refusal(answer, 500, "internal_error")
    check_documented(spec, "POST", "/v1/transcribe", 500)
    assert error == {"message": "internal error: RuntimeError", "type": "server_error", "param": None,
                     "code": "internal_error"}
    assert httpx.get(f"{server.url}/healthz").status_code == 200


# --- refusals written before the app sees the request: raw sockets ------------------------------------------


def _exchange(url: str, data: bytes, timeout_s: float = 30) -> Answer:
    """``data`` sent on a fresh connection, then everything the server writes until it closes the connection."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as conn:
        with contextlib.suppress(OSError):  # refused part way: the answer is waiting
            conn.sendall(data)
        received = b""
        while chunk := conn.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, value in (line.split(":", 1) for line in lines)}
    return Answer(int(status_line.split()[1]), headers, body)


def check_head_refusal_observed(server, caplog, answer: Answer, counted_before: float) -> None:
    """A refusal written before the app saw the request, counted and logged as the app's answers are: under route
    "unmatched" (they were neither counted nor logged as requests, only warned of)."""
    labels = f'{{code="{answer.status}",route="unmatched"}}'
    assert server.metric("batchasr_requests_total", labels) == counted_before + 1
    lines = [fields for record in caplog.records if (fields := getattr(record, "fields", {})).get("request_id")
             == answer.headers["x-request-id"]]
    assert len(lines) == 1 and lines[0]["event"] == "request" and lines[0]["status"] == answer.status, lines
    assert lines[0]["code"] == json.loads(answer.body)["error"]["code"] and lines[0]["duration_ms"] >= 0


def test_a_request_head_past_the_limit_is_431_in_the_error_shape(server, spec, caplog):
    counted = server.metric("batchasr_requests_total", '{code="431",route="unmatched"}')
    padding = b"a" * (MAX_HEAD_BYTES + 1000)
    with caplog.at_level(logging.INFO, logger="batchasr.api"):
        answer = _exchange(server.url, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Padding: " + padding +
                           b"\r\n\r\n")
    error = check_refusal(answer, 431, "request_head_too_large")
    check_head_refusal_observed(server, caplog, answer, counted)
    check_documented(spec, "GET", "/v1/models", 431)
    assert str(MAX_HEAD_BYTES) in error["message"] and answer.headers["connection"] == "close"
    assert int(answer.headers["content-length"]) == len(answer.body)


def test_a_head_or_a_body_that_stops_arriving_is_408_in_the_error_shape(server, spec, monkeypatch, caplog):
    from service import body_buffer
    from service.head_limit import BoundedHttpToolsProtocol

    monkeypatch.setattr(BoundedHttpToolsProtocol, "head_timeout_s", 1.0)  # 60 s in service
    monkeypatch.setattr(body_buffer, "BODY_IDLE_TIMEOUT_S", 1.0)
    counted = server.metric("batchasr_requests_total", '{code="408",route="unmatched"}')
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="batchasr.api"):
        head = _exchange(server.url, b"POST /v1/transcribe HTTP/1.1\r\nHost: x\r\n")
    assert time.monotonic() - started < 20
    error = check_refusal(head, 408, "request_timeout")
    check_head_refusal_observed(server, caplog, head, counted)
    assert "head" in error["message"] and head.headers["connection"] == "close"
    body = _exchange(server.url, b"POST /v1/transcribe HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                     + b"\r\nContent-Type: audio/wav\r\nContent-Length: 100000\r\n\r\n" + bytes(1000))
    error = check_refusal(body, 408, "request_timeout")
    assert "body" in error["message"] and body.headers["connection"] == "close"
    check_documented(spec, "POST", "/v1/transcribe", 408)
    assert httpx.get(f"{server.url}/healthz").status_code == 200


def test_a_body_the_disk_has_no_room_for_is_a_503_to_send_again(server, spec, clip, small_disk, caplog):
    """A full disk ended a request in a 500 (OSError), as if the server were broken, where room comes back once
    other requests' bodies are done."""
    body = clip * (1_150_000 // len(clip) + 1)  # past the first MiB, which waits in memory, but within the limit
    ballast = small_disk / "ballast"
    ballast.write_bytes(bytes(1 << 20))  # half a MiB left: too little for the body
    with caplog.at_level(logging.WARNING, logger="batchasr.api"):
        raw = httpx.post(f"{server.url}/v1/transcribe", content=body, headers={**AUTH, "content-type": "audio/wav"})
    assert check_refusal(raw, 503, "no_space")["type"] == "server_error"
    assert raw.headers["retry-after"] == "10" and raw.headers["connection"] == "close"
    assert "no room for a request body" in caplog.text
    ballast.unlink()  # room for the body, not for the form's file as well
    forms = [_transcription(server.url, {}, ("a.wav", body, "audio/wav")),  # parsed by FastAPI
             httpx.post(f"{server.url}/v1/transcribe", files={"file": ("a.wav", body, "audio/wav")}, headers=AUTH)]
    for form in forms:
        check_refusal(form, 503, "no_space")
        check_documented(spec, "POST", form.request.url.path, 503)
    assert list(small_disk.iterdir()) == []  # nothing left behind
    assert httpx.post(f"{server.url}/v1/transcribe", content=clip, headers={**AUTH, "content-type": "audio/wav"}
                      ).status_code == 200


def _part(boundary: str, name: str, value: bytes, filename: str | None = None) -> bytes:
    """One part of a multipart form, with the delimiter before it and the CRLF after it."""
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    return f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + value + b"\r\n"


def _form_request(path: str, boundary: str, body: bytes, chunked: bool) -> bytes:
    """A POST of the form ``body`` as it is, its length declared or (``chunked``) in chunks with a proper last one,
    on a connection the server closes once it has answered."""
    if chunked:
        length = b"Transfer-Encoding: chunked\r\n"
        body = b"".join(f"{len(body[i:i + 65536]):x}\r\n".encode() + body[i:i + 65536] + b"\r\n"
                        for i in range(0, len(body), 65536)) + b"0\r\n\r\n"
    else:
        length = f"Content-Length: {len(body)}\r\n".encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nConnection: close\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\n").encode() + length + b"\r\n" + body


def test_a_form_cut_off_before_its_closing_boundary_is_400_invalid_body(server, spec, clip):
    """Starlette's parser does not check that a form's closing boundary came: a body that ended after a part (its
    last chunk proper) was a whole form without the fields past the cut. The native route answered 200 with
    `multichannel` lost, the OpenAI route 200 without the `language` asked for, and a file cut short was 400
    `missing_file`."""
    b = "cut-boundary"
    file = _part(b, "file", clip, "a.wav")
    cut_field = f'--{b}\r\nContent-Disposition: form-data; name="multichannel"\r\n\r\ntrue'.encode()
    cuts = [("/v1/transcribe", file + cut_field, True),
            ("/v1/audio/transcriptions", file + _part(b, "response_format", b"text") + cut_field.replace(
                b"multichannel", b"language").replace(b"true", b"fr"), False),
            ("/v1/audio/transcriptions", file[: len(file) // 2], True),
            ("/v1/transcribe", file + _part(b, "multichannel", b"true"), False),  # every part whole, no close
            ("/v1/transcribe", file + f"--{b}-".encode(), True)]
    for path, body, chunked in cuts:
        answer = _exchange(server.url, _form_request(path, b, body, chunked))
        error = check_refusal(answer, 400, "invalid_body")
        assert "closing boundary" in error["message"] and error["param"] is None, error
        check_documented(spec, "POST", path, 400)
    # whole forms as clients end them (the close and CRLF: curl, httpx, requests), or without the CRLF, or with an
    # epilogue (RFC 2046: ignored), one past the tail where the close is looked for first
    expected = _transcription(server.url, {"response_format": "text"}, ("a.wav", clip, "audio/wav"))
    assert expected.status_code == 200, expected.text
    for close in (f"--{b}--\r\n", f"--{b}--", f"--{b}--  \r\nan epilogue\r\n", f"--{b}--\r\n" + "x" * 100_000):
        body = file + _part(b, "response_format", b"text") + close.encode()
        for chunked in (False, True):
            answer = _exchange(server.url, _form_request("/v1/audio/transcriptions", b, body, chunked))
            assert (answer.status, answer.body) == (200, expected.content), (close[:20], answer.body)
    empty = _exchange(server.url, _form_request("/v1/audio/transcriptions", b, f"--{b}--\r\n".encode(), False))
    check_refusal(empty, 400, "missing_file")  # a form of no parts: whole, and without a file


@pytest.mark.parametrize("request_", [
    b"GARBAGE\r\n\r\n",
    b"POST /v1/transcribe HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"POST /v1/transcribe HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST /v1/transcribe HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nnot a chunk\r\n",
], ids=["not a request line", "a length not a number", "a length and chunks", "a chunk not a chunk"])
def test_a_request_that_is_not_http_is_400_in_the_error_shape(server, spec, caplog, request_):
    """uvicorn answered what httptools cannot parse with its own plain-text 400 "Invalid HTTP request received."."""
    counted = server.metric("batchasr_requests_total", '{code="400",route="unmatched"}')
    with caplog.at_level(logging.INFO, logger="batchasr.api"):
        answer = _exchange(server.url, request_)
    check_refusal(answer, 400, "invalid_http_request")
    check_head_refusal_observed(server, caplog, answer, counted)
    assert answer.headers["connection"] == "close" and int(answer.headers["content-length"]) == len(answer.body)
    check_documented(spec, "GET", "/healthz", 400)  # before routing: any route's
    assert httpx.get(f"{server.url}/healthz").status_code == 200
