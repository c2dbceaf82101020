"""`batchasr serve --frontends N`: HTTP in front-end processes, the model in the engine's process.

Real processes over real sockets: the results equal one process's, the queue's limits and disconnects reach the
engine's process, metrics from every front end meet in one exposition, a dead front end is replaced, front ends
do not outlive the engine, and SIGTERM finishes what is in flight.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import socket
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
from hypothesis import given, settings
from hypothesis import strategies as st

from models import load_model
from models.audio_io import read_audio
from service.batcher import BatcherClosed, Priority, QueueFull, WorkItem
from service.config import Settings, auto_frontends, quota_cores, usable_cores
from service.engine import Engine
from service.engine_link import EngineLink
from service.engine_server import EngineServer
from service.job_worker import JobMetrics
from service.metrics import FORWARDED_METRIC_CALLS, Metrics
from service.runtime import build_stack
from service.transcriber import Transcriber
from service.webhook_worker import WebhookMetrics
from service.wire import EngineUnavailable, FrameProtocol, ItemsFailed, send_frame, split_samples
from tests.conftest import long_recording
from tests.redis_server import RedisServer
from tests.servers import send_head, serve_process, stream_transcription

MODEL = "tdt_ctc_hybrid.nemo"


def _transcribe(url: str, audio: bytes, route: str = "/v1/transcribe", timeout: float = 60) -> httpx.Response:
    if route == "/v1/transcribe":
        return httpx.post(f"{url}{route}", content=audio, headers={"content-type": "audio/wav"}, timeout=timeout)
    return httpx.post(f"{url}{route}", files={"file": ("a.wav", audio, "audio/wav")}, timeout=timeout)


def _eventually(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is not alive
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def server(parity_dir):
    with serve_process(parity_dir / MODEL, frontends=2, max_wait_ms=20, max_batch_size=16) as running:
        yield running


def test_front_ends_answer_as_one_process_does(server, parity_dir, parity_audio):
    """Tokens, frames and words, over both routes, against the model in this process; 40 requests at once, so
    both front ends serve and the engine batches across them."""
    model = load_model(parity_dir / MODEL, device="cpu", dtype="float32")
    expected = dict(zip(parity_audio, model.transcribe(parity_audio), strict=True))
    files = [parity_audio[i % len(parity_audio)] for i in range(40)]
    before = {name: server.metric(name) for name in ("batchasr_batch_size_count", "batchasr_batch_size_sum")}

    async def send_all():
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(path):
                return path, await client.post(f"{server.url}/v1/transcribe", content=Path(path).read_bytes(),
                                               headers={"content-type": "audio/wav"})
            return await asyncio.gather(*(one(p) for p in files))

    for path, response in asyncio.run(send_all()):
        assert response.status_code == 200, response.text
        body, want = response.json(), expected[path]
        assert body["text"] == want.text and body["tokens"] == want.tokens
        assert body["token_frames"] == want.token_frames
        assert [w["word"] for w in body["words"]] == [w.word for w in want.words]
    openai = _transcribe(server.url, Path(parity_audio[0]).read_bytes(), "/v1/audio/transcriptions")
    assert openai.json()["text"] == expected[parity_audio[0]].text
    batches = server.metric("batchasr_batch_size_count") - before["batchasr_batch_size_count"]
    items = server.metric("batchasr_batch_size_sum") - before["batchasr_batch_size_sum"]
    assert items == 41 and items / batches > 1, (items, batches)
    front_ends = server.front_end_pids()
    assert len(front_ends) == 2
    for pid in front_ends:  # they served all that without the model's code: no torch in their memory
        assert "libtorch" not in Path(f"/proc/{pid}/maps").read_text()


def test_hotwords_travel_through_a_front_end_to_the_engine(server, parity_dir, parity_audio):
    model = load_model(parity_dir / MODEL, device="cpu", dtype="float32")
    plain, boosted = (model.transcribe([parity_audio[0]], hotwords=words)[0] for words in ([], ["nose"]))
    assert boosted.tokens != plain.tokens  # on this random model "nose" wins where it is boosted
    response = httpx.post(f"{server.url}/v1/transcribe?hotwords=nose", content=Path(parity_audio[0]).read_bytes(),
                          headers={"content-type": "audio/wav"}, timeout=120)
    assert response.status_code == 200 and response.json()["tokens"] == boosted.tokens


def test_a_long_stream_through_a_front_end_says_what_one_request_does(server, parity_audio):
    recording, _ = long_recording(parity_audio, 70)  # three pieces of at most 30 s
    buffer = io.BytesIO()
    sf.write(buffer, recording, 16000, format="FLAC")
    *deltas, done = stream_transcription(server.url, buffer.getvalue())
    whole = httpx.post(f"{server.url}/v1/transcribe", content=buffer.getvalue(),
                       headers={"content-type": "audio/flac"}, timeout=120).json()
    assert whole["segments"] == 3 and len(deltas) == 3
    assert "".join(d["delta"] for d in deltas) == done["text"] == whole["text"]


def test_a_stereo_call_through_a_front_end_is_transcribed_apart_with_its_quiet_skipped(server, parity_dir,
                                                                                     parity_audio):
    """Multichannel and skip_silence through a front end: each channel as the model here reads it."""
    model = load_model(parity_dir / MODEL, device="cpu", dtype="float32")
    clips = [sf.read(p, dtype="float32")[0] for p in parity_audio[:2]]
    call = np.zeros((2, 12 * 16000), np.float32)
    call[0, : len(clips[0])] = clips[0]
    call[1, 8 * 16000 : 8 * 16000 + len(clips[1])] = clips[1]  # the second speaker after 8 s of quiet
    buffer = io.BytesIO()
    sf.write(buffer, call.T, 16000, format="FLAC")
    response = httpx.post(f"{server.url}/v1/transcribe", params={"multichannel": "true", "skip_silence": "true"},
                          content=buffer.getvalue(), headers={"content-type": "audio/flac"}, timeout=120)
    assert response.status_code == 200, response.text
    expected = model.transcribe(call, multichannel=True, skip_silence=True)[0]
    assert [c["tokens"] for c in response.json()["channels"]] == [t.tokens for t in expected.channels]
    assert [c["token_frames"] for c in response.json()["channels"]] == [t.token_frames for t in expected.channels]
    assert response.json()["text"] == expected.text


def test_every_front_ends_requests_and_event_loop_show_in_one_exposition(server, parity_audio):
    route = '{code="200",route="/v1/transcribe"}'
    first = server.metric("batchasr_requests_total", route)
    loop_first = server.metric("batchasr_event_loop_cpu_seconds_total")
    data = Path(parity_audio[2]).read_bytes()
    with ThreadPoolExecutor(8) as pool:  # new connections: the kernel spreads them over both front ends
        assert all(r.status_code == 200 for r in pool.map(lambda _: _transcribe(server.url, data), range(24)))
    assert _eventually(lambda: server.metric("batchasr_requests_total", route) - first == 24)
    assert server.metric("batchasr_intake_wait_seconds_count") >= 24  # counted in the front ends, shown here
    assert server.metric("batchasr_event_loop_cpu_seconds_total") > loop_first
    assert server.metric("batchasr_audio_seconds_total") > 0 and server.metric("batchasr_rtfx") > 0


def test_bad_input_is_refused_by_the_front_end_and_nothing_breaks(server, parity_audio):
    assert _transcribe(server.url, b"").status_code == 400
    assert _transcribe(server.url, b"\x00" * 5000).status_code == 400
    assert _transcribe(server.url, Path(parity_audio[1]).read_bytes()).status_code == 200
    assert httpx.get(f"{server.url}/readyz").json() == {"status": "ready", "problems": []}


def test_a_front_end_refuses_a_request_head_past_the_limit(server):
    labels = '{code="431",route="unmatched"}'
    counted = server.metric("batchasr_requests_total", labels)
    assert send_head(server.url, 100_000, path="/v1/models") == b"HTTP/1.1 431 Request Header Fields Too Large"
    # counted in the front end's engine process, as its other answers are
    assert _eventually(lambda: server.metric("batchasr_requests_total", labels) == counted + 1)
    assert send_head(server.url, 4_000, path="/v1/models") == b"HTTP/1.1 200 OK"


def test_a_full_engine_queue_answers_429_through_the_front_end(parity_dir, parity_audio):
    data = Path(parity_audio[7]).read_bytes()
    with serve_process(parity_dir / MODEL, frontends=2, max_queue=3, max_wait_ms=3000, max_batch_size=64) as running, \
            ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda _: _transcribe(running.url, data), range(6)))
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) == 3 and codes.count(429) == 3, codes
    rejected = next(r for r in responses if r.status_code == 429)
    assert int(rejected.headers["retry-after"]) >= 1 and rejected.json()["error"]["code"] == "queue_full"


def test_a_client_that_goes_away_never_reaches_the_engine(parity_dir, parity_audio):
    data = Path(parity_audio[0]).read_bytes()
    with serve_process(parity_dir / MODEL, frontends=1, max_wait_ms=1500, max_batch_size=64) as running:
        with pytest.raises(httpx.ReadTimeout):
            _transcribe(running.url, data, timeout=0.4)
        time.sleep(2.0)  # past max_wait: the batch would have formed by now
        assert running.metric("batchasr_dropped_items_total", '{reason="cancelled"}') == 1
        assert running.metric("batchasr_batch_size_count") == 0


def test_a_dead_front_end_is_replaced_and_sigterm_finishes_the_requests_in_flight(parity_dir, parity_audio):
    data = Path(parity_audio[2]).read_bytes()
    with serve_process(parity_dir / MODEL, frontends=2, max_wait_ms=3000, max_batch_size=64) as running:
        killed = running.front_end_pids()[0]
        os.kill(killed, signal.SIGKILL)
        assert _eventually(lambda: len(running.front_end_pids()) == 2 and killed not in running.front_end_pids())
        with ThreadPoolExecutor(8) as pool:
            assert all(r.status_code == 200 for r in pool.map(lambda _: _transcribe(running.url, data), range(8)))
            futures = [pool.submit(_transcribe, running.url, data) for _ in range(4)]
            # queued in the engine's process, waiting for the batch to fill (a fixed sleep lost the race on a busy
            # machine: SIGTERM reached the front ends before they had accepted the requests)
            assert _eventually(lambda: running.metric("batchasr_queue_depth") == 4)
            front_ends = running.front_end_pids()
            running.process.send_signal(signal.SIGTERM)
            time.sleep(1.0)
            # the port is closed at once: a new connection is refused, not left waiting to be reset
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"{running.url}/healthz", timeout=5)
            assert running.stop() == 0
            assert [f.result().status_code for f in futures] == [200] * 4
        assert not any(_alive(pid) for pid in front_ends)


def test_front_ends_do_not_outlive_the_engines_process(parity_dir, parity_audio):
    with serve_process(parity_dir / MODEL, frontends=2) as running:
        front_ends = running.front_end_pids()
        running.process.kill()  # no chance to stop them
        running.process.wait(10)
        assert _eventually(lambda: not any(_alive(pid) for pid in front_ends), timeout=20)


def test_a_stalled_client_does_not_keep_a_front_end_alive_after_the_engines_process(parity_dir):
    """An upload that stalls when the engine's process dies held its orphaned front end for the whole request
    timeout (600 s by default)."""
    from service.processes import ENGINE_LOST_GRACE_S

    with serve_process(parity_dir / MODEL, frontends=1, request_timeout_s=120) as running:
        front_end = running.front_end_pids()[0]
        with socket.create_connection(("127.0.0.1", int(running.url.rsplit(":", 1)[1]))) as client:
            client.sendall(b"POST /v1/transcribe HTTP/1.1\r\nhost: x\r\ncontent-type: audio/wav\r\n"
                           b"content-length: 100000\r\n\r\n" + bytes(1000))  # and no more
            time.sleep(0.5)
            running.process.kill()
            running.process.wait(10)
            assert _eventually(lambda: not _alive(front_end), timeout=ENGINE_LOST_GRACE_S + 10)


# the command line, its engine failing at its first batch (as a broken GPU makes it fail)
FAILING_ENGINE = ("-c", "import sys; from service.engine import Engine; from service.cli import main\n"
                        "def broken(self, staged): raise RuntimeError('a fault in the loop')\n"
                        "Engine.process = broken; sys.exit(main(sys.argv[1:]))")


def test_a_failed_engine_exits_without_waiting_for_a_stalled_client(parity_dir, parity_audio):
    """The engine failed, and the process stopped its front ends as at a SIGTERM: one stalled upload held it for
    the request timeout (52 s of 60) before a supervisor could start a fresh one. The links close first now, and
    the front ends finish what they can within ENGINE_LOST_GRACE_S."""
    from service.processes import ENGINE_LOST_GRACE_S

    with (serve_process(parity_dir / MODEL, frontends=1, cli=FAILING_ENGINE, request_timeout_s=60) as running,
          socket.create_connection(("127.0.0.1", int(running.url.rsplit(":", 1)[1]))) as client):
        client.sendall(b"POST /v1/transcribe HTTP/1.1\r\nhost: x\r\ncontent-type: audio/wav\r\n"
                       b"content-length: 100000\r\n\r\n" + bytes(1000))  # and no more
        time.sleep(0.5)
        started = time.monotonic()
        assert _transcribe(running.url, Path(parity_audio[0]).read_bytes()).status_code in (500, 503)
        assert running.process.wait(ENGINE_LOST_GRACE_S + 20) == 1
        assert time.monotonic() - started < ENGINE_LOST_GRACE_S + 15


def test_a_temporary_directory_too_long_for_a_socket_path_is_not_the_engines_end(parity_dir, parity_audio,
                                                                                   tmp_path):
    """The engine's socket lies in the temporary directory, and a Unix socket's path has 108 bytes: a TMPDIR of 102
    characters ended `serve --frontends` with "AF_UNIX path too long" (and an abort) once the model had loaded."""
    long_dir = tmp_path / ("d" * max(1, 102 - len(str(tmp_path)) - 1))
    long_dir.mkdir()
    assert len(str(long_dir)) >= 100
    with serve_process(parity_dir / MODEL, frontends=1, env={"TMPDIR": str(long_dir)}) as running:
        assert _transcribe(running.url, Path(parity_audio[0]).read_bytes()).status_code == 200


@pytest.mark.parametrize("command", ["serve --frontends 1", "worker", "worker, consumer processes"])
def test_a_port_taken_is_one_line_before_the_model_loads(parity_dir, command):
    """A worker's metrics port was bound once the model had loaded, and a taken one ended it with a traceback (and
    with consumer processes, an abort); `serve --frontends` on a taken port printed a traceback too."""
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        args = (["serve", "--frontends", "1", "--port", port] if command.startswith("serve") else
                ["worker", "--redis-url", "redis://127.0.0.1:1", "--metrics-port", port])
        env = {**os.environ, "BATCHASR_JOB_CONSUMERS": "1" if "consumer" in command else "0"}
        done = subprocess.run([sys.executable, "-m", "service.cli", *args, "--model", str(parity_dir / MODEL)],
                              env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().startswith("error: cannot ") and port in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "loaded" not in done.stderr.lower()


def test_an_engine_process_that_stops_answering_is_not_called_ready(parity_dir, parity_audio):
    """SIGSTOP the engine's process (as a hang would leave it): the front ends said ready for as long, took new
    requests for it, and /metrics failed as an internal error (500) after its scrape timed out."""
    from service.engine_link import ENGINE_SILENT_S, SCRAPE_TIMEOUT_S

    with serve_process(parity_dir / MODEL, frontends=1) as running, ThreadPoolExecutor(1) as pool:
        running.process.send_signal(signal.SIGSTOP)
        try:
            scrape = pool.submit(httpx.get, f"{running.url}/metrics", timeout=SCRAPE_TIMEOUT_S + 20)
            assert _eventually(lambda: httpx.get(f"{running.url}/readyz", timeout=5).status_code == 503,
                               timeout=ENGINE_SILENT_S + 10)
            assert "has not answered" in httpx.get(f"{running.url}/readyz", timeout=5).json()["problems"][0]
            refused = _transcribe(running.url, Path(parity_audio[0]).read_bytes())
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "not_ready"
            assert httpx.get(f"{running.url}/healthz", timeout=5).status_code == 200  # not failed: it may go on
            assert scrape.result().status_code == 503
            assert scrape.result().json()["error"]["code"] == "engine_unavailable"
        finally:
            running.process.send_signal(signal.SIGCONT)
        assert _eventually(lambda: httpx.get(f"{running.url}/readyz", timeout=5).status_code == 200)
        assert _transcribe(running.url, Path(parity_audio[0]).read_bytes()).status_code == 200


def test_bulk_jobs_through_a_front_end_and_a_consumer_process(parity_dir, parity_audio, tmp_path):
    model = load_model(parity_dir / MODEL, device="cpu", dtype="float32")
    expected = [t.text for t in model.transcribe(parity_audio)]
    redis = RedisServer(tmp_path).start()
    try:
        with serve_process(parity_dir / MODEL, frontends=1, job_consumers=1, redis_url=redis.url) as running:
            files = [("files", (Path(p).name, Path(p).read_bytes(), "audio/wav")) for p in parity_audio]
            job = httpx.post(f"{running.url}/v1/jobs", files=files, timeout=60).json()
            assert _eventually(lambda: httpx.get(f"{running.url}/v1/jobs/{job['id']}").json()["status"]
                               == "completed", timeout=60)
            lines = httpx.get(f"{running.url}/v1/jobs/{job['id']}/results").text.splitlines()
            assert [json.loads(line)["text"] for line in lines] == expected
            assert running.metric("batchasr_job_items_total", '{status="completed"}') == len(parity_audio)
            helpers = running.front_end_pids()  # the front end and the consumer, which ps tells apart
            assert sorted(Path(f"/proc/{pid}/comm").read_text().strip() for pid in helpers) == [
                "asr-consumer-0", "asr-frontend-0"]
    finally:
        redis.stop()


def test_a_consumer_process_lets_a_cancelled_jobs_items_go(parity_dir, parity_audio, tmp_path):
    """In a consumer process of its own, the items a cancelled job's consumer holds wait in the engine's batcher
    across the link: they are let go there too (the batch would have waited two minutes to fill)."""
    redis = RedisServer(tmp_path).start()
    try:
        with serve_process(parity_dir / MODEL, frontends=1, job_consumers=1, redis_url=redis.url,
                           max_batch_size=64, max_wait_ms=120_000, job_prefetch=8) as running:
            files = [("files", (Path(p).name, Path(p).read_bytes(), "audio/wav")) for p in parity_audio[:8]]
            job = httpx.post(f"{running.url}/v1/jobs", files=files, timeout=60).json()
            assert _eventually(lambda: running.metric("batchasr_queue_depth") == 8, timeout=60)
            assert httpx.delete(f"{running.url}/v1/jobs/{job['id']}", timeout=30).status_code == 200
            assert _eventually(lambda: httpx.get(f"{running.url}/v1/jobs/{job['id']}").json()["status"]
                               == "cancelled", timeout=30)
            assert httpx.get(f"{running.url}/v1/jobs/{job['id']}").json()["counts"]["cancelled"] == 8
            assert _eventually(lambda: running.metric("batchasr_queue_depth") == 0, timeout=10)
            assert running.metric("batchasr_dropped_items_total", '{reason="cancelled"}') == 8
    finally:
        redis.stop()


def test_job_consumer_processes_need_front_ends_under_serve(parity_dir):
    env = {**os.environ, "BATCHASR_JOB_CONSUMERS": "2"}
    done = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--model", str(parity_dir / MODEL)],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "need front-end processes" in done.stderr


# --- the link, in one process ----------------------------------------------------------------------------------


def test_a_link_learns_when_the_engine_is_ready_and_when_it_goes_away(parity_dir, parity_audio, tmp_path,
                                                                     monkeypatch):
    """Engine server and link on one event loop over a real Unix socket: a front end that connects while the
    engine warms up hears when it is ready; requests come back as the model in this process answers them;
    when the engine's side closes, the link says why and calls its ``on_lost``."""
    warm = threading.Event()
    warm_up = Engine._warm_up
    monkeypatch.setattr(Engine, "_warm_up", lambda engine: (warm.wait(30), warm_up(engine)))
    model = load_model(parity_dir / MODEL, device="cpu", dtype="float32")
    waveform = read_audio(parity_audio[3], model.sample_rate)
    expected = model.transcribe([waveform])[0]

    async def scenario() -> None:
        stack = build_stack(Settings(max_wait_ms=5), model)
        server = EngineServer(stack, str(tmp_path / "engine.sock"))
        await server.start()
        lost = asyncio.Event()
        link = await EngineLink.connect(server.path, lost.set)
        try:
            assert not link.ready and link.error is None
            warm.set()
            for _ in range(200):
                if link.ready:
                    break
                await asyncio.sleep(0.05)
            assert link.ready
            transcriber = Transcriber(link, link.config, link.tokenizer, 30.0, 2.0, 60.0)
            result = await transcriber.transcribe(waveform)
            assert result.transcript.tokens == expected.tokens and result.transcript.text == expected.text
            assert b"batchasr_batch_size_count 1.0" in await link.scrape()
            owners = []  # a job item's owner crosses the link: the engine's batcher takes turns by it
            submit = stack.batcher.submit
            stack.batcher.submit = lambda items: (owners.extend(item.owner for item in items), submit(items))[1]
            result = await transcriber.transcribe(waveform, Priority.BULK, owner="alice")
            assert owners == ["alice"] and result.transcript.tokens == expected.tokens
        finally:
            await server.close()
            await stack.stop()
        await asyncio.wait_for(lost.wait(), 10)
        assert not link.ready and "went away" in link.error
        with pytest.raises(EngineUnavailable):
            link.submit([WorkItem(waveform)])
        link.close()

    asyncio.run(scenario())


def test_a_recording_whose_samples_pass_a_frames_limit_goes_in_several(parity_dir, parity_audio, tmp_path,
                                                                        monkeypatch):
    """A frame's header holds its payload's size in 32 bits: a 19-hour recording's pieces failed as an internal
    error. They go in as many frames as they need now (here with a limit of 3 s of samples a frame)."""
    from service import engine_link

    monkeypatch.setattr(engine_link, "MAX_PAYLOAD_BYTES", 16000 * 4 * 3)
    model = load_model(parity_dir / MODEL, device="cpu", dtype="float32")
    waveform = np.concatenate([read_audio(path, model.sample_rate) for path in parity_audio])  # 28 s
    expected = model.transcribe([waveform], max_segment_s=5.0)[0]
    frames = []

    async def scenario() -> list[int]:
        stack = build_stack(Settings(max_wait_ms=5), model)
        server = EngineServer(stack, str(tmp_path / "engine.sock"))
        await server.start()
        link = await EngineLink.connect(server.path, lambda: None)
        send = link._send
        link._send = lambda message, payload=None: (frames.append(len(payload or ())), send(message, payload))[1]
        try:
            for _ in range(200):
                if link.ready:
                    break
                await asyncio.sleep(0.05)
            result = await Transcriber(link, link.config, link.tokenizer, 5.0, 2.0, 60.0).transcribe(waveform)
            return result.transcript.tokens
        finally:
            await server.close()
            await stack.stop()
            link.close()

    assert asyncio.run(scenario()) == expected.tokens
    assert len([n for n in frames if n]) > 5 and max(frames) == 1  # a piece (up to 5 s) a frame


def test_bulk_pieces_are_not_sent_while_the_engines_queue_has_no_room_for_them(parity_dir, tmp_path):
    """A job consumer in a process of its own tries an item again every 0.2 s while the engine's queue is full: each
    try sent the recording's every sample over the socket (370 MB/s for a 40-minute one), to be refused. Bulk pieces
    now wait, unsent, while the engine's last status says there is no room, or it has refused since; an HTTP
    request's are sent, the engine to judge."""
    model = load_model(parity_dir / MODEL, device="cpu", dtype="float32")
    piece = np.zeros(16000, dtype=np.float32)
    sent: list[str] = []

    async def status(link: EngineLink, check) -> None:
        for _ in range(100):
            if check(link.status):
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"the engine's status never came: {link.status}")

    async def scenario() -> None:
        stack = build_stack(Settings(max_queue=3, max_batch_size=32, max_wait_ms=60_000), model)
        server = EngineServer(stack, str(tmp_path / "engine.sock"))
        await server.start()
        link = await EngineLink.connect(server.path, lambda: None)
        send = link._send
        link._send = lambda message, payload=None: (sent.append(type(message).__name__), send(message, payload))[1]
        try:
            await status(link, lambda s: s.ready)
            waiting = [WorkItem(piece) for _ in range(3)]  # held: a batch waits a minute for more
            link.submit(waiting)
            await status(link, lambda s: s.room == 0)
            sent.clear()
            with pytest.raises(QueueFull):
                link.submit([WorkItem(piece, Priority.BULK)])
            assert sent == []
            refused = WorkItem(piece)  # an HTTP request's: sent, and refused there
            link.submit([refused])
            with pytest.raises(QueueFull):
                await asyncio.wrap_future(refused.future)
            assert sent == ["Submit"]
            for item in waiting:  # the queue emptied: the next status says so, and bulk pieces go again
                item.future.cancel()
            await status(link, lambda s: s.room == 2)  # bulk work's share of the queue (batcher.queue_limit)
            link.submit([WorkItem(piece, Priority.BULK)])
            assert sent[-1] == "Submit"
        finally:
            await server.close()
            await stack.stop()
            link.close()

    asyncio.run(scenario())


# --- the wire --------------------------------------------------------------------------------------------------


def test_samples_travel_as_raw_bytes_and_come_back_as_their_pieces():
    pieces = [np.arange(n, dtype=np.float32) / 7 for n in (5, 0, 3)]
    payload = bytearray(b"".join(p.tobytes() for p in pieces))
    back = split_samples(payload, (5, 0, 3))
    assert [b.tolist() for b in back] == [p.tolist() for p in pieces]
    assert all(b.flags.writeable for b in back)
    with pytest.raises(ValueError, match="payload holds 8 samples"):
        split_samples(payload, (5, 4))


def test_refusals_come_back_as_the_exceptions_the_routes_map():
    full = ItemsFailed.from_exception((1, 2), QueueFull(7)).exception()
    assert isinstance(full, QueueFull) and full.retry_after_s == 7
    assert isinstance(ItemsFailed.from_exception((1,), TimeoutError("late")).exception(), TimeoutError)
    assert isinstance(ItemsFailed.from_exception((1,), BatcherClosed("stopping")).exception(), EngineUnavailable)
    other = ItemsFailed.from_exception((1,), ValueError("bad")).exception()
    assert type(other) is RuntimeError and "ValueError: bad" in str(other)


class _Transport:
    """What ``send_frame`` writes to: the bytes, in order."""

    def __init__(self):
        self.sent = bytearray()

    def write(self, data) -> None:
        self.sent += bytes(data)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 40_000), min_size=1, max_size=6), words=st.lists(st.text(max_size=30_000),
       min_size=1, max_size=6), chunks=st.lists(st.integers(1, 70_000), min_size=1, max_size=30))
def test_frames_arrive_whole_however_the_socket_cuts_them(sizes, words, chunks):
    """Small messages, messages larger than the staging buffer, payloads of any size: read in chunks of any
    size, each frame comes out once, whole, in order."""
    transport = _Transport()
    sent = []
    for i, (size, text) in enumerate(zip(sizes, words * len(sizes), strict=False)):
        samples = np.arange(size, dtype=np.float32) + i
        send_frame(transport, (i, text), [samples[: size // 2], samples[size // 2:]])
        sent.append(((i, text), samples))
    received = []
    protocol = FrameProtocol(lambda message, payload: received.append((message, payload)), lambda exc: None)
    stream, at, turn = bytes(transport.sent), 0, 0
    while at < len(stream):
        buffer = protocol.get_buffer(-1)
        n = min(len(buffer), chunks[turn % len(chunks)], len(stream) - at)
        buffer[:n] = stream[at:at + n]
        protocol.buffer_updated(n)
        at, turn = at + n, turn + 1
    assert [m for m, _ in received] == [m for m, _ in sent]
    for (_, payload), (_, samples) in zip(received, sent, strict=True):
        assert np.array_equal(np.frombuffer(payload, dtype=np.float32), samples)


def test_every_count_a_consumer_makes_crosses_the_link():
    """A consumer or front-end process counts through its link, which the engine's process takes only for these
    names."""
    calls = {name for protocol in (JobMetrics, WebhookMetrics) for name in vars(protocol)
             if not name.startswith("_")} | {"observe_intake_wait"}
    assert calls and calls <= set(FORWARDED_METRIC_CALLS)
    assert all(callable(getattr(EngineLink, name)) and callable(getattr(Metrics, name)) for name in calls)


def _ignores_sigterm(ready: Path) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.touch()
    time.sleep(60)


def test_stuck_helper_processes_share_one_grace_period(tmp_path):
    """They were joined one after another, each with the whole grace: N stuck front ends took N grace periods."""
    from service.processes import ProcessPool, ProcessSpec

    specs = [ProcessSpec(f"stuck-{i}", _ignores_sigterm, (tmp_path / str(i),)) for i in range(3)]
    pool = ProcessPool(specs, stop_grace_s=1.5)
    pool.start()
    assert _eventually(lambda: len(list(tmp_path.iterdir())) == 3, timeout=60)  # each ignores SIGTERM now
    started = time.monotonic()
    asyncio.run(pool.stop())
    assert time.monotonic() - started < 3.0  # one grace period (1.5 s), then all killed; not 4.5 s


def test_a_replacement_that_cannot_be_started_is_tried_again(monkeypatch):
    """One failed start (fork refused at a process or memory limit) ended the watcher: no process that died after
    it was ever replaced, and nothing said so."""
    from service import processes

    monkeypatch.setattr(processes, "RESPAWN_DELAY_S", 0.05)
    pool = processes.ProcessPool([processes.ProcessSpec("short-lived", time.sleep, (0.0,))], stop_grace_s=5)
    spawn, starts = pool._spawn, []

    def flaky_spawn(spec: processes.ProcessSpec):
        starts.append(spec)
        if len(starts) == 2:  # the first replacement
            raise OSError(11, "Resource temporarily unavailable")
        return spawn(spec)

    monkeypatch.setattr(pool, "_spawn", flaky_spawn)

    async def scenario() -> None:
        pool.start()
        watcher = asyncio.create_task(pool.watch())
        deadline = time.monotonic() + 60
        while len(starts) < 4 and not watcher.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        watcher.cancel()
        await pool.stop()

    asyncio.run(scenario())
    assert len(starts) >= 4  # the start that failed, and replacements after it


@pytest.mark.parametrize(("device", "cores", "frontends"), [
    ("cuda", 16, 4), ("cuda", 64, 4), ("cuda", 6, 3), ("cuda", 2, 1), ("cuda", 1, 0), ("cpu", 64, 0), ("cpu", 2, 0)])
def test_unset_front_ends_are_four_on_a_gpu_and_none_on_a_cpu(device, cores, frontends):
    """An H200 served 2.2x the RTFx through 4 front ends than with HTTP in the engine's process (its event loop the
    limit); on a CPU they would take the model's cores."""
    assert auto_frontends(device, cores) == frontends


@pytest.mark.parametrize(("cpu_max", "cores"), [("400000 100000", 4), ("150000 100000", 2), ("50000 100000", 1),
                                             ("max 100000", None), ("", None), ("junk", None)])
def test_a_containers_cpu_quota_counts_as_its_cores(cpu_max, cores, tmp_path):
    """A Kubernetes pod limited to 4 CPUs sees every core of its node: its quota (cgroup v2's cpu.max) decides."""
    assert quota_cores(cpu_max) == cores
    (tmp_path / "cpu.max").write_text(cpu_max + "\n")
    everything = usable_cores(str(tmp_path / "none"))
    assert usable_cores(str(tmp_path / "cpu.max")) == min(everything, cores or everything)


def test_serve_without_front_ends_asked_for_says_how_many_it_runs(parity_dir, parity_audio):
    """On a CPU, none: HTTP in the engine's process, and the log says why."""
    with serve_process(parity_dir / MODEL, frontends=None) as running:
        response = httpx.post(f"{running.url}/v1/transcribe", content=Path(parity_audio[0]).read_bytes(),
                              headers={"content-type": "audio/wav"}, timeout=60)
        assert response.status_code == 200 and response.json()["text"]
        assert running.front_end_pids() == []
        assert f"0 HTTP front-end processes (BATCHASR_FRONTENDS unset; cpu, {usable_cores()} cores)" in \
            running.log_text()
