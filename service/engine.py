"""The engine: owns the model on one device and is the only code that runs it.

One thread takes batches, on a GPU staged one ahead by ``service.staging`` (formed, padded and on the device while
the last one runs), runs features -> encoder -> decoder, times each stage (CUDA events on a GPU) and resolves each
item's future with its hypothesis and its share of the compute time.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from enum import Enum

import numpy as np
import torch
from torch import Tensor

from decoding.boosting import build_boost_table
from decoding.types import HOTWORD_BOOST, Hotword, Hotwords, Hypothesis
from models.asr_model import ASRModel, EncodedBatch

from .batcher import Batch, Batcher, ItemResult
from .metrics import Metrics
from .staging import BatchStager, StagedBatch
from .timing import StageClock

log = logging.getLogger(__name__)

WARMUP_S = 1.0  # seconds of audio per warm-up item
LIGHT_WARMUP = ((1, WARMUP_S),)  # one short item: initialises every stage where nothing is captured
WARMUP_HOTWORD = Hotword((1,))  # any token: the boosting graphs are the same for every table that fits


def warmup_shapes(device: torch.device, max_batch_size: int, max_segment_s: float,
                  batch_audio_limit_s: float) -> list[tuple[int, float]]:
    """(rows, seconds) batches to run before the engine says ready.

    On a GPU: the widest and the longest batch the batcher can form. The decoder's graphs are then captured
    for the largest buffers it will need, the encoder's kernels are chosen, and the memory peak is reached
    at start, out-of-memory included, rather than under the first heavy traffic. Elsewhere nothing is
    captured, and one short item initialises every stage."""
    if device.type != "cuda":
        return list(LIGHT_WARMUP)
    widest = (max_batch_size, min(max_segment_s, batch_audio_limit_s / max_batch_size))
    longest = (max(1, min(max_batch_size, int(batch_audio_limit_s // max_segment_s))), max_segment_s)
    return list(dict.fromkeys([*LIGHT_WARMUP, widest, longest]))


# CUDA's messages for the errors that leave a context unusable (cudaGetErrorString): every later call fails too.
# Others (an invalid argument, out of memory) fail the call that met them, and the next batch may run.
STICKY_CUDA_ERRORS = ("illegal memory access", "illegal address", "device-side assert", "unspecified launch failure",
                      "misaligned address", "illegal instruction", "hardware stack error", "invalid program counter",
                      "launch timed out", "uncorrectable ECC error", "unknown error")


def device_broken(exc: BaseException) -> bool:
    """A CUDA error that outlives the batch that met it (an illegal address, a device-side assert, a launch
    failure): the context is broken, and every later batch would fail with it too."""
    message = str(exc)
    return "CUDA" in message and any(sticky in message for sticky in STICKY_CUDA_ERRORS)


class EngineState(str, Enum):
    STARTING = "starting"
    READY = "ready"
    STOPPED = "stopped"
    FAILED = "failed"


class Engine:
    def __init__(self, model: ASRModel, batcher: Batcher, metrics: Metrics, decoder: str = "auto",
                 warmup_shapes: list[tuple[int, float]] | None = None, stage_ahead: bool | None = None,
                 scores: bool = True, hotword_boost: float = HOTWORD_BOOST):
        self.model = model
        self.batcher = batcher
        self.metrics = metrics
        self.decoder = model.resolve_decoder(decoder)
        self.scores = scores  # each token's log-probability, after the search (decoding.scores)
        self.hotword_boost = hotword_boost  # the logit bonus of a token that continues a request's hotword
        self.warmup_shapes = warmup_shapes or list(LIGHT_WARMUP)  # (rows, seconds) run before ready
        self.state = EngineState.STARTING
        self.error: str | None = None
        self.stager = BatchStager(batcher, model.device, ahead=stage_ahead)  # default: ahead on CUDA
        self._thread = threading.Thread(target=self._run, name="batchasr-engine", daemon=True)
        self._ready = threading.Event()
        metrics.bind_queue(lambda: batcher.depth)
        if model.device.type == "cuda":
            metrics.bind_gpu_memory(lambda: torch.cuda.memory_allocated(model.device))

    @property
    def ready(self) -> bool:
        return self.state is EngineState.READY

    @property
    def failed(self) -> bool:
        """For good: warm-up failed, or the loop stopped (a broken device); only a new process can serve."""
        return self.state is EngineState.FAILED

    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._ready.wait(timeout)
        return self.ready

    def stop(self, timeout: float | None = None) -> None:
        """Finish what is queued, then stop the thread."""
        self.batcher.close()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self.state is not EngineState.FAILED:
            self.state = EngineState.STOPPED

    def _run(self) -> None:
        if self.model.device.type == "cuda":  # this thread's current device: what a graph captures, and on cuda:N
            torch.cuda.set_device(self.model.device)
        try:
            self._warm_up()
        except Exception as exc:  # a model that cannot run must say so on /readyz, not die silently
            log.exception("engine warm-up failed")
            self.state, self.error = EngineState.FAILED, f"warm-up failed: {exc}"
            self._ready.set()
            self.batcher.fail_all(exc)  # a job consumer queues items before the engine is ready
            return
        self.state = EngineState.READY
        self._ready.set()
        self.stager.start()
        staged: StagedBatch | None = None
        try:
            while (staged := self.stager.next()) is not None:
                self.process(staged)
        except Exception as exc:  # a dead engine thread must say so on /readyz and answer what waits, not hang it
            log.exception("engine stopped")
            self.state, self.error = EngineState.FAILED, f"the engine stopped: {exc}"
            self.batcher.fail_all(exc)
            with contextlib.suppress(Exception):
                while staged is not None:  # the batch in hand, and the one staged ahead
                    for item in staged.batch.items:
                        if not item.future.done():
                            item.future.set_exception(exc)
                    staged = self.stager.next()

    def _warm_up(self) -> None:
        """Run every stage on each warm-up shape, so lazy init and graph capture happen before traffic."""
        rng = np.random.default_rng(0)
        started = time.perf_counter()
        on_cuda, ctc = self.model.device.type == "cuda", self.model.resolve_decoder(self.decoder) == "ctc"
        for rows, seconds in self.warmup_shapes:
            wave = (rng.standard_normal(int(seconds * self.model.sample_rate)) * 0.01).astype(np.float32)
            encoded = self.model.encode([wave] * rows)
            self.model.decode(encoded, self.decoder, scores=self.scores)
            if on_cuda and ctc:  # CTC's hotword frame loop keeps buffers of its own: sized by every row boosting
                boost = build_boost_table([(WARMUP_HOTWORD,)] * rows, self.hotword_boost, self.model.device)
                self.model.decode(encoded, self.decoder, scores=self.scores, boost=boost)
        if on_cuda and not ctc:  # the transducer's graphs that boost hotwords, for the buffers the shapes left
            boost = build_boost_table([(WARMUP_HOTWORD,)], self.hotword_boost, self.model.device)
            self.model.decode(self.model.encode([wave]), self.decoder, scores=self.scores, boost=boost)
        shapes = ", ".join(f"{rows} x {seconds:g} s" for rows, seconds in self.warmup_shapes)
        log.info("engine warm: %s on %s (%s), batches of %s, %.2f s", self.decoder, self.model.device,
                 self.model.dtype, shapes, time.perf_counter() - started)

    def run(self, waveforms: list[np.ndarray]) -> tuple[list[Hypothesis], dict[str, float]]:
        """Features, encoder, decoder for one batch of waveforms; hypotheses and seconds per stage."""
        return self._compute(lambda: self.model.featurize(waveforms), [len(w) for w in waveforms],
                             [()] * len(waveforms))

    def _compute(self, features: Callable[[], tuple[Tensor, Tensor]], n_samples: list[int],
                 hotwords: list[Hotwords]) -> tuple[list[Hypothesis], dict[str, float]]:
        """``hotwords``: each row's (decoding.boosting)."""
        clock = StageClock(self.model.device)
        marks = [clock.mark()]
        feats, n_frames = features()
        marks.append(clock.mark())
        encoded, lengths = self.model.run_encoder(feats, n_frames)
        marks.append(clock.mark())
        duration_s = [n / self.model.sample_rate for n in n_samples]
        boost = build_boost_table(hotwords, self.hotword_boost, self.model.device)
        hyps = self.model.decode(EncodedBatch(encoded, lengths, duration_s), self.decoder, scores=self.scores,
                                 boost=boost, scores_per_row=self.batcher.fixed_shapes)
        clock.marks.append([*marks, clock.mark()])
        return hyps, clock.stage_seconds()

    def process(self, staged: StagedBatch) -> None:
        started = time.monotonic()
        if staged.error is not None:
            self._failed(staged.batch, staged.error, started)
            return
        self._run_batch(staged.batch, lambda: self.model.features(*staged.on_current_stream()), started)

    def _run_batch(self, batch: Batch, features: Callable[[], tuple[Tensor, Tensor]], started: float) -> None:
        """The batch through every stage from ``features``, its items given their results (or ``_failed``)."""
        padding = batch.rows - len(batch.items)  # rows of silence (fixed shapes), decoded and dropped
        try:
            hyps, stage_s = self._compute(features, batch.row_samples,
                                          [item.hotwords for item in batch.items] + [()] * padding)
        except Exception as exc:
            self._failed(batch, exc, started)
            return
        self._finish(batch, hyps[: len(batch.items)], stage_s, started)

    def _failed(self, batch: Batch, exc: Exception, started: float) -> None:
        """A batch that failed, the device still sound: its halves run again from their waveforms, and theirs
        where they fail too, so that what fails in the end is one item (its own audio's fault, or more than memory
        holds) and not the neighbours it was batched with (a whole batch's HTTP requests answered 500, its job
        items back in minutes with an attempt spent). Halves keep the batch's padded shape (fixed shapes)."""
        if device_broken(exc):
            raise exc  # the loop stops: this batch and all that waits fail with it, and the engine says it failed
        if len(batch.items) == 1:
            log.error("an item of %.1f s failed: %s: %s", batch.n_samples / self.model.sample_rate,
                      type(exc).__name__, exc, exc_info=exc)
            batch.items[0].future.set_exception(exc)
            return
        log.warning("a batch of %d failed (%s: %s); its halves run again", len(batch.items), type(exc).__name__, exc)
        middle = len(batch.items) // 2
        for part in (batch.items[:middle], batch.items[middle:]):
            half = Batch(part, pad_to=batch.pad_to, pad_rows=batch.pad_rows)
            rows = [item.waveform for item in part]
            rows += [np.zeros(half.width, dtype=np.float32)] * (half.rows - len(part))  # silence, as staged
            self._run_batch(half, lambda rows=rows, half=half: self.model.featurize(rows, pad_to=half.width), started)

    def _finish(self, batch: Batch, hyps: list[Hypothesis], stage_s: dict[str, float], started: float) -> None:
        compute_s = sum(stage_s.values())
        rate = self.model.sample_rate
        audio_s = batch.counted_samples / rate  # a long recording's overlaps once: RTFx is of the audio sent
        rows_s = batch.n_samples / rate
        # counted before the results go out: whoever has a result and scrapes sees its batch
        try:
            self.batcher.record_throughput(rows_s, compute_s)  # for Retry-After, which counts queued rows
            self.metrics.observe_batch(len(batch.items), audio_s, rows_s, batch.padded_samples / rate, compute_s,
                                       stage_s, [(started - item.enqueued_at, item.priority.source)
                                                 for item in batch.items])
            self.metrics.count_owner_audio({key: n / rate for key, n in batch.counted_by_owner().items()})
            self.metrics.observe_tokens([hyp.logprobs for hyp in hyps])
            self.metrics.observe_hotwords(sum(bool(item.hotwords) for item in batch.items))
        except Exception:  # a count that failed must not keep results from those waiting for them
            log.exception("counting a batch failed")
        for item, hyp in zip(batch.items, hyps, strict=True):
            share = compute_s * item.n_samples / batch.n_samples
            item.future.set_result(ItemResult(hyp, started - item.enqueued_at, share, len(batch.items)))
