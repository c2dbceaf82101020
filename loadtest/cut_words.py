"""Words at the cuts of long audio: lost or said twice by stitching (docs/benchmarks.md).

Makes continuous speech with espeak-ng (random words, the pauses between them cut out, light noise: no quiet point
to cut at, so cuts fall inside words), cuts it as the service does, and transcribes the whole (stitched) and each
piece alone. At each cut, a word both pieces heard (the same word, its middles within ``--near-s`` of each other)
is *lost* where the stitched transcript has no such word near it, and *doubled* where it has it twice there while
neither piece alone had it twice. Prints one JSON object.

    python loadtest/cut_words.py --minutes 10 --max-segment-s 30 10
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

from models import load_model
from models.segmenter import plan_pieces
from models.transcript import Word

VOCABULARY = (  # words espeak-ng says clearly; the embedded model knows some of them
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "she", "sells", "sea", "shells", "by", "shore",
    "peter", "piper", "picked", "peck", "pickled", "peppers", "how", "much", "wood", "would", "woodchuck", "chuck",
    "if", "could", "time", "flies", "like", "an", "arrow", "fruit", "banana", "green", "apple", "morning", "evening",
    "river", "mountain", "city", "people", "music",
)


def continuous_speech(minutes: float, seed: int) -> np.ndarray:
    """``minutes`` of 16 kHz speech without pauses (10 ms frames under an RMS of 0.01 dropped), with noise."""
    rng = random.Random(seed)
    text = " ".join(rng.choice(VOCABULARY) for _ in range(int(minutes * 280)))
    with tempfile.TemporaryDirectory() as scratch:
        wav = Path(scratch) / "speech.wav"
        subprocess.run(["espeak-ng", "-w", str(wav), "-s", "200", "-g", "0", text], check=True)
        audio, rate = sf.read(wav, dtype="float32")
    audio = soxr.resample(audio, rate, 16000) if rate != 16000 else audio
    frames = audio[: len(audio) // 160 * 160].reshape(-1, 160)
    speech = frames[np.sqrt((frames**2).mean(axis=1)) > 0.01].reshape(-1)
    noise = 0.02 * np.random.default_rng(0).standard_normal(len(speech)).astype(np.float32)
    return (speech + noise)[: int(minutes * 60 * 16000)]


def _middle(word: Word, offset_s: float = 0.0) -> float:
    return (word.start_s + word.end_s) / 2 + offset_s


def cut_errors(model, wave: np.ndarray, max_segment_s: float, near_s: float) -> dict[str, int]:
    rate = model.sample_rate
    plan = plan_pieces(wave, rate, max_segment_s, 2.0, model.config.frame_samples)
    stitched = model.transcribe([wave], max_segment_s=max_segment_s)[0].words
    alone = model.transcribe([wave[s.start : s.end] for s in plan])
    lost, doubled, agreed = [], [], 0
    for i in range(len(plan) - 1):
        zone = (plan[i + 1].start / rate, plan[i].end / rate)
        before = [(w.word, _middle(w, plan[i].start / rate)) for w in alone[i].words]
        after = [(w.word, _middle(w, plan[i + 1].start / rate)) for w in alone[i + 1].words]
        before = [w for w in before if zone[0] <= w[1] < zone[1]]
        after = [w for w in after if zone[0] <= w[1] < zone[1]]
        for word, middle in before:
            heard = [m for w, m in after if w == word and abs(m - middle) <= near_s]
            if not heard:
                continue
            agreed += 1
            around = (min(middle, heard[0]) - near_s, max(middle, heard[0]) + near_s)
            said = sum(w.word == word and around[0] <= _middle(w) <= around[1] for w in stitched)
            once_each = max(sum(w == word and around[0] <= m <= around[1] for w, m in side) for side in (before, after))
            cut = f"{word} at {plan[i].cut_after / rate:.2f} s"
            lost += [cut] if said == 0 else []
            doubled += [cut] if said > max(1, once_each) else []
    return {"max_segment_s": max_segment_s, "cuts": len(plan) - 1, "words_both_heard": agreed, "lost": len(lost),
            "doubled": len(doubled), "words": len(stitched), "lost_at": lost, "doubled_at": doubled}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--near-s", type=float, default=0.4, help="how far apart two timings of one word may be")
    parser.add_argument("--model", default=None, help="a .nemo checkpoint (default: the embedded model)")
    parser.add_argument("max_segment_s", type=float, nargs="*", default=[30.0, 10.0])
    args = parser.parse_args()
    model = load_model(args.model, device="cpu", dtype="float32")
    wave = continuous_speech(args.minutes, args.seed)
    rows = [cut_errors(model, wave, s, args.near_s) for s in args.max_segment_s]
    print(json.dumps({"minutes": args.minutes, "seed": args.seed, "rows": rows}))


if __name__ == "__main__":
    main()
