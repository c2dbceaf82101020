"""models.training.evaluate: the word error rate and the breakdown table the model card quotes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from models import load_model
from models.asr_model import DEFAULT_MODEL
from models.training.evaluate import RATE_BANDS, print_breakdown, read_rows, read_split, read_splits, wer

DATA = Path(__file__).parent / "data" / "default_model"


def test_wer_counts_substitutions_insertions_and_deletions_over_reference_words():
    refs = ["the cat sat", "a dog ran in the park"]
    hyps = ["the hat sat down", "a dog in the park"]  # 1 sub + 1 ins, then 1 del
    assert wer(refs, hyps) == pytest.approx(3 / 9)
    assert wer(refs, refs) == 0.0
    assert wer([""], ["noise"]) == 1.0  # no reference words: errors over max(1, 0)


def test_read_rows_takes_the_first_rows_only(tmp_path):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"i": i}) + "\n" for i in range(5)))
    assert [r["i"] for r in read_rows(tmp_path, "train", 3)] == [0, 1, 2]
    assert len(read_rows(tmp_path, "train")) == 5


@pytest.mark.skipif(not DEFAULT_MODEL.exists(), reason="models/assets/default.nemo not installed")
def test_breakdown_puts_each_utterance_in_its_rate_band(tmp_path, capsys):
    expected = json.loads((DATA / "expected.json").read_text())
    names = sorted(expected)
    for name in names:
        shutil.copy(DATA / name, tmp_path / name)
    rates = [140, 160, 200]  # bands 1, 2 and 4; band 3 stays empty
    rows = [{"audio": n, "text": expected[n], "rate": r} for n, r in zip(names, rates, strict=True)]
    rows[2] = {**rows[2], "text": "a trip to some place"}  # the model hears 3 words more: 3 insertions
    for split in ("train", "test_sentences"):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    print_breakdown(load_model(device="cpu"), tmp_path)

    lines = capsys.readouterr().out.strip().splitlines()
    header, rule, *table = lines
    assert [c.strip() for c in header.strip("|").split("|")][3:] == [
        f"held-out, {low}-{high - 1} wpm ({n})" for (low, high), n in zip(RATE_BANDS, [1, 1, 0, 1], strict=True)]
    assert rule.count("---") == 7
    n_words = sum(len(r["text"].split()) for r in rows)
    for row, head in zip(table, ("TDT", "CTC"), strict=True):
        cells = [c.strip() for c in row.strip("|").split("|")]
        # the held-out files transcribe exactly, so the only errors are the 3 words cut from one reference
        assert cells == [head, f"{300 / n_words:.2f}%", f"{300 / n_words:.2f}%", "0.00%", "0.00%", "0.00%",
                         f"{300 / 5:.2f}%"]


def test_read_splits_pools_the_splits_in_the_order_given(tmp_path):
    expected = json.loads((DATA / "expected.json").read_text())
    names = sorted(expected)
    for name in names:
        shutil.copy(DATA / name, tmp_path / name)
    for split, chosen in (("valid", names[:2]), ("valid_voice", names[2:])):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps({"audio": n, "text": expected[n]}) + "\n"
                                                         for n in chosen))
    audio, texts = read_splits(tmp_path, ["valid_voice", "valid"])
    assert texts == [expected[n] for n in names[2:] + names[:2]]
    assert len(audio) == len(names) and all(a.dtype == np.float32 and a.size > 0 for a in audio)
    with pytest.raises(FileNotFoundError, match="test_voice"):
        read_splits(tmp_path, ["valid", "test_voice"])


def test_a_split_is_read_at_16_khz_in_mono_whatever_its_files(tmp_path):
    rate = 16000
    wave = (0.1 * np.sin(2 * np.pi * 440 * np.arange(rate) / rate)).astype(np.float32)  # 1 s
    sf.write(tmp_path / "8k.wav", wave[::2], rate // 2)
    sf.write(tmp_path / "stereo.wav", np.stack([wave, 0.5 * wave], 1), rate)
    rows = [{"audio": name, "text": "a tone"} for name in ("8k.wav", "stereo.wav")]
    (tmp_path / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    audio, _ = read_split(tmp_path, "valid")  # what average and interpolate score their picks on
    assert [a.shape for a in audio] == [(rate,), (rate,)]
    np.testing.assert_allclose(audio[1], 0.75 * wave, atol=1e-4)  # the channels' mean
