"""Synthetic English speech: WordNet sentences spoken by espeak-ng in many voices, rates and pitches.

Text: the example sentences and definitions of WordNet 3.0 (Debian package ``wordnet-base``; WordNet 3.0
licence, a permissive BSD-style licence). They cover about every sense of every common English word, which
is the vocabulary breadth a small model needs. Sentences are normalised to lowercase words with apostrophes,
the form the model outputs.

Audio: ``espeak-ng --stdout`` (22.05 kHz) resampled to 16 kHz with soxr. Each utterance draws an accent, a
voice variant, a rate and a pitch from a seeded generator, so a corpus is reproducible from its seed.
Held out: test sentences (never in training) and one voice variant (never in training). The validation
sentences are spoken twice: in training voices (``valid``) and in a second unheard voice (``valid_voice``), so
a model can be picked for voices it never heard without scoring the test voice.

Usage: ``python -m models.training.data --cache DIR [--n-train N] [--seed S] [--train-min-count C]``
writes ``DIR/<split>/*.wav`` and ``DIR/<split>.jsonl`` (``{"audio", "text", "voice", "duration_s"}``) for
splits train, valid, valid_voice, test_sentences, test_voice. A split already built is kept, so rerunning on
an older corpus only adds what it lacks.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import random
import re
import subprocess
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

from ..audio_io import resample

SAMPLE_RATE = 16000
TELEPHONE_RATE = 8000  # call-centre audio
WORDNET_DIR = Path("/usr/share/wordnet")  # Debian's wordnet-base
WORDNET_FILES = ("data.noun", "data.verb", "data.adj", "data.adv")

# espeak-ng's English accents (the gmw voices; the mbrola ones need extra packages).
ACCENTS = ("en-us", "en-gb", "en-gb-scotland", "en-gb-x-rp", "en-gb-x-gbclan", "en-gb-x-gbcwmd", "en-029",
           "en-us-nyc")
# Voice variants (espeak-ng-data/voices/!v). Whisper, robots and effects are left out: not speech we serve.
TRAIN_VARIANTS = ("m1", "m2", "m4", "m5", "m6", "m7", "m8", "f1", "f2", "f3", "f5", "klatt", "klatt2",
                  "klatt3", "klatt4", "adam", "Alex", "Alicia", "Andrea", "Andy", "Annie", "aunty", "belinda",
                  "benjamin", "caleb", "david", "ed", "edward", "Gene", "grandma", "grandpa", "Hugo", "iven",
                  "iven2", "john", "Lee", "linda", "max", "Michael", "Mike", "norbert", "paul", "quincy",
                  "rob", "robert", "sandro", "shelby", "steph", "travis", "victor", "zac")
TEST_VOICE = ("en-us", "f4")  # never heard in training: the held-out voice
VALID_VOICE = ("en-us", "m3")  # never heard in training either: picks models for unheard voices
RATE_WPM = (130, 210)
PITCH = (25, 75)
MIN_WORDS, MAX_WORDS = 4, 16
# Held-out sentences are drawn from those whose words all occur this often in the corpus, in every stage.
MIN_WORD_COUNT = 20
N_VALID, N_TEST = 200, 300

_ALLOWED = re.compile(r"^[a-z' ,;:.!?-]+$")


@dataclass(frozen=True)
class Utterance:
    text: str
    voice: str  # "accent+variant"
    rate: int  # words per minute
    pitch: int  # 0-99


# --- text ---------------------------------------------------------------------------------------------


def normalize(sentence: str) -> str | None:
    """Lowercase words and apostrophes, or None when the sentence has what espeak reads otherwise (digits,
    symbols, abbreviations)."""
    s = sentence.strip().lower().replace("`", "'")
    if not s or not _ALLOWED.match(s) or ". " in s.rstrip("."):
        return None
    words = [w.strip("'") for w in re.split(r"[\s,;:.!?-]+", s)]
    words = [w for w in words if w]
    if not MIN_WORDS <= len(words) <= MAX_WORDS or any("'" in w and not re.fullmatch(r"[a-z]+'[a-z]+", w)
                                                       for w in words):
        return None
    return " ".join(words)


def wordnet_sentences(root: Path = WORDNET_DIR) -> list[str]:
    """Glosses of every synset, split into definitions and quoted examples, normalised and deduplicated."""
    found: set[str] = set()
    for name in WORDNET_FILES:
        for line in (root / name).read_text(encoding="latin-1").splitlines():
            if line.startswith(" ") or "|" not in line:
                continue  # licence header
            gloss = line.split("|", 1)[1]
            for part in re.findall(r'"([^"]+)"', gloss) + gloss.split('"')[0].split(";"):
                text = normalize(part)
                if text:
                    found.add(text)
    return sorted(found)


def split_sentences(sentences: list[str], train_min_count: int = MIN_WORD_COUNT) -> dict[str, list[str]]:
    """Held-out splits from the sentences of common words (``MIN_WORD_COUNT``), by a hash of the text, so
    they never change; training takes every other sentence whose words occur ``train_min_count`` times.
    A lower ``train_min_count`` gives more distinct training sentences (and rarer words) without moving
    a single held-out sentence."""
    counts = Counter(w for s in sentences for w in s.split())

    def common(min_count: int) -> list[str]:
        kept = [s for s in sentences if all(counts[w] >= min_count for w in s.split())]
        return sorted(kept, key=lambda s: hashlib.sha1(s.encode()).hexdigest())

    held = common(MIN_WORD_COUNT)
    n_held = N_VALID + 2 * N_TEST
    held_out = set(held[:n_held])
    train = [s for s in common(train_min_count) if s not in held_out]
    return {"valid": held[:N_VALID], "test_sentences": held[N_VALID:N_VALID + N_TEST],
            "test_voice": held[N_VALID + N_TEST:n_held], "train": train}


# --- audio --------------------------------------------------------------------------------------------


def synthesize(utt: Utterance) -> np.ndarray:
    """espeak-ng -> mono float32 at 16 kHz."""
    wav = subprocess.run(["espeak-ng", "-v", utt.voice, "-s", str(utt.rate), "-p", str(utt.pitch), "--stdout",
                          utt.text], check=True, capture_output=True).stdout
    audio, rate = sf.read(io.BytesIO(wav), dtype="float32")
    return resample(audio, rate, SAMPLE_RATE)


def telephone_band(wave: np.ndarray) -> np.ndarray:
    """The wave as it sounds recorded at 8 kHz and resampled back to 16 kHz: nothing above 4 kHz."""
    narrow = resample(wave, SAMPLE_RATE, TELEPHONE_RATE)
    return resample(narrow, TELEPHONE_RATE, SAMPLE_RATE)[: len(wave)]


def plan(sentences: list[str], n: int, rng: random.Random,
         voices: list[tuple[str, str]]) -> Iterator[Utterance]:
    """n utterances cycling through the sentences (shuffled), each with a random voice, rate and pitch."""
    order = list(sentences)
    for i in range(n):
        if i % len(order) == 0:
            rng.shuffle(order)
        accent, variant = rng.choice(voices)
        yield Utterance(order[i % len(order)], f"{accent}+{variant}", rng.randint(*RATE_WPM),
                        rng.randint(*PITCH))


def build_split(cache: Path, split: str, utts: list[Utterance], workers: int) -> None:
    out_dir = cache / split
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = cache / f"{split}.jsonl"
    if manifest.exists() and sum(1 for _ in manifest.open()) == len(utts):
        print(f"{split}: cached ({len(utts)} utterances)")
        return

    def one(item: tuple[int, Utterance]) -> dict:
        i, utt = item
        path = out_dir / f"{i:06d}.wav"
        if not path.exists():
            sf.write(path, synthesize(utt), SAMPLE_RATE, subtype="PCM_16")
        return {"audio": f"{split}/{path.name}", "duration_s": sf.info(path).duration, **asdict(utt)}

    with ThreadPoolExecutor(workers) as pool:  # espeak runs in subprocesses; threads just wait on them
        rows = list(pool.map(one, enumerate(utts)))
    tmp = manifest.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(manifest)
    hours = sum(r["duration_s"] for r in rows) / 3600
    print(f"{split}: {len(rows)} utterances, {hours:.2f} h")


def corpus_plans(splits: dict[str, list[str]], n_train: int, seed: int) -> dict[str, list[Utterance]]:
    """Every split's utterances. ``valid_voice`` draws last from the generator, so adding it changed no
    utterance of the splits older corpora hold."""
    train_voices = [(a, v) for a in ACCENTS for v in TRAIN_VARIANTS]
    rng = random.Random(seed)
    plans = {
        "valid": list(plan(splits["valid"], N_VALID, rng, train_voices)),
        "test_sentences": list(plan(splits["test_sentences"], N_TEST, rng, train_voices)),
        "test_voice": list(plan(splits["test_voice"], N_TEST, rng, [TEST_VOICE])),
        "train": list(plan(splits["train"], n_train, rng, train_voices)),
    }
    plans["valid_voice"] = list(plan(splits["valid"], N_VALID, rng, [VALID_VOICE]))
    return plans


def build_corpus(cache: Path, n_train: int, seed: int, workers: int = 2,
                 train_min_count: int = MIN_WORD_COUNT) -> None:
    splits = split_sentences(wordnet_sentences(), train_min_count)
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "train_text.txt").write_text("\n".join(splits["train"]) + "\n")
    plans = corpus_plans(splits, n_train, seed)
    print({k: len(v) for k, v in splits.items()}, "sentences")
    for split, utts in plans.items():
        build_split(cache, split, utts, workers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, required=True,
                        help="where audio and manifests go (outside the repo)")
    parser.add_argument("--n-train", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--train-min-count", type=int, default=MIN_WORD_COUNT,
                        help="training sentences need each word this often in WordNet's glosses (held-out "
                             f"sentences always {MIN_WORD_COUNT})")
    args = parser.parse_args()
    build_corpus(args.cache, args.n_train, args.seed, args.workers, args.train_min_count)


if __name__ == "__main__":
    main()
