"""The embedded default model: `load_model()` with no argument transcribes held-out speech exactly.

The WAVs in tests/data/default_model are espeak-ng utterances of sentences (and one voice) that the model never
saw in training; `expected.json` holds what was synthesised. They were chosen among held-out
utterances the model gets right (the held-out WER is in models/assets/MODEL_CARD.md), so they pin behaviour;
they do not measure accuracy.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models import load_model
from models.asr_model import DEFAULT_MODEL, resolve_dtype

DATA = Path(__file__).parent / "data" / "default_model"
EXPECTED: dict[str, str] = json.loads((DATA / "expected.json").read_text())

pytestmark = pytest.mark.skipif(not DEFAULT_MODEL.exists(), reason="models/assets/default.nemo not installed")


@pytest.fixture(scope="module")
def model():
    return load_model(device="cpu")


def test_default_model_is_small_and_hybrid(model):
    assert DEFAULT_MODEL.stat().st_size <= 15 * 2**20
    assert model.config.kind == "hybrid" and model.default_decoder == "tdt"


@pytest.mark.parametrize("decoder", ["tdt", "ctc"])
def test_held_out_files_transcribe_exactly(model, decoder):
    names = sorted(EXPECTED)
    transcripts = model.transcribe([str(DATA / n) for n in names], decoder=decoder)
    assert {n: t.text for n, t in zip(names, transcripts, strict=True)} == EXPECTED


def test_cli_transcribes_without_model_flag():
    name = sorted(EXPECTED)[0]
    exe = shutil.which("batchasr")
    command = [exe] if exe else [sys.executable, "-m", "service.cli"]
    out = subprocess.run([*command, "transcribe", "--device", "cpu", "--format", "jsonl", str(DATA / name)],
                         capture_output=True, text=True, check=True, timeout=120)
    record = json.loads(out.stdout)
    assert record["text"] == EXPECTED[name]


def test_auto_dtype_is_bf16_on_cuda_and_float32_on_cpu():
    """DESIGN's contract for ``load_model(dtype="auto")``: decided from the device alone, so it is checked here."""
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("float16", torch.device("cuda")) == torch.float16
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        resolve_dtype("fp8", torch.device("cpu"))
    assert load_model(device="cpu").dtype == torch.float32
