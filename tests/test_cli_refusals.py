"""Options and inputs the command line refuses with one error line and status 2, instead of a traceback or of
touching files it should leave alone."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from service.cli import main
from tests.ports import free_port

CLIP = str(Path(__file__).parent / "data" / "default_model" / "voice_000142.wav")
NO_REDIS = ["--redis-url", "redis://127.0.0.1:1"]  # a well-formed URL where nothing listens: nothing may be sent


def _batchasr(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "service.cli", *args], capture_output=True, text=True, timeout=120)


def test_a_manifest_that_is_a_directory_is_one_error_line(tmp_path):
    result = _batchasr("transcribe", "--manifest", f"{tmp_path}/")
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "Is a directory" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("option", "value"), [
    ("--length-bucket-s", "nan"), ("--length-bucket-s", "inf"), ("--length-bucket-s", "1e-9"),
    ("--length-bucket-s", "0"), ("--max-segment-s", "inf"),
])
def test_a_length_that_is_no_whole_number_of_samples_is_refused_before_the_model_loads(tmp_path, capsys, option,
                                                                                        value):
    with pytest.raises(SystemExit) as refused:  # the model named is never loaded: there is none
        main(["transcribe", "--model", str(tmp_path / "never-loaded.nemo"), option, value, CLIP])
    assert refused.value.code == 2
    assert f"argument {option}: " in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_cuda_graphs_that_need_cuda_are_refused_on_cpu_with_one_line():
    result = _batchasr("transcribe", "--cuda-graphs", "conditional", CLIP)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: ") and "needs a CUDA device" in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


@pytest.mark.parametrize("content", [b"my notes\nimportant last line", b"a single line without its newline"])
def test_skip_existing_leaves_a_file_that_is_not_its_results_untouched(tmp_path, content):
    notes = tmp_path / "notes.txt"
    notes.write_bytes(content)
    result = _batchasr("transcribe", "--format", "jsonl", "--output", str(notes), "--skip-existing", CLIP)
    assert result.returncode == 2
    assert "not a result line this command wrote" in result.stderr
    assert notes.read_bytes() == content


@pytest.mark.parametrize(("options", "message"), [
    (["--output-dir", "DIR"], "--output writes result lines, --output-dir a file per input: give one"),
    (["--format", "srt"], "--format srt is the format of --output-dir's files"),
])
def test_submit_refuses_results_options_that_do_not_go_together_before_emptying_its_output(tmp_path, capsys,
                                                                                         options, message):
    out = tmp_path / "results.jsonl"
    out.write_text("kept\n")
    options = [str(tmp_path / "files") if o == "DIR" else o for o in options]
    assert main(["submit", *NO_REDIS, "--wait", "--output", str(out), *options, CLIP]) == 2
    assert message in capsys.readouterr().err
    assert out.read_text() == "kept\n" and not (tmp_path / "files").exists()


def test_submit_refuses_a_subtitle_format_for_result_lines(capsys):
    assert main(["submit", *NO_REDIS, "--wait", "--format", "vtt", CLIP]) == 2
    assert "--format vtt is the format of --output-dir's files" in capsys.readouterr().err


def test_skip_existing_tells_apart_manifest_lines_that_differ_only_in_duration(tmp_path, capsys):
    """Two stretches of one file, the same but for their duration, are two inputs: a run cut short after the first
    transcribes the second; a line without a duration is matched by its result, which gained one."""
    lines = [{"audio_filepath": CLIP, "duration": 1.0}, {"audio_filepath": CLIP, "duration": 2.0},
             {"audio_filepath": CLIP}]
    manifest = tmp_path / "m.json"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = ["transcribe", "--manifest", str(manifest), "--format", "manifest"]
    whole, cut = tmp_path / "whole.json", tmp_path / "cut.json"
    assert main([*run, "--output", str(whole)]) == 0
    results = whole.read_text().splitlines(keepends=True)
    assert len(results) == 3
    cut.write_text(results[0] + results[2])  # the second not written yet
    capsys.readouterr()
    assert main([*run, "--output", str(cut), "--skip-existing"]) == 0
    assert "2 inputs already in" in capsys.readouterr().err
    assert sorted(cut.read_text().splitlines(keepends=True)) == sorted(results)


def test_ctrl_c_is_one_line_and_status_130_not_a_traceback(redis_server, parity_audio):
    """Ctrl-C while `jobs --results --wait` follows a job (or `transcribe` works) printed a traceback from wherever
    it landed: torch, asyncio."""
    def cli(*args: str, **kwargs) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "service.cli", *args, "--redis-url", redis_server.url],
                                stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, **kwargs)

    submitted = cli("submit", parity_audio[0])  # no worker: the job stays queued
    assert submitted.wait(timeout=60) == 0
    job_id = submitted.stderr.read().split()[1].rstrip(":")
    following = cli("jobs", "--results", job_id, "--wait")
    assert following.stderr.read(1)  # its progress bar: it is following the job
    following.send_signal(signal.SIGINT)
    assert following.wait(timeout=30) == 130
    err = following.stderr.read()
    assert "interrupted" in err and "Traceback" not in err, err


@pytest.mark.parametrize("address, problem", [
    ("localhost:8000", "not an http:// or https:// address"),  # tried again for 5 minutes as an outage
    ("http://[::1", "not a URL"),  # a traceback (httpx.InvalidURL)
    ("http://127.0.0.1:99999", "port 99999 is not one"),  # a traceback (OverflowError)
])
def test_a_server_address_that_is_not_one_is_refused_at_once(parity_audio, address, problem):
    for command in (["submit", parity_audio[0]], ["jobs"], ["jobs", "--cancel", "job_x"]):
        result = subprocess.run([sys.executable, "-m", "service.cli", *command, "--server", address],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and f"error: --server {address!r}: {problem}" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr and "trying again" not in result.stderr


def _manifest_of_one(tmp_path: Path) -> Path:
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"audio_filepath": CLIP, "duration": 1.0}) + "\n")
    return manifest


@pytest.mark.parametrize("resume", [[], ["--skip-existing"]])
def test_the_manifest_being_read_is_no_place_for_its_results(tmp_path, capsys, resume):
    """Given as its own --output, the manifest grew by its results (or, resumed, every line counted as done)."""
    manifest = _manifest_of_one(tmp_path)
    kept = manifest.read_bytes()
    assert main(["transcribe", "--manifest", str(manifest), "--format", "manifest", "--output",
                 str(tmp_path / "." / "m.jsonl"), *resume]) == 2
    assert "is the manifest being read" in capsys.readouterr().err
    assert manifest.read_bytes() == kept


def test_submit_leaves_the_manifest_it_reads_whole_when_told_to_write_results_there(tmp_path, capsys):
    """submit empties its --output before a job is sent: the manifest itself, lost, had it been given as one."""
    manifest = _manifest_of_one(tmp_path)
    kept = manifest.read_bytes()
    assert main(["submit", *NO_REDIS, "--manifest", str(manifest), "--wait", "--format", "manifest",
                 "--output", str(manifest)]) == 2
    assert "is the manifest being read" in capsys.readouterr().err
    assert manifest.read_bytes() == kept


@pytest.mark.parametrize(("format", "lines"), [
    ("manifest", [{"audio_filepath": CLIP, "duration": 1.0}]),  # a manifest: lines with no prediction
    ("manifest", [{"audio": CLIP, "text": "jsonl's record"}]),
    ("jsonl", [{"audio_filepath": CLIP, "pred_text": "a manifest's result"}]),
])
def test_skip_existing_counts_only_its_own_formats_result_lines_as_done(tmp_path, capsys, format, lines):
    """Any JSON object was taken as a result: a manifest given as --output was all 'done', and results of another
    format were added to."""
    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    kept = out.read_bytes()
    assert main(["transcribe", "--format", format, "--output", str(out), "--skip-existing", CLIP]) == 2
    err = capsys.readouterr().err
    assert "out.jsonl:1: not a result line this command wrote (no " in err and f"--format {format}'s" in err
    assert out.read_bytes() == kept


@pytest.mark.parametrize("command", [
    ["transcribe", "--format", "jsonl", CLIP],
    ["submit", *NO_REDIS, "--wait", CLIP],
])
def test_a_results_file_another_command_is_writing_is_refused(tmp_path, capsys, command):
    """Two runs given one --output (a rerun while the first goes on under nohup) each wrote every result."""
    import fcntl

    out = tmp_path / "out.jsonl"
    out.write_text("a line the other command wrote\n")
    with out.open("a") as other:
        fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert main([*command, "--output", str(out)]) == 2
    assert "another batchasr command is writing its results there" in capsys.readouterr().err
    assert out.read_text() == "a line the other command wrote\n"


def test_a_submit_cut_short_says_how_its_jobs_results_are_had(redis_server, parity_audio, tmp_path):
    """Ctrl-C while `submit --wait --format manifest` waited wrote nothing and said only "interrupted": the job goes
    on, and its manifest is had by running the command again under the key it was sent with, which it now says."""
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"audio_filepath": parity_audio[0]}) + "\n")
    run = [sys.executable, "-m", "service.cli", "submit", "--redis-url", redis_server.url, "--manifest",
           str(manifest), "--wait", "--format", "manifest"]
    waiting = subprocess.Popen(run, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    sent = waiting.stderr.readline()  # "job ID: 1 items" (no worker: it stays queued)
    job_id = sent.split()[1].rstrip(":")
    waiting.send_signal(signal.SIGINT)
    assert waiting.wait(timeout=30) == 130
    err = waiting.stderr.read()
    assert f"the jobs go on: {job_id}; their results: batchasr jobs --results {job_id} --wait" in err, err
    key = err.split("--idempotency-key ")[1].split(":")[0]
    again = subprocess.run([*run[:-3], "--idempotency-key", key], capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stderr.startswith(f"job {job_id}: "), again.stderr  # the same job


def test_results_go_on_without_a_lock_where_the_file_system_has_none(tmp_path, capsys, monkeypatch):
    """Lustre without flock (ENOSYS), NFS without lockd (ENOLCK): the lock is said to be missing, not the run
    refused. Descriptors (/dev/stdout, /dev/fd/N) stand for what the shell gave: several commands may share it."""
    import errno
    import fcntl

    from service.line_output import is_named_file

    def no_locks_here(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks_here)
    out = tmp_path / "out.jsonl"
    assert main(["transcribe", "--format", "jsonl", "--output", str(out), CLIP]) == 0
    assert "out.jsonl: cannot be locked (No locks available)" in capsys.readouterr().err
    assert json.loads(out.read_text())["text"]
    assert not is_named_file("/dev/stdout") and not is_named_file("/dev/fd/1") and is_named_file(out)


def _start_up(*args: str, **env: str) -> subprocess.CompletedProcess:
    """``batchasr serve`` or ``worker`` with ``args``, BATCHASR_* from ``env`` alone (the default model on CPU)."""
    clean = {name: value for name, value in os.environ.items() if not name.startswith("BATCHASR_")}
    return subprocess.run([sys.executable, "-m", "service.cli", *args], env={**clean, **env}, capture_output=True,
                          text=True, timeout=120)


def _one_error_line(done: subprocess.CompletedProcess) -> str:
    """Its one line that is not the JSON log's, an ``error:`` (status 2, no traceback)."""
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if not line.startswith("{")]
    assert len(said) == 1 and said[0].startswith("error: "), done.stderr[-3000:]
    return said[0]


@pytest.mark.parametrize("command", ["serve", "serve --frontends 1", "worker"])
def test_a_decoder_the_model_has_no_head_for_is_one_line_at_start_up(command):
    """BATCHASR_DECODER=rnnt for the default model (TDT and CTC heads): `serve` ended in a traceback in its JSON log
    and exit status 3, `worker` in a raw traceback and 1; `transcribe --decoder rnnt` said it in one line."""
    args = command.split() + (["--port", str(free_port())] if command.startswith("serve") else NO_REDIS)
    line = _one_error_line(_start_up(*args, BATCHASR_DECODER="rnnt", BATCHASR_DEVICE="cpu"))
    assert line == "error: BATCHASR_DECODER=rnnt: this model has no rnnt head (it has: ctc, tdt)"


@pytest.mark.parametrize("command", ["serve", "worker", "transcribe"])
@pytest.mark.parametrize("content", [b"", b"not a tar archive at all" * 100], ids=["empty", "corrupt"])
def test_a_model_file_that_is_no_checkpoint_is_one_line_at_start_up(tmp_path, command, content):
    """An empty or corrupt --model: `serve` loaded it in the app's start-up, a traceback in its JSON log and exit
    status 3; the reason tarfile gives spans lines (one per compression tried), and was printed so."""
    model = tmp_path / "broken.nemo"
    model.write_bytes(content)
    where = {"serve": ["--port", str(free_port())], "worker": NO_REDIS, "transcribe": [str(model)]}[command]
    args = [command, "--model", str(model), "--device", "cpu", *where]
    line = _one_error_line(_start_up(*args))
    assert line.startswith(f"error: {model}: ") and "archive" in line, line


def test_serve_on_a_port_taken_is_one_line_before_the_model_loads():
    """Plain `serve` (HTTP in the engine's process) loaded the model, then ended in a JSON log line and exit status
    3; with --frontends the same port was refused at once."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _start_up("serve", "--port", str(port), "--device", "cpu")
    assert _one_error_line(done) == f"error: cannot listen on 127.0.0.1:{port}: Address already in use"
    assert "loaded" not in done.stderr, done.stderr[-3000:]
