"""Prometheus metrics (names are a contract: dashboards and autoscalers read them).

RTFx = rate(batchasr_audio_seconds_total) / rate(batchasr_compute_seconds_total); ``batchasr_rtfx`` is the
same ratio over the last ``RTFX_WINDOW_S`` seconds, for dashboards without PromQL.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from .batcher import Priority

disable_created_metrics()  # the *_created series only add cardinality for our dashboards

RTFX_WINDOW_S = 60.0
# what a front-end or consumer process may have the engine's process count for it (service.engine_link), by name
FORWARDED_METRIC_CALLS = ("observe_job_backlog", "observe_job_store_risks", "count_job_items_reclaimed",
                          "count_job_item_dead_lettered", "count_job_item", "count_job", "count_webhook",
                          "observe_webhooks_waiting", "observe_intake_wait")
INTAKE_WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# up to full batches of 30 s pieces at the largest batch sizes (128 x 30 s: 3840 s; 256 x 30 s: 7680 s)
BATCH_AUDIO_BUCKETS_S = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 2400, 4800, 9600)
UNSURE_BELOW = 0.5  # a token less likely than this is counted unsure
UNSURE_LOGPROB = math.log(UNSURE_BELOW)
# up to the longest waits there are: a request's timeout (600 s) and a job item's (3600 s); past 300 s every wait
# was one bucket (+Inf), so the queue-wait quantiles of a backlog of job items could not be told apart
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
# the label values each labelled counter can take, exposed at 0 from the start: a series that first shows up at 1 has
# no earlier sample for rate() or increase() to count from, so a dashboard would never see the first job that
# failed, nor the first item dropped
JOB_FINAL_STATUSES = ("completed", "completed_with_errors", "failed", "cancelled")
JOB_ITEM_STATUSES = ("completed", "failed")
WEBHOOK_OUTCOMES = ("delivered", "failed", "retried", "handed_back", "dropped")
DROP_REASONS = ("cancelled", "expired")
# what in Redis's settings would lose jobs silently (JobStore.durability_risks)
JOB_STORE_RISKS = ("eviction", "no_appendonly", "unconfirmed_replication")


class Metrics:
    """All of the service's metrics, in a registry of their own (several apps can live in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.audio_seconds = Counter("batchasr_audio_seconds", "Seconds of audio transcribed", registry=r)
        self.compute_seconds = Counter("batchasr_compute_seconds", "Seconds the engine spent on batches",
                                       registry=r)
        # by API key (the owner id Redis keeps its jobs under: a hash of the key) and source ("http" or "job"): what
        # each team sharing a deployment used, to charge it back; a series per key in use
        self.owner_audio_seconds = Counter("batchasr_owner_audio_seconds", "Seconds of audio transcribed by API key",
                                           ["owner", "source"], registry=r)
        self.rtfx = Gauge("batchasr_rtfx", f"Audio seconds per compute second over the last {RTFX_WINDOW_S:.0f} s",
                          registry=r)
        self.rtfx.set_function(self._recent_rtfx)  # as of each scrape: an idle engine's falls to 0
        self.batch_size = Histogram("batchasr_batch_size", "Items per engine batch", buckets=BATCH_SIZE_BUCKETS,
                                    registry=r)
        self.batch_audio_seconds = Histogram("batchasr_batch_audio_seconds", "Seconds of audio per batch",
                                             buckets=BATCH_AUDIO_BUCKETS_S, registry=r)
        self.padding_ratio = Histogram("batchasr_padding_ratio", "Share of each batch's samples that is padding",
                                       buckets=(0.01, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0), registry=r)
        self.queue_depth = Gauge("batchasr_queue_depth", "Items waiting for the engine", registry=r)
        # by source: "http" (someone waits: the API's autoscaling reads it) or "job" (bulk items wait by design)
        self.queue_wait_seconds = Histogram("batchasr_queue_wait_seconds", "Time items wait before their batch",
                                            ["source"], buckets=SECONDS_BUCKETS, registry=r)
        for source in sorted({priority.source for priority in Priority}):  # at 0 from the start: the API's
            self.queue_wait_seconds.labels(source)  # autoscaler reads http's, and a pod that had served none gave none
        self.request_duration_seconds = Histogram("batchasr_request_duration_seconds", "HTTP request latency",
                                                  ["route"], buckets=SECONDS_BUCKETS, registry=r)
        self.stage_seconds = Histogram("batchasr_stage_seconds", "Time per batch in each engine stage", ["stage"],
                                       buckets=SECONDS_BUCKETS, registry=r)
        self.requests = Counter("batchasr_requests", "HTTP requests by route and status code", ["route", "code"],
                                registry=r)
        self.jobs = Counter("batchasr_jobs", "Bulk jobs by final status", ["status"], registry=r)
        self.job_items = Counter("batchasr_job_items", "Bulk job items by status", ["status"], registry=r)
        self.job_stream_lag = Gauge("batchasr_job_stream_lag", "Job items queued or delivered but not acknowledged",
                                    registry=r)
        # what the workers scale on: items in a consumer's hands are being worked through (a few seconds of a GPU's),
        # and a worker added for them would find nothing to read
        self.job_items_waiting = Gauge("batchasr_job_items_waiting",
                                       "Job items queued and not yet delivered to a consumer", registry=r)
        self.job_items_reclaimed = Counter("batchasr_job_items_reclaimed", "Job items reclaimed from stalled workers",
                                           registry=r)
        self.job_items_dead_lettered = Counter("batchasr_job_items_dead_lettered",
                                               "Job items failed for good and moved to the dead-letter stream",
                                               registry=r)
        self.webhooks = Counter("batchasr_webhooks", "Job-completion webhook attempts by outcome (delivered, "
                                "failed for good, retried later, handed_back by a stopping worker, dropped: no "
                                "longer owed)", ["outcome"], registry=r)
        self.webhooks_waiting = Gauge("batchasr_webhooks_waiting", "Webhook deliveries waiting to be tried again",
                                      registry=r)
        self.intake_wait_seconds = Histogram(
            "batchasr_intake_wait_seconds", "Time uploads waited for room in their process's intake budget "
            "(MAX_INTAKE_BYTES) before being read", buckets=INTAKE_WAIT_BUCKETS, registry=r)
        self.job_store_risk = Gauge("batchasr_job_store_risk", "1 where Redis's settings would lose jobs without an "
                                    "error (eviction: a maxmemory-policy other than noeviction; no_appendonly: a "
                                    "restart loses what its last snapshot lacks; unconfirmed_replication: replicas, "
                                    "and no wait_replicas in the Redis URL), as job consumers last read them",
                                    ["risk"], registry=r)
        for risk in JOB_STORE_RISKS:
            self.job_store_risk.labels(risk)
        self.gpu_memory_bytes = Gauge("batchasr_gpu_memory_bytes", "GPU memory held by the engine", registry=r)
        self.dropped_items = Counter("batchasr_dropped_items", "Queued items dropped before the engine",
                                     ["reason"], registry=r)
        self.event_loop_cpu_seconds = Counter(
            "batchasr_event_loop_cpu_seconds",
            "CPU time of the event loops that take requests and job items in, summed over the engine's process and "
            "its front-end and consumer processes: one loop's rate near 1 means it, not the model, limits "
            "throughput", registry=r)
        # what the model makes of the audio, without references: a falling mean log-probability or a rising share of
        # unsure tokens says the audio (or the model's fit to it) got worse: a new codec, a noisy line
        self.tokens = Counter("batchasr_tokens", "Scored tokens the engine emitted (none with TOKEN_SCORES off)",
                              registry=r)
        self.token_neg_logprob = Counter(
            "batchasr_token_neg_logprob", "Sum of the emitted tokens' negative log-probabilities, in nats; over "
            "batchasr_tokens_total, minus the mean token log-probability (avg_logprob)", registry=r)
        self.unsure_tokens = Counter("batchasr_unsure_tokens",
                                     f"Emitted tokens with a probability below {UNSURE_BELOW}", registry=r)
        # a batch with hotwords replays graphs captured with the boosting (CTC: a frame loop over its boosted rows):
        # what share of the engine's batches do, should throughput fall
        self.hotword_batches = Counter("batchasr_hotword_batches", "Engine batches with an item that boosts hotwords",
                                       registry=r)
        self.hotword_items = Counter("batchasr_hotword_items", "Items that boost hotwords, in the engine's batches",
                                     registry=r)
        for counter, values in ((self.jobs, JOB_FINAL_STATUSES), (self.job_items, JOB_ITEM_STATUSES),
                                (self.webhooks, WEBHOOK_OUTCOMES), (self.dropped_items, DROP_REASONS)):
            for value in values:
                counter.labels(value)
        self._event_loop_cpu_seen = time.thread_time()  # from here: the process's start-up (imports) is not the loop's
        self._window: deque[tuple[float, float, float]] = deque()  # (time, audio_s, compute_s)
        self._lock = threading.Lock()

    def expect_owners(self, owners: list[str]) -> None:
        """Each of ``owners``' audio series, at 0 from the start: a series that first appeared at its first batch's
        seconds would have those left out of increase() and rate(), its key's first use uncounted."""
        for owner in owners:
            for source in ("http", "job"):
                self.owner_audio_seconds.labels(owner, source)

    def count_owner_audio(self, used: dict[tuple[str, str], float]) -> None:
        """``used``: seconds of audio by (owner, source); an owner of "" (no API key) is counted as "anonymous", as
        jobs and requests without a key are."""
        for (owner, source), seconds in used.items():
            self.owner_audio_seconds.labels(owner or "anonymous", source).inc(seconds)

    def bind_queue(self, depth: Callable[[], float]) -> None:
        self.queue_depth.set_function(depth)

    def bind_gpu_memory(self, allocated: Callable[[], float]) -> None:
        self.gpu_memory_bytes.set_function(allocated)

    def observe_batch(self, n_items: int, audio_s: float, rows_s: float, padded_s: float, compute_s: float,
                      stage_s: dict[str, float], queue_waits_s: list[tuple[float, str]]) -> None:
        """``audio_s``: the recordings' seconds the batch accounts for (RTFx); ``rows_s``: its rows' seconds
        (with the overlaps of long recordings' pieces); ``padded_s``: the rows padded to the batch's shape."""
        self.audio_seconds.inc(audio_s)
        self.compute_seconds.inc(compute_s)
        self.batch_size.observe(n_items)
        self.batch_audio_seconds.observe(rows_s)
        self.padding_ratio.observe(1 - rows_s / padded_s if padded_s > 0 else 0.0)
        for stage, seconds in stage_s.items():
            self.stage_seconds.labels(stage).observe(seconds)
        for wait, source in queue_waits_s:  # (seconds, "http" or "job": batcher.Priority.source)
            self.queue_wait_seconds.labels(source).observe(wait)
        now = time.monotonic()
        with self._lock:
            self._window.append((now, audio_s, compute_s))
            self._forget_before(now - RTFX_WINDOW_S)

    def _recent_rtfx(self) -> float:
        """RTFx over the batches of the last ``RTFX_WINDOW_S`` seconds, as of the scrape (0 once idle that long)."""
        with self._lock:
            self._forget_before(time.monotonic() - RTFX_WINDOW_S)
            compute = sum(c for _, _, c in self._window)
            return sum(a for _, a, _ in self._window) / compute if compute > 0 else 0.0

    def _forget_before(self, moment: float) -> None:
        while self._window and self._window[0][0] < moment:
            self._window.popleft()

    def observe_tokens(self, logprobs: list[list[float] | None]) -> None:
        """A batch's token scores (a hypothesis's list each; None where tokens were not scored)."""
        scored = [x for scores in logprobs if scores is not None for x in scores]
        self.tokens.inc(len(scored))
        self.token_neg_logprob.inc(-sum(scored))
        self.unsure_tokens.inc(sum(x < UNSURE_LOGPROB for x in scored))

    def observe_hotwords(self, n_boosted: int) -> None:
        """A batch's items that boost hotwords (0: an ordinary batch, not counted)."""
        if n_boosted:
            self.hotword_batches.inc()
            self.hotword_items.inc(n_boosted)

    # the job consumer's counts: method calls, so that a consumer in another process can make them over its link
    def observe_job_backlog(self, waiting: int, delivered: int) -> None:
        self.job_stream_lag.set(waiting + delivered)
        self.job_items_waiting.set(waiting)

    def observe_job_store_risks(self, risks: tuple[str, ...]) -> None:
        for risk in JOB_STORE_RISKS:
            self.job_store_risk.labels(risk).set(int(risk in risks))

    def count_job_items_reclaimed(self, n: int) -> None:
        self.job_items_reclaimed.inc(n)

    def count_job_item_dead_lettered(self) -> None:
        self.job_items_dead_lettered.inc()

    def count_job_item(self, status: str) -> None:
        self.job_items.labels(status).inc()

    def count_job(self, status: str) -> None:
        self.jobs.labels(status).inc()

    def count_webhook(self, outcome: str) -> None:
        self.webhooks.labels(outcome).inc()

    def observe_webhooks_waiting(self, waiting: int) -> None:
        self.webhooks_waiting.set(waiting)

    def observe_intake_wait(self, seconds: float) -> None:
        self.intake_wait_seconds.observe(seconds)

    def observe_request(self, route: str, code: int, duration_s: float) -> None:
        self.requests.labels(route, str(code)).inc()
        self.request_duration_seconds.labels(route).observe(duration_s)

    def observe_event_loop_cpu(self) -> None:
        """Count the calling thread's CPU time since the last call. Called on the event loop's thread before
        each scrape, which is where the time is spent."""
        now = time.thread_time()
        self.add_event_loop_cpu(now - self._event_loop_cpu_seen)
        self._event_loop_cpu_seen = now

    async def count_event_loop_cpu(self, every_s: float = 1.0) -> None:
        """Count the event loop's CPU every ``every_s`` seconds, run as a task on it: for a process whose scrapes are
        answered on a thread of their own (``--metrics-port``), where no scrape counts it."""
        while True:
            await asyncio.sleep(every_s)
            self.observe_event_loop_cpu()

    def add_event_loop_cpu(self, seconds: float) -> None:
        """Another process's event-loop CPU (a front end's report)."""
        self.event_loop_cpu_seconds.inc(max(0.0, seconds))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def scrape(self) -> bytes:
        """The exposition, with this event loop's CPU counted up to now (call it on the loop's thread). Async:
        the /metrics route awaits the same call whether the metrics live here or in the engine process."""
        self.observe_event_loop_cpu()
        return self.render()
