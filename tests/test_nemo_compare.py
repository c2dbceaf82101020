"""The parts of scripts/nemo_compare.py that need no NeMo: token agreement, FLOP counting, the table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from models import load_model
from service.bench import synthetic_audio
from tests.conftest import load_script

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
