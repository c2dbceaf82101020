"""The `batchasr transcribe` command as a user runs it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf

from service.cli import main


def test_console_script_runs(parity_dir, parity_audio):
    exe = shutil.which("batchasr")
    command = [exe] if exe else [sys.executable, "-m", "service.cli"]
    out = subprocess.run([*command, "transcribe", "--model", str(parity_dir / "tdt.nemo"), "--format", "jsonl",
                          parity_audio[0]], capture_output=True, text=True, check=True, timeout=120)
    assert json.loads(out.stdout)["audio"] == parity_audio[0]


def test_resampled_stereo_input_transcribes_like_the_original(parity_dir, parity_audio, tmp_path, capsys):
    wave, _ = sf.read(parity_audio[3], dtype="float32")
    sf.write(tmp_path / "stereo48k.flac", np.stack([wave, wave], axis=1).repeat(3, axis=0), 48000)
    model = str(parity_dir / "tdt_ctc_hybrid.nemo")
    assert main(["transcribe", "--model", model, "--format", "text", parity_audio[3]]) == 0
    original = capsys.readouterr().out
    assert main(["transcribe", "--model", model, "--format", "text", str(tmp_path / "stereo48k.flac")]) == 0
    assert capsys.readouterr().out == original


def test_output_dir_writes_one_file_per_input(parity_dir, parity_audio, tmp_path):
    out = tmp_path / "out"
    assert main(["transcribe", "--model", str(parity_dir / "tdt.nemo"), "--format", "vtt", "--output-dir",
                 str(out), *parity_audio[:3]]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["utt00.vtt", "utt01.vtt", "utt02.vtt"]
    assert all(p.read_text().startswith("WEBVTT") for p in out.iterdir())


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "cannot decode audio"),
        (b"this is not audio at all" * 10, "cannot decode audio"),
        (None, "no such audio file"),
    ],
)
def test_bad_audio_is_reported(parity_dir, tmp_path, capsys, content, message):
    path = tmp_path / "bad.wav"
    if content is not None:
        path.write_bytes(content)
    assert main(["transcribe", "--model", str(parity_dir / "tdt.nemo"), str(path)]) == 1
    assert message in capsys.readouterr().err


def test_subtitles_of_several_files_need_an_output_dir(parity_audio, capsys):
    assert main(["transcribe", "--format", "srt", *parity_audio[:2]]) == 2
    assert "use --output-dir" in capsys.readouterr().err


def test_unknown_model_file_is_a_clear_error(tmp_path, parity_audio, capsys):
    assert main(["transcribe", "--model", str(tmp_path / "nope.nemo"), parity_audio[0]]) == 2
    assert "nope.nemo: no such file or directory" in capsys.readouterr().err
