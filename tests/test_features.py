"""Log-mel features: NeMo's length formula, its filterbank, and independence from batch padding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.checkpoint import open_checkpoint
from models.config import FeatureConfig, parse_features
from models.features import LogMelFeatures, feature_lengths, slaney_mel_filterbank


@pytest.mark.parametrize(("n_samples", "n_frames"), [(0, 0), (159, 0), (160, 1), (16000, 100), (176000, 1100)])
def test_feature_length_formula(n_samples, n_frames):
    assert feature_lengths(torch.tensor([n_samples]), FeatureConfig()).item() == n_frames


@pytest.mark.parametrize("model", ["ctc.nemo", "rnnt.nemo"])  # 80 and 128 mels
def test_computed_filterbank_equals_the_one_nemo_saved(parity_dir, model):
    saved = open_checkpoint(parity_dir / model).state_dict["preprocessor.featurizer.fb"][0]
    computed = slaney_mel_filterbank(saved.shape[0], 512, 16000)
    torch.testing.assert_close(computed, saved, rtol=0, atol=1e-7)


def test_features_do_not_depend_on_padding():
    rng = np.random.default_rng(1)
    featurizer = LogMelFeatures(FeatureConfig(n_mels=80))
    waves = [rng.standard_normal(n).astype(np.float32) for n in (16000, 5000, 321)]
    batch = torch.zeros(3, 16000)
    for i, w in enumerate(waves):
        batch[i, : len(w)] = torch.from_numpy(w)
    feats, lengths = featurizer(batch, torch.tensor([len(w) for w in waves]))
    assert feats.dtype == torch.float32
    for i, w in enumerate(waves):
        alone, n = featurizer(torch.from_numpy(w)[None], torch.tensor([len(w)]))
        torch.testing.assert_close(feats[i, :, : n.item()], alone[0, :, : n.item()], rtol=1e-5, atol=1e-5)
        assert (feats[i, :, lengths[i] :] == 0).all()  # padded frames hold the pad value


def test_normalised_features_have_zero_mean_unit_std():
    wave = torch.from_numpy(np.random.default_rng(2).standard_normal(32000).astype(np.float32))
    feats, n = LogMelFeatures(FeatureConfig(n_mels=64))(wave[None], torch.tensor([32000]))
    valid = feats[0, :, : n.item()]
    assert valid.mean(dim=1).abs().max() < 1e-4
    assert (valid.std(dim=1) - 1).abs().max() < 1e-3


@pytest.mark.parametrize("pad_to", [None, 0, 16])
def test_no_frames_are_added_whatever_the_config_pads_to(pad_to):
    """NeMo's transcribe() pads no frames, whatever the preprocessor's pad_to (a training setting; 16 where the
    config says nothing, as it was taken here): 1 s of audio is its STFT's 101 frames, not 112."""
    section = {"sample_rate": 16000, "features": 80} | ({} if pad_to is None else {"pad_to": pad_to})
    featurizer = LogMelFeatures(parse_features(section, 16000))
    feats, n = featurizer(torch.zeros(1, 16000), torch.tensor([16000]))
    assert (feats.shape[-1], n.item()) == (101, 100)
