"""The HTTP API over real sockets: formats, batching, limits, auth, bad input, disconnects, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
import torch

from models import load_model
from service import request_log
from service.config import Settings
from service.http import ERROR_DESCRIPTIONS, EVERY_ROUTE_ERRORS, owner_of, upload_too_large_message
from service.logs import JsonFormatter
from tests.conftest import REPO, load_script, long_recording
from tests.servers import StreamedUpload, run_server, send_head, serve_process, stream_transcription


@pytest.fixture(scope="module")
def hybrid(parity_dir):
    return load_model(parity_dir / "tdt_ctc_hybrid.nemo", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def server(hybrid):
    with run_server(Settings(max_wait_ms=20, max_batch_size=16), hybrid) as running:
        yield running


def _post(url: str, audio: bytes, name: str = "a.wav", content_type: str = "audio/wav", headers=None, **form):
    return httpx.post(f"{url}/v1/audio/transcriptions", files={"file": (name, audio, content_type)}, data=form,
                      headers=headers, timeout=60)


def _wav_bytes(samples: np.ndarray, rate: int = 16000, subtype: str = "PCM_16") -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, samples, rate, format="WAV", subtype=subtype)
    return buffer.getvalue()


def _stamp_s(stamp: str) -> float:
    h, m, s, ms = re.match(r"(\d+):(\d+):(\d+)[,.](\d+)", stamp).groups()
    return int(h) * 3600 + int(m) * 60 + int(s) + int(ms) / 1000


# --- formats -----------------------------------------------------------------------------------------------


def test_each_response_format(server, hybrid, parity_audio):
    audio_path = parity_audio[5]
    expected = hybrid.transcribe([audio_path])[0]
    data = Path(audio_path).read_bytes()
    assert _post(server.url, data, response_format="json").json()["text"] == expected.text
    assert _post(server.url, data, response_format="text").text == expected.text + "\n"
    srt = _post(server.url, data, response_format="srt")
    assert srt.headers["content-type"].startswith("application/x-subrip")
    blocks = [b.splitlines() for b in srt.text.strip().split("\n\n")]
    assert [b[0] for b in blocks] == [str(i + 1) for i in range(len(blocks))]
    assert " ".join(line for b in blocks for line in b[2:]) == expected.text
    assert all(len(b[2:]) <= 2 and all(len(line) <= 42 for line in b[2:]) for b in blocks)  # two lines of 42
    for block in blocks:
        start, end = (_stamp_s(x) for x in block[1].split(" --> "))
        assert 0 <= start <= end <= expected.duration_s + 1e-3
    vtt = _post(server.url, data, response_format="vtt")
    assert vtt.headers["content-type"].startswith("text/vtt") and vtt.text.startswith("WEBVTT\n\n")
    cues = [c.splitlines() for c in vtt.text.split("\n\n")[1:] if c.strip()]
    assert " ".join(line for c in cues for line in c[1:]) == expected.text
    narrow = _post(server.url, data, response_format="srt", max_line_width="16", max_line_count="1")
    lines = [b.splitlines()[2:] for b in narrow.text.strip().split("\n\n")]
    assert len(lines) > len(blocks) and all(len(cue) == 1 for cue in lines)
    assert all(len(cue[0]) <= 16 or " " not in cue[0] for cue in lines)  # a longer word has its line to itself
    assert " ".join(cue[0] for cue in lines) == expected.text
    for field, value in (("max_line_width", "0"), ("max_line_count", "11"), ("max_line_count", "two")):
        refused = _post(server.url, data, response_format="srt", **{field: value})
        assert refused.status_code in (400, 422) and field in refused.text, (field, value, refused.text)


@pytest.mark.parametrize("field", ["timestamp_granularities[]", "timestamp_granularities"])
def test_verbose_json_with_words_and_segments(server, hybrid, parity_audio, field):
    data = Path(parity_audio[1]).read_bytes()
    files = {"file": ("a.wav", data, "audio/wav")}
    form = {"response_format": "verbose_json", field: ["word", "segment"]}
    body = httpx.post(f"{server.url}/v1/audio/transcriptions", files=files, data=form, timeout=60).json()
    expected = hybrid.transcribe([parity_audio[1]])[0]
    assert body["text"] == expected.text and body["duration"] == pytest.approx(expected.duration_s, abs=1e-3)
    words = body["words"]
    assert " ".join(w["word"] for w in words) == expected.text
    previous = 0.0
    for w in words:
        assert previous <= w["start"] <= w["end"] <= body["duration"]
        previous = w["end"]
    assert " ".join(s["text"] for s in body["segments"]) == expected.text
    assert sum(len(s["tokens"]) for s in body["segments"]) == len(expected.tokens)


def test_each_segments_tokens_spell_its_text():
    """Tokens went to segments by time: a word's last token on the frame where the next segment starts (TDT and
    RNN-T often put one there) went to that segment, whose tokens then began "ity situation"."""
    from decoding.types import Hypothesis
    from models.transcript import build_transcript
    from service.response_bodies import transcript_segments

    model = load_model("models/assets/default.nemo", device="cpu", dtype="float32")
    tokenizer, frame_s = model.tokenizer, model.config.frame_s
    ids, frames = [], []
    for k, word in enumerate("abcdefghi"):
        ids += tokenizer.encode(word)
        frames += [k * 8] * len(tokenizer.encode(word))
    city, situation = tokenizer.encode("city"), tokenizer.encode("situation")
    assert len(city) == 2
    ids += city + situation
    frames += [73, 74] + [74] + [76] * (len(situation) - 1)
    transcript = build_transcript(Hypothesis(tokens=ids, frames=frames), tokenizer, frame_s, 10.0)
    segments = transcript_segments(transcript, tokenizer)
    assert len(segments) == 2 and segments[1].start == round(74 * frame_s, 3)
    assert [tokenizer.ids_to_text(s.tokens).strip() for s in segments] == [s.text for s in segments]


def test_verbose_json_defaults_to_segments_only(server, parity_audio):
    body = _post(server.url, Path(parity_audio[2]).read_bytes(), response_format="verbose_json").json()
    assert "segments" in body and "words" not in body


def test_verbose_json_with_words_alone_has_no_segments(server, parity_audio):
    """As OpenAI's: ``timestamp_granularities[]=word`` alone gives words and leaves the segments out."""
    body = _post(server.url, Path(parity_audio[2]).read_bytes(), response_format="verbose_json",
                 **{"timestamp_granularities[]": "word"}).json()
    assert body["words"] and "segments" not in body
    assert " ".join(w["word"] for w in body["words"]) == body["text"]


def _flac(wave: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, wave, 16000, format="FLAC")
    return buffer.getvalue()


@pytest.mark.parametrize("response_format", ["json", "text"])
def test_stream_sends_the_text_then_done(server, hybrid, parity_audio, response_format):
    expected = hybrid.transcribe([parity_audio[3]])[0].text
    wave, _ = sf.read(parity_audio[3], dtype="float32")
    events = stream_transcription(server.url, _flac(wave), response_format=response_format)
    assert events == [{"type": "transcript.text.delta", "delta": expected},
                      {"type": "transcript.text.done", "text": expected}]


def test_stream_refuses_formats_with_timings(server, parity_audio):
    for response_format in ("srt", "vtt", "verbose_json"):
        response = _post(server.url, Path(parity_audio[0]).read_bytes(), stream="true", response_format=response_format)
        assert response.status_code == 400 and response.json()["error"]["param"] == "stream"
    refused = _post(server.url, b"not audio at all", stream="true")  # failures before the first event: as usual
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_audio"


def test_long_audio_streams_its_text_piece_by_piece(hybrid, parity_audio):
    recording, _ = long_recording(parity_audio, 40)
    with run_server(Settings(max_segment_s=5, max_batch_size=4, max_wait_ms=5), hybrid) as running:
        events = stream_transcription(running.url, _flac(recording))
        whole = _post(running.url, _flac(recording), name="a.flac", content_type="audio/flac").json()["text"]
    *deltas, done = events
    assert len(deltas) > 4 and {e["type"] for e in deltas} == {"transcript.text.delta"}
    assert done == {"type": "transcript.text.done", "text": whole}
    assert "".join(e["delta"] for e in deltas) == whole


def test_a_batch_that_fails_mid_stream_ends_it_with_an_error_event(parity_dir, parity_audio, caplog):
    """The headers are sent with the first delta: a later failure must still be told, not cut the stream short;
    and counted and logged as the failure it is (it was a 200 with no error in both, unseen by the 5xx alert)."""
    model = load_model(parity_dir / "tdt.nemo", device="cpu", dtype="float32")
    recording, _ = long_recording(parity_audio, 40)
    route = '{code="%d",route="/v1/audio/transcriptions"}'
    with run_server(Settings(max_segment_s=5, max_batch_size=1, max_wait_ms=0), model) as running, \
            caplog.at_level(logging.INFO, logger="batchasr.api"):
        decode, batches = model.decode, []

        def failing_after_the_first(*args, **kwargs):
            batches.append(1)
            if len(batches) > 1:
                raise RuntimeError("CUDA error: out of memory")
            return decode(*args, **kwargs)

        model.decode = failing_after_the_first
        events = stream_transcription(running.url, _flac(recording))
        model.decode = decode
        assert httpx.get(f"{running.url}/healthz").status_code == 200
        deadline = time.monotonic() + 10  # counted as the response ends, which the client may see first
        while not running.metric("batchasr_requests_total", route % 500) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (running.metric("batchasr_requests_total", route % 500),
                running.metric("batchasr_requests_total", route % 200)) == (1, 0)
    lines = [json.loads(JsonFormatter().format(r)) for r in caplog.records if r.getMessage() == "request"]
    [line] = [line for line in lines if line["path"] == "/v1/audio/transcriptions"]
    assert (line["status"], line["code"], line["streamed"]) == (500, "internal_error", True)
    assert events[0]["type"] == "transcript.text.delta"
    assert events[-1] == {"type": "error", "error": {"message": "internal error: RuntimeError", "type": "server_error",
                                                     "param": None, "code": "internal_error"}}


def test_an_engine_thread_that_dies_answers_what_waits_and_is_not_ready(parity_dir, parity_audio):
    """Nothing in the engine's loop is expected to raise; had it, the thread died, /readyz still said ready, and
    every request waited out its timeout."""
    model = load_model(parity_dir / "tdt.nemo", device="cpu", dtype="float32")
    data = Path(parity_audio[0]).read_bytes()
    with run_server(Settings(request_timeout_s=60, max_wait_ms=200), model) as running:
        engine = running.service.stack.engine

        def broken(staged):
            raise RuntimeError("a fault in the loop")

        engine.process = broken
        started = time.monotonic()
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda _: _post(running.url, data), range(3)))
        assert time.monotonic() - started < 20  # answered, not timed out
        assert {a.status_code for a in answers} <= {500, 503} and 500 in {a.status_code for a in answers}
        ready = httpx.get(f"{running.url}/readyz")
        assert ready.status_code == 503 and "the engine stopped: a fault in the loop" in ready.text
        health = httpx.get(f"{running.url}/healthz")  # only a new process can serve: a liveness probe restarts it
        assert health.status_code == 503 and health.json()["status"] == "failed"


@pytest.mark.parametrize("route", ["/v1/audio/transcriptions", "/v1/transcribe", "stream"])
def test_a_request_that_finds_the_queue_closed_is_told_to_come_back(parity_dir, parity_audio, route):
    """The engine still ready as the request was decoded, its queue closed by the time the request's pieces came
    (the engine failing, or a shutdown draining it): that was a 500 internal error from one process, while a front
    end said 503 for the same."""
    model = load_model(parity_dir / "tdt.nemo", device="cpu", dtype="float32")
    data = Path(parity_audio[0]).read_bytes()
    with run_server(Settings(), model) as running:
        running.service.stack.batcher.close()
        if route == "stream":
            answer = httpx.post(f"{running.url}/v1/audio/transcriptions", files={"file": ("a.wav", data, "audio/wav")},
                                data={"stream": "true"}, timeout=60)
        else:
            answer = httpx.post(f"{running.url}{route}", files={"file": ("a.wav", data, "audio/wav")}, timeout=60)
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "engine_unavailable" and answer.headers["Retry-After"]


@pytest.mark.parametrize(("error", "broken"), [
    (torch.AcceleratorError("CUDA error: an illegal memory access was encountered"), True),
    (RuntimeError("CUDA error: device-side assert triggered"), True),
    (RuntimeError("CUDA error: unspecified launch failure"), True),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
    (RuntimeError("CUDA error: out of memory"), False),
    (RuntimeError("CUDA error: invalid argument"), False),  # one call's mistake: failing the engine on it would
    (ValueError("an unknown error in the input"), False),   # let one bad request take the service down
])
def test_only_cuda_errors_that_break_the_context_fail_the_engine(error, broken):
    from service.engine import device_broken

    assert device_broken(error) is broken


def test_a_broken_gpu_fails_the_engine_but_running_out_of_memory_fails_one_batch(parity_dir, parity_audio):
    """A CUDA error such as an illegal address breaks the context: every later batch would fail with it while
    /readyz said ready. Out of memory passes: the next batch may fit."""
    model = load_model(parity_dir / "tdt.nemo", device="cpu", dtype="float32")
    data = Path(parity_audio[0]).read_bytes()
    with run_server(Settings(max_wait_ms=5), model) as running:
        engine = running.service.stack.engine
        compute = engine._compute
        failures = iter([torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                         torch.AcceleratorError("CUDA error: an illegal memory access was encountered")])

        def failing(*args, **kwargs):
            raise next(failures)

        engine._compute = failing
        assert _post(running.url, data).status_code == 500
        engine._compute = compute
        assert _post(running.url, data).status_code == 200 and engine.ready
        engine._compute = failing
        assert _post(running.url, data).status_code == 500
        engine._compute = compute
        assert _post(running.url, data).status_code == 503  # at once: nothing is queued for a dead engine
        ready, health = httpx.get(f"{running.url}/readyz"), httpx.get(f"{running.url}/healthz")
        assert ready.status_code == 503 and "illegal memory access" in ready.text
        assert health.status_code == 503 and "illegal memory access" in health.json()["error"]


@pytest.mark.parametrize("frontends", [False, True])
def test_audio_seconds_count_a_long_recording_once_not_its_overlaps(hybrid, parity_dir, parity_audio, frontends):
    recording, _ = long_recording(parity_audio, 60)
    settings = dict(max_segment_s=10, segment_overlap_s=2, max_wait_ms=5)
    with (serve_process(parity_dir / "tdt_ctc_hybrid.nemo", frontends=1, **settings) if frontends
          else run_server(Settings(**settings), hybrid)) as running:
        response = httpx.post(f"{running.url}/v1/transcribe", content=_flac(recording),
                              headers={"content-type": "audio/flac"}, timeout=120)
        assert response.status_code == 200 and response.json()["segments"] > 5  # pieces overlapping by 2 s
        assert running.metric("batchasr_audio_seconds_total") == pytest.approx(len(recording) / 16000, abs=1e-6)
        assert running.metric("batchasr_queue_wait_seconds_count", '{source="http"}') == response.json()["segments"]
        assert running.metric("batchasr_queue_wait_seconds_count", '{source="job"}') == 0


def test_a_client_that_leaves_mid_stream_drops_the_pieces_still_queued(hybrid, parity_audio):
    recording, _ = long_recording(parity_audio, 200)
    with run_server(Settings(max_segment_s=5, max_batch_size=1, max_wait_ms=0), hybrid) as running:
        n_pieces = len(running.service.stack.transcriber.plan(recording))
        with httpx.stream("POST", f"{running.url}/v1/audio/transcriptions", data={"stream": "true"},
                          files={"file": ("a.flac", _flac(recording), "audio/flac")}, timeout=120) as response:
            first = next(response.iter_lines())
        assert first == "event: transcript.text.delta"  # the first piece is done; the client leaves
        deadline = time.monotonic() + 30
        while running.metric("batchasr_dropped_items_total", '{reason="cancelled"}') == 0:
            assert time.monotonic() < deadline, "the pieces still queued were not dropped"
            time.sleep(0.05)
        time.sleep(0.5)
        assert running.metric("batchasr_batch_size_count") < n_pieces  # never all run
        assert httpx.get(f"{running.url}/healthz").status_code == 200


def test_native_endpoint_multipart_and_raw_body(server, hybrid, parity_audio):
    data = Path(parity_audio[4]).read_bytes()
    expected = hybrid.transcribe([parity_audio[4]])[0]
    raw = httpx.post(f"{server.url}/v1/transcribe", content=data, headers={"content-type": "audio/wav"}, timeout=60)
    multipart = httpx.post(f"{server.url}/v1/transcribe", files={"file": ("a.wav", data, "audio/wav")}, timeout=60)
    for response in (raw, multipart):
        body = response.json()
        assert response.status_code == 200, body
        assert (body["text"], body["tokens"], body["token_frames"]) == (expected.text, expected.tokens,
                                                                        expected.token_frames)
        assert body["compute_s"] > 0 and body["rtfx"] == pytest.approx(body["duration_s"] / body["compute_s"],
                                                                       rel=1e-2)
        assert body["queue_s"] >= 0 and body["segments"] == 1
        assert response.headers["x-request-id"]


def test_resampled_and_stereo_uploads(server, hybrid, parity_audio):
    wave, _ = sf.read(parity_audio[6], dtype="float32")
    import soxr

    stereo48 = soxr.resample(wave, 16000, 48000)
    buffer = io.BytesIO()
    sf.write(buffer, np.stack([stereo48, stereo48], axis=1), 48000, format="FLAC")
    body = _post(server.url, buffer.getvalue(), name="a.flac", content_type="audio/flac").json()
    assert body["text"] == hybrid.transcribe([parity_audio[6]])[0].text


# --- batching ----------------------------------------------------------------------------------------------


def test_concurrent_requests_are_batched_and_each_gets_its_own_result(server, hybrid, parity_audio):
    files = [parity_audio[i % len(parity_audio)] for i in range(40)]
    expected = {p: t.text for p, t in zip(parity_audio, hybrid.transcribe(parity_audio), strict=True)}
    batches_before = server.metric("batchasr_batch_size_count")
    items_before = server.metric("batchasr_batch_size_sum")

    async def send_all():
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(path):
                r = await client.post(f"{server.url}/v1/transcribe", content=Path(path).read_bytes(),
                                      headers={"content-type": "audio/wav"})
                return path, r
            return await asyncio.gather(*(one(p) for p in files))

    for path, response in asyncio.run(send_all()):
        assert response.status_code == 200
        assert response.json()["text"] == expected[path]
    batches = server.metric("batchasr_batch_size_count") - batches_before
    items = server.metric("batchasr_batch_size_sum") - items_before
    assert items == 40
    assert items / batches > 1, f"mean batch size {items / batches}"
    assert server.metric("batchasr_rtfx") > 0
    assert server.metric("batchasr_audio_seconds_total") > 0


def test_uploads_wait_their_turn_within_the_intake_budget(hybrid, parity_audio):
    """Decoded one at a time (one decode thread), 24 uploads at once would all be held in memory; within a budget
    of two and a half clips, at most that much is, and each request still gets its own result."""
    files = [parity_audio[i % len(parity_audio)] for i in range(24)]
    expected = {p: t.text for p, t in zip(parity_audio, hybrid.transcribe(parity_audio), strict=True)}
    largest = max(Path(p).stat().st_size for p in parity_audio)
    settings = Settings(decode_threads=1, max_intake_bytes=int(2.5 * largest))
    with run_server(settings, hybrid) as running:
        async def send_all():
            async with httpx.AsyncClient(timeout=120) as client:
                async def one(index: int, path: str):
                    data = Path(path).read_bytes()
                    if index % 2:  # the raw body waits unread; the multipart one in its temporary file
                        r = await client.post(f"{running.url}/v1/transcribe", content=data,
                                              headers={"content-type": "audio/wav"})
                    else:
                        r = await client.post(f"{running.url}/v1/audio/transcriptions", data={"model": "whisper-1"},
                                              files={"file": ("a.wav", data, "audio/wav")})
                    return path, r
                return await asyncio.gather(*(one(i, p) for i, p in enumerate(files)))

        for path, response in asyncio.run(send_all()):
            assert response.status_code == 200, response.text
            assert response.json()["text"] == expected[path]
        intake = running.app.state.service.intake
        # every upload's wait for room is counted; some had to wait
        assert running.metric("batchasr_intake_wait_seconds_count") == 24
        assert running.metric("batchasr_intake_wait_seconds_sum") > 0
        assert running.metric("batchasr_intake_wait_seconds_bucket", '{le="0.001"}') < 24
    assert intake.held == 0
    assert largest < intake.peak <= settings.max_intake_bytes  # used concurrently, never past the budget


def test_clients_that_stall_mid_upload_hold_no_room_in_the_intake_budget(hybrid, parity_audio):
    """A raw body was read within the budget as its client sent it: a client that declared a large body and sent
    nothing held that room for as long as it liked, and with two of them every other upload of the process waited
    for ever. Bodies are now received whole before their routes read them."""
    data = Path(parity_audio[0]).read_bytes()
    with run_server(Settings(max_intake_bytes=3 * len(data)), hybrid) as running:
        host, port = running.url.removeprefix("http://").split(":")
        stalled = []
        for _ in range(3):
            conn = socket.create_connection((host, int(port)))
            conn.sendall(f"POST /v1/transcribe HTTP/1.1\r\nHost: x\r\nContent-Type: audio/wav\r\n"
                         f"Content-Length: {2 * len(data)}\r\n\r\n".encode() + data[:1000])
            stalled.append(conn)
        try:
            time.sleep(0.5)
            answer = httpx.post(f"{running.url}/v1/transcribe", content=data, headers={"content-type": "audio/wav"},
                                timeout=20)
            assert answer.status_code == 200, answer.text
            assert running.service.intake.held == 0
        finally:
            for conn in stalled:
                conn.close()


def test_audio_of_more_pieces_than_the_queue_holds_is_413_not_429_for_ever(hybrid, parity_audio):
    recording, _ = long_recording(parity_audio, 30)  # 30 s in pieces of at most 5 s: 7 or more
    data = _wav_bytes(recording)
    with run_server(Settings(max_queue=4, max_segment_s=5, segment_overlap_s=1), hybrid) as running:
        for route in ("/v1/audio/transcriptions", "/v1/transcribe"):
            response = httpx.post(f"{running.url}{route}", files={"file": ("long.wav", data, "audio/wav")},
                                  timeout=60)
            assert response.status_code == 413, response.text
            error = response.json()["error"]
            assert error["code"] == "audio_too_large" and "more than the queue ever holds (4)" in error["message"]
        assert _post(running.url, Path(parity_audio[0]).read_bytes()).status_code == 200


def test_full_queue_answers_429_with_retry_after(hybrid, parity_audio):
    settings = Settings(max_queue=3, max_wait_ms=3000, max_batch_size=64)
    data = Path(parity_audio[7]).read_bytes()
    with run_server(settings, hybrid) as running, ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda _: _post(running.url, data), range(6)))
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) == 3 and codes.count(429) == 3, codes
    rejected = next(r for r in responses if r.status_code == 429)
    assert int(rejected.headers["retry-after"]) >= 1
    assert rejected.json()["error"]["code"] == "queue_full"


@pytest.mark.parametrize("route", ["/v1/transcribe", "/v1/audio/transcriptions"])
def test_client_disconnect_drops_the_queued_work(hybrid, parity_audio, route):
    settings = Settings(max_wait_ms=1500, max_batch_size=64)
    data = Path(parity_audio[0]).read_bytes()
    upload = ({"files": {"file": ("a.wav", data, "audio/wav")}} if route == "/v1/audio/transcriptions"
              else {"content": data, "headers": {"content-type": "audio/wav"}})  # multipart, or the raw body
    with run_server(settings, hybrid) as running:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{running.url}{route}", timeout=0.4, **upload)
        time.sleep(2.0)  # past max_wait: the batch would have formed by now
        assert running.metric("batchasr_dropped_items_total", '{reason="cancelled"}') == 1
        assert running.metric("batchasr_batch_size_count") == 0  # it never reached the engine
        assert httpx.get(f"{running.url}/healthz").status_code == 200


@pytest.mark.parametrize("route", ["/v1/transcribe", "/v1/audio/transcriptions"])
def test_the_uploads_of_clients_gone_are_not_decoded_ahead_of_a_client_still_waiting(hybrid, parity_audio,
                                                                                     monkeypatch, route):
    """Waiting for a decoding thread (or room in the intake budget), a client's leaving went unseen: five uploads
    whose clients had given up were each decoded in turn before the one still waiting (5.5 s instead of 1)."""
    from service import request_audio

    decode_s, decoded = 1.0, []
    real = request_audio.decode_declared_audio

    def slow_decode(*args, **kwargs):  # as a long compressed recording takes
        decoded.append(time.monotonic())
        time.sleep(decode_s)
        return real(*args, **kwargs)

    monkeypatch.setattr(request_audio, "decode_declared_audio", slow_decode)
    data = Path(parity_audio[0]).read_bytes()
    upload = ({"files": {"file": ("a.wav", data, "audio/wav")}} if route == "/v1/audio/transcriptions"
              else {"content": data, "headers": {"content-type": "audio/wav"}})
    with run_server(Settings(decode_threads=1), hybrid) as running:
        def give_up() -> None:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{running.url}{route}", timeout=0.3, **upload)

        with ThreadPoolExecutor(5) as pool:
            list(pool.map(lambda _: give_up(), range(5)))
        time.sleep(0.2)  # their leaving is seen
        started = time.monotonic()
        assert httpx.post(f"{running.url}{route}", timeout=60, **upload).status_code == 200
        waited = time.monotonic() - started
    assert len(decoded) == 2, decoded  # the one already decoding when its client left, and the one waiting
    assert waited < 2.5 * decode_s


def test_an_upload_whose_client_left_stops_decoding_at_its_next_block(hybrid, parity_audio, monkeypatch):
    """A decode under way when its client left ran to the end, holding its thread, its file and its room in the
    intake budget: a long recording's minutes decoded for no one. Now it is told to stop, and gives up."""
    from service import request_audio
    from service.audio import DecodeStopped

    entered, outcomes = threading.Event(), []
    real = request_audio.decode_declared_audio

    def decode_waiting_for_the_client_to_leave(*args, stop=None):
        entered.set()
        outcomes.append(stop is not None and stop.wait(30))
        try:
            return real(*args, stop=stop)
        except DecodeStopped:
            outcomes.append("stopped")
            raise
        except Exception as exc:
            outcomes.append(repr(exc))
            raise

    monkeypatch.setattr(request_audio, "decode_declared_audio", decode_waiting_for_the_client_to_leave)
    data = Path(parity_audio[0]).read_bytes()
    with run_server(Settings(decode_threads=1), hybrid) as running:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{running.url}/v1/transcribe", content=data, headers={"content-type": "audio/wav"},
                       timeout=1.0)
        assert entered.is_set()
        deadline = time.monotonic() + 30
        while len(outcomes) < 2:
            assert time.monotonic() < deadline, outcomes
            time.sleep(0.05)
        assert httpx.get(f"{running.url}/healthz").status_code == 200
    assert outcomes == [True, "stopped"]


def test_each_request_logs_one_json_line_with_its_request_id(server, parity_audio, caplog):
    data = Path(parity_audio[1]).read_bytes()
    with caplog.at_level(logging.INFO, logger="batchasr.api"):
        response = httpx.post(f"{server.url}/v1/transcribe", content=data,
                              headers={"content-type": "audio/wav", "x-request-id": "trace-42"}, timeout=60)
    assert response.status_code == 200 and response.headers["x-request-id"] == "trace-42"
    lines = [json.loads(JsonFormatter().format(r)) for r in caplog.records if r.name == "batchasr.api"]
    [line] = [line for line in lines if line.get("request_id") == "trace-42"]
    assert line["event"] == "request" and line["path"] == "/v1/transcribe" and line["status"] == 200
    assert line["level"] == "info" and line["duration_ms"] > 0 and line["ts"].endswith("Z")
    assert "code" not in line and "error" not in line
    # a refusal's line says which and why (its status alone left the operator to search by request id)
    with caplog.at_level(logging.INFO, logger="batchasr.api"):
        refused = httpx.post(f"{server.url}/v1/transcribe", content=b"not audio", timeout=60,
                             headers={"content-type": "audio/wav", "x-request-id": "trace-43"})
    lines = [json.loads(JsonFormatter().format(r)) for r in caplog.records if r.name == "batchasr.api"]
    [line] = [line for line in lines if line.get("request_id") == "trace-43"]
    assert line["status"] == refused.status_code == 400
    # a client's id is taken only where it is one: not 60 KB copied into every line, nor bytes no index reads
    for sent in ("A" * 129, "evil\x85\xe9 \"} {\"level\": \"error"):
        answer = httpx.get(f"{server.url}/healthz", headers={"x-request-id": sent.encode("latin-1")})
        assert re.fullmatch("[0-9a-f]{32}", answer.headers["x-request-id"]), answer.headers
    assert httpx.get(f"{server.url}/healthz", headers={"x-request-id": "A" * 128}).headers["x-request-id"] == "A" * 128
    assert (line["code"], line["error"]) == (refused.json()["error"]["code"], refused.json()["error"]["message"])
    quoted = {"error": {"message": "items.0.url: https://u:pw@media.example/a.wav?X-Amz-Signature=s3cr3t: not "
                                   "allowed", "type": "invalid_request_error", "param": None, "code": "invalid_job"}}
    assert request_log._error_of(json.dumps(quoted).encode()) == {  # a pre-signed URL's signature is not logged
        "code": "invalid_job", "error": "items.0.url: https://***@media.example/a.wav?***: not allowed"}
    plain = json.loads(JsonFormatter().format(logging.LogRecord("x", logging.WARNING, "", 0, "a %s", ("b",), None)))
    assert plain["message"] == "a b" and plain["level"] == "warning"


def test_a_libraries_warning_is_logged_as_a_json_line_too():
    script = "import warnings; from service.logs import configure_json_logging as c; c(); warnings.warn('odd')"
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    [line] = run.stderr.splitlines()
    assert json.loads(line)["level"] == "warning" and "UserWarning: odd" in json.loads(line)["message"], run.stderr


def test_every_line_logged_while_a_request_is_handled_names_it(hybrid, parity_audio):
    """A 500's traceback was logged without the request id its client was given (only the request's own line had
    it): once requests run side by side, the two could not be matched."""
    lines = io.StringIO()
    handler = logging.StreamHandler(lines)
    handler.setFormatter(JsonFormatter())
    logger, level = logging.getLogger("batchasr"), logging.getLogger("batchasr").level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with run_server(Settings(), hybrid) as running:
            async def broken(*args, **kwargs):
                raise RuntimeError("boom")

            running.service.stack.transcriber.transcribe = broken
            response = httpx.post(f"{running.url}/v1/transcribe", content=Path(parity_audio[0]).read_bytes(),
                                  headers={"content-type": "audio/wav", "x-request-id": "req-42"}, timeout=60)
            healthy = httpx.get(f"{running.url}/healthz", headers={"x-request-id": "req-43"})
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert response.status_code == 500 and healthy.status_code == 200
    logged = [json.loads(line) for line in lines.getvalue().splitlines()]
    [traceback] = [line for line in logged if "exception" in line]
    assert "boom" in traceback["exception"] and traceback["message"] == "unhandled error"
    assert (traceback["request_id"], traceback["method"], traceback["path"]) == ("req-42", "POST", "/v1/transcribe")
    requests = {line["request_id"]: line["path"] for line in logged if line.get("event") == "request"}
    assert requests["req-42"] == "/v1/transcribe" and requests["req-43"] == "/healthz"  # each its own
    after = json.loads(JsonFormatter().format(logging.LogRecord("x", logging.INFO, "", 0, "later", (), None)))
    assert "request_id" not in after  # outside a request, nothing is named


def test_the_event_loops_cpu_is_counted_on_its_own_thread(server, parity_audio):
    first = server.metric("batchasr_event_loop_cpu_seconds_total")
    started = time.perf_counter()
    data = Path(parity_audio[2]).read_bytes()
    with ThreadPoolExecutor(8) as pool:
        assert all(r.status_code == 200 for r in pool.map(lambda _: _post(server.url, data), range(16)))
    spent = server.metric("batchasr_event_loop_cpu_seconds_total") - first
    # 16 requests take the loop over a millisecond; one thread's CPU cannot outrun the wall clock
    assert 0.001 < spent <= time.perf_counter() - started


# --- auth ----------------------------------------------------------------------------------------------------


def test_api_keys_guard_v1_but_not_operations(hybrid, parity_audio):
    data = Path(parity_audio[3]).read_bytes()
    with run_server(Settings(api_keys=["k1", "k2"]), hybrid) as running:
        missing = _post(running.url, data)
        assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
        assert _post(running.url, data, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert _post(running.url, data, headers={"Authorization": "Bearer k2"}).status_code == 200
        assert httpx.get(f"{running.url}/v1/models").status_code == 401
        assert httpx.get(f"{running.url}/v1/webhooks/secret").status_code == 401
        for route in ("/v1/models", "/v1/webhooks/secret"):  # counted under its route (the webhooks' were not)
            assert running.metric("batchasr_requests_total", f'{{code="401",route="{route}"}}') == 1, route
        for path in ("/healthz", "/readyz", "/metrics"):
            assert httpx.get(f"{running.url}{path}").status_code == 200
        # refused before the body is read: FastAPI parses (and spools to disk) a form before a route's dependencies
        for route in ("/v1/audio/transcriptions", "/v1/transcribe", "/v1/jobs"):
            upload = StreamedUpload("file", total=200_000_000)
            refused = httpx.post(f"{running.url}{route}", content=upload, headers={"content-type": upload.content_type})
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key", refused.text
            assert refused.headers["www-authenticate"] == "Bearer"
            assert upload.sent < 20_000_000  # within the socket's buffers, not the whole upload


def test_each_api_keys_requests_take_their_own_turns_in_the_batcher(hybrid, parity_audio):
    """Every route queues its pieces under the request's key (service.batcher: each owner's items take turns), so
    one key's flood of requests does not hold another's behind it."""
    mono = Path(parity_audio[3]).read_bytes()
    stereo = io.BytesIO()
    left, right = (sf.read(parity_audio[i], dtype="float32")[0] for i in (1, 2))
    n = max(len(left), len(right))
    sf.write(stereo, np.stack([np.pad(left, (0, n - len(left))), np.pad(right, (0, n - len(right)))], 1), 16000,
             format="WAV")
    with run_server(Settings(api_keys=["k1", "k2"]), hybrid) as running:
        batcher = running.service.stack.batcher
        owners: list[tuple[str, int]] = []
        submit = batcher.submit
        batcher.submit = lambda items: (owners.append((items[0].owner, len(items))), submit(items))[1]
        for key in ("k1", "k2"):
            headers = {"Authorization": f"Bearer {key}"}
            assert _post(running.url, mono, headers=headers).status_code == 200
            with httpx.stream("POST", f"{running.url}/v1/audio/transcriptions", data={"stream": "true"},
                              files={"file": ("a.wav", mono, "audio/wav")}, headers=headers, timeout=60) as streamed:
                assert streamed.status_code == 200 and "transcript.text.done" in streamed.read().decode()
            both = httpx.post(f"{running.url}/v1/transcribe", files={"file": ("s.wav", stereo.getvalue(), "audio/wav")},
                              data={"multichannel": "true"}, headers=headers, timeout=60)
            assert both.status_code == 200, both.text
    assert [owner for owner, _ in owners] == [owner_of("k1")] * 3 + [owner_of("k2")] * 3
    assert [n for _, n in owners] == [1, 1, 2, 1, 1, 2]  # the call's two channels queued together


def test_api_keys_are_compared_in_constant_time_with_every_key(monkeypatch):
    """``token in keys`` stops at the first character that differs: how long a refusal took would say how much of
    a key a client had guessed. Every key is compared, each with hmac.compare_digest."""
    import hmac

    from service import http

    compared = []
    original = hmac.compare_digest

    def compare(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return original(a, b)

    monkeypatch.setattr(http.hmac, "compare_digest", compare)
    keys = ["first-key", "second-key", "third-key"]
    assert http.valid_api_key("Bearer first-key", keys) == "first-key"
    assert http.valid_api_key("bearer  third-key ", keys) == "third-key"
    assert http.valid_api_key("Bearer first-kez", keys) is None
    assert http.valid_api_key("Basic first-key", keys) is None
    assert len(compared) == 4 * len(keys)  # a match found early still compares the rest


def test_blank_api_keys_are_dropped_and_an_empty_bearer_is_never_a_key(hybrid, monkeypatch):
    """The ``a,b`` form of BATCHASR_API_KEYS dropped blank keys, its JSON form kept them: with '["k1", ""]' an empty
    ``Authorization: Bearer`` matched the "" and was let in. Both forms drop them now, and an empty token matches no
    key whatever the list holds; a list of nothing but blank keys is refused."""
    from pydantic import ValidationError

    from service import http

    monkeypatch.setenv("BATCHASR_API_KEYS", '["k1", "", "  "]')
    assert Settings().api_keys == ["k1"]
    monkeypatch.setenv("BATCHASR_API_KEYS", "k1, ,")
    assert Settings().api_keys == ["k1"]
    monkeypatch.setenv("BATCHASR_API_KEYS", '[""]')  # dropped, it would turn the keys off
    with pytest.raises(ValidationError, match="only blank keys"):
        Settings()
    for authorization in ("Bearer ", "Bearer", "Bearer   "):
        assert http.valid_api_key(authorization, ["k1", ""]) is None
    monkeypatch.setenv("BATCHASR_API_KEYS", '["k1", ""]')
    with run_server(Settings(), hybrid) as running:
        host, port = running.url.removeprefix("http://").split(":")
        for authorization in (b"Bearer ", b"Bearer"):  # raw: httpx will not send a header value ending in a space
            with socket.create_connection((host, int(port)), timeout=10) as conn:
                conn.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: " + authorization + b"\r\n\r\n")
                assert _read_answer(conn).split(b"\r\n", 1)[0] == b"HTTP/1.1 401 Unauthorized", authorization
        assert httpx.get(f"{running.url}/v1/models", headers={"Authorization": "Bearer k1"}).status_code == 200


def test_request_heads_past_the_limit_are_refused_before_any_key_is_checked(hybrid):
    """httptools keeps a header however long it is (a gigabyte, in one connection, with no API key); past 64 KiB
    the server answers 431 and closes the connection. Ordinary heads, and a long Idempotency-Key, are not."""
    from service.head_limit import MAX_HEAD_BYTES

    with run_server(Settings(api_keys=["k1"]), hybrid) as running:
        assert send_head(running.url, 8_000) == b"HTTP/1.1 200 OK"
        assert send_head(running.url, MAX_HEAD_BYTES - 1000) == b"HTTP/1.1 200 OK"
        for size in (MAX_HEAD_BYTES + 1000, 50_000_000):
            assert send_head(running.url, size, path="/v1/models") == b"HTTP/1.1 431 Request Header Fields Too Large"
        # a head that comes whole in one read (the client's writes coalesced) is counted before it is parsed
        assert send_head(running.url, 100_000, path="/v1/models", whole=True) == \
            b"HTTP/1.1 431 Request Header Fields Too Large"
        assert httpx.get(f"{running.url}/healthz").status_code == 200
        # the key becomes a Redis key kept for days: a client's identifier, not a megabyte
        refused = httpx.post(f"{running.url}/v1/jobs", json={"items": [{"path": "/a.wav"}]},
                             headers={"Authorization": "Bearer k1", "Idempotency-Key": "k" * 256})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_idempotency_key"


def test_connections_that_stall_before_their_head_or_body_is_whole_are_ended(hybrid, monkeypatch):
    """uvicorn kept a connection that sent nothing, half a head or half a body for good: enough of them hold every
    file descriptor the process may open. Each ends now (60 s in service; 1 s here), with 408 where it had begun a
    request."""
    from service import body_buffer
    from service.head_limit import BoundedHttpToolsProtocol

    monkeypatch.setattr(BoundedHttpToolsProtocol, "head_timeout_s", 1.0)
    monkeypatch.setattr(body_buffer, "BODY_IDLE_TIMEOUT_S", 1.0)
    with run_server(Settings(), hybrid) as running:
        host, port = running.url.removeprefix("http://").split(":")
        starts = {"nothing": b"", "half a head": b"POST /v1/transcribe HTTP/1.1\r\nHost: x\r\n",
                  "half a body": b"POST /v1/transcribe HTTP/1.1\r\nHost: x\r\nContent-Type: audio/wav\r\n"
                                 b"Content-Length: 100000\r\n\r\n" + bytes(1000)}
        conns = {}
        for name, start in starts.items():
            conns[name] = socket.create_connection((host, int(port)), timeout=10)
            conns[name].sendall(start)
        answers = {}
        for name, conn in conns.items():
            with conn:
                answer = b""
                while data := conn.recv(4096):  # to the end: the server closes the connection
                    answer += data
                answers[name] = answer.split(b"\r\n", 1)[0]
        assert answers == {"nothing": b"", "half a head": b"HTTP/1.1 408 Request Timeout",
                           "half a body": b"HTTP/1.1 408 Request Timeout"}
        assert httpx.get(f"{running.url}/healthz").status_code == 200


def _read_answer(conn: socket.socket) -> bytes:
    """One answer (head and its ``content-length`` of body) off a kept-alive connection."""
    received = b""
    while b"\r\n\r\n" not in received:
        data = conn.recv(4096)
        assert data, "closed before an answer"
        received += data
    head, _, body = received.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?im)^content-length: *(\d+)", head).group(1))
    while len(body) < length:
        data = conn.recv(4096)
        assert data, "closed mid answer"
        body += data
    return head + b"\r\n\r\n" + body


def test_a_stray_crlf_after_a_request_does_not_keep_the_connection_for_good(hybrid, parity_audio, monkeypatch):
    """httptools skips the CRLFs between requests without beginning a message, and any byte cancels uvicorn's
    keep-alive timer: a request and then "\\r\\n" held a connection for good, timed by nothing. The head timer
    runs from that byte now (408), but not while a body comes slowly, the app answers, or a kept-alive connection
    waits for its next request."""
    from service.head_limit import BoundedHttpToolsProtocol

    monkeypatch.setattr(BoundedHttpToolsProtocol, "head_timeout_s", 1.0)  # 60 s in service; keep-alive is 5 s
    audio = Path(parity_audio[3]).read_bytes()
    with run_server(Settings(), hybrid) as running:
        host, port = running.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(f"POST /v1/transcribe HTTP/1.1\r\nHost: x\r\nContent-Type: audio/wav\r\n"
                         f"Content-Length: {len(audio)}\r\n\r\n".encode())
            step = len(audio) // 4 + 1
            for start in range(0, len(audio), step):  # the body over 2 s: past the head timeout
                time.sleep(0.5)
                conn.sendall(audio[start:start + step])
            assert _read_answer(conn).startswith(b"HTTP/1.1 200 ")
            time.sleep(1.5)  # idle past the head timeout, within keep-alive
            conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _read_answer(conn).startswith(b"HTTP/1.1 200 ")
            conn.sendall(b"\r\n")
            started, answer = time.monotonic(), b""
            with contextlib.suppress(TimeoutError):  # kept open: the recv times out
                while data := conn.recv(4096):  # to the end: the server closes the connection
                    answer += data
            assert answer.split(b"\r\n", 1)[0] == b"HTTP/1.1 408 Request Timeout"
            assert time.monotonic() - started < 5


def test_a_client_gone_mid_upload_is_a_499_not_a_server_error(server):
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) as conn:
        conn.sendall(b"POST /v1/transcribe HTTP/1.1\r\nHost: x\r\nContent-Type: audio/wav\r\n"
                     b"Content-Length: 1000000\r\n\r\n" + bytes(5000))
    route = '{code="%s",route="/v1/transcribe"}'
    deadline = time.monotonic() + 10
    while server.metric("batchasr_requests_total", route % 499) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metric("batchasr_requests_total", route % 499) >= 1
    assert server.metric("batchasr_requests_total", route % 500) == 0


def test_a_client_gone_mid_form_is_a_499_not_a_server_error(hybrid, redis_server, caplog):
    """The same for a multipart form cut off part way, on every route that takes one: the native route and jobs
    (which parse their forms themselves) failed with an unhandled ClientDisconnect, answered 500 and logged it as
    a server error; the OpenAI route answered 400, as for a malformed form."""
    boundary = "gone-boundary"
    part = (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
            "Content-Type: audio/wav\r\n\r\n").encode() + bytes(5000)
    with run_server(Settings(redis_url=redis_server.url), hybrid) as running:
        for path in ("/v1/transcribe", "/v1/audio/transcriptions", "/v1/jobs"):
            with socket.create_connection(("127.0.0.1", int(running.url.rsplit(":", 1)[1]))) as conn:
                conn.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\nContent-Type: "
                             f"multipart/form-data; boundary={boundary}\r\n\r\n".encode() + part)
            deadline = time.monotonic() + 10
            while not running.metric("batchasr_requests_total", f'{{code="499",route="{path}"}}') and \
                    time.monotonic() < deadline:
                time.sleep(0.05)
            codes = {code: running.metric("batchasr_requests_total", f'{{code="{code}",route="{path}"}}')
                     for code in (400, 499, 500)}
            assert codes == {400: 0, 499: 1, 500: 0}, path
    assert not [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]


def test_requests_refused_before_routing_are_counted_under_their_route(hybrid, parity_audio):
    """A 401 (no API key) and a 413 (a declared length past the limit) are answered by middleware before the
    router names the route: they were missing from batchasr_requests_total, while the same 413 for an upload
    that did not declare its length was counted."""
    settings = Settings(api_keys=["k"], max_upload_bytes=100_000)
    with run_server(settings, hybrid) as running:
        assert httpx.get(f"{running.url}/v1/models").status_code == 401
        assert httpx.get(f"{running.url}/v1/jobs/job_x").status_code == 401
        large = httpx.post(f"{running.url}/v1/transcribe", content=bytes(2_000_000),
                           headers={"authorization": "Bearer k", "content-type": "audio/wav"})
        assert large.status_code == 413, large.text
        assert httpx.get(f"{running.url}/v1/nope", headers={"authorization": "Bearer k"}).status_code == 404
        assert running.metric("batchasr_requests_total", '{code="401",route="/v1/models"}') == 1
        assert running.metric("batchasr_requests_total", '{code="401",route="/v1/jobs/{job_id}"}') == 1
        assert running.metric("batchasr_requests_total", '{code="413",route="/v1/transcribe"}') == 1
        assert "unmatched" not in httpx.get(f"{running.url}/metrics").text  # no route: not a route's request


def test_a_file_part_whose_type_the_client_guessed_wrong_is_decoded_all_the_same(server, hybrid, parity_audio):
    """HTTP libraries guess a part's type from its file name: the OpenAI SDK sends a .ts recording (MPEG-TS) as
    text/vnd.trolltech.linguist. The bytes decide; a text file declared as text is still refused (415)."""
    data = Path(parity_audio[2]).read_bytes()
    expected = hybrid.transcribe([parity_audio[2]])[0].text
    guessed = _post(server.url, data, name="call.ts", content_type="text/vnd.trolltech.linguist")
    assert guessed.status_code == 200 and guessed.json()["text"] == expected
    text = _post(server.url, b"not audio at all\n" * 50, name="notes.txt", content_type="text/plain")
    assert text.status_code == 415 and text.json()["error"]["code"] == "unsupported_media_type"


def test_the_native_route_reads_multipart_whatever_the_case_of_its_type(server, hybrid, parity_audio):
    data = Path(parity_audio[4]).read_bytes()
    request = httpx.Request("POST", f"{server.url}/v1/transcribe", files={"file": ("a.wav", data, "audio/wav")})
    boundary = request.headers["content-type"].split("boundary=")[1]
    response = httpx.post(f"{server.url}/v1/transcribe", content=request.read(), timeout=60,
                          headers={"content-type": f"Multipart/Form-Data; boundary={boundary}"})
    assert response.status_code == 200, response.text
    assert response.json()["text"] == hybrid.transcribe([parity_audio[4]])[0].text


# --- bad input -----------------------------------------------------------------------------------------------


def _wav_claiming_hours(hours: float) -> bytes:
    """A PCM WAV whose header claims ``hours`` of audio but which carries one second."""
    data = np.zeros(16000, dtype="<i2").tobytes()
    claimed = int(hours * 3600 * 16000 * 2)
    fmt = struct.pack("<HHIIHH", 1, 1, 16000, 32000, 2, 16)
    return (b"RIFF" + struct.pack("<I", 36 + claimed) + b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt
            + b"data" + struct.pack("<I", claimed) + data)


def _bad_inputs(parity_audio) -> list[tuple[str, bytes, str, int, str]]:
    good = Path(parity_audio[0]).read_bytes()
    nan_wave = np.zeros(8000, dtype=np.float32)
    nan_wave[100] = np.nan
    return [
        ("empty", b"", "audio/wav", 400, "empty"),
        ("random bytes", np.random.default_rng(0).bytes(20000), "audio/wav", 400, "cannot decode audio"),
        ("truncated wav header", good[:30], "audio/wav", 400, "cannot decode audio"),
        ("truncated wav data", good[: len(good) // 2], "audio/wav", 400, "truncated"),
        ("header claims 10 hours", _wav_claiming_hours(10), "audio/wav", 413, "per its header"),
        ("text file", b"hello, this is plain text\n" * 20, "text/plain", 415, "unsupported media type"),
        ("json", b'{"a": 1}', "application/json", 415, "unsupported media type"),
        ("zero samples", _wav_bytes(np.zeros(0, dtype=np.float32)), "audio/wav", 400, "no samples"),
        ("nan samples", _wav_bytes(nan_wave, subtype="FLOAT"), "audio/wav", 400, "NaN"),
    ]


def test_bad_inputs_get_clear_errors_and_the_server_stays_healthy(server, parity_audio):
    for label, data, content_type, status, message in _bad_inputs(parity_audio):
        for route in ("/v1/audio/transcriptions", "/v1/transcribe"):
            response = httpx.post(f"{server.url}{route}", files={"file": ("x", data, content_type)}, timeout=30)
            assert response.status_code == status, (label, route, response.text)
            error = response.json()["error"]
            assert message in error["message"], (label, error)
            assert set(error) == {"message", "type", "param", "code"}
    assert httpx.get(f"{server.url}/healthz").status_code == 200
    assert _post(server.url, Path(parity_audio[0]).read_bytes()).status_code == 200


def test_limits_on_upload_size_and_duration(hybrid, parity_audio):
    data = Path(parity_audio[1]).read_bytes()  # about 3 s, 100 kB
    with run_server(Settings(max_upload_bytes=50_000, max_duration_s=60), hybrid) as running:
        too_big = _post(running.url, data)
        assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "audio_too_large"
        raw = httpx.post(f"{running.url}/v1/transcribe", content=data, headers={"content-type": "audio/wav"})
        assert raw.status_code == 413
    with run_server(Settings(max_duration_s=2.0), hybrid) as running:
        long = _post(running.url, data)
        assert long.status_code == 413 and "limit" in long.json()["error"]["message"]


def test_bodies_past_the_upload_limit_are_refused_as_they_arrive(hybrid):
    """Not spooled whole first: a multipart body is parsed (and its files written to disk) before the route
    sees its size, so without the limit on the body a 200 MB request would be read to its end."""
    with run_server(Settings(max_upload_bytes=50_000), hybrid) as running:
        for route in ("/v1/audio/transcriptions", "/v1/transcribe"):
            declared = httpx.post(f"{running.url}{route}", files={"file": ("x.wav", bytes(5_000_000), "audio/wav")})
            assert declared.status_code == 413 and declared.json()["error"]["code"] == "audio_too_large"
            upload = StreamedUpload("file", total=200_000_000)
            streamed = httpx.post(f"{running.url}{route}", content=upload,
                                  headers={"content-type": upload.content_type})
            assert streamed.status_code == 413, streamed.text
            assert streamed.json()["error"] == {"message": upload_too_large_message(50000),
                                                "type": "invalid_request_error", "param": "file",
                                                "code": "audio_too_large"}
            assert upload.sent < 20_000_000  # refused within a few MB (the socket's buffers), not at the end
        assert httpx.get(f"{running.url}/healthz").status_code == 200


@pytest.mark.parametrize(
    ("form", "status", "param"),
    [
        ({"response_format": "xml"}, 400, "response_format"),
        ({"temperature": "warm"}, 400, "temperature"),
        ({"model": "gpt-9"}, 404, "model"),
        ({"timestamp_granularities[]": "sentence", "response_format": "verbose_json"}, 400,
         "timestamp_granularities[]"),
        ({"stream": "true", "response_format": "srt"}, 400, "stream"),
    ],
)
def test_bad_parameters(server, parity_audio, form, status, param):
    response = _post(server.url, Path(parity_audio[0]).read_bytes(), **form)
    assert response.status_code == status
    assert response.json()["error"]["param"] == param


def test_text_fields_sent_as_files_are_refused_not_read_as_a_file_object(server, parity_audio):
    clip = ("a.wav", Path(parity_audio[0]).read_bytes(), "audio/wav")
    for route, field, data in (("/v1/transcribe", "hotwords", {}), ("/v1/transcribe", "channel_names",
                                                                      {"multichannel": "true"}),
                               ("/v1/transcribe", "multichannel", {}),
                               ("/v1/audio/transcriptions", "timestamp_granularities[]",
                                {"response_format": "verbose_json"})):
        files = [("file", clip), (field, ("field.txt", b"word"))]
        refused = httpx.post(f"{server.url}{route}", files=files, data=data, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field, (route, field, refused.text)
        assert "UploadFile" not in refused.text
    assert httpx.get(f"{server.url}/healthz").status_code == 200


def test_health_and_readiness_answer_head_too(server):
    for path in ("/healthz", "/readyz"):
        answer = httpx.head(f"{server.url}{path}")
        assert answer.status_code == 200 and answer.content == b"", path


def test_a_method_the_path_does_not_take_is_405_naming_every_method_it_does(server):
    """Allow listed only the first route of the path: PUT /v1/jobs said POST although GET lists jobs."""
    for method, path, allowed in (("PUT", "/v1/jobs", "GET, POST"), ("POST", "/v1/jobs/some-id", "GET, DELETE"),
                                  ("GET", "/v1/audio/transcriptions", "POST"), ("DELETE", "/healthz", "GET, HEAD")):
        refused = httpx.request(method, f"{server.url}{path}")
        assert refused.status_code == 405 and refused.headers["allow"] == allowed, (method, path)
        assert refused.json()["error"]["code"] == "method_not_allowed" and allowed in refused.json()["error"]["message"]


def test_the_openai_route_reads_multichannel_false_as_the_native_route_does(server, hybrid, parity_audio):
    """It refuses `multichannel` (the native route's: a call is not mixed down without a word), but took only "",
    "false" and "0" for false: `-F multichannel=off` (or False, no), false to the native route, was refused."""
    data = Path(parity_audio[0]).read_bytes()
    expected = hybrid.transcribe([parity_audio[0]])[0].text
    for word in ("off", "False", "no", "0", " FALSE "):
        taken = _post(server.url, data, multichannel=word)
        assert taken.status_code == 200 and taken.json()["text"] == expected, (word, taken.text)
    in_query = httpx.post(f"{server.url}/v1/audio/transcriptions", params={"multichannel": "off"},
                          files={"file": ("a.wav", data, "audio/wav")}, timeout=60)
    assert in_query.status_code == 200, in_query.text
    for form in ({"multichannel": "on"}, {"multichannel": "Yes"}, {"multichannel": "perhaps"},
                 {"channel_names": "agent,customer"}):
        refused = _post(server.url, data, **form)
        error = refused.json()["error"]
        assert refused.status_code == 400 and (error["param"], error["code"]) == (*form, "invalid_parameter"), form


def test_missing_file_and_known_model_names(server, parity_audio):
    missing = httpx.post(f"{server.url}/v1/audio/transcriptions", data={"model": "whisper-1"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "file"
    model_id = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    assert model_id == "batchasr-default" or model_id
    assert _post(server.url, Path(parity_audio[0]).read_bytes(), model="whisper-1").status_code == 200


# --- lifecycle -------------------------------------------------------------------------------------------------


def test_graceful_shutdown_finishes_queued_requests(hybrid, parity_audio):
    settings = Settings(max_wait_ms=3000, max_batch_size=64)
    data = Path(parity_audio[2]).read_bytes()
    with run_server(settings, hybrid) as running, ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_post, running.url, data) for _ in range(4)]
        # all four queued, waiting for the batch to fill (a fixed sleep raced their connects on a busy machine)
        deadline = time.monotonic() + 30
        while running.metric("batchasr_queue_depth") < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        running.server.should_exit = True
        responses = [f.result() for f in futures]
        running.thread.join(30)
    assert [r.status_code for r in responses] == [200] * 4
    assert not running.thread.is_alive()


def test_openapi_docs(server, parity_audio):
    spec = httpx.get(f"{server.url}/openapi.json").json()
    assert {"/v1/audio/transcriptions", "/v1/transcribe", "/healthz", "/readyz", "/metrics"} <= set(spec["paths"])
    answers = spec["paths"]["/v1/audio/transcriptions"]["post"]["responses"]["200"]["content"]
    assert {"application/json", "text/vtt", "text/event-stream"} <= set(answers)
    # errors as they are sent: a refused parameter is a 400 in the OpenAI shape, never FastAPI's 422; each status
    # described, and those any route may answer on every route (a body's 413 on each that takes one, a key's 401
    # on each under /v1)
    error_schema = {"$ref": "#/components/schemas/ErrorResponse"}
    probes = {"/healthz", "/readyz"}  # their 503 is their own {"status": ...}, as a probe reads it
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            errors = {status for status in responses if status[0] in "45"}
            must = {*map(str, EVERY_ROUTE_ERRORS), "4XX", *(["401"] if path.startswith("/v1") else []),
                    *(["413"] if "requestBody" in operation else [])}
            assert "422" not in errors and must <= errors, (method, path, errors)
            for status in errors - ({"503"} if path in probes else set()):
                assert responses[status]["content"] == {"application/json": {"schema": error_schema}}, (path, status)
                assert status == "4XX" or responses[status]["description"] == ERROR_DESCRIPTIONS[int(status)]
    # the schema is what the service sends: all four fields, every time
    detail = spec["components"]["schemas"]["ErrorDetail"]
    assert set(detail["properties"]) == set(detail["required"]) == {"message", "type", "param", "code"}
    audio = Path(parity_audio[0]).read_bytes()
    refusals = [("post", "/v1/audio/transcriptions", _post(server.url, audio, temperature="warm")),
                ("post", "/v1/audio/transcriptions", _post(server.url, audio, model="gpt-9")),
                ("post", "/v1/transcribe", httpx.post(f"{server.url}/v1/transcribe", content=b"{}",
                                                      headers={"content-type": "application/json"})),
                ("get", "/v1/models/{model}", httpx.get(f"{server.url}/v1/models/gpt-9")),
                ("get", "/v1/jobs", httpx.get(f"{server.url}/v1/jobs")),  # no Redis here: 503
                ("get", "/v1/jobs/{job_id}", httpx.get(f"{server.url}/v1/jobs/job_x"))]
    for method, path, answer in refusals:
        assert str(answer.status_code) in spec["paths"][path][method]["responses"], (path, answer.status_code)
        assert set(answer.json()["error"]) == set(detail["required"])
    # what the routes that read their own bodies take, and what /metrics answers in
    native = spec["paths"]["/v1/transcribe"]["post"]["requestBody"]["content"]
    assert native["multipart/form-data"]["schema"]["required"] == ["file"] and "audio/*" in native
    job = spec["paths"]["/v1/jobs"]["post"]
    assert job["requestBody"]["content"]["multipart/form-data"]["schema"]["required"] == ["files"]
    assert job["requestBody"]["content"]["application/json"]["schema"]["required"] == ["items"]
    assert {"200", "202", "413"} <= set(job["responses"])  # 200: an Idempotency-Key's earlier job
    assert set(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    results = spec["paths"]["/v1/jobs/{job_id}/results"]["get"]["responses"]["200"]["content"]
    assert set(results) == {"application/x-ndjson"}


def test_attention_kernel_setting_is_checked(monkeypatch):
    from pydantic import ValidationError

    from service.config import get_settings

    monkeypatch.delenv("BATCHASR_ATTENTION_KERNEL", raising=False)
    assert get_settings().attention_kernel == "auto"
    monkeypatch.setenv("BATCHASR_ATTENTION_KERNEL", "sdpa")
    assert get_settings().attention_kernel == "sdpa"
    assert get_settings(attention_kernel=None).attention_kernel == "sdpa"  # an unset CLI option keeps the env's
    with pytest.raises(ValidationError, match="must be one of auto, reference, sdpa"):
        Settings(attention_kernel="flash")


def test_stream_latency_script_measures_a_stream_against_one_request(server, parity_dir, capsys):
    script = load_script(REPO / "loadtest" / "stream_latency.py")
    script.main(["--url", server.url, "--audio-dir", str(parity_dir / "audio"), "--seconds", "40", "--repeat", "1"])
    [line] = capsys.readouterr().out.splitlines()
    report = json.loads(line)
    assert report["same_text"] is True and report["deltas"] == 2 and report["audio_s"] >= 40
    assert 0 < report["first_delta_s"] <= report["done_s"] and report["without_stream_s"] > 0


def test_a_setting_left_blank_in_the_environment_is_its_default(monkeypatch):
    """A deployment that lists every variable, some blank (``BATCHASR_LENGTH_BUCKET_S=``), failed to start."""
    from service.config import get_settings

    for name in ("LENGTH_BUCKET_S", "JOB_PREFETCH", "MAX_BATCH_AUDIO_S", "REDIS_URL", "MODEL", "WORKER_NAME"):
        monkeypatch.setenv(f"BATCHASR_{name}", "")
    settings = get_settings()
    assert settings.length_bucket_s is None and settings.job_prefetch is None and settings.redis_url is None
    assert settings.batch_audio_limit_s == Settings().batch_audio_limit_s and settings.model is None
    # those with a default of their own take it: a blank HOST had the server listen on every interface, a blank
    # list of retry delays sent webhooks once, and a blank number or limit refused to start
    for name in ("HOST", "PORT", "JOB_MAX_QUEUED_ITEMS", "TOKEN_SCORES", "MODEL_ALIASES", "WEBHOOK_RETRY_DELAYS_S",
                 "DEVICE", "MAX_SEGMENT_S"):
        monkeypatch.setenv(f"BATCHASR_{name}", " ")
    settings = get_settings()
    for name, field in Settings.model_fields.items():
        assert getattr(settings, name) == field.get_default(call_default_factory=True), name
    monkeypatch.setenv("BATCHASR_LANGUAGES", "")
    assert get_settings().languages == []  # the one whose blank says something: any language


def test_a_stopping_server_waits_for_requests_in_flight_whole_seconds_rounded_up():
    """uvicorn takes its grace in whole seconds: a request timeout under a second was cut to none (requests in flight
    cancelled at a stop)."""
    assert Settings(request_timeout_s=0.5).shutdown_grace_s == 1 and Settings().shutdown_grace_s == 600


def test_languages_setting_takes_codes_and_none_takes_any(monkeypatch, hybrid, parity_audio):
    from pydantic import ValidationError

    from service.config import get_settings

    monkeypatch.setenv("BATCHASR_LANGUAGES", "EN,de")
    assert get_settings().languages == ["en", "de"]
    with pytest.raises(ValidationError, match="not 'english'"):
        Settings(languages=["english"])
    data = Path(parity_audio[0]).read_bytes()
    with run_server(Settings(languages=[]), hybrid) as running:
        answer = _post(running.url, data, response_format="verbose_json", language="de")
        card = httpx.get(f"{running.url}/v1/models").json()["data"][0]
    assert answer.status_code == 200 and answer.json()["language"] == "german" and card["languages"] == []
