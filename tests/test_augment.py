"""Training augmentation on features: the vocal tract length warp moves spectra as a voice change would, and
the masks zero what they say."""

from __future__ import annotations

import pytest
import torch

from models.training.augment import spec_augment, warp_frequencies, warp_sources

N_MELS = 80


def test_no_warp_is_the_identity():
    features = torch.randn(2, N_MELS, 30)
    sources = warp_sources(N_MELS, torch.ones(2))
    assert torch.equal(sources, torch.arange(N_MELS, dtype=torch.float32).expand(2, -1))
    assert warp_frequencies(features, 0.0, torch.Generator()) is features


@pytest.mark.parametrize("factor", [0.86, 0.9, 1.1, 1.14])
def test_sources_stay_on_the_axis_rising_and_pinned_at_both_ends(factor):
    sources = warp_sources(N_MELS, torch.tensor([factor]))[0]
    assert sources[0] == 0.0 and sources[-1] == pytest.approx(N_MELS - 1)
    assert bool((sources[1:] > sources[:-1]).all())
    assert sources[20] == pytest.approx(20 / factor)  # below the knee: bin m reads bin m / factor


def test_a_warp_past_the_knee_is_refused():
    with pytest.raises(ValueError, match="too large"):
        warp_frequencies(torch.zeros(1, N_MELS, 2), 0.2, torch.Generator())


def test_a_formant_moves_by_the_drawn_factor():
    features = torch.zeros(64, N_MELS, 4)
    features[:, 30] = 1.0  # one spectral peak at bin 30 in every sample
    warped = warp_frequencies(features, 0.1, torch.Generator().manual_seed(0))
    peaks = warped[:, :, 0].argmax(dim=1).float()
    assert peaks.min() >= 30 * 0.9 - 1 and peaks.max() <= 30 * 1.1 + 1
    assert peaks.min() < 29 and peaks.max() > 31  # both directions drawn
    assert torch.allclose(warped[:, :, 1], warped[:, :, 0])  # the same warp in every frame of a sample


def test_masks_zero_bands_and_spans_inside_each_sample():
    features = torch.ones(3, N_MELS, 100)
    n_frames = torch.tensor([100, 60, 40])
    out = spec_augment(features, n_frames, 1, 10, 1, 20, torch.Generator().manual_seed(1))
    for b in range(3):
        zero_bins = (out[b] == 0).all(dim=1).sum()
        zero_frames = (out[b] == 0).all(dim=0).nonzero().flatten()
        assert zero_bins <= 10
        assert len(zero_frames) <= 20 and (len(zero_frames) == 0 or zero_frames.max() < n_frames[b])
    assert torch.equal(features, torch.ones(3, N_MELS, 100))  # the input is left alone
