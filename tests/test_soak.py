"""loadtest/soak.py: a few seconds of its mixed load against a real server and Redis, and its leak judgement."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, load_script


@pytest.fixture(scope="module")
def soak():
    yield load_script(REPO / "loadtest" / "soak.py")
    del sys.modules["soak"]


def test_a_short_soak_gets_the_answers_it_expects_and_finds_no_leak(soak, tmp_path):
    out = tmp_path / "soak.json"
    command = [sys.executable, "loadtest/soak.py", "--duration-s", "3", "--sample-s", "1", "--warmup-s", "1",
               "--result-ttl-s", "1", "--concurrency", "2", "--out", str(out)]
    run = subprocess.run(command, cwd=REPO, timeout=120, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    report = json.loads(out.read_text())
    assert report["unexpected"] == [] and report["leaks"] == []
    answers = report["answers"]
    assert answers and all(set(outcomes) <= soak.EXPECTED[kind] for kind, outcomes in answers.items())
    assert {"200", "202"} <= set(report["server_answers"])  # transcriptions and jobs were answered
    assert not [code for code in report["server_answers"] if code.startswith("5")]
    assert report["requests"] > 0 and len(report["samples"]) >= 3
    for field in ("rss_mib", "fds", "threads", "spool_fds", "spool_files", "redis_keys", "redis_used_mib",
                  "queue_depth", "requests"):
        assert all(field in s for s in report["samples"])
    assert report["samples"][-1]["queue_depth"] == 0
    assert set(report["redis_keys_left_after_ttl"].values()) == {0}
    assert {"start", "middle", "end"} <= set(report["rss_mib"]) and "rss_slope_mib_per_1000_requests" in report


def _samples(rss: list[float]) -> list[dict]:
    return [{"requests": 100 * i, "rss_mib": value} for i, value in enumerate(rss)]


def test_a_steady_climb_is_a_leak_and_one_step_is_not(soak):
    climb = _samples([500 + 2 * i for i in range(12)])  # 20 MiB per 1000 requests
    assert soak.rss_slope(climb) == pytest.approx(20.0)
    assert soak.rss_grows(climb, soak.rss_slope(climb), max_slope=5.0)
    step = _samples([500.0] * 10 + [560.0] * 2)  # one batch's peak kept by the allocator, late in the run
    assert soak.rss_slope(step) > 5.0 and not soak.rss_grows(step, soak.rss_slope(step), max_slope=5.0)
    assert not soak.rss_grows(climb[:7], soak.rss_slope(climb[:7]), max_slope=5.0)  # too few samples to tell


def test_the_judgement_names_each_leak(soak):
    idle = {"fds": 20, "threads": 12, "spool_fds": 0, "spool_files": 0}
    assert soak.judge(idle, idle, {"batchasr:job:*": 0}, False, 0.0) == []
    leaked = {"fds": 60, "threads": 30, "spool_fds": 1, "spool_files": 2}
    leaks = soak.judge(idle, leaked, {"batchasr:job:*": 3}, True, 12.5)
    assert leaks == ["fds: 20 at idle before the load, 60 after", "threads: 12 at idle before the load, 30 after",
                     "temporary files left at idle: 1 open, 2 in the directory",
                     "redis: 3 keys batchasr:job:* left after the results' TTL",
                     "rss grows 12.5 MiB per 1000 requests over the second half"]
