r"""Average the weights of a run's last snapshots (checkpoint averaging).

Late in a run the weights wander around a minimum at a small learning rate; their mean usually sits nearer it
than any one of them. ``train --snapshot-every N`` writes ``RUN/snapshots/step-NNNNN.nemo`` every N steps; this
scores the mean of the last k snapshots for each k asked for on the validation split, never on the held-out
test splits, and writes the best::

    python -m models.training.average --snapshots STAGE10/snapshots/*.nemo --cache DATA6 \
        --last 1 2 3 4 6 --out STAGE10/averaged.nemo

The pick is the k with the lowest mean of the TDT and CTC heads' validation WER (float32); a tie goes to the
smaller k. The snapshots are ordered by the step number in their names (``step-NNNNN.nemo``, as ``train`` writes
them; step-100000 comes after step-99600); a file named otherwise is refused.
``--valid-splits valid valid_voice`` scores the validation sentences in training voices and in a voice never
trained on, pooled, so the pick also sees an unheard voice (the held-out test voice stays unscored).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch
from torch import Tensor

from ..asr_model import ASRModel
from ..checkpoint import Checkpoint, open_checkpoint
from .evaluate import add_validation_options, pick_weights, read_splits
from .export import save_nemo

SNAPSHOT_NAME = re.compile(r"step-(\d+)\.nemo")


def snapshot_step(path: Path) -> int:
    """The step in a snapshot's name (``step-NNNNN.nemo``), or a ValueError that says how it should be named."""
    found = SNAPSHOT_NAME.fullmatch(path.name)
    if found is None:
        raise ValueError(f"{path}: not a snapshot name (step-NNNNN.nemo, as train --snapshot-every writes them); "
                         "rename it to the step it was written at")
    return int(found.group(1))


def in_step_order(paths: list[Path]) -> list[Path]:
    """The snapshots ordered by their steps, the last one last: by name, step-100000 would come before step-99600."""
    return sorted(paths, key=snapshot_step)


def checked_snapshots(snapshots: list[Checkpoint]) -> list[dict[str, Tensor]]:
    """The snapshots' weights: all of one architecture, tokenizer and set of weights, or a mean means nothing."""
    first = snapshots[0]
    for other in snapshots[1:]:
        if other.config != first.config or other.tokenizer_model != first.tokenizer_model:
            raise ValueError(f"{other.source} is not a snapshot of the run {first.source} belongs to")
        if other.state_dict.keys() != first.state_dict.keys():
            raise ValueError(f"{other.source} and {first.source} hold different weights")
    return [s.state_dict for s in snapshots]


def average(weights: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """The mean of every float tensor (batch-norm statistics included), in float32; integer counters (batches
    seen) are the last snapshot's."""
    last = weights[-1]
    return {name: torch.stack([w[name].float() for w in weights]).mean(0) if value.is_floating_point() else value
            for name, value in last.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--snapshots", type=Path, nargs="+", required=True, help="a run's snapshot .nemo files")
    add_validation_options(parser)
    parser.add_argument("--last", type=int, nargs="+", default=[1, 2, 3, 4],
                        help="how many of the last snapshots to average, each scored")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--store", choices=["float32", "float16"], default="float32",
                        help="how the written weights are stored (float16: half the file)")
    args = parser.parse_args()
    try:
        paths = in_step_order(args.snapshots)
    except ValueError as exc:
        parser.error(str(exc))
    if any(not 1 <= k <= len(paths) for k in args.last):
        parser.error(f"--last must lie in [1, {len(paths)}] (the number of snapshots)")
    torch.set_num_threads(2)
    snapshots = [open_checkpoint(p) for p in paths]
    weights = checked_snapshots(snapshots)
    audio, texts = read_splits(args.cache, args.valid_splits)
    model = ASRModel.from_checkpoint(snapshots[-1]).eval()

    def row_label(last: float) -> str:
        k = int(last)
        span = paths[-1].stem if k == 1 else f"{paths[-k].stem} to {paths[-1].stem}"
        return f"{k} ({span})"

    print("| last snapshots averaged | TDT | CTC |\n|---|---|---|")
    candidates = {k: lambda k=k: average(weights[-k:]) for k in args.last}
    best, best_wer = pick_weights(model, candidates, audio, texts, row_label)
    assert snapshots[-1].tokenizer_model is not None
    save_nemo(model, snapshots[-1].raw_config, snapshots[-1].tokenizer_model, args.out, getattr(torch, args.store))
    print(f"picked the last {int(best)} (mean validation WER {best_wer:.2f}%); wrote {args.out}")


if __name__ == "__main__":
    main()
