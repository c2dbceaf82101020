"""Corpus splits: held-out sentences stay the same whatever the training sentences' word threshold."""

from __future__ import annotations

import random

from models.training.data import MIN_WORD_COUNT, split_sentences


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
