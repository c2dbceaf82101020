"""Conventional batched greedy transducer decoding ("frame looping"), for RNN-T and TDT.

The outer loop walks encoder frames; at each frame the rows waiting there run the joint and emit labels
until they see a blank, jump past the frame (TDT) or reach ``max_symbols``. The prediction network runs at
full batch after every inner step. It is the exactness reference the label-looping decoder must equal,
and the baseline it is benchmarked against.

Semantics (NeMo's greedy_batch): blank moves to the next frame (TDT: by its duration, at least 1); a
label is emitted at the current frame, steps the prediction network, and moves by its duration (RNN-T: 0);
after ``max_symbols`` labels at one frame, time is forced forward by one. A TDT label is kept even if its
duration jumps past the end of the utterance.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .boosting import BoostTable
from .types import Hypothesis, JointNet, PredictionNet


def split_logits(logits: Tensor, joint: JointNet, durations: Tensor | None) -> tuple[Tensor, Tensor]:
    """(B, V+1+D) joint output -> labels (B,) and frames to advance (B,), blank's duration forced >= 1."""
    n_labels = joint.vocab_size + 1
    labels = logits[:, :n_labels].argmax(dim=-1)
    is_blank = labels == joint.vocab_size
    if durations is None:  # RNN-T: blank moves one frame, a label stays
        return labels, is_blank.long()
    advance = durations[logits[:, n_labels:].argmax(dim=-1)]
    return labels, torch.where(is_blank & (advance == 0), 1, advance)


@torch.inference_mode()
def frame_looping_greedy(
    encoded: Tensor,
    lengths: Tensor,
    prediction: PredictionNet,
    joint: JointNet,
    durations: tuple[int, ...] = (),
    max_symbols: int = 10,
    boost: BoostTable | None = None,
) -> list[Hypothesis]:
    """
    Args:
        encoded: (B, T, d) encoder output.
        lengths: (B,) valid encoder frames.
        durations: TDT duration choices (empty for RNN-T).
        boost: the rows' hotwords (decoding.boosting), or None.
    """
    batch, n_frames, _ = encoded.shape
    device = encoded.device
    enc_proj = joint.project_encoder(encoded)  # (B, T, J), once
    blank = joint.vocab_size
    duration_table = torch.tensor(durations, device=device) if durations else None
    state = prediction.initial_state(batch, device, enc_proj.dtype)
    pred_out, state = prediction.step(torch.full((batch,), blank, device=device), state)
    pred_proj = joint.project_prediction(pred_out)  # (B, J)
    next_frame = torch.zeros(batch, dtype=torch.long, device=device)  # where each row waits
    hyps = [Hypothesis(durations=[] if durations else None) for _ in range(batch)]
    node = boost.roots.clone() if boost is not None else None  # each row's place in its hotwords' tree
    for t in range(n_frames):
        # invariant: rows with next_frame == t (and t inside them) still have to be decoded at frame t
        at_frame = (next_frame == t) & (t < lengths)
        emitted_here = torch.zeros(batch, dtype=torch.long, device=device)
        while bool(at_frame.any()):
            logits = joint.joint_after_projection(enc_proj[:, t], pred_proj)
            if boost is not None:
                logits[:, : blank + 1] += boost.bonus(node, blank + 1)
            labels, advance = split_logits(logits, joint, duration_table)
            emit = at_frame & (labels != blank)
            if boost is not None:
                node = torch.where(emit, boost.advance(node, labels), node)
            _record(hyps, emit, labels, advance if durations else None, t)
            if bool(emit.any()):
                new_out, new_state = prediction.step(torch.where(emit, labels, blank), state)
                pred_proj = torch.where(emit[:, None], joint.project_prediction(new_out), pred_proj)
                state = prediction.select_state(emit, new_state, state)
            emitted_here += emit.long()
            stay = emit & (advance == 0) & (emitted_here < max_symbols)
            leave = at_frame & ~stay
            next_frame = torch.where(leave, t + advance.clamp_min(1), next_frame)
            at_frame = stay
    return hyps


def _record(hyps: list[Hypothesis], emit: Tensor, labels: Tensor, advance: Tensor | None, t: int) -> None:
    rows = emit.nonzero().flatten().tolist()
    if not rows:
        return
    label_list = labels.tolist()
    advance_list = advance.tolist() if advance is not None else None
    for b in rows:
        hyps[b].tokens.append(label_list[b])
        hyps[b].frames.append(t)
        if advance_list is not None:
            hyps[b].durations.append(advance_list[b])

