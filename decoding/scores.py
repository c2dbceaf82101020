"""Each emitted token's log-probability: how sure the model was of it, for word confidences and ``avg_logprob``.

Greedy search keeps only the argmax, so its hot loop stays as lean as capture wants it (``label_looping``). The
scores are recovered afterwards, in one batched pass: the prediction network runs teacher-forced over each
hypothesis's own labels (one sequence call, not a step per label), and the joint runs once per emitted token at
the frame where it was emitted. That is the same distribution the search took its argmax from, so a token's
log-probability is the largest in it (up to the rounding of a different kernel), at a fraction of the search's
cost.

The probability is over the labels and blank (V+1), as the search chose among them; TDT duration logits are a
separate distribution and are left out.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .types import Hypothesis, JointNet, PredictionNet

JOINT_ROWS = 8192  # tokens scored per joint call: bounds memory for long, dense hypotheses


@torch.inference_mode()
def transducer_logprobs(encoded: Tensor, hyps: list[Hypothesis], prediction: PredictionNet, joint: JointNet
                        ) -> list[list[float]]:
    """
    Args:
        encoded: (B, T, d) encoder output the hypotheses were decoded from, one row each.
        hyps: their greedy hypotheses (tokens and frames).
    Returns:
        Per hypothesis, the natural log-probability of each token where it was emitted.
    """
    counts = [len(h.tokens) for h in hyps]
    longest = max(counts, default=0)
    if longest == 0:
        return [[] for _ in hyps]
    device, blank = encoded.device, joint.vocab_size
    rows = torch.repeat_interleave(torch.arange(len(hyps)), torch.tensor(counts))  # (N,) hypothesis of each token
    steps = torch.cat([torch.arange(n) for n in counts])  # (N,) its position in its hypothesis
    tokens = torch.tensor([t for h in hyps for t in h.tokens])
    frames = torch.tensor([f for h in hyps for f in h.frames])
    # the prediction network's inputs: the start symbol (blank), then each hypothesis's labels but its last
    # (a row's last label lands in its padding, whose outputs are never read, unless it is the longest row's)
    inputs = torch.full((len(hyps), longest), blank, dtype=torch.long)
    fed = steps + 1 < longest
    inputs[rows[fed], steps[fed] + 1] = tokens[fed]
    # to the device in one copy (on a GPU each is a wait): the inputs, then each token's row, step, id and frame
    packed = torch.cat([inputs.flatten(), rows, steps, tokens, frames]).to(device)
    inputs, rows, steps, tokens, frames = packed.split([inputs.numel()] + [len(rows)] * 4)
    outputs = prediction.sequence(inputs.view(len(hyps), longest))  # (B, U, H)
    scores = torch.empty(len(tokens), dtype=torch.float32, device=device)
    for start in range(0, len(tokens), JOINT_ROWS):
        part = slice(start, start + JOINT_ROWS)
        enc_proj = joint.project_encoder(encoded[rows[part], frames[part]])  # (n, J)
        pred_proj = joint.project_prediction(outputs[rows[part], steps[part]])  # (n, J)
        logits = joint.joint_after_projection(enc_proj, pred_proj)[:, : blank + 1].float()
        scores[part] = _chosen_logprob(logits, tokens[part])
    return _split(scores, counts)


@torch.inference_mode()
def ctc_logprobs(log_probs: Tensor, hyps: list[Hypothesis]) -> list[list[float]]:
    """Each token's highest log-probability over the frames of its run (``log_probs`` (B, T, V+1), as
    ``ctc_greedy`` took them; hypotheses with their run lengths as durations).

    CTC spreads a token over its run, often with blank close behind at its edges: the run's peak is the model's
    belief in it. (On held-out speech the peak told wrong words from right with AUROC 0.93, the run's first
    frame 0.88: docs/benchmarks.md.)"""
    counts = [len(h.tokens) for h in hyps]
    if not any(counts):
        return [[] for _ in hyps]
    device = log_probs.device
    runs = torch.tensor([d for h in hyps for d in h.durations or [1] * len(h.tokens)])
    token_of_frame = torch.repeat_interleave(torch.arange(len(runs)), runs)  # (M,) each run frame's token
    rows = torch.repeat_interleave(torch.arange(len(hyps)), torch.tensor(counts))[token_of_frame]
    starts = torch.tensor([f for h in hyps for f in h.frames])
    offsets = torch.arange(len(token_of_frame)) - torch.repeat_interleave(torch.cumsum(runs, 0) - runs, runs)
    frames = starts[token_of_frame] + offsets
    tokens = torch.tensor([t for h in hyps for t in h.tokens])[token_of_frame]
    rows, frames, tokens, token_of_frame = torch.stack([rows, frames, tokens, token_of_frame]).to(device)  # one copy
    values = log_probs[rows, frames, tokens].float()  # (M,), the head's output is already a log-softmax
    peaks = torch.full((len(runs),), -torch.inf, device=device)
    peaks.scatter_reduce_(0, token_of_frame, values, reduce="amax")
    return _split(peaks, counts)


def _chosen_logprob(logits: Tensor, tokens: Tensor) -> Tensor:
    """(n, C) scores, (n,) chosen classes -> (n,) log-softmax of each chosen class."""
    return logits.gather(1, tokens.unsqueeze(1)).squeeze(1) - torch.logsumexp(logits, dim=1)


def _split(scores: Tensor, counts: list[int]) -> list[list[float]]:
    flat = scores.cpu().tolist()  # the one device-to-host copy
    out, start = [], 0
    for n in counts:
        out.append(flat[start : start + n])
        start += n
    return out
