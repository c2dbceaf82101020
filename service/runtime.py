"""Assembles the serving stack on one model: batcher -> engine -> transcriber, and the job consumer.

`batchasr serve` (through the app's lifespan, or in the engine process when HTTP runs in front-end processes)
and `batchasr worker` build it here; a front-end process builds its own, smaller stack over its engine link.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .audio import AudioLimits
from .batcher import Batcher
from .config import Settings
from .engine_link import EngineLink
from .job_keys import owner_of
from .job_types import ANONYMOUS
from .job_worker import ConsumerOptions, JobConsumer, JobMetrics, default_consumer_name
from .jobs import JobStore
from .metrics import Metrics
from .transcriber import Transcriber
from .url_inputs import UrlFetcher
from .webhooks import WebhookSender

if TYPE_CHECKING:  # a front end's stack needs neither (nor torch, which they import)
    from models.asr_model import ASRModel

    from .engine import Engine


@dataclass
class Stack:
    settings: Settings
    model: ASRModel
    metrics: Metrics
    batcher: Batcher
    engine: Engine
    transcriber: Transcriber
    decode_pool: ThreadPoolExecutor
    limits: AudioLimits
    jobs: JobStore | None = None
    consumer: JobConsumer | None = None
    _consumer_task: asyncio.Task | None = None
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    def make_consumer(self) -> JobConsumer:
        """A job consumer feeding this engine (settings.redis_url must be set)."""
        assert self.jobs is not None and self.consumer is None
        s = self.settings
        self.consumer = make_consumer(s, self.jobs, self.transcriber, self.limits, self.metrics, self.decode_pool,
                                      s.worker_name or default_consumer_name(), s.job_items_in_flight,
                                      lambda: self.engine.failed)
        return self.consumer

    def start_consumer(self) -> None:
        """Consume bulk jobs on this engine until ``request_stop`` (needs a running event loop)."""
        self._consumer_task = asyncio.create_task(self.make_consumer().run(self._stop))

    def request_stop(self) -> None:
        """Ask the job consumer to stop (signal handlers call this)."""
        self._stop.set()

    async def wait_engine_failed(self, poll_s: float = 1.0) -> None:
        """Returns once the engine has failed for good (never, while it serves)."""
        while not self.engine.failed:
            await asyncio.sleep(poll_s)

    async def wait_consumer(self) -> None:
        if self._consumer_task is not None:
            await self._consumer_task

    async def stop(self) -> None:
        """Stop taking job items, finish those in hand, drain the engine's queue, release everything."""
        self._stop.set()
        if self._consumer_task is not None:
            await self._consumer_task
        if self.consumer is not None:
            await self.consumer.close()  # a consumer that drained rather than ran still holds its connections
        await asyncio.to_thread(self.engine.stop)
        self.decode_pool.shutdown(wait=True)
        if self.jobs is not None:
            await self.jobs.close()


@dataclass
class FrontendStack:
    """A front-end process's share of the stack: its link to the engine process stands in for the engine (its
    readiness) and for the batcher (the transcriber's work queue). The job routes get a store of their own."""

    settings: Settings
    engine: EngineLink
    transcriber: Transcriber
    decode_pool: ThreadPoolExecutor
    limits: AudioLimits
    jobs: JobStore | None = None

    async def stop(self) -> None:
        self.engine.close()
        self.decode_pool.shutdown(wait=True)
        if self.jobs is not None:
            await self.jobs.close()


READING_SHARE = 16  # a consumer reads (fetches, decodes) this fraction of its items in flight at once


def make_consumer(s: Settings, jobs: JobStore, transcriber: Transcriber, limits: AudioLimits, metrics: JobMetrics,
                  decode_pool: ThreadPoolExecutor, name: str, prefetch: int,
                  engine_failed: Callable[[], bool]) -> JobConsumer:
    # the items in flight hold at most the audio of as many segments; a sixteenth of them are read at once
    # (service.audio_budget)
    options = ConsumerOptions(name=name, prefetch=prefetch, visibility_timeout_s=s.job_visibility_timeout_s,
                              max_attempts=s.job_max_attempts, max_audio_s=prefetch * s.max_segment_s,
                              first_item_s=s.max_segment_s, max_reading=max(1, prefetch // READING_SHARE))
    webhooks = (WebhookSender(s.webhook_secret, s.webhook_url_prefixes, delays_s=tuple(s.webhook_retry_delays_s))
                if s.webhook_secret else None)
    urls = UrlFetcher(s.input_url_prefixes, s.max_upload_bytes, s.job_url_timeout_s) if s.input_url_prefixes else None
    return JobConsumer(jobs, transcriber, limits, s.input_roots, metrics, options, decode_pool, webhooks, urls,
                       engine_failed)


def _job_store(s: Settings) -> JobStore | None:
    if not s.redis_url:
        return None
    return JobStore.from_url(s.redis_url, max_connections=s.redis_max_connections, input_ttl_s=s.job_input_ttl_s,
                             result_ttl_s=s.job_result_ttl_s, max_upload_bytes=s.max_upload_bytes,
                             max_queued_items=s.job_max_queued_items)


def _limits(s: Settings, sample_rate: int) -> AudioLimits:
    return AudioLimits(s.max_upload_bytes, s.max_duration_s, sample_rate, s.max_channels)


def _decode_pool(s: Settings) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(s.decode_threads, thread_name_prefix="batchasr-decode")


def build_frontend_stack(settings: Settings, link: EngineLink) -> FrontendStack:
    s = settings
    assert link.config is not None, "the link has not been greeted"
    transcriber = Transcriber(link, link.config, link.tokenizer, s.max_segment_s, s.segment_overlap_s,
                              s.request_timeout_s, s.max_queue, bulk_timeout_s=s.job_item_timeout_s)
    return FrontendStack(settings=s, engine=link, transcriber=transcriber, decode_pool=_decode_pool(s),
                         limits=_limits(s, link.config.features.sample_rate), jobs=_job_store(s))


def load_serving_model(settings: Settings) -> ASRModel:
    """The model ``settings`` name, loaded (``CheckpointError`` where it cannot be read), with the head
    ``settings.decoder`` asks for (``CannotStart`` where it has none)."""
    from models.asr_model import load_model

    model = load_model(settings.model, settings.device, settings.dtype, settings.attention_kernel)
    serving_decoder(settings, model)
    return model


def serving_decoder(settings: Settings, model: ASRModel) -> str:
    """The head that decodes: ``settings.decoder`` for ``model``; ``CannotStart`` naming the setting where the model
    has no such head (BATCHASR_DECODER=rnnt for a TDT model ended `serve` and `worker` in a traceback)."""
    from .config import SettingProblem
    from .processes import CannotStart

    try:
        return model.resolve_decoder(settings.decoder)
    except ValueError as exc:
        raise CannotStart(SettingProblem("decoder", settings.decoder, str(exc), overridden=False).line({})) from exc


def build_stack(settings: Settings, model: ASRModel, metrics: Metrics | None = None) -> Stack:
    """Batcher, engine (started: it warms up in its thread) and transcriber; a job store if Redis is set.
    ``CannotStart``, before any of them is made, where the model lacks the head ``settings.decoder`` names."""
    from .engine import Engine, warmup_shapes

    decoder = serving_decoder(settings, model)
    metrics = metrics or Metrics()
    metrics.expect_owners([owner_of(key) for key in settings.api_keys] or [ANONYMOUS])
    s = settings
    rate = model.sample_rate
    batcher = Batcher(s.max_batch_size, s.batch_audio_limit_s, s.max_wait_ms, s.max_queue, rate,
                      on_drop=lambda reason: metrics.dropped_items.labels(reason).inc(),
                      length_bucket_s=s.length_bucket_s, longest_samples=int(s.max_segment_s * rate))
    longest_s = batcher.padded_length(int(s.max_segment_s * rate)) / rate
    engine = Engine(model, batcher, metrics, decoder=decoder, scores=s.token_scores, hotword_boost=s.hotword_boost,
                    warmup_shapes=warmup_shapes(model.device, s.max_batch_size, longest_s, s.batch_audio_limit_s))
    transcriber = Transcriber(batcher, model.config, model.tokenizer, s.max_segment_s, s.segment_overlap_s,
                              s.request_timeout_s, s.max_queue, bulk_timeout_s=s.job_item_timeout_s)
    engine.start()
    return Stack(settings=s, model=model, metrics=metrics, batcher=batcher, engine=engine, transcriber=transcriber,
                 decode_pool=_decode_pool(s), limits=_limits(s, model.sample_rate), jobs=_job_store(s))
