"""Test helpers: a real uvicorn server on a free port, in a thread of the test process."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import uvicorn

from models.asr_model import ASRModel
from service.api import create_app
from service.config import Settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    def __init__(self, server: uvicorn.Server, thread: threading.Thread, url: str, app):
        self.server, self.thread, self.url, self.app = server, thread, url, app

    @property
    def service(self):
        return self.app.state.service

    def metric(self, name: str, labels: str = "") -> float:
        """A sample's value from /metrics (0 when absent)."""
        text = httpx.get(f"{self.url}/metrics").text
        for line in text.splitlines():
            if line.startswith(f"{name}{labels} ") or (not labels and line.startswith(f"{name} ")):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def shutdown(self, timeout: float = 60) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


@contextmanager
def run_server(settings: Settings, model: ASRModel, ready_timeout: float = 60) -> Iterator[RunningServer]:
    port = free_port()
    app = create_app(settings.model_copy(update={"port": port}), model=model)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    running = RunningServer(server, thread, f"http://127.0.0.1:{port}", app)
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{running.url}/readyz", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    else:
        running.shutdown()
        raise RuntimeError("server did not become ready")
    try:
        yield running
    finally:
        running.shutdown()
