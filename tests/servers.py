"""Test helpers: a real uvicorn server on a free port, in a thread of the test process, or `batchasr serve
--frontends N` in processes of its own."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import httpx
import uvicorn

from models.asr_model import ASRModel
from service.api import create_app
from service.config import Settings
from service.head_limit import HTTP_PROTOCOL
from service.job_types import ItemInput, Job
from service.jobs import JobStore
from service.runtime import build_stack
from tests.ports import free_port


async def drain_jobs(settings: Settings, model: ASRModel, body: Callable[[JobStore], Awaitable[Any]]) -> None:
    """Run ``body(store)`` then drain the job stream with an in-process consumer on one engine."""
    stack = build_stack(settings, model)
    assert await asyncio.to_thread(stack.engine.wait_ready, 30)
    try:
        assert stack.jobs is not None, "drain_jobs needs settings.redis_url"
        await body(stack.jobs)
        await stack.make_consumer().drain()
    finally:
        await stack.stop()


def upload_items(paths: list[str], n: int) -> list[ItemInput]:
    """``n`` upload items, the files at ``paths`` in turn."""
    return [ItemInput(audio=Path(paths[i % len(paths)]).name, upload=Path(paths[i % len(paths)]).read_bytes())
            for i in range(n)]


async def settle_items(store: JobStore, count: int, state: str = "completed") -> None:
    """Deliver ``count`` items and finish each in ``state`` and acknowledge it, as a worker does."""
    taken = await store.read_items("c", count, block_ms=0)
    assert len(taken) == count
    for stream, message_id, fields in taken:
        job_id, index = fields[b"job"].decode(), int(fields[b"index"])
        await store.start_item(job_id, index)
        await store.finish_item(job_id, index, state, {"status": state}, error="unreachable" * (state == "failed"))
        await store.ack_item(stream, message_id)


def drained_jobs(settings: Settings, model: ASRModel, submit: Callable[[JobStore], Awaitable[dict[Any, Job]]]
                 ) -> dict[Any, Job]:
    """The jobs ``submit(store)`` makes (it returns them by name), as they are once an in-process consumer has
    drained the streams."""
    submitted: dict[Any, Job] = {}

    async def body(store: JobStore) -> None:
        submitted.update(await submit(store))

    async def read_back() -> dict[Any, Job]:
        store = JobStore.from_url(settings.redis_url)
        try:
            return {name: await store.get(job.id) for name, job in submitted.items()}
        finally:
            await store.close()

    asyncio.run(drain_jobs(settings, model, body))
    return asyncio.run(read_back())


def finished_job(url: str, n: int, words_each: int = 0) -> tuple[str, list[Path]]:
    """A job of ``n`` path items, each finished with a result naming its index (and ``words_each`` words)."""
    words = [{"word": f"w{i}", "start": i * 0.4, "end": i * 0.4 + 0.3, "confidence": 0.9} for i in range(words_each)]
    sources = [Path(f"/audio/{i:06d}.wav") for i in range(n)]

    async def scenario() -> str:
        store = JobStore.from_url(url)
        job, _ = await store.submit([ItemInput(audio=str(p), path=str(p)) for p in sources])
        for index in range(n):
            await store.start_item(job.id, index)
            await store.finish_item(job.id, index, "completed", {"audio": str(sources[index]), "status": "completed",
                                                                  "text": f"item {index}", "words": words})
        await store.close()
        return job.id

    return asyncio.run(scenario()), sources


def metric(url: str, name: str, labels: str = "") -> float:
    """A sample's value from the server's /metrics (0 when absent)."""
    text = httpx.get(f"{url}/metrics").text
    for line in text.splitlines():
        if line.startswith(f"{name}{labels} ") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_job(url: str, job_id: str, timeout_s: float = 120, headers: dict[str, str] | None = None) -> dict:
    """The job, once it has finished (its status no longer queued or in progress)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = httpx.get(f"{url}/v1/jobs/{job_id}", headers=headers).json()
        if job["status"] not in ("queued", "in_progress"):
            return job
        time.sleep(0.2)
    raise AssertionError("the job did not finish")


def stream_transcription(url: str, audio: bytes, **form: str) -> list[dict]:
    """POST audio to the OpenAI route with stream=true: the server-sent events, each checked to name its type on
    its `event:` line."""
    with httpx.stream("POST", f"{url}/v1/audio/transcriptions", files={"file": ("a.flac", audio, "audio/flac")},
                      data={"stream": "true", **form}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        blocks = [b for b in response.read().decode().split("\n\n") if b.strip()]
    return [parse_event(block) for block in blocks]


def parse_event(block: str) -> dict:
    """One server-sent event (``event: TYPE`` then ``data: JSON``): its data, checked to carry the same type."""
    event, data = block.strip().split("\n")
    assert event.startswith("event: ") and data.startswith("data: ")
    body = json.loads(data.removeprefix("data: "))
    assert body["type"] == event.removeprefix("event: ")
    return body


def wait_ready(url: str, timeout: float, alive=lambda: True) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive():
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    return False


class RunningServer:
    def __init__(self, server: uvicorn.Server, thread: threading.Thread, url: str, app):
        self.server, self.thread, self.url, self.app = server, thread, url, app

    @property
    def service(self):
        return self.app.state.service

    def metric(self, name: str, labels: str = "") -> float:
        return metric(self.url, name, labels)

    def shutdown(self, timeout: float = 60) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


@contextmanager
def run_server(settings: Settings, model: ASRModel, ready_timeout: float = 60, port: int | None = None
               ) -> Iterator[RunningServer]:
    """The app on a real uvicorn server in a thread, on ``port`` (a free one when not given), once ready."""
    port = port or free_port()
    app = create_app(settings.model_copy(update={"port": port}), model=model)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on",
                                           http=HTTP_PROTOCOL))  # as `batchasr serve` runs it
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    running = RunningServer(server, thread, f"http://127.0.0.1:{port}", app)
    if not wait_ready(running.url, ready_timeout):
        running.shutdown()
        raise RuntimeError("server did not become ready")
    try:
        yield running
    finally:
        running.shutdown()


class ServerProcess:
    """`batchasr serve` in a subprocess: the engine's process, and its front ends when asked for."""

    def __init__(self, process: subprocess.Popen, url: str, log: IO[str]):
        self.process, self.url, self.log = process, url, log

    def log_text(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def metric(self, name: str, labels: str = "") -> float:
        return metric(self.url, name, labels)

    def front_end_pids(self) -> list[int]:
        """Its front-end processes (children started by multiprocessing's spawn)."""
        out = subprocess.run(["pgrep", "-P", str(self.process.pid), "-f", "spawn_main"], capture_output=True,
                             text=True)
        return sorted(int(pid) for pid in out.stdout.split())

    def stop(self, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)


@contextmanager
def serve_process(model: Path, frontends: int | None = 2, ready_timeout: float = 120,
                  env: dict[str, str] | None = None, cli: tuple[str, ...] = ("-m", "service.cli"),
                  **settings: object) -> Iterator[ServerProcess]:
    """``batchasr serve --frontends N`` on a free port (None: no ``--frontends``); ``settings`` as BATCHASR_*
    variables, with ``env``; ``cli``: what python runs the command line with."""
    port = free_port()
    env = {**os.environ, **(env or {}), **{f"BATCHASR_{k.upper()}": str(v) for k, v in settings.items()}}
    # the log goes to a file, not a pipe: nobody reads it while the server runs
    with tempfile.TemporaryFile("w+") as log:
        asked = [] if frontends is None else ["--frontends", str(frontends)]
        process = subprocess.Popen([sys.executable, *cli, "serve", "--model", str(model), "--device",
                                    "cpu", "--dtype", "float32", "--port", str(port), *asked],
                                   env=env, stdout=subprocess.DEVNULL, stderr=log)
        running = ServerProcess(process, f"http://127.0.0.1:{port}", log)
        try:
            if not wait_ready(running.url, ready_timeout, alive=lambda: process.poll() is None):
                raise RuntimeError(f"server did not become ready: {running.log_text()[-3000:]}")
            yield running
        finally:
            for pid in running.front_end_pids():  # normally gone with the engine's process; never left behind
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if process.poll() is None:
                process.kill()
                process.wait(30)


def send_head(url: str, header_bytes: int, path: str = "/healthz", chunk: int = 1 << 16, whole: bool = False
              ) -> bytes:
    """A GET whose head carries one header of ``header_bytes``, sent a chunk at a time as a client would (or in one
    write, ``whole``): the first line of the answer (empty if the server closed the connection without one)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        start_line = f"GET {path} HTTP/1.1\r\nHost: x\r\nX-Padding: ".encode()
        try:
            if whole:
                conn.sendall(start_line + b"a" * header_bytes + b"\r\n\r\n")
            else:
                conn.sendall(start_line)
                for start in range(0, header_bytes, chunk):
                    conn.sendall(b"a" * min(chunk, header_bytes - start))
                conn.sendall(b"\r\n\r\n")
        except OSError:  # refused part way: the answer is waiting
            pass
        answer = b""
        with contextlib.suppress(OSError):
            while b"\r\n" not in answer and (data := conn.recv(4096)):
                answer += data
    return answer.split(b"\r\n", 1)[0]


class StreamedUpload:
    """A multipart body with one file field of ``total`` bytes, sent in chunks without a declared length (as
    chunked transfer encoding), counting the bytes the server took before it answered."""

    boundary = "batchasr-test-boundary"

    def __init__(self, field: str, total: int, chunk: int = 100_000):
        self.field, self.total, self.chunk = field, total, chunk
        self.sent = 0

    @property
    def content_type(self) -> str:
        return f"multipart/form-data; boundary={self.boundary}"

    def __iter__(self) -> Iterator[bytes]:
        yield (f'--{self.boundary}\r\nContent-Disposition: form-data; name="{self.field}"; filename="x.wav"\r\n'
               "Content-Type: audio/wav\r\n\r\n").encode()
        while self.sent < self.total:
            self.sent += self.chunk
            yield bytes(self.chunk)
        yield f"\r\n--{self.boundary}--\r\n".encode()
