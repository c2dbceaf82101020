"""Feature-space augmentation for training: SpecAugment masks and vocal tract length perturbation.

Both act on normalised log-mel features (B, M, T), after the model's preprocessor and before the encoder.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Bins above this share of the mel axis are squeezed or stretched so the top bin stays the top bin.
WARP_KNEE = 0.85


def spec_augment(features: Tensor, n_frames: Tensor, freq_masks: int, freq_mask_width: int, time_masks: int,
                 time_mask_width: int, gen: torch.Generator) -> Tensor:
    """Zero random mel bands and time spans (features are normalised, so zero is the mean)."""
    batch, n_mels, _ = features.shape
    out = features.clone()
    for b in range(batch):
        for _ in range(freq_masks):
            width = int(torch.randint(0, freq_mask_width + 1, (), generator=gen))
            start = int(torch.randint(0, n_mels - width + 1, (), generator=gen))
            out[b, start:start + width] = 0.0
        for _ in range(time_masks):
            width = int(torch.randint(0, time_mask_width + 1, (), generator=gen))
            start = int(torch.randint(0, max(1, int(n_frames[b]) - width), (), generator=gen))
            out[b, :, start:start + width] = 0.0
    return out


def warp_sources(n_mels: int, factors: Tensor) -> Tensor:
    """For each factor a, the (fractional) source bin of every output bin: (B,) -> (B, M).

    A longer or shorter vocal tract moves every formant by about the same factor. Below the knee output bin m
    reads bin m / a (a > 1 moves the spectrum up); above it a straight line joins that point to the top bin,
    so no output bin reads outside the axis (Jaitly and Hinton's piecewise-linear VTLP, on the mel axis).
    """
    top = float(n_mels - 1)
    knee = WARP_KNEE * top
    bins = torch.arange(n_mels, dtype=torch.float32, device=factors.device)
    a = factors.float().unsqueeze(1)
    below = bins / a
    above = knee / a + (bins - knee) * (top - knee / a) / (top - knee)
    return torch.where(bins <= knee, below, above).clamp(0.0, top)


def warp_frequencies(features: Tensor, max_warp: float, gen: torch.Generator) -> Tensor:
    """Each sample's mel axis warped by a factor drawn from [1 - max_warp, 1 + max_warp]: new voices from
    the ones trained on (espeak has few variants, and the model otherwise learns them, not speech)."""
    if max_warp <= 0.0:
        return features
    if max_warp >= 1.0 - WARP_KNEE:  # the knee would read past the top bin
        raise ValueError(f"a warp of {max_warp} is too large; at most {1.0 - WARP_KNEE:.2f} keeps the axis")
    batch, n_mels, _ = features.shape
    factors = 1.0 + (torch.rand(batch, generator=gen) * 2.0 - 1.0) * max_warp
    sources = warp_sources(n_mels, factors.to(features.device))  # (B, M)
    low = sources.floor().long().clamp(max=n_mels - 2)
    frac = (sources - low).unsqueeze(-1).to(features.dtype)  # (B, M, 1)
    index = low.unsqueeze(-1).expand(-1, -1, features.shape[-1])
    lower = features.gather(1, index)
    upper = features.gather(1, index + 1)
    return lower + frac * (upper - lower)
