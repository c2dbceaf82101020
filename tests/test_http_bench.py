"""loadtest/http_bench.py end to end on the embedded model: it is what the GPU run records issue 4's ratio with,
so it must work before a GPU is lent; and the interpreter-lock probe beside it."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

from tests.conftest import REPO, load_script


@pytest.fixture(scope="module")
def http_bench():
    yield load_script(REPO / "loadtest" / "http_bench.py")
    del sys.modules["http_bench"]


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_server_cpu_tells_the_main_thread_from_the_rest(http_bench):
    before = http_bench.ServerCpu.read(os.getpid())
    worker = threading.Thread(target=_spin, args=(0.3,))
    worker.start()
    worker.join()
    middle = http_bench.ServerCpu.read(os.getpid())
    _spin(0.3)
    after = http_bench.ServerCpu.read(os.getpid())
    assert middle.event_loop_s - before.event_loop_s < 0.1 <= middle.process_s - before.process_s
    assert after.event_loop_s - middle.event_loop_s >= 0.2
    view = http_bench.front_end_view(middle, after, requests=100, audio_s=50.0, wall_s=0.3)
    assert 2.0 <= view["event_loop_cpu_ms_per_request"] <= 5.0
    assert view["event_loop_ceiling_rtfx"] == round(50.0 / (after.event_loop_s - middle.event_loop_s), 1)


def test_a_small_run_reports_a_bulk_job_after_saturation_then_half_load_on_the_kept_baseline(parity_dir, tmp_path):
    """Both server layouts on the same audio: HTTP in the engine's process, and in two front ends. With --jobs
    the bulk job comes right after saturation (the half-load run came first, and a spent budget skipped both);
    a second run on the same clips reuses the kept offline baseline and measures half load."""
    out, cache = tmp_path / "out" / "bulk_bench.json", tmp_path / "cache"
    out.parent.mkdir()
    common = [sys.executable, "loadtest/http_bench.py", "--model", "models/assets/default.nemo",
              "--audio-dir", str(parity_dir / "audio"), "--batch-size", "4", "--cache-dir", str(cache)]
    subprocess.run([*common, "--requests", "24", "--concurrency", "8", "--jobs", "--frontends", "0,2",
                    "--out", str(out)], cwd=REPO, check=True, timeout=300, capture_output=True)
    report = json.loads(out.read_text())
    assert report["offline"]["transcribe"]["rtfx"] > 0 and report["offline"]["bench"]["rtfx"] > 0
    assert [run["frontends"] for run in report["servers"]] == [0, 2]
    for run in report["servers"]:
        saturation = run["http_saturation"]
        assert saturation["requests"] == 24 and saturation["rtfx"] > 0
        assert saturation["front_end"]["event_loop_cpu_ms_per_request"] >= 0  # /proc counts 10 ms ticks
        assert saturation["server"]["mean_batch_size"] > 1  # 8 in flight were batched
        stages = saturation["server"]["stage_s"]
        assert set(stages) == {"features", "encoder", "decoder"} and all(s > 0 for s in stages.values())
        assert stages["encoder"] > stages["features"]
        assert run["bulk_job"]["status"] == "completed" and run["bulk_job"]["items"] == 24
        assert run["bulk_vs_bench"] == round(run["bulk_job"]["rtfx_wall"] / report["offline"]["bench"]["rtfx"], 3)
        assert run["http_half_load"] == "not measured: --jobs times the bulk job instead"
    in_process, split = report["servers"]
    assert in_process["http_saturation"]["front_end"]["event_loop_cpu_ms_per_request"] > 0
    assert "front_end_processes" not in in_process["http_saturation"]["front_end"]
    front_ends = split["http_saturation"]["front_end"]["front_end_processes"]
    assert front_ends["count"] == 2 and front_ends["cpu_ms_per_request"] > 0
    # the servers' logs beside the report, to come back with the results
    assert sorted(p.name for p in out.parent.iterdir()) == ["bulk_bench.json", "bulk_bench_serve_0.log",
                                                           "bulk_bench_serve_2.log"]
    assert all((out.parent / f"bulk_bench_serve_{n}.log").stat().st_size > 0 for n in (0, 2))
    goals = load_script(REPO / "scripts" / "gpu_goals.py").http_goals(report, "bulk")  # reads what the bench wrote
    assert len(goals) == 4 and all("not measured" not in measured for _, measured, _ in goals)

    again = tmp_path / "http_bench.json"
    subprocess.run([*common, "--requests", "12", "--concurrency", "4", "--frontends", "0", "--out", str(again)],
                   cwd=REPO, check=True, timeout=300, capture_output=True)
    report = json.loads(again.read_text())
    assert report["offline"]["reused"] == "measured by an earlier run on the same clips (24 requests)"
    [run] = report["servers"]
    assert 0 < run["http_half_load"]["p50_s"] <= run["http_half_load"]["p99_s"] and "bulk_job" not in run


def test_with_jobs_the_bulk_job_is_timed_even_once_the_budget_is_spent(http_bench, tmp_path, monkeypatch):
    """The stage's budget is spent by the time saturation ends: the bulk job, which the stage is for, still runs."""
    class Server:
        pid = os.getpid()

        def terminate(self):
            pass

        def wait(self, timeout):
            pass

    async def saturate(url, bodies, durations, concurrency):
        return {"rtfx": 100.0, "wall_s": 1.0, "requests_per_s": 10.0}

    async def bulk_job(url, clips):
        return {"status": "completed", "rtfx_wall": 90.0, "wall_s": 1.0}

    async def open_loop(*_):
        raise AssertionError("no half-load run with --jobs")

    for name, stand_in in (("start_server", lambda *_: Server()), ("saturate", saturate), ("bulk_job", bulk_job),
                           ("open_loop", open_loop), ("server_counters", lambda url: {})):
        monkeypatch.setattr(http_bench, name, stand_in)
    run = {"frontends": 4}
    args = argparse.Namespace(concurrency=2, out=tmp_path / "bulk_bench.json")
    clip = http_bench.Clip("a.wav", b"RIFF", None, 2.0)
    http_bench.server_run(run, "model.nemo", [clip, clip], {"bench": {"rtfx": 100.0}}, "redis://x", args,
                          http_bench.Budget(0), lambda: None)
    assert run["bulk_job"]["rtfx_wall"] == 90.0 and run["bulk_vs_bench"] == 0.9 and run["http_vs_bench"] == 1.0


def test_the_checkpoint_is_kept_for_the_same_calibration_clips(http_bench, tmp_path, monkeypatch):
    """The http and bulk stages of one call build one 2.4 GB checkpoint, not two."""
    made = []

    def save(name, path, device, waves, seed):
        made.append(path)
        path.write_bytes(b"nemo")
        return 1.5

    monkeypatch.setattr(http_bench, "save_random_checkpoint", save)
    clips = [http_bench.Clip(f"{i}.wav", bytes([i]), None, 1.0) for i in range(6)]
    first = http_bench.random_checkpoint("parakeet-tdt-0.6b-v2", clips, "cpu", tmp_path, tmp_path / "work")
    assert http_bench.random_checkpoint("parakeet-tdt-0.6b-v2", clips[:4], "cpu", tmp_path, tmp_path) == first
    assert first[1] == 1.5 and len(made) == 1
    http_bench.random_checkpoint("parakeet-tdt-0.6b-v2", clips[2:], "cpu", tmp_path, tmp_path)  # other audio
    assert len(made) == 2


def test_a_large_server_log_keeps_its_start_and_end(http_bench, tmp_path):
    log = tmp_path / "serve.log"
    log.write_bytes(b"start\n" + b"x" * 3_000_000 + b"\nend\n")
    http_bench.trim_log(log, max_bytes=1_000_000)
    text = log.read_bytes()
    assert text.startswith(b"start\n") and text.endswith(b"\nend\n") and b"bytes cut ...]" in text
    assert 1_000_000 <= len(text) < 1_000_100


def test_a_spent_budget_keeps_the_offline_baseline_and_begins_no_server(parity_dir, tmp_path):
    out = tmp_path / "report.json"
    command = [sys.executable, "loadtest/http_bench.py", "--model", "models/assets/default.nemo",
               "--audio-dir", str(parity_dir / "audio"), "--requests", "4", "--batch-size", "4", "--frontends", "0,2",
               "--budget-s", "0", "--out", str(out)]
    subprocess.run(command, cwd=REPO, check=True, timeout=300, capture_output=True)
    report = json.loads(out.read_text())
    assert report["offline"]["bench"]["rtfx"] > 0
    assert report["servers"] == [{"frontends": 0, "not_measured": "budget spent"},
                                 {"frontends": 2, "not_measured": "budget spent"}]


def test_a_failure_before_any_server_is_in_the_report(tmp_path):
    """The GPU run's summary reads the report: a bench that failed before its first server used to leave none, and
    the HTTP goal's row with it."""
    out = tmp_path / "http_bench.json"
    command = [sys.executable, "loadtest/http_bench.py", "--model", str(tmp_path / "missing.nemo"), "--requests", "2",
               "--device", "cpu", "--out", str(out)]
    assert subprocess.run(command, cwd=REPO, timeout=300, capture_output=True).returncode == 1
    report = json.loads(out.read_text())
    assert report["servers"] == [] and "missing.nemo" in report["error"]


def test_a_server_that_cannot_start_is_reported_at_once_with_its_output(http_bench, tmp_path):
    """Not after the ten minutes a large model on a GPU is given to get ready: device time is short."""
    args = argparse.Namespace(batch_size=4, device="cpu", dtype="float32", attention_kernel="auto")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with status") as raised:
        http_bench.start_server(str(tmp_path / "missing.nemo"), http_bench.free_port(), None, 0, 1 << 20, args,
                                tmp_path / "serve.log")
    assert time.monotonic() - started < 120 and "missing.nemo" in str(raised.value)


def test_synthetic_requests_take_a_few_clips_in_turn(http_bench, monkeypatch):
    monkeypatch.setattr(http_bench, "DISTINCT_CLIPS", 2)
    clips = http_bench.synthetic_clips(5)
    assert [c.name for c in clips] == ["synthetic_00000.wav", "synthetic_00001.wav"] * 2 + ["synthetic_00000.wav"]
    assert clips[0].body != clips[1].body and clips[0].body.startswith(b"RIFF") and clips[0].duration_s > 1


def test_gil_share_runs_and_reports_each_setting():
    command = [sys.executable, "scripts/gil_share.py", "--busy", "0.5", "--switch-ms", "5", "1", "--ops", "300"]
    lines = subprocess.run(command, cwd=REPO, check=True, timeout=120, capture_output=True,
                           text=True).stdout.splitlines()
    assert lines[0].startswith("event loop idle:")
    assert [line.split(":")[0] for line in lines[1:]] == ["event loop busy  50%, switch interval 5 ms",
                                                          "event loop busy  50%, switch interval 1 ms"]


def test_url_fetch_cost_reports_each_client(parity_dir, capsys):
    script = load_script(REPO / "loadtest" / "url_fetch_cost.py")
    script.main(["--audio-dir", str(parity_dir / "audio"), "--fetches", "60", "--concurrency", "8"])
    reports = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["client"] for r in reports] == ["UrlFetcher (aiohttp)", "httpx"]
    assert all(r["fetches"] == 60 and r["mean_kb"] > 10 and r["loop_cpu_ms_per_fetch"] > 0 for r in reports)


def test_p99_is_not_the_largest_of_a_hundred(http_bench):
    """It took the latency one rank above the 99th: of 100, the largest."""
    latencies = [float(i) for i in range(1, 101)]
    assert http_bench.p99(latencies) == pytest.approx(99.01)
    assert http_bench.p99([0.5]) == 0.5 and http_bench.p99([1.0, 2.0]) == pytest.approx(1.99)


def test_an_audio_dir_without_readable_audio_is_named_in_the_error(http_bench, tmp_path):
    with pytest.raises(ValueError, match=r"no \.wav or \.flac files"):  # was a ZeroDivisionError
        http_bench.file_clips(tmp_path, 4)
    (tmp_path / "notes.WAV").write_text("not audio")
    with pytest.raises(ValueError, match=r"notes\.WAV: not audio the bench can read"):
        http_bench.file_clips(tmp_path, 4)
    with pytest.raises(ValueError, match="not a directory"):
        http_bench.file_clips(tmp_path / "missing", 4)


def _bulk_job_against(http_bench, submitted: tuple[int, dict]) -> dict:
    """http_bench.bulk_job against a stand-in server: POST /v1/jobs answers ``submitted``."""
    import asyncio

    from aiohttp import web

    async def submit(_request: web.Request) -> web.Response:
        status, body = submitted
        return web.json_response(body, status=status)

    async def main() -> dict:
        app = web.Application()
        app.router.add_post("/v1/jobs", submit)
        runner = web.AppRunner(app)
        await runner.setup()
        port = http_bench.free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            clip = http_bench.Clip("a.wav", b"RIFF", None, 2.0)
            return await http_bench.bulk_job(f"http://127.0.0.1:{port}", [clip, clip])
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def test_a_bulk_job_that_fails_or_loses_items_gives_no_throughput(http_bench):
    """A refused submission raised a KeyError; a job whose items failed counted their audio as transcribed."""
    with pytest.raises(RuntimeError, match=r"HTTP 503: .*no Redis"):
        _bulk_job_against(http_bench, (503, {"error": {"message": "no Redis"}}))
    job = {"id": "j", "status": "completed_with_errors", "counts": {"completed": 1, "failed": 1}, "rtfx": 90.0}
    bulk = _bulk_job_against(http_bench, (202, job))
    assert bulk["status"] == "completed_with_errors" and bulk["counts"] == job["counts"]
    assert bulk["rtfx_wall"] is None and bulk["items_per_s"] is None and bulk["rtfx_engine"] is None
    done = _bulk_job_against(http_bench, (202, {**job, "status": "completed", "counts": {"completed": 2}}))
    assert done["rtfx_wall"] > 0 and done["rtfx_engine"] == 90.0


def test_url_fetch_cost_says_when_it_has_nothing_to_serve(tmp_path, capsys):
    """An empty --audio-dir was a ZeroDivisionError."""
    script = load_script(REPO / "loadtest" / "url_fetch_cost.py")
    for directory in (tmp_path, tmp_path / "missing"):
        with pytest.raises(SystemExit):
            script.main(["--audio-dir", str(directory), "--fetches", "4"])
        assert f"--audio-dir {directory}: no files to serve" in capsys.readouterr().err


def test_stream_latency_makes_its_recording_at_16_khz_whatever_the_clips_rate(tmp_path):
    """An 8 kHz clip was written into the 16 kHz recording as it was: twice as fast, and counted at half its length."""
    import io

    import numpy as np
    import soundfile as sf

    script = load_script(REPO / "loadtest" / "stream_latency.py")
    tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(16000) / 8000)).astype(np.float32)
    sf.write(tmp_path / "slow.wav", tone, 8000)  # 2 s
    sf.write(tmp_path / "stereo.wav", np.stack([tone, tone], axis=1)[:8000], 8000)  # 1 s, two channels
    audio, seconds = script.recording(tmp_path, 7.0)
    info = sf.info(io.BytesIO(audio))
    assert (info.samplerate, info.channels) == (16000, 1)
    assert seconds == pytest.approx(2 * (1.0 + 0.5 + 2.0 + 0.5)) == pytest.approx(info.frames / 16000)
    (tmp_path / "notes.wav").write_text("not audio")
    with pytest.raises(SystemExit, match=r"notes\.wav"):
        script.recording(tmp_path, 7.0)


def test_the_overload_script_runs_past_capacity_and_the_server_recovers(tmp_path):
    """loadtest/overload.py in brief: arrivals at three times what the server answered, a one-second timeout."""
    out = tmp_path / "overload.json"
    command = [sys.executable, "loadtest/overload.py", "--timeout-s", "1", "--baseline-s", "3", "--overload-s", "6",
               "--window-s", "2", "--concurrency", "4", "--batch-size", "4", "--out", str(out)]
    subprocess.run(command, cwd=REPO, check=True, timeout=300, capture_output=True)
    report = json.loads(out.read_text())
    assert len(report["overload_windows"]) == 3 and report["arrivals_per_s"] > 0
    answered = Counter()
    for window in report["overload_windows"]:
        answered.update(window["statuses"])
    assert answered["504"] > 0 and set(answered) <= {"200", "504"}  # past capacity: timeouts, nothing else
    assert sum(report["dropped_items"].values()) > 0  # the pieces of those past their time never ran
    assert report["queue_depth_after"] == 0  # nothing left behind once the last answer is in
    assert set(report["recovered"]["statuses"]) == {"200"}


def test_job_submit_time_reports_each_shape(capsys):
    script = load_script(REPO / "loadtest" / "job_submit_time.py")
    script.main(["--shapes", "50x100", "2x5000000", "--repeat", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["50 items of 100 bytes (0 MiB)",
                                                      "2 items of 5000000 bytes (10 MiB)"]
    assert all("best of 2" in line for line in lines)


def test_intake_memory_measures_job_submissions_and_their_transcription():
    import subprocess
    import sys

    command = [sys.executable, "loadtest/intake_memory.py", "--route", "job", "--clients", "2", "--files", "2",
               "--minutes", "0.05", "--transcribed"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    submitted, transcribed = result.stdout.splitlines()
    assert submitted.startswith("2 jobs of 2 uploads of 1 MiB (0.05 min") and "the front end's peak RSS" in submitted
    assert submitted.endswith("statuses [202]")
    assert "the engine process's peak RSS" in transcribed and transcribed.endswith("jobs ['completed']")


def test_results_memory_reports_both_ways(capsys):
    script = load_script(REPO / "loadtest" / "results_memory.py")
    script.main(["--items", "300", "--tail", "100"])
    listed, streamed, resumed, again = capsys.readouterr().out.splitlines()
    assert listed.startswith("300 results as a list: peak") and streamed.startswith("300 results streamed: peak")
    assert resumed.startswith("the last 100 after an outage, from where it stopped: 100 read, ")
    assert again.startswith("the last 100 after an outage, from the start again, skipping: 300 read, ")


def test_stream_reads_times_each_count_of_keys(capsys):
    script = load_script(REPO / "loadtest" / "stream_reads.py")
    script.main(["--keys", "0", "2", "--items", "4", "--repeat", "2"])
    header, rule, *rows = capsys.readouterr().out.splitlines()
    assert header.startswith("| keys | item streams | read_items(64)") and rule.startswith("|---|")
    assert [row.split(" | ")[:2] for row in rows] == [["| 0", "3"], ["| 2", "9"]]
    assert all(row.count(" ms") == 4 for row in rows)


def test_quota_contention_queues_the_large_job_beside_the_small_ones(capsys):
    script = load_script(REPO / "loadtest" / "quota_contention.py")
    script.main(["--items", "3000", "--every-ms", "20", "--timeout-s", "30"])
    (line,) = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"a job of 3000 items queued in [0-9.]+ s; \d+ one-item jobs of the same key meanwhile", line)


def test_key_fairness_times_the_light_key_both_ways(capsys):
    script = load_script(REPO / "loadtest" / "key_fairness.py")
    script.main(["--flood", "2", "--flood-s", "4", "--light", "3", "--warm-s", "0.5", "--batch-size", "2"])
    own, shared = capsys.readouterr().out.splitlines()
    assert own.startswith("light requests under a key of its own: median ")
    assert shared.startswith("light requests under the flooding key: median ")
    assert all("audio s/s" in line for line in (own, shared))
