"""The `batchasr transcribe` command as a user runs it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from models import load_model
from service.cli import main


def _batchasr() -> list[str]:
    """The command as a user runs it: the installed console script, else the module."""
    exe = shutil.which("batchasr")
    return [exe] if exe else [sys.executable, "-m", "service.cli"]


def test_console_script_runs(parity_dir, parity_audio):
    out = subprocess.run([*_batchasr(), "transcribe", "--model", str(parity_dir / "tdt.nemo"), "--format", "jsonl",
                          parity_audio[0]], capture_output=True, text=True, check=True, timeout=120)
    record = json.loads(out.stdout)
    assert record["audio"] == parity_audio[0]
    assert len(record["token_logprobs"]) == len(record["tokens"]) > 0 and record["avg_logprob"] < 0
    assert all(0 <= w["confidence"] <= 1 for w in record["words"])


def test_resampled_stereo_input_transcribes_like_the_original(parity_dir, parity_audio, tmp_path, capsys):
    wave, _ = sf.read(parity_audio[3], dtype="float32")
    sf.write(tmp_path / "stereo48k.flac", np.stack([wave, wave], axis=1).repeat(3, axis=0), 48000)
    model = str(parity_dir / "tdt_ctc_hybrid.nemo")
    assert main(["transcribe", "--model", model, "--format", "text", parity_audio[3]]) == 0
    original = capsys.readouterr().out
    assert main(["transcribe", "--model", model, "--format", "text", str(tmp_path / "stereo48k.flac")]) == 0
    assert capsys.readouterr().out == original


def test_a_run_over_many_files_ends_with_a_summary_naming_the_least_sure(parity_dir, parity_audio, capsys):
    assert main(["transcribe", "--model", str(parity_dir / "tdt.nemo"), "--format", "jsonl", *parity_audio[:4]]) == 0
    out, err = capsys.readouterr()
    records = [json.loads(line) for line in out.splitlines()]
    seconds = sum(r["duration_s"] for r in records)
    assert f"4 files, {seconds / 3600:.2f} h of audio in" in err
    least_sure = min(records, key=lambda r: r["avg_logprob"])
    assert f"least sure files (avg_logprob): {least_sure['audio']} ({least_sure['avg_logprob']:.3f})" in err
    scores = [x for r in records for x in r["token_logprobs"]]
    assert f"mean token log-probability {sum(scores) / len(scores):.4f}" in err


def test_files_that_read_like_noise_are_named_with_what_to_do(tmp_path, capsys):
    """A tape of long quiet stretches reads as pages of made-up words without --skip-silence: the run says which
    files read like noise (their avg_logprob), and what leaves the quiet out."""
    speech = Path(__file__).parent / "data" / "default_model" / "sentences_000110.wav"
    hiss = tmp_path / "hiss.wav"
    spectrum = np.fft.rfft(np.random.default_rng(0).standard_normal(8 * 16000))
    pink = np.fft.irfft(spectrum / np.sqrt(np.maximum(np.arange(len(spectrum)), 1)), 8 * 16000)
    sf.write(hiss, (pink / pink.std() * 0.05).astype(np.float32), 16000)
    assert main(["transcribe", "--format", "text", str(speech), str(hiss)]) == 0
    err = capsys.readouterr().err
    assert f"1 of 2 files read like noise or silence (avg_logprob below -0.8): {hiss}; where they hold" in err
    assert main(["transcribe", "--format", "text", "--skip-silence", str(hiss)]) == 0
    err = capsys.readouterr().err
    assert f"1 of 1 files read like noise or silence (avg_logprob below -0.8): {hiss}\n" in err
    assert main(["transcribe", "--format", "text", str(speech)]) == 0
    assert "noise" not in capsys.readouterr().err


def test_subtitle_lines_follow_the_layout_options(parity_dir, parity_audio, capsys):
    model = str(parity_dir / "tdt.nemo")
    assert main(["transcribe", "--model", model, "--format", "srt", parity_audio[2]]) == 0
    default = [block.splitlines()[2:] for block in capsys.readouterr().out.strip().split("\n\n")]
    assert main(["transcribe", "--model", model, "--format", "srt", "--max-line-width", "16", "--max-line-count", "1",
                 parity_audio[2]]) == 0
    narrow = [block.splitlines()[2:] for block in capsys.readouterr().out.strip().split("\n\n")]
    assert len(narrow) > len(default) and all(len(cue) == 1 for cue in narrow)
    assert " ".join(cue[0] for cue in narrow) == " ".join(line for cue in default for line in cue)
    assert main(["transcribe", "--model", model, "--format", "srt", "--max-line-count", "0", parity_audio[2]]) == 2
    assert "max_line_count must be 1 to 10" in capsys.readouterr().err


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
    ],
)
def test_bad_audio_is_reported(parity_dir, tmp_path, capsys, content, message):
    path = tmp_path / "bad.wav"
    path.write_bytes(content)
    assert main(["transcribe", "--model", str(parity_dir / "tdt.nemo"), str(path)]) == 1
    assert message in capsys.readouterr().err


def test_a_missing_file_is_refused_before_the_model_loads(tmp_path, capsys):
    assert main(["transcribe", "--model", str(tmp_path / "never-loaded.nemo"), str(tmp_path / "gone.wav")]) == 2
    assert "gone.wav: no such file or directory" in capsys.readouterr().err


def test_a_directory_run_writes_every_readable_file_and_reports_the_rest(parity_dir, parity_audio, tmp_path,
                                                                         capsys):
    for path in parity_audio[:4]:
        (tmp_path / Path(path).name).write_bytes(Path(path).read_bytes())
    (tmp_path / "utt01b.wav").write_bytes(b"RIFF but not audio" * 20)  # sorts among the good ones
    (tmp_path / "notes.txt").write_text("not audio, not taken")
    assert main(["transcribe", "--model", str(parity_dir / "tdt.nemo"), "--format", "jsonl", "--batch-size", "2",
                 str(tmp_path)]) == 1
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.splitlines()]
    assert [Path(r["audio"]).name for r in lines] == sorted(Path(p).name for p in parity_audio[:4])
    expected = load_model(parity_dir / "tdt.nemo", device="cpu", dtype="float32").transcribe(parity_audio[:4])
    by_name = {Path(p).name: t.text for p, t in zip(parity_audio[:4], expected, strict=True)}
    assert all(r["text"] == by_name[Path(r["audio"]).name] for r in lines)
    assert "utt01b.wav" in captured.err and "1 of 5 files could not be read" in captured.err


def test_output_dir_mirrors_directories_refuses_clashes_and_resumes(parity_dir, parity_audio, tmp_path, capsys):
    source = tmp_path / "archive"
    (source / "day1").mkdir(parents=True)
    (source / "day2").mkdir()
    clips = [Path(p).read_bytes() for p in parity_audio[:3]]
    for name, data in (("day1/call.wav", clips[0]), ("day2/call.wav", clips[1]), ("extra.wav", clips[2])):
        (source / name).write_bytes(data)
    out = tmp_path / "out"
    command = ["transcribe", "--model", str(parity_dir / "tdt.nemo"), "--format", "jsonl", "--output-dir", str(out)]
    assert main([*command, str(source)]) == 0
    written = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert written == ["day1/call.jsonl", "day2/call.jsonl", "extra.jsonl"]  # the same name twice, both kept
    first = (out / "day2/call.jsonl").read_text()
    assert main([*command, str(source / "day1/call.wav"), str(source / "day2/call.wav")]) == 2
    assert "would both be written as call.jsonl" in capsys.readouterr().err
    (out / "day2/call.jsonl").unlink()
    assert main([*command, "--skip-existing", str(source)]) == 0
    assert "2 files already transcribed" in capsys.readouterr().err
    assert (out / "day2/call.jsonl").read_text() == first
    assert not list(out.rglob("*.partial"))
    # printed, not written to files: files of one name are no clash
    assert main([*command[:-2], str(source / "day1/call.wav"), str(source / "day2/call.wav")]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["audio"] for r in lines] == [str(source / "day1/call.wav"), str(source / "day2/call.wav")]
    # printed results: nothing to resume from, so --skip-existing is a mistake, not silently nothing
    assert main([*command[:-2], "--skip-existing", str(source)]) == 2
    assert "--skip-existing resumes a run that writes --output FILE or --output-dir" in capsys.readouterr().err


def test_results_that_cannot_be_written_end_the_run_with_an_error_line(parity_dir, parity_audio, tmp_path, capsys):
    """An output that cannot be made, a full disk (/dev/full) or a reader gone (a closed pipe): status 2 and one
    error line, not a traceback with the status 1 of an unreadable input."""
    model = str(parity_dir / "tdt.nemo")
    (tmp_path / "taken").write_text("a file where the output folder would go")
    assert main(["transcribe", "--model", str(tmp_path / "never-loaded.nemo"), "--output-dir",
                 str(tmp_path / "taken"), parity_audio[0]]) == 2  # refused before the model loads
    assert capsys.readouterr().err.startswith("error: cannot write the results: ")
    assert main(["transcribe", "--model", model, "--format", "jsonl", "--output", "/dev/full", *parity_audio[:2]]) == 2
    assert capsys.readouterr().err == "error: cannot write the results: [Errno 28] No space left on device\n"
    run = subprocess.Popen([sys.executable, "-m", "service.cli", "transcribe", "--model", model, *parity_audio[:3]],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run.stdout.close()  # as `| head -0` does
    _, err = run.communicate(timeout=120)
    assert run.returncode == 2
    assert err == "error: cannot write the results: [Errno 32] Broken pipe\n"


def test_an_empty_directory_is_an_error(tmp_path, capsys):
    assert main(["transcribe", str(tmp_path)]) == 2
    assert "no audio files found" in capsys.readouterr().err


def test_subtitles_of_several_files_need_an_output_dir(parity_audio, capsys):
    assert main(["transcribe", "--format", "srt", *parity_audio[:2]]) == 2
    assert "use --output-dir" in capsys.readouterr().err


def test_unknown_model_file_is_a_clear_error(tmp_path, parity_audio, capsys):
    assert main(["transcribe", "--model", str(tmp_path / "nope.nemo"), parity_audio[0]]) == 2
    assert "nope.nemo: no such file or directory" in capsys.readouterr().err


def test_a_device_that_cannot_be_had_is_an_error_line_not_a_traceback(parity_audio, capsys):
    assert main(["transcribe", "--device", "gpu", parity_audio[0]]) == 2
    assert capsys.readouterr().err == "error: unknown device 'gpu'; choose auto, cpu, cuda or cuda:N\n"


@pytest.mark.parametrize("device", ["mps", "xpu", "meta", "meta:0"])
def test_a_device_type_batchasr_does_not_run_on_is_an_error_line_not_a_traceback(device, parity_audio, capsys):
    """torch knows these devices, and loading onto them (or transcribing there) crashed with a traceback."""
    assert main(["transcribe", "--device", device, parity_audio[0]]) == 2
    assert capsys.readouterr().err == (f"error: unsupported device '{device}' (batchasr runs on cpu and cuda); "
                                       "choose auto, cpu, cuda or cuda:N\n")


def test_a_model_config_that_cannot_be_read_is_one_error_line(parity_dir, parity_audio, tmp_path, capsys):
    """A section that is no mapping ended in an AttributeError traceback; a word for a number, in "invalid literal
    for int()" naming neither the file nor the key."""
    import tarfile

    import yaml

    with tarfile.open(parity_dir / "tdt.nemo") as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    config = tmp_path / "unpacked" / "model_config.yaml"
    raw = yaml.safe_load(config.read_text())
    for edit, problem in ((lambda c: c.update(encoder=[1, 2]), "encoder: [1, 2] is not a mapping of options"),
                          (lambda c: c["encoder"].update(n_layers="abc"),
                           "encoder.n_layers: 'abc' is not a whole number")):
        changed = yaml.safe_load(yaml.safe_dump(raw))
        edit(changed)
        config.write_text(yaml.safe_dump(changed))
        assert main(["transcribe", "--model", str(tmp_path / "unpacked"), parity_audio[0]]) == 2
        assert capsys.readouterr().err == f"error: {tmp_path / 'unpacked'}: model_config.yaml: {problem}\n"


def test_a_blank_model_is_the_embedded_default(parity_dir, parity_audio, tmp_path, monkeypatch, capsys):
    """``--model ""`` was the working directory, and loaded any checkpoint found anywhere under it."""
    import tarfile

    with tarfile.open(parity_dir / "tdt.nemo") as tar:
        tar.extractall(tmp_path / "some" / "nested", filter="data")
    assert main(["transcribe", parity_audio[0]]) == 0
    default = capsys.readouterr().out
    monkeypatch.chdir(tmp_path)
    assert main(["transcribe", "--model", "", parity_audio[0]]) == 0
    assert capsys.readouterr().out == default


@pytest.mark.parametrize("kind", ["fifo", "device", "dash"])
def test_audio_from_standard_input_is_refused_as_not_supported(kind, tmp_path, monkeypatch, capsys):
    """A pipe (``/dev/stdin`` on one, a FIFO) or a device was reported as "no such file or directory"."""
    monkeypatch.chdir(tmp_path)
    path = {"fifo": str(tmp_path / "pipe"), "device": "/dev/null", "dash": "-"}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    assert main(["transcribe", "--model", str(tmp_path / "never-loaded.nemo"), path]) == 2
    reason = "no such file" if kind == "dash" else "not a regular file"
    assert capsys.readouterr().err == f"error: {path}: {reason} (reading from standard input is not supported)\n"


def test_directories_are_walked_through_linked_folders_and_a_dead_link_is_reported(parity_audio, tmp_path, capsys):
    calls = tmp_path / "calls"
    calls.mkdir()
    (calls / "a.wav").write_bytes(Path(parity_audio[0]).read_bytes())
    archive = tmp_path / "archive"
    archive.mkdir()
    (archive / "calls").symlink_to(calls)  # a folder linked in, as mounts and dataset trees often are
    (archive / "gone.wav").symlink_to(tmp_path / "deleted.wav")
    (archive / "again").symlink_to(archive)  # a loop ends
    assert main(["transcribe", "--format", "jsonl", str(archive)]) == 1
    captured = capsys.readouterr()
    assert [json.loads(line)["audio"] for line in captured.out.splitlines()] == [str(archive / "calls" / "a.wav")]
    assert "gone.wav" in captured.err and "1 of 2 files could not be read" in captured.err


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_bad_settings_are_named_one_line_each_before_the_model_loads(command, tmp_path):
    """A bad BATCHASR_* setting ended `serve` and `worker` in pydantic's traceback, naming the field rather than the
    variable; some (an unknown decoder or dtype, a Redis URL of another scheme) only once the model had loaded."""
    bad = {"BATCHASR_MAX_SEGMENT_S": "4", "BATCHASR_MAX_UPLOAD_BYTES": "-1", "BATCHASR_DECODER": "rnn",
           "BATCHASR_PORT": "http", "BATCHASR_REDIS_URL": "http://:hunter2@cache:6379"}
    env = {name: value for name, value in os.environ.items() if not name.startswith("BATCHASR_")}
    env |= bad | {"BATCHASR_MODEL": str(tmp_path / "never-loaded.nemo")}  # loading it would be another error
    run = subprocess.run([*_batchasr(), command], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr and "hunter2" not in run.stderr
    assert run.stderr.splitlines() == [
        "error: BATCHASR_DECODER=rnn: must be one of auto, ctc, rnnt, tdt",
        "error: BATCHASR_PORT=http: Input should be a valid integer, unable to parse string as an integer",
        "error: BATCHASR_MAX_UPLOAD_BYTES=-1: must be >= 1",
        "error: BATCHASR_MAX_SEGMENT_S=4: must be at least 5 seconds",
        "error: BATCHASR_REDIS_URL='http://:***@cache:6379': Redis URL must specify one of the following schemes "
        "(redis://, rediss://, unix://)"]


def test_a_variable_no_setting_reads_is_warned_of_with_the_setting_it_likely_meant(monkeypatch, capsys):
    """BATCHASR_MAX_UPLOAD_BYTE=... was ignored without a word, and the default limit taken."""
    for name in [n for n in os.environ if n.startswith("BATCHASR_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("BATCHASR_MAX_UPLOAD_BYTE", "1000")
    monkeypatch.setenv("BATCHASR_LOGGING", "debug")
    monkeypatch.setenv("BATCHASR_CONDITIONAL_NODES", "0")  # read by the decoder, not a setting: no warning
    assert main(["serve", "--port", "70000"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "warning: BATCHASR_LOGGING is not a setting and is ignored",
        "warning: BATCHASR_MAX_UPLOAD_BYTE is not a setting and is ignored; did you mean BATCHASR_MAX_UPLOAD_BYTES?",
        "error: --port=70000: must be 0 to 65535"]


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_a_missing_model_or_an_absent_gpu_is_named_before_the_server_starts(command, monkeypatch, capsys, tmp_path):
    """Both were found by the server's start-up: a traceback in its JSON log, and exit status 3. An input root that
    is not there (a volume not mounted) is warned of."""
    for name in [n for n in os.environ if n.startswith("BATCHASR_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("BATCHASR_MODEL", str(tmp_path / "gone.nemo"))
    monkeypatch.setenv("BATCHASR_INPUT_ROOTS", f"{tmp_path},{tmp_path / 'unmounted'}")
    assert main([command, "--device", "cuda:99", "--redis-url", "redis://127.0.0.1:1"]) == 2
    warning, *lines = capsys.readouterr().err.splitlines()
    assert warning == (f"warning: BATCHASR_INPUT_ROOTS: {tmp_path / 'unmounted'} is not a directory here; job items "
                       "under it will fail as not found")  # the root that is there: no word
    assert lines[0] == f"error: BATCHASR_MODEL={tmp_path / 'gone.nemo'}: no such file"
    no_gpu = ("CUDA is not available on this machine" if not torch.cuda.is_available()
              else "there is no cuda:99")
    assert len(lines) == 2 and lines[1].startswith("error: --device=cuda:99: " + no_gpu), lines


def test_a_bad_setting_given_as_an_option_is_named_as_the_option(capsys):
    assert main(["serve", "--port", "70000", "--device", "gpu", "--frontends", "-1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --device=gpu: unknown device 'gpu'; choose auto, cpu, cuda or cuda:N",
        "error: --port=70000: must be 0 to 65535",
        "error: --frontends=-1: must be >= 0"]


@pytest.mark.parametrize(("name", "value", "words"), [
    ("max_wait_ms", 1e13, "from 0 to 3,600,000"),  # passed, and overflowed the engine thread's wait: failed for good
    ("request_timeout_s", 1e300, "at most 2,592,000"),
    ("max_batch_audio_s", 10, "at least max_segment_s (30)"),  # was told as BATCHASR_MAX_SEGMENT_S, not set
])
def test_settings_past_what_the_service_can_take_are_refused_naming_the_one_given(monkeypatch, name, value, words):
    from service.config import InvalidSettings, get_settings

    for variable in [v for v in os.environ if v.startswith("BATCHASR_")]:
        monkeypatch.delenv(variable)
    monkeypatch.setenv(f"BATCHASR_{name.upper()}", str(value))
    with pytest.raises(InvalidSettings) as refused:
        get_settings()
    [problem] = refused.value.problems
    assert problem.field == name and words in problem.message, problem


def test_the_synopsis_in_docs_cli_md_shows_every_option_of_each_command():
    """It left out `submit --api-key` and `--idempotency-key`, and `--device`, `--dtype` and `--attention-kernel` of
    `serve`, `worker` and `bench`; each option's choices are shown too (docs/test_docs.py checks that it shows no
    option a command lacks)."""
    import argparse
    import re

    from service.cli import build_parser

    text = (Path(__file__).parent.parent / "docs" / "cli.md").read_text()
    synopsis = text[text.index("```\nbatchasr ") + 4:]
    synopsis = synopsis[:synopsis.index("```")]
    shown: dict[str, str] = {}
    command = ""
    for line in synopsis.splitlines():
        if start := re.match(r"batchasr (\w+)", line):
            command = start.group(1)
        shown[command] = shown.get(command, "") + line + "\n"
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(shown) == set(sub.choices)
    for name, parser in sub.choices.items():
        for action in parser._actions:
            for option in (o for o in action.option_strings if o.startswith("--") and o != "--help"):
                values = re.findall(rf"{option} ([\w:|]+)", shown[name])
                assert values or re.search(rf"{option}(?![\w-])", shown[name]), f"batchasr {name} {option}"
                if action.choices:  # every choice, across the places it is shown (submit: --format manifest apart)
                    assert {v for value in values for v in value.split("|")} == set(action.choices), option
    for name in ("transcribe", "serve", "worker", "bench"):  # --device is free text: auto, cpu, cuda, cuda:N
        assert "--device auto|cpu|cuda|cuda:N" in shown[name], name
