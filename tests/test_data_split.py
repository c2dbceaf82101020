"""Corpus splits: held-out sentences stay the same whatever the training sentences' word threshold, and
the utterances of older corpora stay the same now that validation is also spoken in an unheard voice."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict

from models.training.data import (
    ACCENTS,
    MIN_WORD_COUNT,
    TEST_VOICE,
    TRAIN_VARIANTS,
    VALID_VOICE,
    corpus_plans,
    split_sentences,
)


def _sentences() -> list[str]:
    rng = random.Random(0)
    common = [f"w{i}" for i in range(30)]
    sentences = {" ".join(rng.choices(common, k=6)) for _ in range(1200)}
    # Words that occur 10 times each: sentences with them train only when the threshold is 10 or lower.
    rare = [f"r{i}" for i in range(20)]
    sentences |= {" ".join([*rng.choices(common, k=5), word, str(j)]) for word in rare for j in range(10)}
    return sorted(sentences)


def test_lowering_the_training_threshold_adds_training_sentences_and_moves_no_held_out_one():
    sentences = _sentences()
    strict, broad = split_sentences(sentences), split_sentences(sentences, train_min_count=10)
    for split in ("valid", "test_sentences", "test_voice"):
        assert broad[split] == strict[split], split
    held_out = {s for split in ("valid", "test_sentences", "test_voice") for s in strict[split]}
    assert len(held_out) == 800
    assert not held_out & set(broad["train"])
    assert set(strict["train"]) < set(broad["train"])
    added = set(broad["train"]) - set(strict["train"])
    assert added and all(any(w.startswith("r") for w in s.split()) for s in added)
    assert MIN_WORD_COUNT > 10


def test_corpus_plans_keep_older_splits_and_speak_validation_in_a_second_unheard_voice():
    splits = split_sentences(_sentences())
    plans = corpus_plans(splits, 500, seed=0)
    older = {k: [asdict(u) for u in plans[k]] for k in ("valid", "test_sentences", "test_voice", "train")}
    # The digest of these four splits before valid_voice existed: corpora built then stay reproducible.
    assert hashlib.sha256(json.dumps(older).encode()).hexdigest() == \
        "39843f7f63f5eef26f4c4cd350d9a09dd0f9215112556424b255f5e63df9aee4"
    valid_voice = "+".join(VALID_VOICE)
    assert [u.text for u in plans["valid_voice"]] and {u.voice for u in plans["valid_voice"]} == {valid_voice}
    assert {u.text for u in plans["valid_voice"]} == set(splits["valid"])
    heard = {u.voice for u in plans["train"]} | {f"{a}+{v}" for a in ACCENTS for v in TRAIN_VARIANTS}
    assert valid_voice not in heard and VALID_VOICE != TEST_VOICE
