"""Batched greedy CTC: one argmax over the batch, one device-to-host copy, collapse on the host."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .types import Hypothesis


@torch.inference_mode()
def ctc_greedy(log_probs: Tensor, lengths: Tensor, blank_id: int) -> list[Hypothesis]:
    """
    Args:
        log_probs: (B, T, V+1) per-frame scores (any monotonic transform of them gives the same result).
        lengths: (B,) valid frames.
        blank_id: index of the blank class.
    Returns:
        One hypothesis per row: repeats merged, blanks dropped; a token's frame is where its run starts and
        its duration is the run's length in frames.
    """
    best = log_probs.argmax(dim=-1)  # (B, T)
    valid = torch.arange(best.shape[1], device=best.device)[None, :] < lengths[:, None]
    labels = best.masked_fill(~valid, blank_id).cpu().numpy()  # the one device-to-host copy
    hyps = []
    for row in labels:
        prev = np.concatenate(([blank_id], row[:-1]))
        starts = np.flatnonzero((row != blank_id) & (row != prev))  # first frame of each emitted run
        run_ends = np.flatnonzero(np.diff(row, append=-1) != 0)  # last frame of every run
        ends = run_ends[np.searchsorted(run_ends, starts)]
        hyps.append(Hypothesis(tokens=row[starts].tolist(), frames=starts.tolist(),
                               durations=(ends - starts + 1).tolist()))
    return hyps
