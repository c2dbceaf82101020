"""A helper process's connection to the engine process (``service.engine_server`` is the other end).

Front ends and job consumers use it the same way: it is their work queue (the transcriber submits pieces to it
as it would to the batcher), their view of the engine's readiness, and their metrics sink: requests and job
items are counted where every other metric is kept, in the engine process, and a scrape of any front end shows
them all.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from models.config import ModelConfig
from models.tokenizer import Tokenizer

from .batcher import Priority, QueueFull, WorkItem
from .wire import (
    MAX_PAYLOAD_BYTES,
    SAMPLE_DTYPE,
    Cancel,
    EngineStatus,
    EngineUnavailable,
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
)

log = logging.getLogger(__name__)

LOOP_CPU_REPORT_S = 1.0  # how often a helper process reports its event loop's CPU
SCRAPE_TIMEOUT_S = 10.0
# the engine process sends its status every second (engine_server.STATUS_POLL_S): nothing from it this long and it
# is stuck (stopped, or its event loop blocked), so this process takes no new requests for it until it speaks again
ENGINE_SILENT_S = 10.0


class EngineLink:
    """Connect with ``EngineLink.connect``; everything else runs on the event loop that connected it."""

    def __init__(self, on_lost: Callable[[], None]):
        self.protocol = FrameProtocol(self._on_frame, self._on_connection_lost)
        self.config: ModelConfig | None = None
        self.tokenizer: Tokenizer | None = None
        self.status = EngineStatus(ready=False)
        self._greeted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._on_lost = on_lost
        self._lost: str | None = None
        self._ids = itertools.count()
        self._pending: dict[int, Future] = {}  # item id -> the future its transcriber awaits
        self._scrapes: dict[int, asyncio.Future[bytes]] = {}
        self._loop_cpu_seen = time.thread_time()
        self._reporter: asyncio.Task | None = None
        self._heard_at = time.monotonic()  # the engine process's last frame
        self._full_since_status = False  # the engine refused pieces for want of room since its last status

    @classmethod
    async def connect(cls, path: str, on_lost: Callable[[], None], timeout_s: float = 30.0) -> EngineLink:
        """Connect to the engine process at ``path`` and read its greeting. ``on_lost`` is called (on the event
        loop) if the engine process goes away."""
        link = cls(on_lost)
        try:
            await asyncio.wait_for(asyncio.get_running_loop().create_unix_connection(lambda: link.protocol, path),
                                   timeout_s)
            await asyncio.wait_for(link._greeted, timeout_s)
        except (OSError, TimeoutError, EngineUnavailable) as exc:
            link.close()
            raise EngineUnavailable(f"cannot reach the engine process at {path}: {exc}") from exc
        link._reporter = asyncio.create_task(link._report_loop_cpu())
        return link

    # --- what the routes see ----------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.status.ready and self._lost is None and self.silent_s is None

    @property
    def silent_s(self) -> float | None:
        """How long the engine process has said nothing, once that is past ``ENGINE_SILENT_S``; else None."""
        silent_s = time.monotonic() - self._heard_at
        return silent_s if silent_s > ENGINE_SILENT_S else None

    @property
    def error(self) -> str | None:
        """Why the engine is not ready, if not for warming up."""
        if (reason := self._lost or self.status.error) is not None:
            return reason
        silent_s = self.silent_s
        return None if silent_s is None else f"the engine process has not answered for {silent_s:.0f} s"

    @property
    def failed(self) -> bool:
        """The engine process's engine failed for good (an error while not ready), or this link to it is lost. Not
        a silent engine process: it may go on (a stopped process continued), and its supervisor sees it."""
        return not self.ready and (self._lost or self.status.error) is not None

    def submit(self, items: list[WorkItem]) -> None:
        """Send the pieces to the engine process, in as many frames as their samples need (a frame holds 4 GiB: a
        19-hour recording's pieces failed as an internal error). Its refusal (``QueueFull``) comes back on their
        futures; bulk pieces (a job item's) are refused here, unsent, while the engine's last status says its queue
        has no room for them, or it has refused some since."""
        if self._lost is not None:
            raise EngineUnavailable(self._lost)
        if all(item.priority is not Priority.INTERACTIVE for item in items) and not self._room_for(len(items)):
            # a job consumer tries again every 0.2 s while the queue is full: sent each time, a 40-minute
            # recording's samples crossed the socket at 370 MB/s, a fifth of the engine process's interpreter
            raise QueueFull(1)
        for group in _frame_groups(items):
            ids = tuple(next(self._ids) for _ in group)
            first = group[0]
            self._send(Submit(ids, tuple(item.n_samples for item in group), int(first.priority), first.timeout_s,
                              first.hotwords, tuple(item.counted_samples or 0 for item in group), first.owner),
                       [item.waveform for item in group])
            for item_id, item in zip(ids, group, strict=True):  # once sent: a frame that failed leaves nothing
                self._pending[item_id] = item.future
                item.future.add_done_callback(lambda f, i=item_id: self._maybe_cancelled(i, f))

    def _room_for(self, pieces: int) -> bool:
        """Whether the engine's queue may take ``pieces``, by its last status (a second old at most) and any refusal
        since; an engine that does not say (its status without room) is asked by sending."""
        room = self.status.room
        return not self._full_since_status and (room is None or pieces <= room)

    def observe_request(self, route: str, code: int, duration_s: float) -> None:
        self._send(RequestObserved(route, code, duration_s))

    def observe_intake_wait(self, seconds: float) -> None:
        self._send(MetricCall("observe_intake_wait", (seconds,)))

    # a job consumer's counts (``job_worker.JobMetrics``), kept in the engine process
    def observe_job_backlog(self, waiting: int, delivered: int) -> None:
        self._send(MetricCall("observe_job_backlog", (waiting, delivered)))

    def observe_job_store_risks(self, risks: tuple[str, ...]) -> None:
        self._send(MetricCall("observe_job_store_risks", (risks,)))

    def count_job_items_reclaimed(self, n: int) -> None:
        self._send(MetricCall("count_job_items_reclaimed", (n,)))

    def count_job_item_dead_lettered(self) -> None:
        self._send(MetricCall("count_job_item_dead_lettered", ()))

    def count_job_item(self, status: str) -> None:
        self._send(MetricCall("count_job_item", (status,)))

    def count_job(self, status: str) -> None:
        self._send(MetricCall("count_job", (status,)))

    def count_webhook(self, outcome: str) -> None:
        self._send(MetricCall("count_webhook", (outcome,)))

    def observe_webhooks_waiting(self, waiting: int) -> None:
        self._send(MetricCall("observe_webhooks_waiting", (waiting,)))

    async def scrape(self) -> bytes:
        """The engine process's metrics, this front end's event-loop CPU reported first."""
        if self._lost is not None:
            raise EngineUnavailable(self._lost)
        self._report_cpu()
        scrape_id = next(self._ids)
        answer = self._scrapes[scrape_id] = asyncio.get_running_loop().create_future()
        self._send(Scrape(scrape_id))
        try:
            return await asyncio.wait_for(answer, SCRAPE_TIMEOUT_S)
        except TimeoutError:  # the route says so (503), rather than failing as if it were a bug (500)
            raise EngineUnavailable(f"the engine process did not answer within {SCRAPE_TIMEOUT_S:.0f} s") from None
        finally:
            self._scrapes.pop(scrape_id, None)

    def close(self) -> None:
        if self._reporter is not None:
            self._reporter.cancel()
        self._lost = self._lost or "the front end is stopping"
        if self.protocol.transport is not None:
            self.protocol.transport.close()

    # --- plumbing ---------------------------------------------------------------------------------------

    def _send(self, message: object, payload: list[np.ndarray] | None = None) -> None:
        transport = self.protocol.transport
        if self._lost is None and transport is not None and not transport.is_closing():
            send_frame(transport, message, payload)

    def _maybe_cancelled(self, item_id: int, future: Future) -> None:
        """A piece its request gave up on (client gone, timeout): the engine process drops it if still queued."""
        if future.cancelled() and self._pending.pop(item_id, None) is not None:
            self._send(Cancel((item_id,)))

    def _report_cpu(self) -> None:
        now = time.thread_time()
        self._send(LoopCpu(now - self._loop_cpu_seen))
        self._loop_cpu_seen = now

    async def _report_loop_cpu(self) -> None:
        while True:
            await asyncio.sleep(LOOP_CPU_REPORT_S)
            self._report_cpu()

    def _on_frame(self, message: object, payload: bytearray) -> None:
        self._heard_at = time.monotonic()
        if isinstance(message, ItemDone):
            future = self._pending.pop(message.item_id, None)
            if future is not None and not future.done():
                future.set_result(message.result)
        elif isinstance(message, ItemsFailed):
            self._full_since_status |= message.kind == "queue_full"
            for item_id in message.item_ids:
                future = self._pending.pop(item_id, None)
                if future is not None and not future.done():
                    future.set_exception(message.exception())
        elif isinstance(message, EngineStatus):
            self.status, self._full_since_status = message, False
        elif isinstance(message, Exposition):
            answer = self._scrapes.get(message.scrape_id)
            if answer is not None and not answer.done():
                answer.set_result(message.body)
        elif isinstance(message, Hello):
            self.config, self.status = message.config, message.state
            if message.tokenizer_model is not None:
                self.tokenizer = Tokenizer(message.tokenizer_model)
            if not self._greeted.done():
                self._greeted.set_result(None)
        else:
            log.error("unexpected message from the engine process: %s", type(message).__name__)

    def _on_connection_lost(self, exc: Exception | None) -> None:
        reason = self._lost or f"the engine process went away ({exc or 'connection closed'})"
        stopping = self._lost is not None
        self._lost = reason
        pending, self._pending = self._pending, {}
        if pending and not stopping:
            log.error("%s; failing %d pieces in flight", reason, len(pending))
        for future in pending.values():
            if not future.done():
                future.set_exception(EngineUnavailable(reason))
        for answer in [*self._scrapes.values(), self._greeted]:
            if not answer.done():
                answer.set_exception(EngineUnavailable(reason))
        if not stopping:
            self._on_lost()


def _frame_groups(items: list[WorkItem]) -> list[list[WorkItem]]:
    """``items`` in order, in groups whose samples fit one frame's payload."""
    groups: list[list[WorkItem]] = [[]]
    held = 0
    for item in items:
        size = item.waveform.size * np.dtype(SAMPLE_DTYPE).itemsize
        if groups[-1] and held + size > MAX_PAYLOAD_BYTES:
            groups.append([])
            held = 0
        groups[-1].append(item)
        held += size
    return groups
