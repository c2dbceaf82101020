"""Word error rate of a model on the held-out splits, per head and precision (the model card's table).

Columns: unseen sentences; unseen sentences in a voice not heard in training; the unseen sentences again
through a telephone channel (8 kHz, as call-centre audio arrives).

Usage: ``python -m models.training.evaluate --cache DIR [--model PATH]`` (default: the embedded model).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from .. import load_model
from ..asr_model import ASRModel
from .data import telephone_band

SPLITS = ("test_sentences", "test_voice")


def edit_distance(ref: Sequence[str], hyp: Sequence[str]) -> int:
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1]


def wer(refs: Sequence[str], hyps: Sequence[str]) -> float:
    errors = sum(edit_distance(r.split(), h.split()) for r, h in zip(refs, hyps, strict=True))
    return errors / max(1, sum(len(r.split()) for r in refs))


def read_split(cache: Path, split: str, limit: int | None = None) -> tuple[list[np.ndarray], list[str]]:
    rows = [json.loads(line) for line in (cache / f"{split}.jsonl").read_text().splitlines()][:limit]
    audio = [sf.read(cache / r["audio"], dtype="float32")[0] for r in rows]
    return audio, [r["text"] for r in rows]


def split_wer(model: ASRModel, audio: list[np.ndarray], texts: list[str], decoder: str) -> float:
    hyps = [t.text for t in model.transcribe(audio, batch_size=32, decoder=decoder)]
    return wer(texts, hyps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--model", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    data = {split: read_split(args.cache, split) for split in SPLITS}
    sentences, texts = data["test_sentences"]
    data["telephone"] = ([telephone_band(a) for a in sentences], texts)
    print("| head | precision | held-out sentences | held-out voice | held-out sentences, 8 kHz |\n"
          "|---|---|---|---|---|")
    for dtype in ("float32", "bfloat16"):
        model = load_model(args.model, device="cpu", dtype=dtype)
        for decoder in ("tdt", "ctc"):
            cells = [f"{100 * split_wer(model, *data[s], decoder):.2f}%" for s in data]
            print(f"| {decoder.upper()} | {dtype} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
