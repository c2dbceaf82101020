"""An engine warmed up on a GPU, for the tests that check what its warm-up captured."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from models import ASRModel
from service.batcher import Batcher
from service.engine import Engine, warmup_shapes
from service.metrics import Metrics


@contextlib.contextmanager
def warm_engine(model: ASRModel, rows: int, segment_s: float) -> Iterator[Engine]:
    """An engine for ``model`` whose batches hold up to ``rows`` items of ``segment_s``, ready; stopped after."""
    shapes = warmup_shapes(model.device, rows, segment_s, rows * segment_s)
    engine = Engine(model, Batcher(rows, rows * segment_s, 10.0, 100), Metrics(), warmup_shapes=shapes)
    engine.start()
    try:
        assert engine.wait_ready(120), engine.error
        yield engine
    finally:
        engine.stop(30)
