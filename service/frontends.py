"""`batchasr serve --frontends N`: HTTP in N front-end processes, the model in this one.

One event loop parses every request, decodes its audio and words its answer, and it shares the interpreter lock
with the engine thread: on a GPU, at hundreds of requests a second, that loop is the limit, and the engine thread
launches its kernels in the loop's gaps. With front ends, HTTP spreads over N processes (one listening socket,
shared), and this process keeps the model, the batcher, the engine thread, the job consumer and the metrics; its
event loop only moves samples in and results out (``service.engine_server``).

Lifecycle: the engine warms up while the front ends start (``/readyz`` says so); a front end that dies is
started again; SIGTERM or SIGINT stops the front ends first (each finishes its requests, which the engine still
serves), then drains the engine and stops the job consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import tempfile
from multiprocessing.process import BaseProcess
from pathlib import Path

from .config import Settings
from .logs import configure_json_logging

log = logging.getLogger(__name__)

RESPAWN_DELAY_S = 1.0  # between a front end's death and its replacement, so a crash loop cannot spin
STOP_GRACE_S = 10.0  # beyond the front ends' own graceful-shutdown timeout, before they are killed


def listening_socket(host: str, port: int) -> socket.socket:
    """The socket every front end accepts on (the kernel hands each connection to one of them)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def run_frontend(settings: Settings, sock: socket.socket, engine_path: str, log_level: int) -> None:
    """A front-end process: uvicorn on the shared socket, the API over a link to the engine process."""
    import uvicorn

    from .api import create_frontend_app

    configure_json_logging(log_level)
    server: uvicorn.Server | None = None

    def engine_lost() -> None:
        if server is not None:
            server.should_exit = True  # finish what can be finished (nothing: every request fails 503), exit

    app = create_frontend_app(settings, engine_path, engine_lost)
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="on",
                                           timeout_graceful_shutdown=int(settings.request_timeout_s)))
    server.run(sockets=[sock])


class FrontendPool:
    """The front-end processes: started, restarted when one dies, stopped gracefully."""

    def __init__(self, settings: Settings, sock: socket.socket, engine_path: str, log_level: int):
        self.settings, self.sock, self.engine_path, self.log_level = settings, sock, engine_path, log_level
        self._context = multiprocessing.get_context("spawn")  # no inherited threads, CUDA state or locks
        self._processes: list[BaseProcess] = []
        self._stopping = False

    def start(self) -> None:
        self._processes = [self._spawn(index) for index in range(self.settings.frontends)]

    def _spawn(self, index: int) -> BaseProcess:
        process = self._context.Process(
            target=run_frontend, name=f"batchasr-frontend-{index}", daemon=True,
            args=(self.settings, self.sock, self.engine_path, self.log_level))
        process.start()
        return process

    async def watch(self) -> None:
        """Restart front ends that die, until ``stop``."""
        while not self._stopping:
            await asyncio.sleep(RESPAWN_DELAY_S)
            for index, process in enumerate(self._processes):
                if not self._stopping and not process.is_alive():
                    log.error("front end %d (pid %s) exited with %s; starting another", index, process.pid,
                              process.exitcode)
                    self._processes[index] = self._spawn(index)

    async def stop(self) -> None:
        """SIGTERM each front end (it stops accepting and finishes its requests), wait, kill stragglers."""
        self._stopping = True
        for process in self._processes:
            if process.is_alive() and process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)
        grace = self.settings.request_timeout_s + STOP_GRACE_S
        for process in self._processes:
            await asyncio.to_thread(process.join, grace)
            if process.is_alive():
                log.error("front end pid %s did not stop within %.0f s; killing it", process.pid, grace)
                process.kill()
                await asyncio.to_thread(process.join)


async def serve_with_frontends(settings: Settings, log_level: int = logging.INFO) -> int:
    """Run the engine here and ``settings.frontends`` HTTP front ends until SIGTERM or SIGINT."""
    from models.asr_model import load_model

    from .engine_server import EngineServer
    from .runtime import build_stack

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    sock = listening_socket(settings.host, settings.port)  # first: a taken port fails before the model loads
    model = await asyncio.to_thread(load_model, settings.model, settings.device, settings.dtype,
                                    settings.attention_kernel)
    stack = build_stack(settings, model)
    if stack.jobs is not None:
        stack.start_consumer()
    with tempfile.TemporaryDirectory(prefix="batchasr-") as private:  # created 0700: only this user connects
        engine_path = str(Path(private) / "engine.sock")
        server = EngineServer(stack, engine_path)
        await server.start()
        pool = FrontendPool(settings, sock, engine_path, log_level)
        pool.start()
        log.info("serving on http://%s:%d with %d front-end processes", settings.host, settings.port,
                 settings.frontends)
        watcher = asyncio.create_task(pool.watch())
        await stop.wait()
        log.info("stopping: front ends first, then the engine")
        watcher.cancel()
        await pool.stop()
        sock.close()
        await server.close()
        await stack.stop()
    log.info("stopped")
    return 0
