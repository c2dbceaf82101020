"""Batched greedy CTC: one argmax over the batch, one device-to-host copy, collapse on the host. With hotwords
(decoding.boosting), a frame loop instead: which token a frame emits depends on the tokens emitted before it."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .boosting import NULL_NODE, BoostTable
from .ctc_boost import CtcBoostLoop
from .types import Hypothesis


@torch.inference_mode()
def ctc_greedy(log_probs: Tensor, lengths: Tensor, blank_id: int, boost: BoostTable | None = None,
               loop: CtcBoostLoop | None = None) -> list[Hypothesis]:
    """
    Args:
        log_probs: (B, T, V+1) per-frame log-probabilities (without ``boost``, any monotonic transform of them
            gives the same result).
        lengths: (B,) valid frames.
        blank_id: index of the blank class.
        boost: the rows' hotwords, or None (``ctc_boosted_labels``).
        loop: runs the boosted rows' frame loop, keeping its buffers and CUDA graph (a model keeps one); None:
            eagerly, on buffers of this batch's size.
    Returns:
        One hypothesis per row: repeats merged, blanks dropped; a token's frame is where its run starts and
        its duration is the run's length in frames.
    """
    plain = boost is None
    labels = log_probs.argmax(dim=-1) if plain else ctc_boosted_labels(log_probs, lengths, blank_id, boost, loop)
    valid = torch.arange(labels.shape[1], device=labels.device)[None, :] < lengths[:, None]
    return [_collapse(row, blank_id) for row in labels.masked_fill(~valid, blank_id).cpu().numpy()]


def ctc_boosted_labels(log_probs: Tensor, lengths: Tensor, blank_id: int, boost: BoostTable,
                       loop: CtcBoostLoop | None = None) -> Tensor:
    """(B, T) each frame's label, with hotwords boosted.

    A frame's label is the argmax of its log-probabilities plus the bonus of the tokens that continue a hotword
    from where the row's emitted tokens leave it. The previous frame's label gets no bonus: taking it again
    would continue its run, not emit it. Only an emission (a label neither blank nor the previous frame's)
    moves the row down its tree. Rows without hotwords take the plain argmax, outside the frame loop, which
    runs over the boosted rows alone and as far as the longest of them (``decoding.ctc_boost``: a step reads
    the table spread over the vocabulary, 12 kernels a frame where walking the tree took 33). A table too large
    to spread (``BoostTable.spread``) is walked.
    """
    labels = log_probs.argmax(dim=-1)
    rows = (boost.roots != NULL_NODE).nonzero().squeeze(1)
    if not len(rows):
        return labels
    row_lengths, roots = lengths.index_select(0, rows), boost.roots.index_select(0, rows)
    n_frames, n_classes = int(row_lengths.max()), log_probs.shape[-1]
    row_log_probs = log_probs.index_select(0, rows)[:, :n_frames]
    past_end = torch.arange(n_frames, device=lengths.device) >= row_lengths.unsqueeze(1)
    spread = boost.spread(n_classes)
    if spread is None:
        row_labels = _walk_trees(row_log_probs, past_end, roots, boost, blank_id)
    else:
        row_labels = (loop or CtcBoostLoop(blank_id, "off"))(row_log_probs, past_end, roots, spread)
    labels[rows, :n_frames] = row_labels
    return labels


def _walk_trees(log_probs: Tensor, past_end: Tensor, node: Tensor, boost: BoostTable, blank_id: int) -> Tensor:
    """``ctc_boost.frame_step``'s loop for a table too large to spread: each step walks the rows' trees."""
    n_rows, n_frames, n_classes = log_probs.shape
    labels = torch.empty((n_rows, n_frames), dtype=torch.long, device=log_probs.device)
    previous = torch.full_like(node, blank_id)
    for t in range(n_frames):
        scores = log_probs[:, t].float() + boost.bonus(node, n_classes).scatter_(1, previous.unsqueeze(1), 0.0)
        label = scores.argmax(dim=-1).masked_fill_(past_end[:, t], blank_id)
        emitted = (label != blank_id) & (label != previous)
        node = torch.where(emitted, boost.advance(node, label), node)
        labels[:, t] = previous = label
    return labels


def _collapse(row: np.ndarray, blank_id: int) -> Hypothesis:
    """One row's frame labels -> its hypothesis: a token per run of a non-blank label."""
    prev = np.concatenate(([blank_id], row[:-1]))
    starts = np.flatnonzero((row != blank_id) & (row != prev))  # first frame of each emitted run
    run_ends = np.flatnonzero(np.diff(row, append=-1) != 0)  # last frame of every run
    ends = run_ends[np.searchsorted(run_ends, starts)]
    return Hypothesis(tokens=row[starts].tolist(), frames=starts.tolist(), durations=(ends - starts + 1).tolist())
