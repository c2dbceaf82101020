"""How hard to boost hotwords: WER on held-out speech the embedded model never trained on, for several bonuses.

    python -m models.training.data --cache DIR --n-train 0    # the held-out splits (espeak-ng, WordNet)
    python loadtest/hotword_boost.py --cache DIR [--model M] [--decoder ctc] [--split test_voice]
        [--boosts 1.5 2 2.5 3 4] [--missed-boost 4]

Two columns per bonus. "Missed + others": each utterance boosts the words it said that the model (unboosted)
missed, as a call centre knows its product names, plus ``--others`` rare words said in one other utterance each
(what a list holds that this call does not say). "Others alone": every utterance boosts just those. The first
shows what boosting fixes, the second what it breaks. ``--missed-boost X`` gives the missed words their own bonus
(``word:X``), the others keeping the row's: a list whose names the model is known to miss, pushed harder.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models import load_model
from models.training.evaluate import read_split, wer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, required=True, help="corpus from models.training.data")
    parser.add_argument("--model", default=None, help="a .nemo file (default: the embedded model)")
    parser.add_argument("--decoder", default="auto", help="auto (the model's own) | tdt | rnnt | ctc")
    parser.add_argument("--split", default="test_sentences", help="test_sentences | test_voice (both held out)")
    parser.add_argument("--boosts", type=float, nargs="+", default=[1.5, 2.0, 2.5, 3.0, 4.0])
    parser.add_argument("--missed-boost", type=float, default=None, help="the missed words' own bonus (default: none)")
    parser.add_argument("--others", type=int, default=20, help="rare words not said, in every list (default 20)")
    args = parser.parse_args()
    model = load_model(args.model, device="cpu", dtype="float32")
    audio, said = read_split(args.cache, args.split)
    seconds = sum(len(w) for w in audio) / model.sample_rate

    def batched(**hotwords) -> tuple[list[str], float]:
        """Every utterance in batches of 32: the texts, and RTFx."""
        started = time.perf_counter()
        texts = [t.text for t in model.transcribe(audio, batch_size=32, decoder=args.decoder, **hotwords)]
        return texts, seconds / (time.perf_counter() - started)

    batched()  # warm-up
    plain, plain_rtfx = batched()
    counts = Counter(word for text in said for word in text.split())
    rare = sorted(word for word, n in counts.items() if n == 1 and len(word) > 3)
    others = random.Random(1).sample(rare, args.others)
    print(f"{len(audio)} utterances, WER {100 * wer(said, plain):.2f}% without hotwords (RTFx {plain_rtfx:.0f})\n")
    print("| bonus | WER: missed + others | WER: others alone | RTFx, others alone |\n|---|---|---|---|")
    for boost in args.boosts:
        fixed = []
        for wave, text, heard in zip(audio, said, plain, strict=True):
            missed = [word for word in text.split() if word not in heard.split()]
            if args.missed_boost is None:
                hotwords = list(dict.fromkeys(missed + others))
            else:  # last, so that a missed word among the others keeps its own bonus (the last given wins)
                hotwords = list(dict.fromkeys(others + [f"{word}:{args.missed_boost:g}" for word in missed]))
            fixed.append(model.transcribe([wave], decoder=args.decoder, hotwords=hotwords,
                                          hotword_boost=boost)[0].text)
        alone, rtfx = batched(hotwords=others, hotword_boost=boost)
        print(f"| {boost:g} | {100 * wer(said, fixed):.2f}% | {100 * wer(said, alone):.2f}% | {rtfx:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
