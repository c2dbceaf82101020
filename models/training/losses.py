"""Transducer losses (RNN-T and TDT) written for memory, and the CTC loss, in plain PyTorch.

A transducer lattice needs only two log-probabilities per node: blank, and the next target label (plus the
duration log-probabilities for TDT). The joint output [B, T, U+1, V+1(+D)] is therefore never kept: each
chunk of samples runs the joint under ``torch.utils.checkpoint``, takes a float32 logsumexp over the labels
and gathers blank and target, so only [B, T, U+1] tensors survive the forward pass. The backward pass
recomputes one chunk's joint at a time. The forward-variable recursion then runs in float32 (float64 if the
inputs are float64) whatever dtype the joint ran in.

Lattice conventions (NeMo's, ``nemo/collections/asr/losses/rnnt_pytorch.py``): node (t, u) means u labels
emitted and frame t being read, t in [0, T), u in [0, U].
- RNN-T: blank moves (t, u) -> (t+1, u); a label moves (t, u) -> (t, u+1); the path ends with a blank
  from (T-1, U).
- TDT: every arc also picks a duration d from ``durations`` (log-softmax over the D duration logits,
  separate from the label log-softmax). A label moves (t, u) -> (t+d, u+1), d may be 0; a blank moves
  (t, u) -> (t+d, u) with d >= 1 only. The path ends with a blank from (T-d, U) that lands exactly on T.
  ``sigma`` is the logit under-normalisation of the TDT paper, subtracted from label log-probabilities.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

NEG = -1e30  # log(0) stand-in: finite, so logaddexp and its gradient never see (-inf) - (-inf)
CHUNK_ELEMENTS = 1 << 23  # joint outputs per checkpointed chunk (32 MB of float32 logits)

JointFn = Callable[[Tensor], Tensor]  # (..., J) hidden sum -> (..., V+1+D) logits


@dataclass
class LatticeLogProbs:
    """What the loss needs from the joint, per lattice node. Padded nodes hold zeros."""

    blank: Tensor  # (B, T, U+1) log P(blank | t, u)
    emit: Tensor  # (B, T, U+1) log P(target[u] | t, u); column U is padding
    duration: Tensor | None  # (B, T, U+1, D) log P(durations[n] | t, u); None for RNN-T


class _SelectLogProbs(torch.autograd.Function):
    """Logits (b, t, u, V+1+D) -> log P(blank), log P(target[u]) (b, t, u) and the duration log-softmax
    (b, t, u, D), with a backward that writes the logits' gradient in one buffer:
    d/dlogit_k = [k = blank] g_blank + [k = target] g_emit - softmax_k (g_blank + g_emit) over the labels,
    and g_dur - softmax(dur) * sum(g_dur) over the durations. Autograd's own backward of the same ops
    (logsumexp, gather, two slices) fills several full-size buffers, which is most of a large vocabulary's
    training time."""

    @staticmethod
    def forward(ctx, logits: Tensor, idx: Tensor, vocab_size: int, sigma: float  # type: ignore[override]
                ) -> tuple[Tensor, Tensor, Tensor]:
        labels = logits[..., : vocab_size + 1]
        lse = labels.logsumexp(dim=-1)  # (b, t, u)
        norm = lse + sigma
        blank = labels[..., vocab_size] - norm
        full_idx = idx[:, None, :, None].expand(-1, logits.shape[1], -1, 1)
        emit = labels.gather(-1, full_idx).squeeze(-1) - norm
        duration = logits[..., vocab_size + 1 :].log_softmax(dim=-1)
        ctx.save_for_backward(logits, lse, full_idx, duration)
        ctx.vocab_size = vocab_size
        return blank, emit, duration

    @staticmethod
    def backward(ctx, g_blank: Tensor, g_emit: Tensor, g_duration: Tensor  # type: ignore[override]
                 ) -> tuple[Tensor | None, ...]:
        logits, lse, full_idx, duration = ctx.saved_tensors
        v = ctx.vocab_size
        grad = torch.empty_like(logits)
        labels_grad = grad[..., : v + 1]
        torch.sub(logits[..., : v + 1], lse[..., None], out=labels_grad)
        labels_grad.exp_().mul_(-(g_blank + g_emit)[..., None])  # softmax x -(g_blank + g_emit)
        labels_grad[..., v] += g_blank
        labels_grad.scatter_add_(-1, full_idx, g_emit[..., None])
        if duration.shape[-1]:
            grad[..., v + 1 :] = g_duration - duration.exp() * g_duration.sum(dim=-1, keepdim=True)
        return grad, None, None, None


def lattice_log_probs(enc_proj: Tensor, pred_proj: Tensor, targets: Tensor, enc_lengths: Tensor,
                      target_lengths: Tensor, joint_fn: JointFn, vocab_size: int, n_durations: int = 0,
                      sigma: float = 0.0, chunk_elements: int = CHUNK_ELEMENTS) -> LatticeLogProbs:
    """Run the joint chunk by chunk and keep only blank/target (and duration) log-probabilities.

    Args:
        enc_proj: (B, T, J) projected encoder output.
        pred_proj: (B, U+1, J) projected prediction-network output (row 0: after the start symbol).
        targets: (B, U) label ids (padding: any valid id).
        joint_fn: hidden sum -> logits with V+1 labels (blank = V) then D duration logits.
    """
    batch, n_frames, _ = enc_proj.shape
    n_nodes_u = pred_proj.shape[1]
    acc = torch.promote_types(enc_proj.dtype, torch.float32)
    width = vocab_size + 1 + n_durations
    index = F.pad(targets, (0, 1), value=0).long()  # (B, U+1): a dummy label at u = U

    def gather(enc: Tensor, pred: Tensor, idx: Tensor) -> tuple[Tensor, ...]:
        logits = joint_fn(enc[:, :, None] + pred[:, None]).to(acc)  # (b, t, u, V+1+D), freed after this call
        blank, emit, duration = _SelectLogProbs.apply(logits, idx, vocab_size, sigma)
        return (blank, emit, duration) if n_durations else (blank, emit)

    # Longest samples bound each chunk; chunks are contiguous rows, so sort the batch by length beforehand
    # (the trainer does) to keep padding low. A sample too big for one chunk is split along time.
    per_sample = n_frames * n_nodes_u * width
    rows = max(1, chunk_elements // max(per_sample, 1))
    use_checkpoint = torch.is_grad_enabled() and (enc_proj.requires_grad or pred_proj.requires_grad)
    parts: list[tuple[Tensor, ...]] = []
    for start in range(0, batch, rows):
        sl = slice(start, start + rows)
        t_max = int(enc_lengths[sl].max())
        u_max = int(target_lengths[sl].max()) + 1
        t_step = max(1, chunk_elements // (u_max * width)) if rows == 1 else t_max
        pieces = []
        for t0 in range(0, t_max, t_step):
            args = (enc_proj[sl, t0:min(t0 + t_step, t_max)], pred_proj[sl, :u_max], index[sl, :u_max])
            pieces.append(checkpoint(gather, *args, use_reentrant=False) if use_checkpoint else gather(*args))
        out = [torch.cat(xs, dim=1) for xs in zip(*pieces, strict=True)]  # joined along time
        pad = (0, n_nodes_u - u_max, 0, n_frames - t_max)
        parts.append(tuple(F.pad(x, pad) if x.dim() == 3 else F.pad(x, (0, 0, *pad)) for x in out))
    blank, emit, *duration = (torch.cat(xs) for xs in zip(*parts, strict=True))
    return LatticeLogProbs(blank=blank, emit=emit, duration=duration[0] if duration else None)


def _within_frame(arrive: Tensor, step: Tensor) -> Tensor:
    """alpha[u] = logaddexp(arrive[u], alpha[u-1] + step[u-1]) for all u at once.

    Unrolled: alpha[u] = logsumexp_{k<=u} (arrive[k] + sum_{k<=j<u} step[j])
                       = S[u] + logcumsumexp(arrive - S)[u], S: exclusive cumsum of step.
    arrive, step: (B, U+1) -> (B, U+1).
    """
    prefix = F.pad(step[:, :-1].cumsum(dim=1), (1, 0))
    return prefix + torch.logcumsumexp(arrive - prefix, dim=1)


def _shift_u(x: Tensor) -> Tensor:
    """(B, U+1): value of node u-1 at u, NEG at u = 0 (an arc that emits one label)."""
    return F.pad(x[:, :-1], (1, 0), value=NEG)


def transducer_log_likelihood(lp: LatticeLogProbs, enc_lengths: Tensor, target_lengths: Tensor,
                              durations: Sequence[int] = ()) -> Tensor:
    """log P(targets | input) per sample (B,), summed over every alignment; RNN-T if no durations."""
    batch, n_frames, n_nodes_u = lp.blank.shape
    acc = torch.promote_types(lp.blank.dtype, torch.float32)
    blank_full, emit_full = lp.blank.to(acc), lp.emit.to(acc)
    # Per-frame views taken once with unbind: its backward stacks the frame gradients in one op, where
    # indexing [:, t] inside the loop would allocate and fill a full-size zero gradient for every frame.
    blank, emit = blank_full.transpose(0, 1).unbind(0), emit_full.transpose(0, 1).unbind(0)  # T x (B, U+1)
    start = torch.full((batch, n_nodes_u), NEG, dtype=acc, device=lp.blank.device)
    start[:, 0] = 0.0
    rows = torch.arange(batch, device=lp.blank.device)
    u_end = target_lengths.long()
    alphas: list[Tensor] = []  # alphas[t]: (B, U+1)

    if not durations:  # RNN-T
        for t in range(n_frames):
            arrive = start if t == 0 else alphas[t - 1] + blank[t - 1]
            alphas.append(_within_frame(arrive, emit[t]))
        t_end = enc_lengths.long() - 1
        return torch.stack(alphas)[t_end, rows, u_end] + blank_full[rows, t_end, u_end]

    assert lp.duration is not None and lp.duration.shape[-1] == len(durations)
    dur_full = lp.duration.to(acc)
    dur = [step.unbind(0) for step in dur_full.permute(1, 3, 0, 2).unbind(0)]  # dur[t][n]: (B, U+1)
    zero = durations.index(0) if 0 in durations else None
    for t in range(n_frames):
        terms = [start] if t == 0 else []
        for n, d in enumerate(durations):
            if d == 0 or t - d < 0:
                continue
            src, jump = alphas[t - d], dur[t - d][n]
            terms.append(src + blank[t - d] + jump)  # blank lasting d frames
            terms.append(_shift_u(src + emit[t - d] + jump))  # label, then d frames
        arrive = torch.stack(terms).logsumexp(dim=0) if terms else torch.full_like(start, NEG)
        alphas.append(arrive if zero is None else _within_frame(arrive, emit[t] + dur[t][zero]))
    stacked = torch.stack(alphas)  # (T, B, U+1)
    finals = []
    for n, d in enumerate(durations):
        if d == 0:
            continue
        t_src = enc_lengths.long() - d
        ok = t_src >= 0
        t_src = t_src.clamp_min(0)
        term = stacked[t_src, rows, u_end] + blank_full[rows, t_src, u_end] + dur_full[rows, t_src, u_end, n]
        finals.append(torch.where(ok, term, torch.full_like(term, NEG)))
    return torch.stack(finals).logsumexp(dim=0)


def transducer_loss(enc_proj: Tensor, pred_proj: Tensor, targets: Tensor, enc_lengths: Tensor,
                    target_lengths: Tensor, joint_fn: JointFn, vocab_size: int, durations: Sequence[int] = (),
                    sigma: float = 0.0, chunk_elements: int = CHUNK_ELEMENTS) -> Tensor:
    """Negative log-likelihood per sample (B,), float32 or wider: RNN-T, or TDT when durations are given."""
    lp = lattice_log_probs(enc_proj, pred_proj, targets, enc_lengths, target_lengths, joint_fn, vocab_size,
                           len(durations), sigma, chunk_elements)
    return -transducer_log_likelihood(lp, enc_lengths, target_lengths, durations)


def ctc_loss(log_probs: Tensor, targets: Tensor, enc_lengths: Tensor, target_lengths: Tensor,
             blank: int) -> Tensor:
    """torch's CTC on (B, T, V+1) log-probabilities, computed in float32; per sample (B,)."""
    return F.ctc_loss(log_probs.float().transpose(0, 1), targets, enc_lengths, target_lengths, blank=blank,
                      reduction="none", zero_infinity=True)
