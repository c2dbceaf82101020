"""One request's path through the engine: split long audio, queue the pieces, await them, stitch.

Shared by the HTTP routes and the bulk-job consumer; neither touches the batcher or the model directly.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from models.config import ModelConfig
from models.tokenizer import Tokenizer
from models.transcript import Transcript, build_transcript

from .batcher import ItemResult, Priority, WorkItem
from .segmenter import Segment, plan_segments, stitch


@dataclass(frozen=True)
class RequestResult:
    transcript: Transcript
    queue_s: float  # longest wait of any of its pieces
    compute_s: float  # engine time attributed to it
    n_segments: int

    @property
    def rtfx(self) -> float:
        return self.transcript.duration_s / self.compute_s if self.compute_s > 0 else 0.0


class WorkQueue(Protocol):
    """Where pieces go: the engine's batcher, or a front-end process's link to the engine process."""

    def submit(self, items: list[WorkItem]) -> None:
        """Queue all or none; ``QueueFull`` is raised here or set on every item's future."""


class Transcriber:
    def __init__(self, queue: WorkQueue, config: ModelConfig, tokenizer: Tokenizer | None, max_segment_s: float,
                 segment_overlap_s: float, timeout_s: float):
        self.queue = queue
        self.config = config
        self.tokenizer = tokenizer
        self.max_segment_s = max_segment_s
        self.segment_overlap_s = segment_overlap_s
        self.timeout_s = timeout_s
        self.sample_rate = config.features.sample_rate
        # samples per encoder frame: cut points are snapped to it so token frames stay whole
        self.frame_samples = config.features.hop_length * config.encoder.subsampling_factor

    def plan(self, waveform: np.ndarray) -> list[Segment]:
        """Where ``transcribe`` cuts ``waveform`` into pieces."""
        return plan_segments(len(waveform), waveform, self.sample_rate, self.max_segment_s, self.segment_overlap_s,
                             self.frame_samples)

    async def transcribe(self, waveform: np.ndarray, priority: Priority = Priority.INTERACTIVE) -> RequestResult:
        """Queue (raises ``QueueFull``), await every piece, stitch. Cancelling this cancels queued pieces."""
        segments = self.plan(waveform)
        items = [WorkItem(waveform[s.start : s.end], priority, self.timeout_s) for s in segments]
        self.queue.submit(items)
        gathered = asyncio.gather(*(asyncio.wrap_future(item.future) for item in items))
        gathered.add_done_callback(lambda f: f.cancelled() or f.exception())  # a drop is not an error to log
        try:
            results: list[ItemResult] = await asyncio.wait_for(gathered, self.timeout_s)
        finally:
            for item in items:
                item.future.cancel()  # no-op once done; drops pieces still queued if we gave up
        hyp = stitch(list(zip(segments, (r.hypothesis for r in results), strict=True)), self.tokenizer,
                     self.frame_samples)
        transcript = build_transcript(hyp, self.tokenizer, self.config.frame_s, len(waveform) / self.sample_rate)
        return RequestResult(transcript=transcript, queue_s=max(r.queue_s for r in results),
                             compute_s=sum(r.compute_s for r in results), n_segments=len(segments))
