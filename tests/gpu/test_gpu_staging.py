"""Batches staged on the GPU: padded in pinned host buffers that are reused, uploaded on a stream of their own."""

from __future__ import annotations

import numpy as np
import torch

from models import load_model
from models.audio_io import read_audio
from service.batcher import Batch, Batcher, WorkItem
from service.engine import Engine
from service.metrics import Metrics
from service.staging import N_HOST_BUFFERS, BatchStager


def test_staged_batches_give_the_features_featurize_gives_even_in_reused_buffers(parity_dir):
    model = load_model(parity_dir / "tdt.nemo", device="cuda", dtype="float32")
    stager = BatchStager(Batcher(8, 1000.0, 0.0, 100), model.device)
    rng = np.random.default_rng(0)
    # the widest batch first: the later ones reuse its buffer, whose rows still hold its samples
    shapes = [(3, 40000), (5, 9000), (2, 23000), (4, 100)]
    assert len(shapes) > N_HOST_BUFFERS
    for rows, width in shapes:
        waves = [(rng.standard_normal(rng.integers(1, width + 1)) * 0.1).astype(np.float32) for _ in range(rows)]
        staged = stager.stage(Batch([WorkItem(w) for w in waves]))
        features, frames = model.features(*staged.on_current_stream())
        expected, expected_frames = model.featurize(waves)
        assert torch.equal(frames, expected_frames)
        assert torch.equal(features, expected), (rows, width)


def test_the_engine_on_cuda_computes_from_staged_batches_as_transcribe_does(parity_dir, parity_audio):
    model = load_model(parity_dir / "tdt.nemo", device="cuda", dtype="float32")
    expected = [t.tokens for t in model.transcribe(parity_audio, batch_size=4)]
    batcher = Batcher(4, 1000.0, 5.0, 100)
    engine = Engine(model, batcher, Metrics())
    assert engine.stager.ahead  # the default on CUDA
    engine.start()
    try:
        assert engine.wait_ready(120), engine.error
        for _ in range(3):  # several rounds: buffers and streams reused
            items = [WorkItem(read_audio(path, model.sample_rate)) for path in parity_audio]
            batcher.submit(items)
            assert [item.future.result(120).hypothesis.tokens for item in items] == expected
    finally:
        engine.stop(30)
