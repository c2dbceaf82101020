"""FastConformer encoder (NeMo ``ConformerEncoder`` with ``dw_striding`` subsampling and rel-pos attention).

Module and parameter names follow NeMo's, so a NeMo state dict loads with ``strict=True``. Padded frames are
masked at every step that mixes time (subsampling convolutions, attention, the conv module), so each
utterance's output does not depend on what else is in the batch.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .config import EncoderConfig

ATTENTION_MASK_VALUE = -10000.0  # NeMo's INF_VAL: masked scores are this, not -inf
# How attention weights are computed: "reference" is NeMo's sequence of operations (scores, softmax, weighted
# sum, each a separate tensor); "sdpa" hands the content scores, softmax and weighted sum to
# torch's fused scaled_dot_product_attention, with the position scores as its additive mask. Same result
# up to rounding (about 1e-7 in float32).
ATTENTION_KERNELS = ("reference", "sdpa")
ATTENTION_KERNEL_OPTIONS = ("auto", *ATTENTION_KERNELS)  # what users may ask for; resolve_attention_kernel decides
# sdpa on CUDA: the memory-efficient kernel (it takes an additive mask), else torch's own math. Not cuDNN's: it
# builds a plan for each new shape, hundreds of ms (every batch of new lengths), about what sdpa cost each batch shape
# new to the process in the H200 bench (docs/benchmarks.md).
CUDA_SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def resolve_attention_kernel(kernel: str, device: torch.device) -> str:
    """``auto``: sdpa on CPU, where it is measured faster with the same tokens (docs/benchmarks.md); reference
    on other devices until it is measured there."""
    if kernel == "auto":
        return "sdpa" if device.type == "cpu" else "reference"
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; choose from {', '.join(ATTENTION_KERNEL_OPTIONS)}")
    return kernel


def _conv_out_length(n: Tensor) -> Tensor:
    """Frames after one kernel-3, stride-2, padding-1 convolution: floor((n + 2 - 3) / 2) + 1."""
    return torch.div(n + 2 - 3, 2, rounding_mode="floor") + 1


def _time_mask(n_frames: Tensor, max_len: int) -> Tensor:
    """(B, max_len) bool, True on valid frames."""
    return torch.arange(max_len, device=n_frames.device)[None, :] < n_frames[:, None]


class DepthwiseStridingSubsampling(nn.Module):
    """``dw_striding``: a regular 3x3 stride-2 conv, then (depthwise 3x3 stride 2, pointwise 1x1) pairs.

    Time is the height axis and mel the width axis. Padded frames are zeroed before every convolution that
    mixes frames and after the last layer (NeMo >= 2.5 ``MaskedConvSequential`` zeroes them before every
    layer; the layers between work frame by frame, so valid frames get the same values), so padding never
    leaks into valid frames.
    """

    def __init__(self, n_mels: int, channels: int, d_model: int, factor: int):
        super().__init__()
        n_stages = int(math.log2(factor))
        layers: list[nn.Module] = [nn.Conv2d(1, channels, 3, stride=2, padding=1), nn.ReLU(inplace=True)]
        for _ in range(n_stages - 1):
            layers += [
                nn.Conv2d(channels, channels, 3, stride=2, padding=1, groups=channels),
                nn.Conv2d(channels, channels, 1),
                nn.ReLU(inplace=True),
            ]
        self.conv = nn.Sequential(*layers)
        freq = n_mels
        for _ in range(n_stages):
            freq = (freq + 2 - 3) // 2 + 1
        self.out = nn.Linear(channels * freq, d_model)

    @property
    def input_conv(self) -> nn.Conv2d:
        """The regular conv over the single-channel features; the depthwise/pointwise pairs follow it."""
        return self.conv[0]

    def forward(self, x: Tensor, n_frames: Tensor) -> tuple[Tensor, Tensor]:
        """(B, T, n_mels), (B,) -> (B, T', d_model), (B,)"""
        x = x.unsqueeze(1)  # (B, 1, T, F)
        if x.device.type == "cpu":
            # oneDNN runs these convolutions (the 1-channel one and the depthwise ones) 2-3x faster on
            # channels-last tensors; the layout follows from the input. Same values to ~1e-6.
            x = x.contiguous(memory_format=torch.channels_last)
        lengths = n_frames
        for layer in self.conv:
            if isinstance(layer, nn.Conv2d) and layer.kernel_size != (1, 1):
                # it mixes neighbouring frames: padding must be zero here. ReLU and the 1x1 convs work frame by
                # frame, so what they leave in padded frames never reaches a valid one before the next mask.
                x = x * _time_mask(lengths, x.shape[2])[:, None, :, None].to(x.dtype)
            x = layer(x)
            if isinstance(layer, nn.Conv2d) and layer.stride != (1, 1):
                lengths = _conv_out_length(lengths)
        x = x * _time_mask(lengths, x.shape[2])[:, None, :, None].to(x.dtype)
        b, c, t, f = x.shape
        x = self.out(x.transpose(1, 2).reshape(b, t, c * f))  # channel-major flatten: (B, T', C*F')
        return x, lengths


class RelPositionalEncoding(nn.Module):
    """Sinusoidal embeddings for relative positions T-1 ... -(T-1); returned separately, never added to x."""

    def __init__(self, d_model: int, max_len: int):
        super().__init__()
        self.d_model = d_model
        self.register_buffer("pe", self._table(max_len, torch.device("cpu")), persistent=False)

    @property
    def max_len(self) -> int:
        """Positions the table covers each way (its 2L-1 rows)."""
        return (self.pe.shape[1] + 1) // 2

    def cover(self, n_feature_frames: int) -> None:
        """NeMo's ``update_max_seq_length``: once an input's feature frames (not its encoder frames) pass the
        table's length, the table is computed again for that many, on the model's device, and kept. The same
        inputs then read the same values as in NeMo: on a GPU, sin and cos round apart from the CPU's."""
        if n_feature_frames > self.max_len:
            self.pe = self._table(n_feature_frames, self.pe.device)

    def _table(self, length: int, device: torch.device) -> Tensor:
        positions = torch.arange(length - 1, -length, -1, dtype=torch.float32, device=device).unsqueeze(1)
        div = torch.exp(torch.arange(0, self.d_model, 2, dtype=torch.float32, device=device)
                        * -(math.log(10000.0) / self.d_model))
        pe = torch.zeros(positions.shape[0], self.d_model, device=device)
        pe[:, 0::2] = torch.sin(positions * div)
        pe[:, 1::2] = torch.cos(positions * div)
        return pe.unsqueeze(0)  # (1, 2L-1, d_model)

    def forward(self, n_frames: int, dtype: torch.dtype) -> Tensor:
        """(1, 2T-1, d_model) embeddings for positions T-1 down to -(T-1)."""
        if n_frames > self.max_len:  # frames given without ``cover`` first
            self.pe = self._table(n_frames, self.pe.device)
        center = self.pe.shape[1] // 2 + 1
        return self.pe[:, center - n_frames : center + n_frames - 1].to(dtype)


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, bias: bool):
        super().__init__()
        self.linear1 = nn.Linear(d_model, d_ff, bias=bias)
        self.activation = nn.SiLU()
        self.linear2 = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear2(self.activation(self.linear1(x)))


class RelPositionMultiHeadAttention(nn.Module):
    """Transformer-XL style attention with untied per-layer biases ``pos_bias_u``/``pos_bias_v``."""

    def __init__(self, d_model: int, n_heads: int, bias: bool):
        super().__init__()
        self.n_heads, self.d_k = n_heads, d_model // n_heads
        self.linear_q = nn.Linear(d_model, d_model, bias=bias)
        self.linear_k = nn.Linear(d_model, d_model, bias=bias)
        self.linear_v = nn.Linear(d_model, d_model, bias=bias)
        self.linear_out = nn.Linear(d_model, d_model, bias=bias)
        self.linear_pos = nn.Linear(d_model, d_model, bias=False)  # never a bias, whatever use_bias says
        self.pos_bias_u = nn.Parameter(torch.zeros(n_heads, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(n_heads, self.d_k))
        self.kernel = "reference"  # one of ATTENTION_KERNELS; set for the whole encoder by set_attention_kernel

    @staticmethod
    def rel_shift(x: Tensor) -> Tensor:
        """(B, h, T, 2T-1) scores by absolute position -> row i, column j holds relative position i - j."""
        b, h, t, p = x.shape
        x = nn.functional.pad(x, (1, 0))  # (B, h, T, 2T)
        x = x.view(b, h, p + 1, t)[:, :, 1:]  # drop the first row
        return x.reshape(b, h, t, p)

    def forward(self, x: Tensor, pos_emb: Tensor, att_mask: Tensor, pad_mask: Tensor) -> Tensor:
        """x (B, T, d), pos_emb (1, 2T-1, d), att_mask (B, T, T) True where attention is not allowed,
        pad_mask (B, T) True on padded frames."""
        b, t, _ = x.shape
        q = self.linear_q(x).view(b, t, self.n_heads, self.d_k)  # (B, T, h, d_k)
        k = self.linear_k(x).view(b, t, self.n_heads, self.d_k).transpose(1, 2)  # (B, h, T, d_k)
        v = self.linear_v(x).view(b, t, self.n_heads, self.d_k).transpose(1, 2)
        p = self.linear_pos(pos_emb).view(1, -1, self.n_heads, self.d_k).transpose(1, 2)  # (1, h, 2T-1, d_k)
        q_u = (q + self.pos_bias_u).transpose(1, 2)  # (B, h, T, d_k)
        q_v = (q + self.pos_bias_v).transpose(1, 2)
        mask = att_mask.unsqueeze(1)  # (B, 1, T, T)
        if self.kernel == "sdpa":
            scale = 1 / math.sqrt(self.d_k)
            scores_pos = self.rel_shift(torch.matmul(q_v * scale, p.transpose(-2, -1)))[..., :t]
            with sdpa_kernel(CUDA_SDPA_BACKENDS) if q_u.is_cuda else contextlib.nullcontext():
                out = nn.functional.scaled_dot_product_attention(
                    q_u, k, v, attn_mask=scores_pos.masked_fill(mask, ATTENTION_MASK_VALUE))
            # a padded query attends to nothing: zero, as the reference's masked weights make it
            out = out.masked_fill(pad_mask[:, None, :, None], 0.0)
        else:
            scores_pos = self.rel_shift(torch.matmul(q_v, p.transpose(-2, -1)))[..., :t]  # (B, h, T, T)
            scores_content = torch.matmul(q_u, k.transpose(-2, -1))
            scores = (scores_content + scores_pos) / math.sqrt(self.d_k)
            attn = torch.softmax(scores.masked_fill(mask, ATTENTION_MASK_VALUE), dim=-1).masked_fill(mask, 0.0)
            out = torch.matmul(attn, v)
        return self.linear_out(out.transpose(1, 2).reshape(b, t, self.n_heads * self.d_k))


class ConvModule(nn.Module):
    """Pointwise conv + GLU, depthwise conv over time, batch norm, SiLU, pointwise conv."""

    def __init__(self, d_model: int, kernel_size: int, bias: bool):
        super().__init__()
        self.pointwise_conv1 = nn.Conv1d(d_model, 2 * d_model, 1, bias=bias)
        self.depthwise_conv = nn.Conv1d(d_model, d_model, kernel_size, padding=(kernel_size - 1) // 2,
                                        groups=d_model, bias=bias)
        self.batch_norm = nn.BatchNorm1d(d_model)
        self.activation = nn.SiLU()
        self.pointwise_conv2 = nn.Conv1d(d_model, d_model, 1, bias=bias)

    def forward(self, x: Tensor, pad_mask: Tensor) -> Tensor:
        """x (B, T, d), pad_mask (B, T) True on padding."""
        x = self.pointwise_conv1(x.transpose(1, 2))  # (B, 2d, T)
        x = nn.functional.glu(x, dim=1)
        x = x.masked_fill(pad_mask.unsqueeze(1), 0.0)  # padding must not reach valid frames through the conv
        x = self.activation(self.batch_norm(self.depthwise_conv(x)))
        return self.pointwise_conv2(x).transpose(1, 2)


class ConformerLayer(nn.Module):
    """Macaron block: half FF, self-attention, conv module, half FF, final LayerNorm."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, kernel_size: int, bias: bool):
        super().__init__()
        self.norm_feed_forward1 = nn.LayerNorm(d_model)
        self.feed_forward1 = FeedForward(d_model, d_ff, bias)
        self.norm_self_att = nn.LayerNorm(d_model)
        self.self_attn = RelPositionMultiHeadAttention(d_model, n_heads, bias)
        self.norm_conv = nn.LayerNorm(d_model)
        self.conv = ConvModule(d_model, kernel_size, bias)
        self.norm_feed_forward2 = nn.LayerNorm(d_model)
        self.feed_forward2 = FeedForward(d_model, d_ff, bias)
        self.norm_out = nn.LayerNorm(d_model)

    def forward(self, x: Tensor, pos_emb: Tensor, att_mask: Tensor, pad_mask: Tensor) -> Tensor:
        x = torch.add(x, self.feed_forward1(self.norm_feed_forward1(x)), alpha=0.5)  # halving is exact: one pass
        x = x + self.self_attn(self.norm_self_att(x), pos_emb, att_mask, pad_mask)
        x = x + self.conv(self.norm_conv(x), pad_mask)
        x = torch.add(x, self.feed_forward2(self.norm_feed_forward2(x)), alpha=0.5)
        return self.norm_out(x)


class FastConformerEncoder(nn.Module):
    """Log-mel features -> encoder frames (8x subsampled for Parakeet)."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.pre_encode = DepthwiseStridingSubsampling(cfg.feat_in, cfg.subsampling_channels, cfg.d_model,
                                                       cfg.subsampling_factor)
        self.pos_enc = RelPositionalEncoding(cfg.d_model, cfg.pos_emb_max_len)
        self.xscale = math.sqrt(cfg.d_model) if cfg.xscaling else None
        d_ff = cfg.d_model * cfg.ff_expansion
        self.layers = nn.ModuleList(
            ConformerLayer(cfg.d_model, cfg.n_heads, d_ff, cfg.conv_kernel_size, cfg.use_bias)
            for _ in range(cfg.n_layers)
        )
        self.attention_kernel = "reference"

    def set_attention_kernel(self, kernel: str) -> None:
        """Compute attention with ``kernel`` (see ``ATTENTION_KERNELS``) in every layer."""
        if kernel not in ATTENTION_KERNELS:
            raise ValueError(f"unknown attention kernel {kernel!r}; choose from {', '.join(ATTENTION_KERNELS)}")
        for layer in self.layers:
            layer.self_attn.kernel = kernel
        self.attention_kernel = kernel

    def forward(self, features: Tensor, n_frames: Tensor) -> tuple[Tensor, Tensor]:
        """
        Args:
            features: (B, n_mels, T) log-mel, cast to the encoder's dtype.
            n_frames: (B,) valid feature frames.
        Returns:
            (B, T', d_model) encoder output and (B,) valid encoder frames.
        """
        return self.contextualise(*self.subsample(features, n_frames))

    def subsample(self, features: Tensor, n_frames: Tensor) -> tuple[Tensor, Tensor]:
        """(B, n_mels, T), (B,) -> (B, T', d_model) frames before the conformer layers, (B,) valid frames."""
        self.pos_enc.cover(features.shape[-1])
        x, lengths = self.pre_encode(features.transpose(1, 2), n_frames)
        if self.xscale is not None:
            x = x * self.xscale
        return x, lengths

    def contextualise(self, x: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """The conformer layers over subsampled frames: (B, T', d_model), (B,) -> the same shapes."""
        t = x.shape[1]
        pos_emb = self.pos_enc(t, x.dtype)  # (1, 2T'-1, d)
        valid = _time_mask(lengths, t)  # (B, T')
        att_mask = ~(valid[:, :, None] & valid[:, None, :])  # (B, T', T') True where not allowed
        pad_mask = ~valid
        for layer in self.layers:
            x = layer(x, pos_emb, att_mask, pad_mask)
        return x, lengths
