"""models.training.throughput: times real training steps on the shipped model's size, per precision."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import soundfile as sf
import torch

from models.asr_model import DEFAULT_MODEL
from models.training.throughput import audio_seconds_per_second, load_trainable, real_batches
from models.training.train import Recipe

DATA = Path(__file__).parent / "data" / "default_model"

pytestmark = pytest.mark.skipif(not DEFAULT_MODEL.exists(), reason="models/assets/default.nemo not installed")


@pytest.fixture
def corpus(tmp_path):
    """The held-out test files as a tiny training corpus (the layout models.training.data writes)."""
    expected = json.loads((DATA / "expected.json").read_text())
    rows = []
    for name, text in sorted(expected.items()):
        shutil.copy(DATA / name, tmp_path / name)
        rows.append({"audio": name, "text": text, "duration_s": sf.info(tmp_path / name).duration})
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_times_real_steps_that_train_the_model(corpus):
    recipe = Recipe(batch_seconds=4.0)  # one utterance a batch
    model, tokenizer = load_trainable(DEFAULT_MODEL, recipe)
    batches = real_batches(corpus, recipe, tokenizer, 3)
    assert len(batches) == 3 and all(len(b.n_samples) == 1 for b in batches)
    before = [p.detach().clone() for p in model.parameters()]

    rate = audio_seconds_per_second(model, batches, recipe, "fp32")

    assert rate > 0
    changed = sum(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert changed > len(before) // 2  # the optimizer stepped
