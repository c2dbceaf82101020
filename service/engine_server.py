"""The engine process's side of the front-end link: queues what front ends submit, sends back each result.

The engine process keeps the model, the batcher, the engine thread, the job consumer and every metric; front-end
processes parse HTTP and build responses. This loop only moves samples into the batcher and results out, so
little of the interpreter lock is taken from the engine thread, whatever the request rate.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from concurrent.futures import Future
from functools import partial
from typing import Any

from .batcher import BatcherClosed, Priority, QueueFull, WorkItem
from .engine import EngineState
from .metrics import FORWARDED_METRIC_CALLS
from .runtime import Stack
from .wire import (
    Cancel,
    EngineStatus,
    Exposition,
    FrameProtocol,
    Hello,
    ItemDone,
    ItemsFailed,
    LoopCpu,
    MetricCall,
    RequestObserved,
    Scrape,
    Submit,
    send_frame,
    split_samples,
)

log = logging.getLogger(__name__)

STATUS_POLL_S = 1.0  # how often the engine's state is sent to front ends: changed or not, it says this process lives


class _FrontEnd:
    """One front end's connection: its frames in, results out; its item ids still queued or running."""

    def __init__(self, server: EngineServer):
        self.server = server
        self.items: dict[int, WorkItem] = {}
        # the greeting is made when it is sent, so it carries the engine's status of that moment
        self.protocol = FrameProtocol(self._on_frame, self._on_lost, on_connected=lambda: self.send(server.hello()))
        self.closed = False

    def send(self, message: object) -> None:
        transport = self.protocol.transport
        if not self.closed and transport is not None and not transport.is_closing():
            send_frame(transport, message)

    def _on_frame(self, message: object, payload: bytearray) -> None:
        try:
            self.server.handle(self, message, payload)
        except Exception:
            log.exception("front-end link failed; closing it")
            if self.protocol.transport is not None:
                self.protocol.transport.close()

    def _on_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.front_ends.discard(self)
        for item in self.items.values():
            item.future.cancel()  # nobody is waiting: queued pieces never reach the model


class EngineServer:
    def __init__(self, stack: Stack, path: str):
        self.stack = stack
        self.path = path
        self.front_ends: set[_FrontEnd] = set()
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Listen on ``path``; tell every front end when the engine is ready (or failed)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(self._connected, path=self.path)
        self._spawn(self._announce_ready())

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._server is not None:
            self._server.close()
        for front_end in list(self.front_ends):
            if front_end.protocol.transport is not None:
                front_end.protocol.transport.close()

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _status(self) -> EngineStatus:
        engine, batcher = self.stack.engine, self.stack.batcher
        return EngineStatus(ready=engine.ready, error=engine.error, room=batcher.room(Priority.BULK))

    async def _announce_ready(self) -> None:
        engine = self.stack.engine
        # in steps, so that no thread is left waiting on an engine that never finishes warming up
        while not await asyncio.to_thread(engine.wait_ready, STATUS_POLL_S) and engine.state is EngineState.STARTING:
            self._announce()  # a long warm-up is not silence (engine_link.ENGINE_SILENT_S)
        self._announce()
        while engine.state is EngineState.READY:  # an engine that stops later is told too: /readyz goes false
            await asyncio.sleep(STATUS_POLL_S)
            self._announce()

    def _announce(self) -> None:
        status = self._status()
        for front_end in self.front_ends:
            front_end.send(status)

    def hello(self) -> Hello:
        tokenizer = self.stack.model.tokenizer
        return Hello(self.stack.model.config, tokenizer.model_proto if tokenizer else None, self._status())

    def _connected(self) -> FrameProtocol:
        front_end = _FrontEnd(self)
        self.front_ends.add(front_end)
        return front_end.protocol

    def handle(self, front_end: _FrontEnd, message: object, payload: bytearray) -> None:
        metrics = self.stack.metrics
        if isinstance(message, Submit):
            self._submit(front_end, message, payload)
        elif isinstance(message, Cancel):
            for item_id in message.item_ids:
                if (item := front_end.items.get(item_id)) is not None:
                    item.future.cancel()
        elif isinstance(message, RequestObserved):
            metrics.observe_request(message.route, message.code, message.duration_s)
        elif isinstance(message, LoopCpu):
            metrics.add_event_loop_cpu(message.seconds)
        elif isinstance(message, MetricCall) and message.method in FORWARDED_METRIC_CALLS:
            getattr(metrics, message.method)(*message.args)
        elif isinstance(message, Scrape):
            self._spawn(self._scrape(front_end, message.scrape_id))
        else:
            raise TypeError(f"unexpected message from a front end: {type(message).__name__}")

    async def _scrape(self, front_end: _FrontEnd, scrape_id: int) -> None:
        await asyncio.sleep(0)  # let observations that arrived with it on other links count first
        front_end.send(Exposition(scrape_id, await self.stack.metrics.scrape()))

    def _submit(self, front_end: _FrontEnd, message: Submit, payload: bytearray) -> None:
        pieces = split_samples(payload, message.lengths)
        counted = message.counted or (None,) * len(pieces)
        items = [WorkItem(piece, Priority(message.priority), message.timeout_s, message.hotwords, counted_samples=n,
                          owner=message.owner) for piece, n in zip(pieces, counted, strict=True)]
        try:
            self.stack.batcher.submit(items)
        except (QueueFull, BatcherClosed) as exc:
            front_end.send(ItemsFailed.from_exception(message.item_ids, exc))
            return
        loop = asyncio.get_running_loop()
        for item_id, item in zip(message.item_ids, items, strict=True):
            front_end.items[item_id] = item
            # the engine thread resolves the future; the answer is written from this loop
            item.future.add_done_callback(lambda f, i=item_id: loop.call_soon_threadsafe(
                partial(self._finished, front_end, i, f)))

    @staticmethod
    def _finished(front_end: _FrontEnd, item_id: int, future: Future) -> None:
        front_end.items.pop(item_id, None)
        if future.cancelled():
            return  # the front end cancelled it (it knows), or is gone
        if (exc := future.exception()) is not None:
            front_end.send(ItemsFailed.from_exception((item_id,), exc))
        else:
            front_end.send(ItemDone(item_id, future.result()))
