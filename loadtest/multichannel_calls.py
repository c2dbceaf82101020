"""Stereo calls transcribed mixed down to mono, or each channel apart (``multichannel``), with or without their
long quiet stretches (``skip_silence``): word error rate against what was said, and compute time, on the
embedded default model.

    python loadtest/multichannel_calls.py --calls 30 --turns 8 --overlap 1.0

Each call alternates two speakers, one a channel, saying the default model's test sentences over a faint line
noise. A turn starts between ``--overlap`` seconds before the previous one ends (talking over it) and 0.8 s after.
Mixed, the reference is every turn's words in the order the turns start; apart, each channel's turns in order.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models import load_model

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "default_model"
RATE = 16000
MAX_PAUSE_S = 0.8


@dataclass
class Call:
    audio: np.ndarray  # (2, samples)
    said: list[list[str]]  # each channel's words, in order
    said_in_order: list[str]  # every turn's words, by start


def make_call(rng: np.random.Generator, clips: list[tuple[np.ndarray, str]], turns: int, overlap_s: float) -> Call:
    placed, start = [], 0.3
    for turn in range(turns):
        clip, text = clips[rng.integers(len(clips))]
        placed.append((turn % 2, int(start * RATE), clip, text))
        start += len(clip) / RATE + rng.uniform(-overlap_s, MAX_PAUSE_S)
    length = max(s + len(clip) for _, s, clip, _ in placed) + RATE // 2
    audio = (rng.standard_normal((2, length)) * 0.002).astype(np.float32)
    said: list[list[str]] = [[], []]
    for channel, s, clip, text in placed:
        audio[channel, s : s + len(clip)] += clip
        said[channel] += text.split()
    return Call(audio, said, [w for _, _, _, text in sorted(placed, key=lambda p: p[1]) for w in text.split()])


def word_edits(reference: list[str], hypothesis: list[str]) -> int:
    """Levenshtein distance over words."""
    previous = list(range(len(hypothesis) + 1))
    for i, ref in enumerate(reference, start=1):
        current = [i]
        for j, hyp in enumerate(hypothesis, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ref != hyp)))
        previous = current
    return previous[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--overlap", type=float, default=1.0, help="most seconds a turn talks over the last")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    expected = json.loads((DATA / "expected.json").read_text())
    clips = [(sf.read(DATA / name, dtype="float32")[0], text) for name, text in sorted(expected.items())]
    rng = np.random.default_rng(args.seed)
    calls = [make_call(rng, clips, args.turns, args.overlap) for _ in range(args.calls)]
    model = load_model(device="cpu")
    model.transcribe([calls[0].audio[0]])  # warm-up

    call_s = sum(c.audio.shape[1] for c in calls) / RATE
    words = sum(len(c.said_in_order) for c in calls)
    print(f"{args.calls} calls, {call_s:.0f} s of calls, {words} words, overlap up to {args.overlap} s")
    print("| transcribed | WER | compute s | RTFx (call seconds) |\n|---|---|---|---|")
    for label, skip_silence in (("mixed to mono", False), ("mixed, skip_silence", True)):
        started = time.perf_counter()
        mixed = model.transcribe([c.audio.mean(axis=0) for c in calls], batch_size=args.batch_size,
                                 max_segment_s=30, skip_silence=skip_silence)
        elapsed = time.perf_counter() - started
        edits = sum(word_edits(c.said_in_order, t.text.split()) for c, t in zip(calls, mixed, strict=True))
        print(f"| {label} | {100 * edits / words:.1f}% | {elapsed:.2f} | {call_s / elapsed:.0f} |")
    for label, skip_silence in (("channels apart", False), ("apart, skip_silence", True)):
        started = time.perf_counter()
        apart = model.transcribe([c.audio for c in calls], batch_size=args.batch_size, max_segment_s=30,
                                 multichannel=True, skip_silence=skip_silence)
        elapsed = time.perf_counter() - started
        edits = sum(word_edits(said, t.text.split()) for c, conv in zip(calls, apart, strict=True)
                    for said, t in zip(c.said, conv.channels, strict=True))
        print(f"| {label} | {100 * edits / words:.1f}% | {elapsed:.2f} | {call_s / elapsed:.0f} |")

if __name__ == "__main__":
    main()
