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
splits train, valid, valid_voice, test_sentences, test_voice, and ``DIR/<split>.plan.json``: a digest of each
file's utterance (text, voice, rate, pitch), written before synthesis starts. A rebuild keeps the files whose
utterance is unchanged and synthesises the others again, so rerunning on an older corpus only adds what it lacks,
and a rerun with another ``--seed``, ``--n-train`` or ``--train-min-count`` never pairs a new text with old
audio. ``train_text.txt`` (the tokenizer's text) is written with the training split it describes.
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


def utterance_key(utt: Utterance) -> str:
    """A digest of what an utterance's audio is made from: text, voice, rate and pitch."""
    return hashlib.sha1(json.dumps(asdict(utt), sort_keys=True).encode()).hexdigest()[:16]


def manifest_keys(manifest: Path) -> list[str]:
    """The utterance keys of a manifest's rows (each row holds its utterance's fields); [] when there is none."""
    if not manifest.exists():
        return []
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    return [utterance_key(Utterance(r["text"], r["voice"], r["rate"], r["pitch"])) for r in rows]


def audio_keys(cache: Path, split: str) -> list[str]:
    """What the split's NNNNNN.wav files were synthesised from, by index: the plan file, or for a corpus built
    before plan files, its manifest's rows. A file past the list is of unknown origin."""
    plan_file = cache / f"{split}.plan.json"
    return json.loads(plan_file.read_text()) if plan_file.exists() else manifest_keys(cache / f"{split}.jsonl")


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def build_split(cache: Path, split: str, utts: list[Utterance], workers: int) -> None:
    """The split's audio and manifest for ``utts``: a file is kept only when it was synthesised from the same
    utterance, so a rebuild for another plan never pairs a row's text with another utterance's audio."""
    out_dir = cache / split
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = cache / f"{split}.jsonl"
    plan_file = cache / f"{split}.plan.json"
    wanted = [utterance_key(u) for u in utts]
    known = audio_keys(cache, split)
    paths = [out_dir / f"{i:06d}.wav" for i in range(len(utts))]
    if known == wanted and manifest_keys(manifest) == wanted and all(p.exists() for p in paths):
        if not plan_file.exists():  # a corpus built before plan files
            write_atomically(plan_file, json.dumps(wanted))
        print(f"{split}: cached ({len(utts)} utterances)")
        return
    stale = [p for i, p in enumerate(paths) if p.exists() and (i >= len(known) or known[i] != wanted[i])]
    if stale:
        print(f"{split}: {len(stale)} audio files were made for other utterances (another --seed, --n-train or "
              "--train-min-count) or for unrecorded ones: synthesising them again")
    for path in stale:  # before the plan is written: every file left belongs to the plan on disk
        path.unlink()
    write_atomically(plan_file, json.dumps(wanted))

    def one(item: tuple[Path, Utterance]) -> dict:
        path, utt = item
        if not path.exists():  # written whole or not at all: a build cut short leaves no truncated file
            tmp = path.with_name(path.stem + ".tmp.wav")
            sf.write(tmp, synthesize(utt), SAMPLE_RATE, subtype="PCM_16")
            tmp.replace(path)
        return {"audio": f"{split}/{path.name}", "duration_s": sf.info(path).duration, **asdict(utt)}

    with ThreadPoolExecutor(workers) as pool:  # espeak runs in subprocesses; threads just wait on them
        rows = list(pool.map(one, zip(paths, utts, strict=True)))
    write_atomically(manifest, "".join(json.dumps(r) + "\n" for r in rows))
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
    plans = corpus_plans(splits, n_train, seed)
    print({k: len(v) for k, v in splits.items()}, "sentences")
    for split, utts in plans.items():
        build_split(cache, split, utts, workers)
        if split == "train":  # the tokenizer's text, written with the training split it describes
            write_atomically(cache / "train_text.txt", "\n".join(splits["train"]) + "\n")


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
