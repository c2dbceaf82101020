"""The parts of scripts/nemo_compare.py that need no NeMo: token agreement, FLOP counting, the table, and what it
keeps when its time runs out (batchasr standing in for NeMo)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from models import load_model
from service.bench import synthetic_audio
from tests.conftest import REPO, load_script

SCRIPT = Path(__file__).parents[1] / "scripts" / "nemo_compare.py"


@pytest.fixture(scope="module")
def nemo_compare():
    yield load_script(SCRIPT)  # NeMo is imported only when a model is compared
    del sys.modules["nemo_compare"]


def test_agreement_counts_identical_utterances_and_token_edits(nemo_compare):
    same = nemo_compare.agreement([[1, 2], [3]], [[1, 2], [4, 5]])
    assert (same["utterances"], same["identical"]) == (2, 1)
    assert same["token_edit_rate"] == 0.5  # [3] -> [4, 5]: 2 edits over NeMo's 4 tokens
    assert same["sha1_batchasr"] != same["sha1_nemo"]
    assert nemo_compare.agreement([[7]], [[7]])["sha1_batchasr"] == nemo_compare.agreement([[7]], [[7]])["sha1_nemo"]


def test_encoder_flops_grow_with_the_audio(nemo_compare, parity_dir):
    model = load_model(parity_dir / "tdt.nemo", device="cpu", dtype="float32")
    waves = [w[:32000] for w in synthetic_audio(4, seed=0)]
    one, both = (nemo_compare.encoder_flops(model, waves[:n], 2) for n in (2, 4))
    assert 0 < one < both
    assert nemo_compare.matmul_peak_flops(model.device, model.dtype) > 0


def test_a_record_becomes_one_table_row_per_attention_kernel(nemo_compare):
    side = {"rtfx": 3000.0, "usd_per_million_audio_hours": 833.3}
    run = {"batchasr": side, "rtfx_ratio": 1.5, "agreement": {"identical": 510, "utterances": 512,
                                                               "token_edit_rate": 0.0004},
           "stages": {"stage_s": {"features": 0.1, "encoder": 1.0, "decoder": 0.05}, "mode": "conditional"},
           "encoder": {"share_of_speed_of_light": 0.3, "achieved_tflops": 240.0, "peak_tflops": 800.0}}
    record = {"model": "parakeet-tdt-0.6b-v2", "batch_size": 128, "dtype": "bfloat16",
              "nemo": {"rtfx": 2000.0, "usd_per_million_audio_hours": 1250.0}, "nemo_graph_mode": "full_graph",
              "nemo_stage_s": {"features": 0.1, "encoder": 1.4, "decoder": 0.1},
              "float32_agreement": {"identical": 128, "utterances": 128},
              "runs": [dict(run, attention_kernel="reference"), dict(run, attention_kernel="sdpa")]}
    rows = nemo_compare.table_rows(record)
    assert len(rows) == 2 and "| reference |" in rows[0] and "| sdpa |" in rows[1]
    assert rows[0].count("|") == nemo_compare.HEADER.splitlines()[0].count("|")
    assert "| 1.50x |" in rows[0] and "510/512 (0.04% token edits)" in rows[0] and "833 / 1,250" in rows[0]
    assert "| 3000 (conditional) | 2000 (full_graph) |" in rows[0]


class HalfSecondLeft:
    """A budget with half a second left, always: what it says, without the test's own timing in it."""

    def __init__(self, seconds: float | None = None):
        pass

    @classmethod
    def from_launch(cls, seconds: float | None) -> HalfSecondLeft:
        return cls(seconds)

    def left(self) -> float:
        return 0.5

    @property
    def spent(self) -> bool:
        return False

    def allows(self, seconds: float) -> bool:
        return self.left() >= seconds


@pytest.fixture()
def without_nemo(nemo_compare, parity_dir, monkeypatch):
    """main() on CPU with a fixture for the random checkpoint and batchasr standing in for NeMo."""
    import shutil

    def checkpoint(name, path, device, waves, seed):
        shutil.copy(parity_dir / "tdt.nemo", path)
        return 0.0

    class NeMo:
        def __init__(self, path, device, dtype):
            self.model = load_model(path, device=device, dtype="float32")

        def to(self, dtype):
            return self

    monkeypatch.setattr(nemo_compare, "save_random_checkpoint", checkpoint)
    monkeypatch.setattr(nemo_compare, "load_nemo", NeMo)
    monkeypatch.setattr(nemo_compare, "nemo_transcriber", lambda nemo, batch: nemo_compare.batchasr_transcriber(
        nemo.model, batch))
    monkeypatch.setattr(nemo_compare, "rebuild_nemo_decoding", lambda nemo: nemo)
    monkeypatch.setattr(nemo_compare, "nemo_stage_seconds", lambda *_: {"features": 0.1, "encoder": 1, "decoder": 1})
    monkeypatch.setattr(nemo_compare, "nemo_graph_mode", lambda nemo: None)
    monkeypatch.setattr(nemo_compare, "nemo_conditional_nodes", lambda: "supported")
    monkeypatch.setattr(nemo_compare, "matmul_peak_flops", lambda *_: 1e12)


def run_main(nemo_compare, out: Path, models: tuple[str, ...] = ("parakeet-tdt-0.6b-v2",)) -> int:
    return nemo_compare.main(["--out", str(out), "--models", *models, "--device", "cpu",
                              "--dtype", "float32", "--n-utterances", "2", "--check-utterances", "2",
                              "--batch-size", "2", "--repeat", "1"])


@pytest.mark.parametrize("error", [ModuleNotFoundError("No module named 'nemo'"),
                                   RuntimeError("lightning and torch disagree")])  # a broken install, too
def test_a_missing_nemo_fails_every_model_before_any_checkpoint(nemo_compare, without_nemo, tmp_path, monkeypatch,
                                                                 error):
    """Found once, up front: each model used to write its checkpoint (4.4 GB for the 1.1B) and time batchasr in
    float32 before NeMo's import failed."""
    def no_nemo():
        raise error

    def checkpoint(*_):
        raise AssertionError("no checkpoint should be written")

    monkeypatch.setattr(nemo_compare, "nemo_conditional_nodes", no_nemo)
    monkeypatch.setattr(nemo_compare, "save_random_checkpoint", checkpoint)
    assert run_main(nemo_compare, tmp_path, ("parakeet-tdt-0.6b-v2", "parakeet-rnnt-1.1b")) == 1
    records = [json.loads(line) for line in (tmp_path / "nemo_compare.jsonl").read_text().splitlines()]
    assert [r["error"] for r in records] == [f"NeMo does not import: {type(error).__name__}: {error}"] * 2


def test_every_model_is_timed_with_the_first_kernel_before_any_with_the_second(nemo_compare, without_nemo,
                                                                              tmp_path, monkeypatch):
    """A budget that runs short leaves the second kernel out, not the second model (issue 7 wants both)."""
    order = []

    def batchasr_run(ours, name, *_):
        order.append((name, ours.encoder.attention_kernel))
        return {"attention_kernel": ours.encoder.attention_kernel}

    monkeypatch.setattr(nemo_compare, "batchasr_run", batchasr_run)
    monkeypatch.setattr(nemo_compare, "table_rows", lambda r: [])
    assert run_main(nemo_compare, tmp_path, ("parakeet-tdt-0.6b-v2", "parakeet-rnnt-1.1b")) == 0
    assert order == [("parakeet-tdt-0.6b-v2", "reference"), ("parakeet-rnnt-1.1b", "reference"),
                     ("parakeet-tdt-0.6b-v2", "sdpa"), ("parakeet-rnnt-1.1b", "sdpa")]
    records = [json.loads(line) for line in (tmp_path / "nemo_compare.jsonl").read_text().splitlines()]
    assert [r["nemo_conditional_nodes"] for r in records] == ["supported"] * 2
    assert not any("running" in r for r in records)


def test_an_interrupt_keeps_every_phase_measured_and_says_where_it_stopped(nemo_compare, without_nemo, tmp_path,
                                                                           monkeypatch):
    """The stage's time limit sends SIGINT: KeyboardInterrupt is no Exception, and the record used to be written
    only once the whole model was compared."""
    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(nemo_compare, "timed_passes", interrupted)  # NeMo's timing, the phase after float32's
    assert run_main(nemo_compare, tmp_path) == 130
    [record] = [json.loads(line) for line in (tmp_path / "nemo_compare.jsonl").read_text().splitlines()]
    assert record["float32_agreement"]["identical"] == 2
    assert record["stopped"] == "interrupted while timing NeMo (the stage's time ran out)"
    assert "| not measured: interrupted while timing NeMo" in (tmp_path / "nemo_compare.md").read_text()
    rows = load_script(REPO / "scripts" / "gpu_goals.py").nemo_goals([record])
    assert [(measured.split(" (")[0], met) for _, measured, met in rows] == [
        ("2 of 2", True), ("not measured: interrupted while timing NeMo", False),
        ("not measured: interrupted while timing NeMo", False)]  # reference and sdpa attention


def test_a_second_attention_kernel_begins_only_if_the_first_ones_time_is_left(nemo_compare, without_nemo, tmp_path,
                                                                              monkeypatch):
    def batchasr_run(ours, *_):
        time.sleep(0.6)
        return {"attention_kernel": ours.encoder.attention_kernel}

    monkeypatch.setattr(nemo_compare, "batchasr_run", batchasr_run)
    monkeypatch.setattr(nemo_compare, "table_rows", lambda r: [])
    monkeypatch.setattr(nemo_compare, "Budget", HalfSecondLeft)
    assert run_main(nemo_compare, tmp_path) == 0
    [record] = [json.loads(line) for line in (tmp_path / "nemo_compare.jsonl").read_text().splitlines()]
    assert [run["attention_kernel"] for run in record["runs"]] == ["reference"]
    assert record["not_measured"].startswith("attention kernel sdpa: 0 s of the budget left, a kernel's run takes")
