"""Through HTTP: NeMo parity on the fixtures, and long audio split, batched and stitched."""

from __future__ import annotations

import difflib
import io
from pathlib import Path

import httpx
import pytest
import soundfile as sf

from models import load_model
from service.config import Settings
from tests.conftest import long_recording
from tests.servers import run_server


def test_http_float32_matches_nemo(parity_dir, parity_reference, parity_audio):
    for name, entry in parity_reference["models"].items():
        model = load_model(parity_dir / entry["file"], device="cpu", dtype="float32")
        with run_server(Settings(max_wait_ms=5), model) as running:
            for path, expected in zip(parity_audio, entry["main_bs4"], strict=True):
                body = httpx.post(f"{running.url}/v1/transcribe", content=Path(path).read_bytes(),
                                  headers={"content-type": "audio/wav"}, timeout=60).json()
                assert body["text"] == expected["text"], (name, path)
                if expected["tokens"] is not None:
                    assert body["tokens"] == expected["tokens"] and body["token_frames"] == expected["frames"]


def word_agreement(a: list[str], b: list[str]) -> float:
    matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    return 2 * sum(m.size for m in matcher.get_matching_blocks()) / max(1, len(a) + len(b))


def test_ten_minutes_of_audio_stitch_in_order(parity_dir, parity_audio):
    """Random-weight fixtures: timing structure only (their text depends on context, so no agreement check)."""
    model = load_model(parity_dir / "tdt_ctc_hybrid.nemo", device="cpu", dtype="float32")
    recording, _ = long_recording(parity_audio, 600)
    buffer = io.BytesIO()
    sf.write(buffer, recording, 16000, format="FLAC")
    with run_server(Settings(max_segment_s=30, max_batch_size=32), model) as running:
        response = httpx.post(f"{running.url}/v1/transcribe", content=buffer.getvalue(),
                              headers={"content-type": "audio/flac"}, timeout=600)
    body = response.json()
    assert response.status_code == 200, body
    assert body["segments"] >= 20
    assert body["duration_s"] == pytest.approx(len(recording) / 16000)
    frames = body["token_frames"]
    assert frames == sorted(frames) and frames[-1] * 0.08 < body["duration_s"] + 1
    words = body["words"]
    starts = [w["start"] for w in words]
    assert starts == sorted(starts) and all(w["start"] <= w["end"] <= body["duration_s"] for w in words)
    assert " ".join(w["word"] for w in words) == body["text"]
