"""Word error rate of a model on the held-out splits, per head and precision (the model card's table).

Columns: unseen sentences; unseen sentences in a voice not heard in training; the unseen sentences again
through a telephone channel (8 kHz, as call-centre audio arrives).

``--breakdown`` also prints where the errors are (float32): WER on training utterances beside the held-out
sentences (how well the model fits what it trained on vs how it generalises), and held-out WER by the
speaking rate espeak was given (fast speech puts more tokens in each 80 ms encoder frame).

Usage: ``python -m models.training.evaluate --cache DIR [--model PATH] [--breakdown]`` (default: the embedded
model).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable
from itertools import islice
from pathlib import Path

import numpy as np
import torch

from .. import load_model
from ..asr_model import ASRModel
from ..audio_io import read_audio
from ..wer import edit_distance, wer  # noqa: F401 (wer: this module's, for the scripts that score splits)
from .data import SAMPLE_RATE, telephone_band

SPLITS = ("test_sentences", "test_voice")
RATE_BANDS = ((130, 150), (150, 170), (170, 190), (190, 211))  # words per minute, [low, high)
N_FIT = 300  # training utterances for the fit column


def read_rows(cache: Path, split: str, limit: int | None = None) -> list[dict]:
    with (cache / f"{split}.jsonl").open() as manifest:
        return [json.loads(line) for line in islice(manifest, limit)]


def read_waves(paths: Iterable[Path]) -> list[np.ndarray]:
    """Audio files as the model hears them: mono at 16 kHz, whatever their rate and channels."""
    return [read_audio(path, SAMPLE_RATE) for path in paths]


def read_split(cache: Path, split: str, limit: int | None = None) -> tuple[list[np.ndarray], list[str]]:
    rows = read_rows(cache, split, limit)
    return read_waves(cache / r["audio"] for r in rows), [r["text"] for r in rows]


def read_splits(cache: Path, splits: list[str]) -> tuple[list[np.ndarray], list[str]]:
    """Several splits pooled into one, in the order given: WER over the pool weighs each split by its words."""
    audio: list[np.ndarray] = []
    texts: list[str] = []
    for split in splits:
        split_audio, split_texts = read_split(cache, split)
        audio += split_audio
        texts += split_texts
    return audio, texts


def add_validation_options(parser: argparse.ArgumentParser) -> None:
    """The corpus and the validation splits a pick is scored on (never a test split)."""
    parser.add_argument("--cache", type=Path, required=True, help="corpus from models.training.data")
    parser.add_argument("--valid-splits", nargs="+", default=["valid"], choices=["valid", "valid_voice"],
                        help="the splits the pick is scored on, pooled (valid_voice: the validation sentences "
                             "in a voice never trained on)")


def split_wer(model: ASRModel, audio: list[np.ndarray], texts: list[str], decoder: str) -> float:
    hyps = [t.text for t in model.transcribe(audio, batch_size=32, decoder=decoder)]
    return wer(texts, hyps)


def heads_wer(model: ASRModel, audio: list[np.ndarray], texts: list[str]) -> tuple[float, float]:
    """WER of the TDT and the CTC head, in percent."""
    tdt, ctc = (100 * split_wer(model, audio, texts, head) for head in ("tdt", "ctc"))
    return tdt, ctc


def pick_lowest(mean_wer: dict[float, float]) -> float:
    """The candidate with the lowest WER; a tie goes to the smaller one (the nearer the start, the fewer
    averaged)."""
    return min(mean_wer, key=lambda candidate: (mean_wer[candidate], candidate))


def pick_weights(model: ASRModel, candidates: dict[float, Callable[[], dict[str, torch.Tensor]]],
                 audio: list[np.ndarray], texts: list[str], row_label: Callable[[float], str]) -> tuple[float, float]:
    """Score each candidate's weights with both heads (a table row each), load the one with the lowest mean WER
    into ``model`` and return it with that WER. Weights are built on demand: candidates can be whole models."""
    mean_wer: dict[float, float] = {}
    for key in sorted(candidates):
        model.load_weights(candidates[key](), row_label(key))
        tdt, ctc = heads_wer(model, audio, texts)
        mean_wer[key] = (tdt + ctc) / 2
        print(f"| {row_label(key)} | {tdt:.2f}% | {ctc:.2f}% |", flush=True)
    best = pick_lowest(mean_wer)
    model.load_weights(candidates[best](), row_label(best))
    return best, mean_wer[best]


def print_breakdown(model: ASRModel, cache: Path) -> None:
    """WER on training utterances vs held-out sentences, and held-out WER by speaking rate, per head."""
    fit = read_split(cache, "train", N_FIT)
    held_out = read_split(cache, "test_sentences")
    rates = [r["rate"] for r in read_rows(cache, "test_sentences")]
    bands = [[i for i, rate in enumerate(rates) if low <= rate < high] for low, high in RATE_BANDS]
    columns = [f"training utterances (first {N_FIT})", "held-out sentences"]
    columns += [f"held-out, {low}-{high - 1} wpm ({len(band)})" for (low, high), band in
                zip(RATE_BANDS, bands, strict=True)]
    print(f"\n| head | {' | '.join(columns)} |\n|---|" + "---|" * len(columns))
    for decoder in ("tdt", "ctc"):
        hyps = [t.text for t in model.transcribe(held_out[0], batch_size=32, decoder=decoder)]
        cells = [split_wer(model, *fit, decoder), wer(held_out[1], hyps)]
        cells += [wer([held_out[1][i] for i in band], [hyps[i] for i in band]) for band in bands]
        print(f"| {decoder.upper()} | " + " | ".join(f"{100 * c:.2f}%" for c in cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--breakdown", action="store_true",
                        help="also print training-utterance WER and held-out WER by speaking rate")
    args = parser.parse_args()
    torch.set_num_threads(2)
    data = {split: read_split(args.cache, split) for split in SPLITS}
    sentences, texts = data["test_sentences"]
    data["telephone"] = ([telephone_band(a) for a in sentences], texts)
    print("| head | precision | held-out sentences | held-out voice | held-out sentences, 8 kHz |\n"
          "|---|---|---|---|---|")
    models = {dtype: load_model(args.model, device="cpu", dtype=dtype) for dtype in ("float32", "bfloat16")}
    for dtype, model in models.items():
        for decoder in ("tdt", "ctc"):
            cells = [f"{100 * split_wer(model, *data[s], decoder):.2f}%" for s in data]
            print(f"| {decoder.upper()} | {dtype} | {' | '.join(cells)} |", flush=True)
    if args.breakdown:
        print_breakdown(models["float32"], args.cache)


if __name__ == "__main__":
    main()
