"""Waveform -> normalised log-mel features, exactly as NeMo >= 2.5 computes them (``FilterbankFeatures``).

Always float32, batched, with no per-utterance Python loop. Padded samples and frames never influence the
valid ones: pre-emphasis is zeroed past each length, normalisation statistics use valid frames only, and
frames past each length are set to the pad value.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .config import FeatureConfig

NORM_EPS = 1e-5  # added to the standard deviation (not the variance), as NeMo does


def feature_lengths(n_samples: Tensor, cfg: FeatureConfig) -> Tensor:
    """Valid feature frames for each input length. The STFT gives one frame more, always treated as padding."""
    pad = (cfg.n_fft // 2) * 2
    return torch.div(n_samples.long() + pad - cfg.n_fft, cfg.hop_length, rounding_mode="floor").clamp_min(0)


def slaney_mel_filterbank(n_mels: int, n_fft: int, sample_rate: int) -> Tensor:
    """librosa.filters.mel(norm="slaney", htk=False) from 0 Hz to Nyquist, shape (n_mels, n_fft // 2 + 1).

    Used only for checkpoints that lack the saved ``fb`` buffer (built-in architectures with random
    weights); real checkpoints carry NeMo's own filterbank, which is what parity needs.
    """
    f_sp = 200.0 / 3  # Slaney scale: linear below 1 kHz, logarithmic above
    min_log_hz, logstep = 1000.0, torch.log(torch.tensor(6.4, dtype=torch.float64)) / 27.0
    min_log_mel = min_log_hz / f_sp

    def hz_to_mel(hz: Tensor) -> Tensor:
        return torch.where(hz >= min_log_hz, min_log_mel + torch.log(hz.clamp_min(1e-10) / min_log_hz) / logstep,
                           hz / f_sp)

    def mel_to_hz(mel: Tensor) -> Tensor:
        return torch.where(mel >= min_log_mel, min_log_hz * torch.exp(logstep * (mel - min_log_mel)), f_sp * mel)

    fft_freqs = torch.linspace(0, sample_rate / 2, n_fft // 2 + 1, dtype=torch.float64)
    edges = torch.tensor([0.0, sample_rate / 2], dtype=torch.float64)
    mel_edges = hz_to_mel(edges)
    mel_f = mel_to_hz(torch.linspace(float(mel_edges[0]), float(mel_edges[1]), n_mels + 2, dtype=torch.float64))
    fdiff = mel_f.diff()
    ramps = mel_f[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = torch.clamp(torch.minimum(lower, upper), min=0.0)
    weights *= (2.0 / (mel_f[2 : n_mels + 2] - mel_f[:n_mels]))[:, None]
    return weights.float()


class LogMelFeatures(nn.Module):
    """NeMo's ``AudioToMelSpectrogramPreprocessor`` in eval mode (no dither), ``per_feature`` normalisation."""

    def __init__(self, cfg: FeatureConfig):
        super().__init__()
        self.cfg = cfg
        window_fn = getattr(torch, f"{cfg.window}_window")  # hann -> torch.hann_window, as NeMo builds it
        self.register_buffer("window", window_fn(cfg.win_length, periodic=False))
        fb = slaney_mel_filterbank(cfg.n_mels, cfg.n_fft, cfg.sample_rate)
        self.register_buffer("fb", fb.unsqueeze(0))  # (1, n_mels, n_fft // 2 + 1)

    @torch.no_grad()
    def forward(self, audio: Tensor, n_samples: Tensor) -> tuple[Tensor, Tensor]:
        """
        Args:
            audio: (B, N) waveform at ``cfg.sample_rate``, any float dtype (computed in float32).
            n_samples: (B,) valid samples in each row.
        Returns:
            features (B, n_mels, T) float32 and their valid lengths (B,) int64.
        """
        cfg = self.cfg
        x = audio.float()
        n_frames = feature_lengths(n_samples, cfg)
        if cfg.preemph:
            x = torch.cat((x[:, :1], x[:, 1:] - cfg.preemph * x[:, :-1]), dim=1)
            valid = torch.arange(x.shape[1], device=x.device)[None, :] < n_samples[:, None]
            x = x.masked_fill(~valid, 0.0)
        with torch.autocast(x.device.type, enabled=False):
            spec = torch.stft(x, n_fft=cfg.n_fft, hop_length=cfg.hop_length, win_length=cfg.win_length,
                              window=self.window.float(), center=True, pad_mode="constant", return_complex=True)
            # sqrt(re^2 + im^2), then the power: NeMo's order, which matters for bit-exactness. NeMo sums the
            # squares over the last dim of view_as_real; adding the two halves is the same arithmetic, 3x faster.
            re, im = torch.view_as_real(spec).unbind(-1)
            mag = (re * re + im * im).sqrt()  # (B, n_fft // 2 + 1, T)
            if cfg.mag_power != 1.0:
                mag = mag.pow(cfg.mag_power)
            mel = torch.matmul(self.fb.float(), mag)  # (B, n_mels, T)
        logmel = torch.log(mel + cfg.log_guard)
        feats = normalize_per_feature(logmel, n_frames)
        frame_valid = torch.arange(feats.shape[2], device=x.device)[None, :] < n_frames[:, None]
        feats = feats.masked_fill(~frame_valid[:, None, :], cfg.pad_value)
        return feats, n_frames


def normalize_per_feature(x: Tensor, n_frames: Tensor) -> Tensor:
    """Per utterance and mel bin: subtract the mean, divide by (unbiased std + 1e-5), over valid frames only.

    Args:
        x: (B, n_mels, T) log-mel.
        n_frames: (B,) valid frames.
    """
    valid = (torch.arange(x.shape[2], device=x.device)[None, :] < n_frames[:, None]).unsqueeze(1)  # (B, 1, T)
    count = valid.sum(dim=2)  # (B, 1)
    mean = torch.where(valid, x, 0.0).sum(dim=2) / count  # (B, n_mels)
    sq_dev = torch.where(valid, x - mean.unsqueeze(2), 0.0) ** 2
    std = torch.sqrt(sq_dev.sum(dim=2) / (count - 1.0))
    std = std.masked_fill(std.isnan(), 0.0)  # one valid frame: 0/0
    std = std + NORM_EPS
    return (x - mean.unsqueeze(2)) / std.unsqueeze(2)
