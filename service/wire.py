"""What the engine process and its helper processes (HTTP front ends, job consumers) say to each other over a
Unix socket.

A frame is a fixed header (message bytes, payload bytes), the pickled message, then the payload: the raw float32
samples of a submission, so audio is never pickled. Both ends are this program, started together: pickle is safe
here, and the socket lives in a directory only this user can open.
"""

from __future__ import annotations

import asyncio
import itertools
import pickle
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np

from decoding.types import Hotwords
from models.config import ModelConfig

from .batcher import BatcherClosed, ItemResult, QueueFull

HEADER = struct.Struct("!II")  # message bytes, payload bytes
MAX_PAYLOAD_BYTES = 2**32 - 1  # what the header's field holds: 18.6 hours of 16 kHz float32 samples
SAMPLE_DTYPE = np.float32


class EngineUnavailable(RuntimeError):
    """The engine process went away (or never answered): a front end cannot serve without it."""


# --- engine -> front end ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineStatus:
    ready: bool
    error: str | None = None
    room: int | None = None  # pieces of bulk work the engine's queue takes now (batcher.Batcher.room)


@dataclass(frozen=True)
class Hello:
    """The first message on a connection: what a front end needs to plan, stitch and word its requests."""

    config: ModelConfig
    tokenizer_model: bytes | None  # serialized SentencePiece model
    state: EngineStatus


@dataclass(frozen=True)
class ItemDone:
    item_id: int
    result: ItemResult


@dataclass(frozen=True)
class ItemsFailed:
    """Items that will not be transcribed, with the exception the front end raises for them."""

    item_ids: tuple[int, ...]
    kind: str  # queue_full | timeout | stopped | error
    message: str
    retry_after_s: int = 1

    @classmethod
    def from_exception(cls, item_ids: tuple[int, ...], exc: BaseException) -> ItemsFailed:
        if isinstance(exc, QueueFull):
            return cls(item_ids, "queue_full", str(exc), exc.retry_after_s)
        if isinstance(exc, TimeoutError):
            return cls(item_ids, "timeout", str(exc))
        if isinstance(exc, BatcherClosed):
            return cls(item_ids, "stopped", str(exc))
        return cls(item_ids, "error", f"{type(exc).__name__}: {exc}")

    def exception(self) -> Exception:
        if self.kind == "queue_full":
            return QueueFull(self.retry_after_s)
        if self.kind == "timeout":
            return TimeoutError(self.message)
        if self.kind == "stopped":
            return EngineUnavailable(self.message)
        return RuntimeError(self.message)


@dataclass(frozen=True)
class Exposition:
    scrape_id: int
    body: bytes  # Prometheus text format


# --- front end -> engine ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Submit:
    """A request's pieces, queued together or refused together. Payload: their samples, concatenated."""

    item_ids: tuple[int, ...]
    lengths: tuple[int, ...]  # samples per piece
    priority: int
    timeout_s: float
    hotwords: Hotwords = ()  # the request's, as tokens
    counted: tuple[int, ...] = ()  # samples per piece its recording accounts for (batcher.WorkItem.counted_samples)
    owner: str = ""  # whose turn the pieces take (batcher.WorkItem.owner)


@dataclass(frozen=True)
class Cancel:
    item_ids: tuple[int, ...]


@dataclass(frozen=True)
class RequestObserved:
    route: str
    code: int
    duration_s: float


@dataclass(frozen=True)
class LoopCpu:
    seconds: float  # the helper process's event-loop CPU since its last report


@dataclass(frozen=True)
class MetricCall:
    """A front end's or job consumer's count, made in the engine process (one of ``metrics.FORWARDED_METRIC_CALLS``)."""

    method: str
    args: tuple


@dataclass(frozen=True)
class Scrape:
    scrape_id: int


# --- framing ------------------------------------------------------------------------------------------------


def send_frame(transport: asyncio.WriteTransport, message: object, payload: list[np.ndarray] | None = None) -> None:
    """Queue one frame (the transport sends it as the socket allows). ``payload``: arrays sent as their raw
    bytes, one after another, without a copy into the frame."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    arrays = [np.ascontiguousarray(a, dtype=SAMPLE_DTYPE) for a in payload or ()]
    if sum(a.nbytes for a in arrays) > MAX_PAYLOAD_BYTES:
        raise ValueError(f"a frame's payload is at most {MAX_PAYLOAD_BYTES} bytes")
    transport.write(HEADER.pack(len(body), sum(a.nbytes for a in arrays)) + body)
    for array in arrays:
        if array.nbytes:
            transport.write(memoryview(array).cast("B"))


class FrameProtocol(asyncio.BufferedProtocol):
    """Reads frames and hands each to ``on_frame(message, payload)``; ``on_connected()`` once the transport is
    up, ``on_lost(exc)`` when the peer is gone.

    Small frames are read many at a time into a staging buffer. A payload (a request's samples, hundreds of
    kilobytes) is read by the kernel straight into a buffer of its own once its frame is known: no copies
    through a stream's buffer, which cost more CPU per request than everything else this link does."""

    STAGING_BYTES = 1 << 16

    def __init__(self, on_frame: Callable[[object, bytearray], None], on_lost: Callable[[Exception | None], None],
                 on_connected: Callable[[], None] = lambda: None):
        self.on_frame, self.on_lost, self.on_connected = on_frame, on_lost, on_connected
        self.transport: asyncio.Transport | None = None
        self._staging = bytearray(self.STAGING_BYTES)
        self._start = self._end = 0  # unread bytes in the staging buffer
        self._message: object = None
        self._payload: bytearray | None = None  # the payload being read, and how much of it has arrived
        self._payload_filled = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        self.on_connected()

    def connection_lost(self, exc: Exception | None) -> None:
        self.on_lost(exc)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._payload is not None:
            return memoryview(self._payload)[self._payload_filled:]
        if self._end == len(self._staging):  # full: move what is unread to the front, or grow for a large frame
            unread = self._staging[self._start:self._end]
            if len(unread) == len(self._staging):
                self._staging = bytearray(2 * len(self._staging))
            self._staging[:len(unread)] = unread
            self._start, self._end = 0, len(unread)
        return memoryview(self._staging)[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._payload is not None:
            self._payload_filled += nbytes
            if self._payload_filled == len(self._payload):
                payload, self._payload = self._payload, None
                self.on_frame(self._message, payload)
            return
        self._end += nbytes
        self._parse_staged()

    def _parse_staged(self) -> None:
        staging = self._staging
        while self._end - self._start >= HEADER.size:
            body_size, payload_size = HEADER.unpack_from(staging, self._start)
            body_at = self._start + HEADER.size
            if self._end - body_at < body_size:
                break  # the rest of this frame's message is still to come
            message = pickle.loads(memoryview(staging)[body_at:body_at + body_size])
            self._start = body_at + body_size
            payload = bytearray(payload_size)
            staged = min(payload_size, self._end - self._start)
            payload[:staged] = memoryview(staging)[self._start:self._start + staged]
            self._start += staged
            if staged < payload_size:  # the kernel writes the rest straight into it
                self._message, self._payload, self._payload_filled = message, payload, staged
                break
            self.on_frame(message, payload)
        if self._start == self._end:
            self._start = self._end = 0


def split_samples(payload: bytearray, lengths: tuple[int, ...]) -> list[np.ndarray]:
    """A submission's payload back into its pieces: float32 arrays over the payload's own memory."""
    samples = np.frombuffer(payload, dtype=SAMPLE_DTYPE)
    if len(samples) != sum(lengths):
        raise ValueError(f"payload holds {len(samples)} samples, the message says {sum(lengths)}")
    bounds = itertools.accumulate(lengths, initial=0)
    return [samples[start:end] for start, end in itertools.pairwise(bounds)]
