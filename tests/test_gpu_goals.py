"""scripts/gpu_goals.py: the issues' GPU goals read off the stages' files, judged right either way."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import REPO, load_script


@pytest.fixture(scope="module")
def goals():
    yield load_script(REPO / "scripts" / "gpu_goals.py")
    del sys.modules["gpu_goals"]


def bench_record(algorithm: str, mode: str, batch: int = 128, decoder_s: float = 1.0, share: float = 0.5,
                 sha1: str = "aaaa", scores: bool = False, hotwords: int = 0, kernel: str = "reference") -> dict:
    return {"model": "parakeet-tdt-0.6b-v2", "batch_size": batch, "decoder": "tdt", "decoder_algorithm": algorithm,
            "mode": mode, "attention_kernel": kernel, "scores": scores, "hotwords": hotwords,
            "decoder_share": share, "stage_s": {"features": 0.1, "encoder": 1.0, "decoder": decoder_s},
            "tokens_sha1": sha1}


def test_issue_3_goals_are_judged_at_batch_128_on_the_search_alone(goals):
    records = [bench_record("frame_looping", "eager", decoder_s=0.6),
               bench_record("label_looping", "conditional", decoder_s=0.1, share=0.04),
               bench_record("label_looping", "conditional", decoder_s=0.5, share=0.30, scores=True),  # not the goal's
               bench_record("label_looping", "conditional", sha1="bbbb", hotwords=20),  # boosted: other tokens
               bench_record("frame_looping", "eager", batch=16, sha1="cccc"),
               bench_record("label_looping", "no_while", batch=16, sha1="dddd"),
               {"model": "parakeet-tdt-0.6b-v2", "batch_size": 1, "error": "RuntimeError()"}]
    rows = goals.bench_goals(records)
    assert [(measured, met) for _, measured, met in rows] == [("4.0%", True), ("6.0x", True),
                                                              ("at batch 128 of 16, 128", False)]
    records[1] = bench_record("label_looping", "conditional", decoder_s=0.2, share=0.06)
    assert [met for _, _, met in goals.bench_goals(records)[:2]] == [False, False]  # 6.0%, 3.0x


def test_issue_4_goal_per_server_layout(goals):
    report = {"offline": {"bench": {"rtfx": 1000.0}},
              "servers": [{"frontends": 4, "http_vs_bench": 0.93, "http_saturation": {"rtfx": 930.0}},
                          {"frontends": 0, "http_vs_bench": 0.85, "http_saturation": {"rtfx": 850.0}},
                          {"frontends": 2, "not_measured": "budget spent"}]}
    rows = goals.http_goals(report)
    assert [(measured, met) for _, measured, met in rows] == [("93% (930 against 1000)", True),
                                                              ("85% (850 against 1000)", False),
                                                              ("budget spent", None)]
    assert "4 front-end processes" in rows[0][0] and "the engine's process" in rows[1][0]


def test_issue_7_goals_per_model_and_attention_kernel(goals):
    run = {"attention_kernel": "reference", "rtfx_ratio": 1.42, "batchasr": {"rtfx": 4260.0},
           "agreement": {"identical": 250, "utterances": 256}}
    record = {"model": "parakeet-rnnt-1.1b", "dtype": "bfloat16", "batch_size": 128, "nemo": {"rtfx": 3000.0},
              "nemo_graph_mode": "full_graph",
              "float32_agreement": {"identical": 64, "utterances": 64},
              "runs": [run, dict(run, attention_kernel="sdpa", rtfx_ratio=1.2)]}
    rows = goals.nemo_goals([record, {"model": "parakeet-tdt-0.6b-v2", "error": "ImportError: nemo"}])
    assert [met for _, _, met in rows] == [True, True, False, False]
    assert rows[1][1] == ("1.42x (4260 against 3000, NeMo's graph mode full_graph); "
                          "the same tokens in 250 of 256 utterances")
    assert rows[3][1] == "failed: ImportError: nemo"


def test_the_table_holds_what_the_stages_wrote_and_says_when_nothing(goals, tmp_path, capsys):
    assert goals.goals_table(tmp_path) == "## Goals\n\nNothing measured yet.\n"
    (tmp_path / "bench.jsonl").write_text("\n".join(json.dumps(r) for r in [
        bench_record("frame_looping", "eager"), bench_record("label_looping", "conditional", share=0.2)])
        + '\n{"model": "cut sh')  # a stage stopped while writing
    assert goals.main([str(tmp_path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[2] == "| goal | measured | met |" and len(table) == 4 + 3
    assert table[4].endswith("| 20.0% | **no** |") and table[6].endswith("| at batch 128 of 128 | yes |")
    assert goals.main([]) == 2
