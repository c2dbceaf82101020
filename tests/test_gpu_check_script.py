"""scripts/gpu_check.sh's plumbing, on a CPU: the device tool brings back at most eight files and lends 15 minutes,
so whatever runs, three files come back, and a stage the budget cannot fit is skipped and said to be."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def gpu_check(out: Path, budget_s: int, *args: str) -> subprocess.CompletedProcess:
    # no wheels: those a checkout carries for the GPU image (scripts/prepare_gpu_carry.sh) need its Python
    env = {**os.environ, "OUT": str(out), "GPU_CHECK_BUDGET_S": str(budget_s), "GPU_CHECK_WHEELS": str(out / "none")}
    return subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def test_a_stage_that_ran_comes_back_in_three_files(tmp_path):
    done = gpu_check(tmp_path, 300, "tests")
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["env.txt", "results.tar.gz", "summary.md"]
    summary = (tmp_path / "summary.md").read_text()
    assert "## tests: exit status 0" in summary and "skipped" in summary  # pytest's line: tests/gpu needs CUDA
    with tarfile.open(tmp_path / "results.tar.gz") as tar:
        assert {"./gpu_tests.log", "./summary.md"} <= set(tar.getnames())
    env = (tmp_path / "env.txt").read_text()
    assert "torch" in env
    # no CUDA here, so the conditional-node smoke decode fails, and must be noticed (its exit status once was not)
    assert "conditional smoke failed: the stages after tests run with BATCHASR_CONDITIONAL_NODES=0" in env


def test_stages_the_budget_cannot_fit_are_skipped_and_said_to_be(tmp_path):
    done = gpu_check(tmp_path, 30, "tests", "bench")
    assert done.returncode == 1
    summary = (tmp_path / "summary.md").read_text()
    assert "## tests: skipped" in summary and "## bench: skipped" in summary


def test_a_stage_is_skipped_when_its_share_leaves_no_minute_past_its_tail(tmp_path):
    """http_bench may run 70 s past its budget (its server's start and stop): a share of 60-129 s would have given
    it a budget of nothing, or less."""
    done = gpu_check(tmp_path, 125, "http")
    assert done.returncode == 1
    assert "## http: skipped" in (tmp_path / "summary.md").read_text()


def test_extra_options_go_to_a_single_stage(tmp_path):
    done = gpu_check(tmp_path, 300, "tests", "bench", "--models", "parakeet-ctc-1.1b")
    assert done.returncode == 2 and "name a single stage" in done.stderr
