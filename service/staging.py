"""Batches staged one ahead of the engine: formed, padded and copied to the device while it runs the last one.

Without this the GPU idles between batches while the engine thread forms the next batch (a few ms among
thousands of waiting pieces) and copies its rows to the device (a copy per row from pageable memory). Here a
thread of its own does both while the engine waits for its batch's results: it pads rows into a pinned host
buffer and uploads the batch with one asynchronous copy on a stream of its own. The engine's stream waits for
that copy, not the host.

On a CPU there is no idle device to keep fed, and a batch formed early is chosen from fewer waiting pieces
(the staged batch holds some back): there the engine thread forms and pads each batch when it needs it.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

import torch
from torch import Tensor

from .batcher import Batch, Batcher

log = logging.getLogger(__name__)

N_HOST_BUFFERS = 2  # one being filled while the other's copy may still be in flight


@dataclass
class StagedBatch:
    batch: Batch
    audio: Tensor | None = None  # (B, N) float32 on the model's device, zero past each row's length
    n_samples: Tensor | None = None  # (B,) int64 on the device
    copied: torch.cuda.Event | None = None  # the upload, on CUDA
    error: BaseException | None = None  # staging failed: the batch's items get this

    def on_current_stream(self) -> tuple[Tensor, Tensor]:
        """The batch, for use on the current stream: it waits for the upload, and the allocator learns that
        the stream uses the memory (it was allocated on the stager's)."""
        assert self.audio is not None and self.n_samples is not None
        if self.copied is not None:
            stream = torch.cuda.current_stream(self.audio.device)
            stream.wait_event(self.copied)
            self.audio.record_stream(stream)
            self.n_samples.record_stream(stream)
        return self.audio, self.n_samples


class _PinnedBuffer:
    """Page-locked host memory reused across batches (grown when a batch needs more), and the event of its
    last upload: it is not refilled before that copy has read it."""

    def __init__(self) -> None:
        self.memory = torch.empty(0, dtype=torch.float32)
        self.uploaded: torch.cuda.Event | None = None

    def take(self, rows: int, width: int) -> Tensor:
        if self.uploaded is not None:
            self.uploaded.synchronize()
        if self.memory.numel() < rows * width:
            self.memory = torch.empty(rows * width, dtype=torch.float32, pin_memory=True)
        return self.memory[: rows * width].view(rows, width)


class BatchStager:
    """Forms each batch and puts it on the device: from its own thread, one batch ahead of the engine, when
    ``ahead`` (the default on CUDA); else when the engine asks."""

    def __init__(self, batcher: Batcher, device: torch.device, ahead: bool | None = None):
        self.batcher = batcher
        self.device = device
        self.ahead = device.type == "cuda" if ahead is None else ahead
        self._staged: queue.Queue[StagedBatch | None] = queue.Queue(maxsize=1)
        # a batch is formed only once the engine has taken the last one: with the queue's room alone, one waited in
        # the queue while the thread held another formed, so urgent work arriving then waited for two batches
        self._room = threading.Semaphore(1)
        self._thread = threading.Thread(target=self._run, name="batchasr-stager", daemon=True)
        self._cuda = device.type == "cuda"
        # high priority: a pool of streams apart from the default-priority ones the decoders capture their graphs on
        # (PyTorch hands those out round-robin, 32 a device), so no capture can ever take in this stream's copies
        self._stream = torch.cuda.Stream(device, priority=-1) if self._cuda else None
        self._buffers = [_PinnedBuffer() for _ in range(N_HOST_BUFFERS)] if self._cuda else []
        self._turn = 0

    def start(self) -> None:
        if self.ahead:
            self._thread.start()

    def next(self) -> StagedBatch | None:
        """The next staged batch; None once the batcher is closed and drained."""
        if self.ahead:
            staged = self._staged.get()
            self._room.release()
            return staged
        batch = self.batcher.next_batch()
        return None if batch is None else self._stage_or_fail(batch)

    def _run(self) -> None:
        try:
            while self._room.acquire() and (batch := self.batcher.next_batch()) is not None:
                self._staged.put(self._stage_or_fail(batch))
        finally:
            self._staged.put(None)

    def _stage_or_fail(self, batch: Batch) -> StagedBatch:
        try:
            return self.stage(batch)
        except Exception as exc:  # e.g. out of pinned memory: fail this batch's items, not the engine
            log.exception("staging a batch of %d failed", len(batch.items))
            return StagedBatch(batch, error=exc)

    @torch.inference_mode()
    def stage(self, batch: Batch) -> StagedBatch:
        rows, width, lengths = batch.rows, batch.width, batch.row_samples
        if not self._cuda:
            audio = torch.empty(rows, width, dtype=torch.float32)
            self._fill(audio, batch)
            return StagedBatch(batch, audio, torch.tensor(lengths, dtype=torch.long))
        buffer = self._buffers[self._turn]
        self._turn = (self._turn + 1) % len(self._buffers)
        host = buffer.take(rows, width)
        self._fill(host, batch)
        host_lengths = torch.tensor(lengths, dtype=torch.long).pin_memory()
        assert self._stream is not None
        with torch.cuda.stream(self._stream):
            audio = host.to(self.device, non_blocking=True)
            n_samples = host_lengths.to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._stream)
        buffer.uploaded = copied
        return StagedBatch(batch, audio, n_samples, copied)

    @staticmethod
    def _fill(rows: Tensor, batch: Batch) -> None:
        """Each waveform into its row, zeros after it and in the padding rows (a reused buffer holds an older
        batch's samples)."""
        out = rows.numpy()
        for row, item in enumerate(batch.items):
            out[row, : item.n_samples] = item.waveform
            out[row, item.n_samples :] = 0.0
        out[len(batch.items) :] = 0.0
