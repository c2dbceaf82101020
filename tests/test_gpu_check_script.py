"""scripts/gpu_check.sh's plumbing, on a CPU: the device tool brings back at most eight files and lends 15 minutes,
so whatever runs, three files come back, a stage the budget cannot fit is skipped and said to be, what a stage
wrote reaches them while it runs, and a second call on the warm machine skips the setup."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from tests.conftest import REPO


@pytest.fixture(scope="module")
def state(tmp_path_factory) -> Path:
    """The machine's /tmp between calls: one set-up for the module's runs, as on a warm machine."""
    return tmp_path_factory.mktemp("state")


def environment(out: Path, state: Path, budget_s: int, **more: str) -> dict[str, str]:
    # no wheels: those a checkout carries for the GPU image (scripts/prepare_gpu_carry.sh) need its Python
    return {**os.environ, "OUT": str(out), "GPU_CHECK_BUDGET_S": str(budget_s), "GPU_CHECK_WHEELS": str(out / "none"),
            "GPU_CHECK_STATE": str(state), **more}


def gpu_check(out: Path, state: Path, budget_s: int, *args: str, **more: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=REPO,
                          env=environment(out, state, budget_s, **more), capture_output=True, text=True, timeout=300)


def test_a_stage_that_ran_comes_back_in_three_files(tmp_path, state):
    done = gpu_check(tmp_path, state, 300, "tests", GPU_CHECK_FRESH="1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["env.txt", "results.tar.gz", "summary.md"]
    summary = (tmp_path / "summary.md").read_text()
    assert "## tests: exit status 0" in summary and "skipped" in summary  # pytest's line: tests/gpu needs CUDA
    with tarfile.open(tmp_path / "results.tar.gz") as tar:
        assert {"./gpu_tests.log", "./summary.md"} <= set(tar.getnames())
    env = (tmp_path / "env.txt").read_text()
    assert "torch" in env
    # no CUDA here, so the conditional-node smoke decode fails, and must be noticed (its exit status once was not)
    assert "the stages after tests run with BATCHASR_CONDITIONAL_NODES=0" in env
    assert re.search(r"conditional smoke failed \(exit status [1-9]\d*\)", env)
    # and what a conditional body cannot hold is looked into (scripts/diag_conditional.py; on a GPU, variant by variant)
    assert "conditional diag: no CUDA here: nothing to find out" in env


def test_a_second_call_on_the_warm_machine_skips_the_setup(tmp_path, state):
    """Call 2 has a few minutes: the wheels' install, the env probe and the smoke decode (up to 100 s) are
    what call 1 on the same machine found. A fresh machine (no marker) does them: the test above."""
    first = gpu_check(tmp_path / "first", state, 30, "tests", GPU_CHECK_FRESH="1")
    second = gpu_check(tmp_path / "second", state, 30, "tests")
    assert "== setup: the carried wheels, the env probe, the smoke decode" in first.stdout
    assert "== setup: as an earlier call on this machine left it" in second.stdout and "torch" not in second.stdout
    env = (tmp_path / "second" / "env.txt").read_text()
    assert env.startswith("(env probe and smoke decode as an earlier call on this machine found them")
    assert "conditional smoke failed" in env  # and its stages run with conditional nodes off, as the first's
    assert "    (env probe and smoke decode as an earlier call" in (tmp_path / "second" / "summary.md").read_text()


def test_stages_the_budget_cannot_fit_are_skipped_and_said_to_be(tmp_path, state):
    done = gpu_check(tmp_path, state, 30, "tests", "bench")
    assert done.returncode == 1
    summary = (tmp_path / "summary.md").read_text()
    assert "## tests: skipped" in summary and "## bench: skipped" in summary


def test_a_stage_is_skipped_when_its_share_leaves_no_minute_past_its_tail(tmp_path, state):
    """http_bench may run 70 s past its budget (its server's start and stop): a share of 60-129 s would have given
    it a budget of nothing, or less. The share also leaves the stage's kill and the last save inside the budget:
    145 s left 144 for http once, which then ran past the command's limit."""
    done = gpu_check(tmp_path, state, 145, "http")
    assert done.returncode == 1
    assert "## http: skipped, a share of 1" in (tmp_path / "summary.md").read_text()


def test_extra_options_go_to_a_single_stage(tmp_path, state):
    done = gpu_check(tmp_path, state, 300, "tests", "bench", "--models", "parakeet-ctc-1.1b")
    assert done.returncode == 2 and "name a single stage" in done.stderr


def test_a_command_stopped_mid_stage_keeps_its_rows_and_names_the_stage(tmp_path, state, parity_dir):
    """The device tool stops a command at its timeout: the running stage's rows used to stay in a temporary
    folder, and in the first stage even summary.md was not written yet."""
    bench = ["--device", "cpu", "--dtype", "float32", "--models", str(parity_dir / "tdt.nemo"), "--batch-sizes",
             "8", "4", "2", "1", "--n-utterances", "256"]  # half a minute or more on a CPU, a row every few seconds
    process = subprocess.Popen(["bash", "scripts/gpu_check.sh", "bench", *bench], cwd=REPO, start_new_session=True,
                               env=environment(tmp_path, state, 300, GPU_CHECK_SAVE_EVERY_S="1"),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not rows_in_results(tmp_path):
            time.sleep(0.5)
        assert rows_in_results(tmp_path), "no bench rows reached the results while the stage ran"
        summary = (tmp_path / "summary.md").read_text()
        assert "## bench: running, " in summary and "| tdt.nemo |" in summary.replace(str(parity_dir) + "/", "")
        stage = descendants(process.pid)
        assert any(b"bench_table.py" in cmdline(pid) for pid in stage)
        os.killpg(process.pid, signal.SIGTERM)  # the tool's stop: the whole command at once
        process.wait(30)
        # the stage's timeout leads a process group of its own, which that signal missed: the script passes it on,
        # so the stage writes down what it has and ends rather than run on unseen
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in stage):
            time.sleep(0.2)
        assert not [pid for pid in stage if Path(f"/proc/{pid}").exists()]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    summary = (tmp_path / "summary.md").read_text()
    assert "**Cut while bench was running:** the command was stopped (SIGTERM)" in summary
    assert sorted(p.name for p in tmp_path.iterdir()) == ["env.txt", "results.tar.gz", "summary.md"]


def rows_in_results(out: Path) -> int:
    """bench.jsonl's lines in the results.tar.gz under ``out`` (0 before there is one)."""
    try:
        with tarfile.open(out / "results.tar.gz") as tar:
            return len(tar.extractfile("./bench.jsonl").read().splitlines())
    except (FileNotFoundError, KeyError, tarfile.TarError, EOFError):
        return 0


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, whatever its process group."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_fetching_the_wheels_goes_on_without_redis_packages(tmp_path):
    """apt-get download failing left the glob of .deb files as written, `mv` failed on it under `set -e`, and the
    carry was not prepared at all, where the warning said only the bulk-job stage would skip."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "fetch_gpu_wheels.sh").write_text((REPO / "scripts" / "fetch_gpu_wheels.sh").read_text())
    (tmp_path / "scripts" / "gpu_wheels_service.txt").write_text("# none\n")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "apt-get").write_text("#!/bin/sh\nexit 100\n")
    (fake / "apt-get").chmod(0o755)
    subprocess.run(["git", "init", "-q", "."], cwd=tmp_path, check=True)
    run = subprocess.run(["bash", "scripts/fetch_gpu_wheels.sh", "service"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"})
    assert run.returncode == 0 and "no Redis packages" in run.stderr, run.stderr
