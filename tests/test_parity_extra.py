"""More NeMo parity: the project's own fixtures (tests/fixtures/nemo-extra, made with NeMo 3.0.0 by
scripts/make_nemo_fixtures.py): 128 vs 80 mels, xscaling off, no biases, conv kernel 5, 2-layer prediction
networks, non-default TDT durations, CTC with token frames, inputs up to 60 s and shorter than a frame."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from models import ASRModel, load_model
from service.cli import main as cli_main
from tests.conftest import EXTRA_PARITY_DIR, load_reference

REFERENCE = load_reference(EXTRA_PARITY_DIR)
BATCH_SIZES = (1, 2, 3, 4, 10)
CASES = [(name, "auto", "main_bs4") for name in REFERENCE["models"]] + [
    (name, "ctc", "ctc_bs4") for name, entry in REFERENCE["models"].items() if "ctc_bs4" in entry]


@cache
def _model(name: str) -> ASRModel:
    return load_model(EXTRA_PARITY_DIR / REFERENCE["models"][name]["file"], device="cpu", dtype="float32")


def _int16(audio_dir: Path, clip: str) -> np.ndarray:
    data, rate = sf.read(audio_dir / f"{clip}.wav", dtype="int16")
    assert rate == 16000 and data.ndim == 1
    return data


def build_input(audio_dir: Path, name: str) -> np.ndarray:
    """The fixture's input ``name`` as int16 samples (the recipe in tests/fixtures/nemo-extra/README.md)."""
    if name.endswith(".wav"):
        return _int16(audio_dir, name.removesuffix(".wav"))
    recipe = REFERENCE["synthetic"][name]
    if recipe["kind"] == "concat":
        gap = np.zeros(recipe["gap_samples"], dtype=np.int16)
        unit = np.concatenate([x for clip in recipe["clips"] for x in (_int16(audio_dir, clip), gap)])
        n = recipe["total_samples"]
        return np.tile(unit, -(-n // len(unit)))[:n]
    start = recipe["start"]
    return _int16(audio_dir, recipe["clip"])[start : start + recipe["num_samples"]]


@pytest.fixture(scope="module")
def inputs(parity_dir) -> list[np.ndarray]:
    return [build_input(parity_dir / "audio", name) for name in REFERENCE["audio"]]


def test_inputs_cover_long_and_sub_frame_audio(inputs):
    lengths = [len(x) for x in inputs]
    assert max(lengths) == 960000 and min(lengths) == 1279  # 60 s, and one sample short of 80 ms


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
@pytest.mark.parametrize(("name", "decoder", "key"), CASES)
def test_python_api_matches_nemo(inputs, name, decoder, key, batch_size):
    waveforms = [x.astype(np.float32) / np.float32(32768.0) for x in inputs]
    transcripts = _model(name).transcribe(waveforms, batch_size=batch_size, decoder=decoder)
    for audio, got, expected in zip(REFERENCE["audio"], transcripts, REFERENCE["models"][name][key], strict=True):
        label = f"{name}/{decoder} bs={batch_size} {audio}"
        assert (got.text, got.tokens, got.token_frames) == (expected["text"], expected["tokens"],
                                                            expected["frames"]), label


@pytest.mark.parametrize(("name", "decoder", "key"), CASES)
def test_cli_jsonl_matches_nemo(inputs, tmp_path, capsys, name, decoder, key):
    paths = []
    for audio, samples in zip(REFERENCE["audio"], inputs, strict=True):
        path = tmp_path / (audio if audio.endswith(".wav") else f"{audio}.wav")
        sf.write(path, samples, 16000, subtype="PCM_16")  # int16 exactly: reads back as NeMo's input
        paths.append(str(path))
    model_path = str(EXTRA_PARITY_DIR / REFERENCE["models"][name]["file"])
    for batch_size in BATCH_SIZES:
        # --max-segment-s 0: every file whole, as NeMo's transcribe() takes it (by default the command cuts the
        # 45 s input at 30 s, as the service does)
        assert cli_main(["transcribe", "--model", model_path, "--device", "cpu", "--dtype", "float32",
                         "--decoder", decoder, "--batch-size", str(batch_size), "--max-segment-s", "0",
                         "--format", "jsonl", *paths]) == 0
        lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        for record, expected in zip(lines, REFERENCE["models"][name][key], strict=True):
            assert (record["text"], record["tokens"], record["token_frames"]) == (
                expected["text"], expected["tokens"], expected["frames"]), f"{name} bs={batch_size} {record['audio']}"
