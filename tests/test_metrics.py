"""The engine's Prometheus metrics that are computed, not just counted."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from service import metrics as metrics_module
from service.job_types import JobStatus
from service.metrics import RTFX_WINDOW_S, Metrics


def test_the_recent_rtfx_is_of_the_last_window_as_of_the_scrape(monkeypatch):
    """It was set when a batch ran, so an engine gone idle kept showing its last busy minute for ever."""
    clock = [1000.0]
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: clock[0])
    metrics = Metrics()

    def rtfx() -> float:
        return metrics.registry.get_sample_value("batchasr_rtfx")

    assert rtfx() == 0.0
    metrics.observe_batch(2, 10.0, 12.0, 12.0, 0.1, {}, [(0.5, "http"), (2.0, "job")])
    clock[0] += 30
    metrics.observe_batch(1, 30.0, 30.0, 30.0, 0.1, {}, [])
    assert rtfx() == 200.0  # 40 s of audio in 0.2 s
    clock[0] += RTFX_WINDOW_S - 10
    assert rtfx() == 300.0  # the first batch has left the window
    clock[0] += 20
    assert rtfx() == 0.0  # idle for a whole window
    assert metrics.registry.get_sample_value("batchasr_queue_wait_seconds_count", {"source": "http"}) == 1
    assert metrics.registry.get_sample_value("batchasr_queue_wait_seconds_count", {"source": "job"}) == 1


def test_counters_by_status_are_exposed_at_zero_before_their_first_count():
    """A labelled counter's series used to appear only when first counted, at 1: rate() and increase() need a sample
    before that, so Prometheus never saw the first job of a status, the first failed item, the first dropped item."""
    scraped = {(s.name, tuple(s.labels.values())): s.value
               for family in text_string_to_metric_families(Metrics().render().decode()) for s in family.samples}
    final = [s.value for s in JobStatus if s not in (JobStatus.QUEUED, JobStatus.IN_PROGRESS)]
    expected = [*(("batchasr_jobs_total", status) for status in final),
                *(("batchasr_job_items_total", status) for status in ("completed", "failed")),
                *(("batchasr_webhooks_total", outcome) for outcome in ("delivered", "failed", "handed_back")),
                *(("batchasr_dropped_items_total", reason) for reason in ("cancelled", "expired"))]
    for name, value in expected:
        assert scraped.get((name, (value,))) == 0.0, (name, value)


def test_the_event_loops_cpu_counts_from_when_the_metrics_are_made_not_from_the_process_start():
    """The first count took all of the thread's CPU since the process started (importing torch, building the
    stack): a spike of seconds on the "event loop busy" panel after every restart."""
    import time

    started = time.thread_time()
    while time.thread_time() - started < 0.3:  # as imports spend before the metrics exist
        sum(range(1000))
    metrics = Metrics()
    metrics.observe_event_loop_cpu()
    assert metrics.registry.get_sample_value("batchasr_event_loop_cpu_seconds_total") < 0.1


def test_queue_waits_are_told_apart_up_to_a_job_items_timeout():
    """The buckets ended at 300 s: a job item's wait of 20 minutes and one of 50 fell in one bucket (+Inf)."""
    metrics = Metrics()
    metrics.observe_batch(2, 10.0, 12.0, 12.0, 0.1, {}, [(1200.0, "job"), (3000.0, "job")])

    def waits_within(le: str) -> float:
        return metrics.registry.get_sample_value("batchasr_queue_wait_seconds_bucket", {"source": "job", "le": le})

    assert (waits_within("300.0"), waits_within("1800.0"), waits_within("3600.0")) == (0.0, 1.0, 2.0)


def test_a_full_batch_of_30_s_pieces_at_the_deployed_batch_size_has_a_bucket_of_its_own():
    """The buckets ended at 1200 s: with MAX_BATCH_SIZE 128 (compose, Kubernetes) a full batch holds 3840 s, and
    the dashboard's p95 could show no more than 1200."""
    metrics = Metrics()
    metrics.observe_batch(128, 128 * 30.0, 128 * 30.0, 128 * 30.0, 2.0, {}, [])

    def batches_within(le: str) -> float:
        return metrics.registry.get_sample_value("batchasr_batch_audio_seconds_bucket", {"le": le})

    assert (batches_within("2400.0"), batches_within("4800.0")) == (0.0, 1.0)
