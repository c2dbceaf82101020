"""How well the scores tell errors apart, on held-out speech the embedded model never trained on: word confidences
(does a low one mark a wrong word?) and each utterance's ``avg_logprob`` (does dropping the least sure utterances,
as a dataset builder would, take the errors with them?).

    python -m models.training.data --cache DIR --n-train 0    # the held-out splits (espeak-ng, WordNet)
    python loadtest/confidence_quality.py --cache DIR [--model M] [--decoder tdt|ctc]

Conditions: the held-out sentences; the held-out voice; the sentences through a telephone channel (8 kHz); and
the sentences under white noise at 10 and 0 dB SNR. A word of the transcript is right when a minimum-edit
alignment pairs it with the same word of what was said; otherwise it is wrong (a substitution or an insertion).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models import load_model
from models.training.data import telephone_band
from models.training.evaluate import read_split, wer

WORD_THRESHOLDS = (0.5, 0.8, 0.9)
DROP_SHARES = (0.05, 0.1, 0.2)  # the least sure utterances dropped, by avg_logprob


def right_words(said: list[str], heard: list[str]) -> list[bool]:
    """For each heard word: does a minimum-edit alignment pair it with the same said word?"""
    rows, cols = len(said) + 1, len(heard) + 1
    cost = np.zeros((rows, cols), dtype=np.int32)
    cost[:, 0], cost[0, :] = np.arange(rows), np.arange(cols)
    for i in range(1, rows):
        for j in range(1, cols):
            cost[i, j] = min(cost[i - 1, j] + 1, cost[i, j - 1] + 1,
                             cost[i - 1, j - 1] + (said[i - 1] != heard[j - 1]))
    right = [False] * len(heard)
    i, j = len(said), len(heard)
    while i > 0 and j > 0:  # walk back; a match is preferred where it is as cheap
        if said[i - 1] == heard[j - 1] and cost[i, j] == cost[i - 1, j - 1]:
            right[j - 1] = True
            i, j = i - 1, j - 1
        elif cost[i, j] == cost[i - 1, j - 1] + 1:
            i, j = i - 1, j - 1
        elif cost[i, j] == cost[i, j - 1] + 1:
            j -= 1
        else:
            i -= 1
    return right


def auroc(scores: np.ndarray, positive: np.ndarray) -> float:
    """The chance that a random right word is more confident than a random wrong one (ties count half)."""
    pos, neg = scores[positive], scores[~positive]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    order = np.argsort(np.concatenate([pos, neg]), kind="mergesort")
    ranks = np.empty(len(order))
    values = np.concatenate([pos, neg])[order]
    # average ranks over ties
    start = 0
    while start < len(values):
        end = start
        while end + 1 < len(values) and values[end + 1] == values[start]:
            end += 1
        ranks[order[start : end + 1]] = (start + end) / 2 + 1
        start = end + 1
    return float((ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def word_row(name: str, scores: np.ndarray, right: np.ndarray) -> str:
    """A table row: words, the share wrong, AUROC, and per threshold the wrong / right words below it."""
    flagged = [f"{100 * np.mean(scores[~right] < t):.0f}% / {100 * np.mean(scores[right] < t):.1f}%"
               for t in WORD_THRESHOLDS]
    return (f"| {name} | {len(scores)} | {100 * np.mean(~right):.1f}% | {auroc(scores, right):.3f} | "
            + " | ".join(flagged) + " |")


def with_noise(wave: np.ndarray, snr_db: float, rng: np.random.Generator) -> np.ndarray:
    power = float(np.mean(wave.astype(np.float64) ** 2))
    noise = rng.standard_normal(len(wave)) * np.sqrt(power / 10 ** (snr_db / 10))
    return (wave + noise).astype(np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, required=True, help="corpus from models.training.data")
    parser.add_argument("--model", default=None, help="a .nemo file (default: the embedded model)")
    parser.add_argument("--decoder", default="auto", choices=("auto", "tdt", "rnnt", "ctc"))
    args = parser.parse_args()
    model = load_model(args.model, device="cpu", dtype="float32")
    sentences, texts = read_split(args.cache, "test_sentences")
    rng = np.random.default_rng(0)
    conditions = {
        "held-out sentences": (sentences, texts),
        "held-out voice": read_split(args.cache, "test_voice"),
        "8 kHz telephone": ([telephone_band(w) for w in sentences], texts),
        "white noise, 10 dB SNR": ([with_noise(w, 10, rng) for w in sentences], texts),
        "white noise, 0 dB SNR": ([with_noise(w, 0, rng) for w in sentences], texts),
    }
    word_rows, utterance_rows = [], []
    pooled_scores, pooled_right = [], []
    for name, (audio, said) in conditions.items():
        started = time.perf_counter()
        transcripts = model.transcribe(audio, batch_size=32, decoder=args.decoder)
        elapsed = time.perf_counter() - started
        scores, right = [], []
        for transcript, text in zip(transcripts, said, strict=True):
            scores += [w.confidence for w in transcript.words]
            right += right_words(text.split(), [w.word for w in transcript.words])
        scores_a, right_a = np.array(scores), np.array(right, dtype=bool)
        pooled_scores.append(scores_a)
        pooled_right.append(right_a)
        word_rows.append(word_row(name, scores_a, right_a))
        hyps = [t.text for t in transcripts]
        by_doubt = np.argsort([t.avg_logprob if t.avg_logprob is not None else 0.0 for t in transcripts])
        cells = []
        for share in DROP_SHARES:
            kept = sorted(by_doubt[round(share * len(transcripts)) :])
            cells.append(f"{100 * wer([said[i] for i in kept], [hyps[i] for i in kept]):.2f}%")
        utterance_rows.append(f"| {name} | {100 * wer(said, hyps):.2f}% | " + " | ".join(cells)
                              + f" | {sum(len(w) for w in audio) / 16000 / elapsed:.0f} |")
    scores_all, right_all = np.concatenate(pooled_scores), np.concatenate(pooled_right)
    print("Word confidence (the least sure token's probability): wrong words flagged / right words flagged\n")
    print("| condition | words | wrong | AUROC | " + " | ".join(f"below {t}" for t in WORD_THRESHOLDS) + " |")
    print("|---|---|---|---|" + "---|" * len(WORD_THRESHOLDS))
    print("\n".join(word_rows))
    print(word_row("all", scores_all, right_all))
    print("\nUtterances dropped by avg_logprob, least sure first: WER of what is kept\n")
    print("| condition | WER, all kept | " + " | ".join(f"{share:.0%} dropped" for share in DROP_SHARES)
          + " | RTFx |")
    print("|---|---|" + "---|" * len(DROP_SHARES) + "---|")
    print("\n".join(utterance_rows))


if __name__ == "__main__":
    main()
