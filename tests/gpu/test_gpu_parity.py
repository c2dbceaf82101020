"""float32 on CUDA reproduces NeMo's own greedy output on the parity fixtures, token for token and frame for frame,
with TF32 switched on around it (as a program that wants it elsewhere would): the model turns it off for itself."""

from __future__ import annotations

import warnings

import pytest
import torch

from models import load_model
from tests.parity import assert_matches_nemo, nemo_cases


@pytest.mark.parametrize(("batch_size", "attention"), [(1, "reference"), (4, "reference"), (4, "sdpa")])
def test_float32_on_cuda_matches_nemo(parity_dir, parity_reference, parity_audio, batch_size, attention):
    """sdpa: the memory-efficient kernel on CUDA (models.fastconformer.CUDA_SDPA_BACKENDS)."""
    switches = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = [s.allow_tf32 for s in switches]
    try:
        for s in switches:
            s.allow_tf32 = True
        for name, decoder, key in nemo_cases(parity_reference):
            model = load_model(parity_dir / parity_reference["models"][name]["file"], device="cuda", dtype="float32",
                               attention_kernel=attention)
            transcripts = model.transcribe(parity_audio, batch_size=batch_size, decoder=decoder)
            for audio, got, expected in zip(parity_audio, transcripts, parity_reference["models"][name][key],
                                            strict=True):
                record = {"text": got.text, "tokens": got.tokens, "token_frames": got.token_frames}
                assert_matches_nemo(record, expected, f"{name}/{decoder} bs={batch_size} {audio}")
        assert [s.allow_tf32 for s in switches] == [True, True]
    finally:
        for s, value in zip(switches, saved, strict=True):
            s.allow_tf32 = value


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_prediction_lstm_weights_are_one_cudnn_buffer(parity_dir, parity_audio, dtype):
    """Moved to the GPU, each LSTM weight had its own memory, and cuDNN copied them all into one buffer at every
    decoder step (warning so once): the model hands cuDNN one buffer from the start."""
    model = load_model(parity_dir / "rnnt.nemo", device="cuda", dtype=dtype)
    lstm = model.decoder.prediction.dec_rnn.lstm
    flat = lstm._flat_weights
    assert all(w.untyped_storage().data_ptr() == flat[0].untyped_storage().data_ptr() for w in flat)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*single contiguous chunk of memory.*")
        model.transcribe(parity_audio[:2], batch_size=2)
