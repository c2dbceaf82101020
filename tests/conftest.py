"""Shared test fixtures: where the NeMo parity fixtures live, and small audio helpers."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

# The tests' models are small: one thread each is faster than two fighting over two cores, and worker
# subprocesses started by tests inherit the setting.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parent.parent
# NeMo's own outputs on small models: the project's shared fixtures sit beside the checkout.
PARITY_DIR = Path(os.environ.get("BATCHASR_PARITY_DIR", REPO.parent / "shared" / "fixtures" / "nemo-parity"))
EXTRA_PARITY_DIR = REPO / "tests" / "fixtures" / "nemo-extra"
GAP_S = 0.4  # silence between concatenated utterances


def load_script(path: Path) -> ModuleType:
    """A script under scripts/ or loadtest/ as a module (registered, so its dataclasses can find it)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def load_reference(directory: Path) -> dict:
    return json.loads((directory / "reference.json").read_text())


@pytest.fixture(scope="session")
def parity_dir() -> Path:
    if not (PARITY_DIR / "reference.json").exists():
        if os.environ.get("CI"):  # CI always has the shared fixtures: their absence is a failure there
            pytest.fail(f"NeMo parity fixtures missing from {PARITY_DIR}")
        pytest.skip(f"NeMo parity fixtures not found (set BATCHASR_PARITY_DIR); looked in {PARITY_DIR}")
    return PARITY_DIR


@pytest.fixture(scope="session")
def parity_reference(parity_dir: Path) -> dict:
    return load_reference(parity_dir)


@pytest.fixture(scope="session")
def parity_audio(parity_dir: Path, parity_reference: dict) -> list[str]:
    return [str(parity_dir / "audio" / name) for name in parity_reference["audio"]]


@pytest.fixture(scope="module")
def model(parity_dir: Path):
    """The fastest parity fixture (one encoder layer) in float32: the model of the tests about serving and jobs,
    where the model is not what is tested. A file testing another model has a ``model`` fixture of its own."""
    from models import load_model

    return load_model(parity_dir / "tdt.nemo", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def expected(model, parity_audio: list[str]) -> dict[str, str]:
    """Each parity clip's text by ``model`` alone, by file name: what a job's or a request's result must say."""
    return {Path(p).name: t.text for p, t in zip(parity_audio, model.transcribe(parity_audio), strict=True)}


@pytest.fixture
def redis_server(tmp_path):
    """A private redis-server on a free port, for one test."""
    from tests.redis_server import RedisServer  # here: the GPU tests run where the redis client is not installed

    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


def long_recording(paths: list[str] | list[Path], seconds: float, gap_s: float = GAP_S
                   ) -> tuple[np.ndarray, list[np.ndarray]]:
    """16 kHz utterances, each followed by ``gap_s`` of silence, repeated to ``seconds``; also the pieces in order."""
    import soundfile as sf  # here: the GPU tests run where soundfile may not be installed

    clips = [sf.read(p, dtype="float32")[0] for p in paths]
    gap = np.zeros(int(gap_s * 16000), dtype=np.float32)
    pieces, total = [], 0
    while total < seconds * 16000:
        clip = clips[len(pieces) % len(clips)]
        pieces.append(clip)
        total += len(clip) + len(gap)
    joined = np.concatenate([x for clip in pieces for x in (clip, gap)])
    return joined, pieces


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    """A 1.5 MiB filesystem of its own (tmpfs) as the temporary files' folder; skipped where mounting is not
    allowed."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    monkeypatch.setattr(tempfile, "tempdir", str(disk))
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)
