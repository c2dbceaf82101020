"""`batchasr serve --frontends N` (and `BATCHASR_JOB_CONSUMERS`): HTTP and job consumers in processes of their
own, the model in this one.

One event loop parses every request, decodes its audio and words its answer, and it shares the interpreter lock
with the engine thread: on a GPU, at hundreds of requests a second, that loop is the limit, and the engine thread
launches its kernels in the loop's gaps. With front ends, HTTP spreads over N processes (one listening socket,
shared), and this process keeps the model, the batcher, the engine thread and the metrics; its event loop only
moves samples in and results out (``service.engine_server``). Job consumers can move out the same way
(``BATCHASR_JOB_CONSUMERS``, for `batchasr worker` too): their Redis round trips then cost the engine nothing.

Lifecycle: the engine warms up while the front ends start (``/readyz`` says so); a process that dies is started
again; SIGTERM or SIGINT stops the front ends and consumers first (each finishes its requests or items, which the
engine still serves), then drains the engine.
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
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from .config import Settings
from .logs import configure_json_logging

log = logging.getLogger(__name__)

RESPAWN_DELAY_S = 1.0  # between a helper process's death and its replacement, so a crash loop cannot spin
STOP_GRACE_S = 10.0  # beyond the request timeout (a front end's graceful shutdown), before a helper is killed
# a front end whose engine process is gone: what it can still finish (an answer being written, an upload that is then
# told 503) gets this long, not the request timeout that a stalled client would hold it for, orphaned
ENGINE_LOST_GRACE_S = 5
UNIX_PATH_MAX = 108  # a Unix socket's path, with its terminating NUL


class CannotStart(Exception):
    """What keeps the service from starting, found before the model loads (a port taken, no room for the engine's
    socket) or as it loads (no head for BATCHASR_DECODER): one line and exit status 2, not a traceback."""


def listening_socket(host: str, port: int) -> socket.socket:
    """The socket every front end accepts on (the kernel hands each connection to one of them)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise CannotStart(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.set_inheritable(True)
    return sock


def run_frontend(settings: Settings, sock: socket.socket, engine_path: str, log_level: int) -> None:
    """A front-end process: uvicorn on the shared socket, the API over a link to the engine process."""
    import uvicorn

    from .api import create_frontend_app
    from .head_limit import HTTP_PROTOCOL

    configure_json_logging(log_level)
    server: uvicorn.Server | None = None

    def engine_lost() -> None:
        if server is not None:
            server.config.timeout_graceful_shutdown = min(server.config.timeout_graceful_shutdown or 0,
                                                          ENGINE_LOST_GRACE_S)
            server.should_exit = True  # finish what can be finished (nothing: every request fails 503), exit

    app = create_frontend_app(settings, engine_path, engine_lost)
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="on", http=HTTP_PROTOCOL,
                                           timeout_graceful_shutdown=settings.shutdown_grace_s))
    server.run(sockets=[sock])


def run_job_consumer(settings: Settings, engine_path: str, index: int, log_level: int) -> None:
    """A job consumer process: items from Redis, their pieces to the engine process over a link, results back
    to Redis. SIGTERM or SIGINT: finish the items in hand (the engine still serves them), acknowledge, exit."""
    configure_json_logging(log_level)
    run_async(_consume(settings, engine_path, index))


async def _consume(settings: Settings, engine_path: str, index: int) -> None:
    from .engine_link import EngineLink
    from .job_worker import default_consumer_name
    from .runtime import build_frontend_stack, make_consumer

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    link = await EngineLink.connect(engine_path, on_lost=stop.set)
    stack = build_frontend_stack(settings, link)
    assert stack.jobs is not None, "job consumers need settings.redis_url"
    # the engine process's name and the index: the same for this consumer's process started again (ProcessPool)
    name = f"{settings.worker_name or default_consumer_name(os.getppid())}-{index}"
    prefetch = max(1, settings.job_items_in_flight // settings.job_consumers)
    consumer = make_consumer(settings, stack.jobs, stack.transcriber, stack.limits, link, stack.decode_pool, name,
                             prefetch, lambda: link.failed)
    log.info("job consumer %s: %d items in flight", name, prefetch)
    await consumer.run(stop)
    await stack.stop()


def run_async(main: Coroutine[Any, Any, Any]) -> Any:
    """Run on uvloop where it is installed (as uvicorn does): less CPU per message on the engine's link."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def process_title(name: str) -> str:
    """What ps shows for the helper process ``name`` (``batchasr-frontend-0``: ``asr-frontend-0``)."""
    return name.replace("batchasr-", "asr-", 1)[:15]


def _run_named(name: str, target: Callable[..., None], args: tuple) -> None:
    """``target(*args)`` in a process that ps, top and /proc show by its role (``asr-frontend-0``,
    ``asr-consumer-1``: Linux keeps 15 characters), not as one more python."""
    with contextlib.suppress(OSError):  # not Linux, or /proc read-only: the name is a convenience
        Path("/proc/self/comm").write_text(process_title(name))
    target(*args)


@dataclass(frozen=True)
class ProcessSpec:
    name: str
    target: Callable[..., None]
    args: tuple


class ProcessPool:
    """The engine's helper processes (front ends, job consumers): started, restarted when one dies, stopped
    gracefully."""

    def __init__(self, specs: list[ProcessSpec], stop_grace_s: float):
        self.specs = specs
        self.stop_grace_s = stop_grace_s
        self._context = multiprocessing.get_context("spawn")  # no inherited threads, CUDA state or locks
        self._processes: list[BaseProcess] = []
        self._stopping = False

    def start(self) -> None:
        self._processes = [self._spawn(spec) for spec in self.specs]

    def _spawn(self, spec: ProcessSpec) -> BaseProcess:
        process = self._context.Process(target=_run_named, name=spec.name, args=(spec.name, spec.target, spec.args),
                                        daemon=True)
        process.start()
        return process

    async def watch(self) -> None:
        """Restart processes that die, until ``stop``."""
        while not self._stopping:
            await asyncio.sleep(RESPAWN_DELAY_S)
            for index, (spec, process) in enumerate(zip(self.specs, self._processes, strict=True)):
                if not self._stopping and not process.is_alive():
                    log.error("%s (pid %s) exited with %s; starting another", spec.name, process.pid,
                              process.exitcode)
                    try:
                        self._processes[index] = self._spawn(spec)
                    except Exception:  # no fork now (a process or memory limit): next round, not never again
                        log.exception("starting another %s failed; trying again in %.0f s", spec.name,
                                      RESPAWN_DELAY_S)

    async def stop(self) -> None:
        """SIGTERM each (a front end stops accepting and finishes its requests, a consumer its items), wait,
        kill stragglers."""
        self._stopping = True
        for process in self._processes:
            if process.is_alive() and process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s  # one grace period for all, not one each in turn
        for process in self._processes:
            await asyncio.to_thread(process.join, max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.error("%s (pid %s) did not stop within %.0f s; killing it", process.name, process.pid,
                          self.stop_grace_s)
                process.kill()
                await asyncio.to_thread(process.join)


async def run_engine_process(settings: Settings, http: bool = True, metrics_port: int | None = None,
                             log_level: int = logging.INFO) -> int:
    """The model here; ``settings.frontends`` HTTP front ends (when ``http``) and ``settings.job_consumers`` job
    consumers in processes of their own (none: this process consumes jobs, when Redis is set). Runs until
    SIGTERM or SIGINT."""
    from .runtime import build_stack, load_serving_model

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    # first, before the model loads: a taken port, or no room for the engine's socket's path, fails at once
    sock = listening_socket(settings.host, settings.port) if http else None
    if metrics_port:
        check_port_free(metrics_port)
    # the engine's socket in a directory created 0700: only this user connects
    with tempfile.TemporaryDirectory(prefix="batchasr-", dir=socket_dir()) as private:
        engine_path = str(Path(private) / "engine.sock")
        model = await asyncio.to_thread(load_serving_model, settings)
        stack = build_stack(settings, model)
        try:
            await _serve_engine(settings, stack, sock, engine_path, metrics_port, stop, log_level)
        finally:  # whatever ends it, the engine drains and its thread stops: a failure after the model had loaded
            # aborted the process, the thread still running
            if sock is not None:
                sock.close()
            await stack.stop()
    log.info("stopped")
    return 1 if stack.engine.failed else 0


async def _serve_engine(settings: Settings, stack: Any, sock: socket.socket | None, engine_path: str,
                        metrics_port: int | None, stop: asyncio.Event, log_level: int) -> None:
    """The engine's server and the helper processes, until ``stop`` or the engine fails; then the helpers stop
    (front ends finish their requests, consumers their items), and the engine's server closes."""
    from .engine_server import EngineServer

    consumers = settings.job_consumers if stack.jobs is not None else 0
    if stack.jobs is not None and not consumers:
        stack.start_consumer()
    if metrics_port:
        from prometheus_client import start_http_server

        start_http_server(metrics_port, registry=stack.metrics.registry)
    # scrapes on the metrics port's thread count no event loop's CPU: this one's is counted by a task of its own
    loop_cpu = asyncio.create_task(stack.metrics.count_event_loop_cpu()) if metrics_port else None
    server = EngineServer(stack, engine_path)
    await server.start()
    specs = [ProcessSpec(f"batchasr-frontend-{i}", run_frontend, (settings, sock, engine_path, log_level))
             for i in range(settings.frontends if sock is not None else 0)]
    specs += [ProcessSpec(f"batchasr-consumer-{i}", run_job_consumer, (settings, engine_path, i, log_level))
              for i in range(consumers)]
    pool = ProcessPool(specs, settings.request_timeout_s + STOP_GRACE_S)
    pool.start()
    log.info("engine process: %d front ends%s, %d job consumer processes", len(specs) - consumers,
             f" on http://{settings.host}:{settings.port}" if sock is not None else "", consumers)
    watcher = asyncio.create_task(pool.watch())
    stopped, failed = asyncio.create_task(stop.wait()), asyncio.create_task(stack.wait_engine_failed())
    await asyncio.wait([stopped, failed], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    failed.cancel()
    watcher.cancel()
    if loop_cpu is not None:
        loop_cpu.cancel()
    if sock is not None:  # this copy first: else the port keeps listening, with no one to accept, until the
        sock.close()      # front ends have finished, and new connections wait there to be reset
    if stack.engine.failed:  # nothing here can serve again: exit, for the supervisor to start a fresh process.
        # The links close first: helpers take the engine-lost path (ENGINE_LOST_GRACE_S), not the request
        # timeout a stalled client would hold them for
        log.error("the engine failed (%s): stopping", stack.engine.error)
        await server.close()
        await pool.stop()
        return
    log.info("stopping: front ends and consumers first, then the engine")
    stack.request_stop()  # this process's job consumer, if any, takes no more items while the front ends finish
    await pool.stop()
    await server.close()


def socket_dir() -> str | None:
    """Where the engine's socket's directory goes: the temporary directory (None), or /tmp where that one's path is
    too long for a Unix socket's (108 bytes, with the directory's and the socket's names): a long TMPDIR failed
    `serve --frontends` after the model had loaded. ``CannotStart`` where neither has room."""
    room = UNIX_PATH_MAX - len("/batchasr-12345678/engine.sock") - 1
    if len(tempfile.gettempdir()) <= room:
        return None
    if os.path.isdir("/tmp") and os.access("/tmp", os.W_OK | os.X_OK):
        return "/tmp"
    raise CannotStart(f"the temporary directory's path ({tempfile.gettempdir()}) is too long for the engine's socket: "
                  f"set TMPDIR to a directory of at most {room} characters")


def check_port_free(port: int) -> None:
    """``CannotStart`` now, before the model loads, where ``port`` is taken (the metrics port, served once the
    metrics exist, which is after): a taken one ended a worker only after a minute of loading, with a traceback."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as exc:
            raise CannotStart(f"cannot serve metrics on port {port}: {exc.strerror or exc}") from exc
