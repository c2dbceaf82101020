"""models.training.data: a split rebuilt for another plan never pairs a row's text with another utterance's
audio, and keeps the files whose utterance is unchanged."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import soundfile as sf

from models.training.data import SAMPLE_RATE, Utterance, build_split, synthesize

pytestmark = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng not installed")

A = Utterance("the cat sat on the mat", "en-us+m1", 170, 50)
B = Utterance("a completely different sentence here", "en-us+m1", 170, 50)
C = Utterance("and another one for good measure", "en-us+m1", 170, 50)


def _wav(cache: Path, index: int) -> Path:
    return cache / "train" / f"{index:06d}.wav"


def _rows(cache: Path) -> list[dict]:
    return [json.loads(line) for line in (cache / "train.jsonl").read_text().splitlines()]


def _is_audio_of(cache: Path, index: int, utt: Utterance) -> bool:
    return sf.info(_wav(cache, index)).frames == len(synthesize(utt))


def test_a_rebuild_for_another_plan_synthesises_the_changed_utterances_again(tmp_path):
    assert len(synthesize(A)) != len(synthesize(C))  # told apart by their length
    build_split(tmp_path, "train", [A], 1)
    first = _wav(tmp_path, 0).stat().st_ino
    build_split(tmp_path, "train", [A, B], 1)  # more utterances: the first file kept
    assert _wav(tmp_path, 0).stat().st_ino == first
    second = _wav(tmp_path, 1).stat().st_ino
    build_split(tmp_path, "train", [C, B], 1)  # as many utterances of another plan (another --seed, say)
    assert [r["text"] for r in _rows(tmp_path)] == [C.text, B.text]
    assert _is_audio_of(tmp_path, 0, C)
    assert _rows(tmp_path)[0]["duration_s"] == len(synthesize(C)) / SAMPLE_RATE
    assert _wav(tmp_path, 1).stat().st_ino == second  # B's file is B's still


def test_files_of_unrecorded_utterances_are_synthesised_again_and_older_corpora_stay_cached(tmp_path, capsys):
    build_split(tmp_path, "train", [A], 1)
    (tmp_path / "train.plan.json").unlink()  # a corpus built before plan files: its manifest tells its files
    first = _wav(tmp_path, 0).stat().st_ino
    build_split(tmp_path, "train", [A], 1)
    assert "train: cached (1 utterances)" in capsys.readouterr().out
    assert _wav(tmp_path, 0).stat().st_ino == first and (tmp_path / "train.plan.json").exists()
    shutil.copy(_wav(tmp_path, 0), _wav(tmp_path, 1))  # left by a build cut short: no record of its utterance
    build_split(tmp_path, "train", [A, B], 1)
    assert "1 audio files were made for other utterances" in capsys.readouterr().out
    assert _is_audio_of(tmp_path, 1, B) and _wav(tmp_path, 0).stat().st_ino == first
