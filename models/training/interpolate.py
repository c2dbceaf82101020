"""Interpolate a warm-started stage's weights with those of the model it started from.

A stage that warm-starts on new data learns it at some cost to what its start knew (the default model's stage
6: better on unseen sentences, worse on the unseen voice). Both ends lie on one training path, so the weights
between them are a model too, and often better than either (weight-space ensembling). The weight given to the
tuned model is picked by WER on the validation split, never on the held-out test splits::

    python -m models.training.interpolate --start STAGE5.nemo --tuned STAGE6/model.nemo --cache DATA6 \\
        --weights 0.3 0.4 0.5 0.6 0.7 --out STAGE6/interpolated.nemo

The pick is the weight with the lowest mean of the TDT and CTC heads' validation WER (float32); a tie goes to
the smaller weight, the model nearer the start. A stage that grew the encoder (``train --n-layers``) is
interpolated with its start grown the same way (``depth_growth.py``). ``--store float16`` writes the weights in
half precision, for a model whose float32 file would be too large to embed.
``--valid-splits valid valid_voice`` scores the validation sentences in training voices and in a voice never
trained on, pooled, so the pick also sees an unheard voice (the held-out test voice stays unscored).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor

from ..asr_model import ASRModel
from ..checkpoint import Checkpoint, open_checkpoint
from .depth_growth import deepen
from .evaluate import add_validation_options, pick_weights, read_splits
from .export import save_nemo


def checked_start_weights(start: Checkpoint, tuned: Checkpoint) -> dict[str, Tensor]:
    """The start's weights to interpolate with the tuned model's: both ends must be the same architecture with
    the same tokenizer, or a weighted sum means nothing; a start with fewer encoder layers is grown to the tuned
    depth (a stage that grew the encoder started from it grown)."""
    if start.config.encoder.n_layers > tuned.config.encoder.n_layers:
        raise ValueError(f"{start.source} has more encoder layers than {tuned.source}")
    grown = replace(start.config, encoder=replace(start.config.encoder, n_layers=tuned.config.encoder.n_layers))
    if grown != tuned.config:
        raise ValueError(f"{start.source} and {tuned.source} are different architectures")
    if start.tokenizer_model != tuned.tokenizer_model:
        raise ValueError(f"{start.source} and {tuned.source} have different tokenizers")
    start_weights = deepen(start.state_dict, tuned.config.encoder.n_layers)
    if start_weights.keys() != tuned.state_dict.keys():
        raise ValueError(f"{start.source} and {tuned.source} hold different weights")
    return start_weights


def interpolate(start: dict[str, Tensor], tuned: dict[str, Tensor], weight: float) -> dict[str, Tensor]:
    """(1 - weight) * start + weight * tuned for every float tensor, batch-norm statistics included;
    integer counters (batches seen) are the tuned model's."""
    return {name: torch.lerp(start[name].float(), value.float(), weight) if value.is_floating_point() else value
            for name, value in tuned.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--start", type=Path, required=True, help="the .nemo the stage warm-started from")
    parser.add_argument("--tuned", type=Path, required=True, help="the stage's result")
    add_validation_options(parser)
    parser.add_argument("--weights", type=float, nargs="+", default=[0.3, 0.4, 0.5, 0.6, 0.7])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--store", choices=["float32", "float16"], default="float32",
                        help="how the written weights are stored (float16: half the file)")
    args = parser.parse_args()
    if any(not 0.0 <= w <= 1.0 for w in args.weights):
        parser.error("--weights must lie in [0, 1]")
    torch.set_num_threads(2)
    start, tuned = open_checkpoint(args.start), open_checkpoint(args.tuned)
    start_weights = checked_start_weights(start, tuned)
    audio, texts = read_splits(args.cache, args.valid_splits)
    model = ASRModel.from_checkpoint(tuned).eval()
    print("| weight of the tuned model | TDT | CTC |\n|---|---|---|")
    candidates = {w: lambda w=w: interpolate(start_weights, tuned.state_dict, w) for w in args.weights}
    best, best_wer = pick_weights(model, candidates, audio, texts, lambda w: f"{w:g}")
    assert tuned.tokenizer_model is not None
    save_nemo(model, tuned.raw_config, tuned.tokenizer_model, args.out, getattr(torch, args.store))
    print(f"picked weight {best:g} (mean validation WER {best_wer:.2f}%); wrote {args.out}")


if __name__ == "__main__":
    main()
