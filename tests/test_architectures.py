"""Published Parakeet architectures build from config alone and run a forward pass on CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.architectures import ARCHITECTURES, build_random_model
from models.config import parse_model_config


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "n_params_m", "n_tensors"),
    [
        # 725 state-dict tensors is the count dumped from NeMo's parakeet-tdt-0.6b-v3 (same layout as v2)
        ("parakeet-tdt-0.6b-v2", 617.8, 725),
        ("parakeet-rnnt-1.1b", 1070.4, 2 + 12 + 42 * 40 + 9 + 6),
    ],
)
def test_full_size_architecture_forward(name, n_params_m, n_tensors):
    model = build_random_model(name, device="cpu", dtype="float32", blank_bias=2.0)
    state = model.state_dict()
    assert len(state) == n_tensors
    assert sum(p.numel() for p in model.parameters()) / 1e6 == pytest.approx(n_params_m, abs=0.1)
    audio = np.random.default_rng(0).standard_normal(16000).astype(np.float32) * 0.1
    batch = model.encode([audio, audio[:8000]])
    assert batch.encoded.shape == (2, 13, 1024)  # 100 feature frames -> 13 encoder frames
    assert batch.lengths.tolist() == [13, 7]
    assert torch.isfinite(batch.encoded).all()
    hyps = model.decode(batch)
    assert len(hyps) == 2 and all(f < 13 for f in hyps[0].frames)
    del model, state


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_every_builtin_architecture_parses(name):
    config = parse_model_config(ARCHITECTURES[name])
    assert config.frame_s == pytest.approx(0.08)
    assert config.vocab_size in (1024, 8192)


def test_small_hybrid_architecture_decodes_with_both_heads():
    model = build_random_model("parakeet-tdt_ctc-110m", device="cpu", dtype="float32")
    assert model.config.kind == "hybrid" and model.config.transducer.is_tdt
    batch = model.encode([np.zeros(4000, dtype=np.float32) + 0.01])
    assert len(model.decode(batch, "tdt")) == len(model.decode(batch, "ctc")) == 1


def test_unknown_architecture_is_named():
    with pytest.raises(ValueError, match=r"unknown architecture 'parakeet-9b'; built-in: parakeet-tdt-0\.6b-v2"):
        build_random_model("parakeet-9b")


def test_random_encoder_output_moves_with_the_audio_and_calibrates_to_speech_like_label_rates():
    """Without centring the subsampling, every frame's output is nearly the same vector (its spread over time was
    3% of its size) and greedy decoding emits labels on every frame or on none, whatever the blank bias."""
    from service.bench import calibrate_blank_bias, synthetic_audio

    model = build_random_model("parakeet-tdt_ctc-110m", device="cpu", dtype="float32")
    waves = [w[:48000] for w in synthetic_audio(3, seed=2)]
    batch = model.encode(waves)
    frames = batch.encoded[0, : int(batch.lengths[0])]
    assert frames.std(dim=0).mean() > 0.5 * frames.std()
    for decoder in ("tdt", "ctc"):
        calibrate_blank_bias(model, waves, decoder)
        hyps = model.decode(batch, decoder)
        assert sum(len(h.tokens) for h in hyps) / int(batch.lengths.sum()) == pytest.approx(1 / 3, abs=0.08)
