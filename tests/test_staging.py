"""Batches staged ahead of the engine: what the engine computes from, and what happens when staging fails."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from models import load_model
from models.audio_io import read_audio
from service.batcher import Batch, Batcher, Priority, WorkItem
from service.engine import Engine
from service.metrics import Metrics
from service.staging import BatchStager


def _items(*lengths: int, seed: int = 0) -> list[WorkItem]:
    rng = np.random.default_rng(seed)
    return [WorkItem((rng.standard_normal(n) * 0.1).astype(np.float32)) for n in lengths]


def test_a_staged_batch_is_its_waveforms_zero_padded():
    items = _items(5, 9, 1)
    staged = BatchStager(Batcher(4, 100.0, 0.0, 10), torch.device("cpu")).stage(Batch(items))
    audio, n_samples = staged.on_current_stream()
    assert audio.shape == (3, 9) and n_samples.tolist() == [5, 9, 1]
    for row, item in enumerate(items):
        assert torch.equal(audio[row, : item.n_samples], torch.from_numpy(item.waveform))
        assert not audio[row, item.n_samples :].any()


def test_at_most_one_batch_is_formed_ahead_of_the_one_running():
    """The stager put a batch in its queue of one and formed the next while it waited for room: two batches were
    formed ahead of the running one, and a request arriving then waited for both, past what the batcher allows
    for (FINISH_BATCHES)."""
    batcher = Batcher(4, 1000.0, 0.0, 100)
    batcher.submit([WorkItem(np.zeros(16000, np.float32), Priority.BULK_LOW) for _ in range(40)])
    stager = BatchStager(batcher, torch.device("cpu"), ahead=True)
    stager.start()
    assert stager.next() is not None  # the engine runs this one
    time.sleep(0.3)  # the stager forms what it may meanwhile
    urgent = WorkItem(np.zeros(16000, np.float32), Priority.INTERACTIVE)
    batcher.submit([urgent])
    ahead_of_it = 0
    while urgent not in stager.next().batch.items:
        ahead_of_it += 1
    batcher.close()
    assert ahead_of_it <= 1


@pytest.mark.parametrize("ahead", [False, True], ids=["when_asked", "ahead"])
def test_the_engine_computes_from_staged_batches_as_from_waveforms(parity_dir, parity_audio, ahead):
    """The engine's loop (staged batches) gives the tokens `transcribe` gives, batch after batch, whether
    batches are staged on a thread of their own (as on a GPU) or when the engine asks (as on a CPU)."""
    model = load_model(parity_dir / "tdt.nemo", device="cpu", dtype="float32")
    expected = model.transcribe(parity_audio)
    batcher = Batcher(3, 1000.0, 5.0, 100)
    engine = Engine(model, batcher, Metrics(), stage_ahead=ahead)
    engine.start()
    try:
        assert engine.wait_ready(60)
        items = [WorkItem(read_audio(path, model.sample_rate)) for path in parity_audio]
        batcher.submit(items)
        results = [item.future.result(60) for item in items]
    finally:
        engine.stop(30)
    assert [r.hypothesis.tokens for r in results] == [t.tokens for t in expected]
    assert max(r.batch_size for r in results) > 1


@pytest.mark.parametrize("ahead", [False, True], ids=["when_asked", "ahead"])
def test_a_batch_that_cannot_be_staged_runs_again_from_its_waveforms_and_the_engine_goes_on(parity_dir, monkeypatch,
                                                                                          ahead):
    """Staging failed (no pinned memory): its items were failed with it; now its halves run from their waveforms."""
    model = load_model(parity_dir / "tdt.nemo", device="cpu", dtype="float32")
    batcher = Batcher(2, 1000.0, 0.0, 100)
    engine = Engine(model, batcher, Metrics(), stage_ahead=ahead)
    stage = engine.stager.stage
    calls = []

    def fail_first(batch: Batch):
        calls.append(batch)
        if len(calls) == 1:
            raise MemoryError("cannot pin host memory")
        return stage(batch)

    monkeypatch.setattr(engine.stager, "stage", fail_first)
    engine.start()
    try:
        assert engine.wait_ready(60)
        first = _items(16000, 16000, seed=1)
        batcher.submit(first)
        alone = [model.transcribe([item.waveform])[0].tokens for item in first]
        assert [item.future.result(60).hypothesis.tokens for item in first] == alone
        assert [item.future.result(60).batch_size for item in first] == [1, 1]
        second = _items(8000, seed=2)
        batcher.submit(second)
        assert second[0].future.result(60).batch_size == 1
    finally:
        engine.stop(30)


POISON = 12_345  # samples: the length of the item the model below cannot take


@pytest.mark.parametrize("ahead", [False, True], ids=["when_asked", "ahead"])
@pytest.mark.parametrize("limit", ["poison", "rows"])
def test_a_failed_batch_fails_only_the_item_at_fault(parity_dir, monkeypatch, limit, ahead):
    """"poison": one item's audio makes the model raise, wherever it is batched: it alone fails, the seven batched
    with it get their results. "rows": more than 2 rows fail (memory a batch of 8 does not have): every item gets
    its result, from halves and quarters of the batch. Either way the engine goes on."""
    model = load_model(parity_dir / "tdt.nemo", device="cpu", dtype="float32")
    features = model.features

    def failing(audio, n_samples):
        if limit == "poison" and bool((n_samples == POISON).any()):
            raise ValueError("this audio breaks the model")
        if limit == "rows" and len(n_samples) > 2:
            raise RuntimeError("out of memory")
        return features(audio, n_samples)

    monkeypatch.setattr(model, "features", failing)
    batcher = Batcher(8, 1000.0, 1000.0, 100)
    engine = Engine(model, batcher, Metrics(), stage_ahead=ahead)
    engine.start()
    try:
        assert engine.wait_ready(60)
        items = _items(16000, 9000, POISON, 20000, 7000, 11000, 15000, 8000, seed=3)
        batcher.submit(items)
        for item in items:
            if limit == "poison" and item.n_samples == POISON:
                with pytest.raises(ValueError, match="breaks the model"):
                    item.future.result(60)
                continue
            result = item.future.result(60)
            assert result.hypothesis.tokens == model.transcribe([item.waveform])[0].tokens
            assert result.batch_size < len(items)
        assert engine.ready
        later = _items(8000, seed=4)
        batcher.submit(later)
        assert later[0].future.result(60).hypothesis.tokens is not None
    finally:
        engine.stop(30)


def test_batches_are_staged_ahead_on_cuda_only():
    batcher = Batcher(2, 1000.0, 0.0, 100)
    assert not BatchStager(batcher, torch.device("cpu")).ahead
    assert BatchStager(batcher, torch.device("cpu"), ahead=True).ahead


def test_items_queued_before_a_warm_up_that_fails_get_its_error(parity_dir):
    """A job consumer queues items from the start, before the engine is ready. A warm-up that failed closed the
    queue and left them there: each waited out its timeout (an hour for a job item), and a shutdown waited on
    them."""
    model = load_model(parity_dir / "tdt.nemo", device="cpu", dtype="float32")
    batcher = Batcher(4, 100.0, 0.0, 10)
    engine = Engine(model, batcher, Metrics())

    def failing_warm_up():
        raise RuntimeError("CUDA error: out of memory")

    engine._warm_up = failing_warm_up
    item = WorkItem(np.zeros(16000, dtype=np.float32), Priority.BULK, timeout_s=3600)
    batcher.submit([item])
    engine.start()
    assert not engine.wait_ready(30) and engine.failed and "out of memory" in engine.error
    with pytest.raises(RuntimeError, match="out of memory"):
        item.future.result(timeout=5)
    assert batcher.depth == 0
