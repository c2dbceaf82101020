"""Training throughput per precision: audio seconds per second of forward, backward and optimizer step.

What to compare before picking ``train --precision`` on a machine: bf16 autocast pays only where the CPU
(or GPU) has fast bf16 matrix instructions and the model's matrices are large enough to use them. Batches
are built as ``train`` builds them (length-sorted, about ``batch_seconds`` of audio, a share of utterances
joined into long samples, augmentation on) from a ``models.training.data`` corpus; every precision trains
the same batches from the same starting weights, after one untimed warm-up step, in this one process.

Usage: ``python -m models.training.throughput --data DIR [--model PATH] [--precision fp32 bf16]
[--steps 8] [--concat-fraction 0.35] [--threads 1] [--n-layers L] [--freeze-input-conv]`` (default model: the
embedded one).
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import numpy as np
import torch

from ..asr_model import DEFAULT_MODEL, ASRModel
from ..checkpoint import open_checkpoint
from .depth_growth import encoder_depth
from .export import ModelSize, load_sentencepiece
from .parallel import Workers
from .train import (
    Batch,
    Recipe,
    epoch_batches,
    initial_model,
    load_batch,
    make_optimizer,
    pick_precision,
    read_manifest,
    train_step,
)


def load_trainable(path: Path, recipe: Recipe, n_layers: int | None = None) -> tuple[ASRModel, bytes]:
    """A .nemo of the training size as a trainable model (grown to ``n_layers`` encoder layers if given), and
    its tokenizer."""
    start = open_checkpoint(path)
    if start.tokenizer_model is None:
        raise ValueError(f"{path}: the checkpoint has no SentencePiece tokenizer to train with")
    size = ModelSize(n_layers=n_layers or encoder_depth(start.state_dict))
    model, _ = initial_model(size, recipe, start.tokenizer_model, start)
    return model.train(), start.tokenizer_model


def real_batches(data: Path, recipe: Recipe, tokenizer: bytes, n: int) -> list[Batch]:
    """The first n training batches of epoch 0, as ``train`` would draw them."""
    sp = load_sentencepiece(tokenizer)
    batches = epoch_batches(read_manifest(data, "train"), recipe, 0, 1, data / "train.jsonl")
    return [load_batch(b, sp, recipe, np.random.default_rng(i), augment=True) for i, b in enumerate(batches[:n])]


def audio_seconds_per_second(model: ASRModel, batches: list[Batch], recipe: Recipe, precision: str) -> float:
    """Train on the batches (the first untimed) and return audio seconds trained per wall second."""
    amp_dtype, use_scaler = pick_precision(model.device, precision)
    optimizer = make_optimizer(model, recipe)
    scaler = torch.amp.GradScaler(model.device.type, enabled=use_scaler)
    gen = torch.Generator().manual_seed(recipe.seed)
    train_step(model, batches[0], recipe, gen, amp_dtype, optimizer, scaler, Workers())
    start = time.perf_counter()
    for batch in batches[1:]:
        train_step(model, batch, recipe, gen, amp_dtype, optimizer, scaler, Workers())
    return sum(b.audio_seconds(model.sample_rate) for b in batches[1:]) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="corpus from models.training.data")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="a .nemo of the training size")
    parser.add_argument("--precision", nargs="+", choices=["auto", "bf16", "fp16", "fp32"], default=["fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per precision (plus one warm-up)")
    parser.add_argument("--concat-fraction", type=float, default=0.35)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--freeze-input-conv", action=argparse.BooleanOptionalAction, default=False,
                        help="train as train --freeze-input-conv does")
    parser.add_argument("--n-layers", type=int, default=None,
                        help="encoder layers to train (default: the model's; more: grown, depth_growth.py)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    recipe = Recipe(concat_fraction=args.concat_fraction, concat_max_s=20.0, telephone_fraction=0.15,
                    freeze_input_conv=args.freeze_input_conv)
    model, tokenizer = load_trainable(args.model, recipe, args.n_layers)
    batches = real_batches(args.data, recipe, tokenizer, args.steps + 1)
    initial = copy.deepcopy(model.state_dict())
    audio_s = sum(b.audio_seconds(model.sample_rate) for b in batches[1:])
    print(f"{args.steps} steps of {audio_s:.0f} s of audio, "
          f"{args.threads} thread(s)\n| precision | audio-s/s |\n|---|---|")
    for precision in args.precision:
        model.load_state_dict(initial)
        rate = audio_seconds_per_second(model, batches, recipe, precision)
        print(f"| {precision} ({pick_precision(model.device, precision)[0] or torch.float32}) | {rate:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
