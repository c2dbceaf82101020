"""The engine's Prometheus metrics that are computed, not just counted."""

from __future__ import annotations

from service import metrics as metrics_module
from service.metrics import RTFX_WINDOW_S, Metrics


def test_the_recent_rtfx_is_of_the_last_window_as_of_the_scrape(monkeypatch):
    """It was set when a batch ran, so an engine gone idle kept showing its last busy minute for ever."""
    clock = [1000.0]
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: clock[0])
    metrics = Metrics()

    def rtfx() -> float:
        return metrics.registry.get_sample_value("batchasr_rtfx")

    assert rtfx() == 0.0
    metrics.observe_batch(2, 10.0, 12.0, 12.0, 0.1, {}, [(0.5, True), (2.0, False)])
    clock[0] += 30
    metrics.observe_batch(1, 30.0, 30.0, 30.0, 0.1, {}, [])
    assert rtfx() == 200.0  # 40 s of audio in 0.2 s
    clock[0] += RTFX_WINDOW_S - 10
    assert rtfx() == 300.0  # the first batch has left the window
    clock[0] += 20
    assert rtfx() == 0.0  # idle for a whole window
    assert metrics.registry.get_sample_value("batchasr_queue_wait_seconds_count", {"source": "http"}) == 1
    assert metrics.registry.get_sample_value("batchasr_queue_wait_seconds_count", {"source": "job"}) == 1
