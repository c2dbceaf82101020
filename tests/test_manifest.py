"""NeMo manifests through ``batchasr transcribe``: a stretch of a file read as the same stretch of its samples (WAV,
FLAC at another rate, a media container read through FFmpeg); lines kept with their prediction added; references
scored; bad lines refused before the model loads, unreadable audio reported by its line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf

from models import AudioClip, load_model
from models.audio_io import AudioError, read_audio, resample
from models.wer import edit_distance
from service.cli import main
from service.config import Settings
from service.manifest import ErrorRate, ManifestEntry, words_for_scoring
from service.stretch_upload import HEADER_BYTES, stretch_upload
from service.submit_inputs import upload_size
from tests.media import encode
from tests.servers import run_server, wait_job

MODEL = "tdt_ctc_hybrid.nemo"


def _write_manifest(path: Path, lines: list[dict | str]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_a_clip_is_the_stretch_of_the_samples_it_names(parity_audio, tmp_path):
    wave = read_audio(parity_audio[1])
    assert np.array_equal(read_audio(AudioClip(Path(parity_audio[1]), 0.5, 1.0)), wave[8000:24000])
    assert np.array_equal(read_audio(AudioClip(Path(parity_audio[1]), 1.25)), wave[20000:])  # to the end
    # at 48 kHz, libsndfile seeks: the stretch of the file's own samples, resampled
    high = resample(wave, 16000, 48000)
    sf.write(tmp_path / "high.flac", high, 48000, subtype="PCM_24")
    own, _ = sf.read(tmp_path / "high.flac", dtype="float32")
    assert np.allclose(read_audio(AudioClip(tmp_path / "high.flac", 0.5, 1.0)),
                       resample(own[24000:72000], 48000, 16000), atol=1e-6)
    # a media container cannot seek: FFmpeg's frames are read up to the offset
    (tmp_path / "call.m4a").write_bytes(encode(wave, "m4a"))
    whole = read_audio(tmp_path / "call.m4a")
    clip = read_audio(AudioClip(tmp_path / "call.m4a", 0.5, 1.0))
    assert len(clip) == 16000 and np.allclose(clip, whole[8000:24000], atol=1e-6)


def test_a_clip_out_of_its_file_or_with_no_length_is_refused(parity_audio):
    with pytest.raises(AudioError, match="offset lies past the end"):
        read_audio(AudioClip(Path(parity_audio[0]), 60.0))
    for offset, duration in ((-1.0, None), (float("nan"), None), (0.0, 0.0), (0.0, -2.0), (1e308, None), (0.0, 1e308)):
        with pytest.raises(ValueError, match=r"an offset is 0 s or more|a duration is more than 0 s"):
            AudioClip(Path(parity_audio[0]), offset, duration)


def test_a_manifest_is_transcribed_line_by_line_keeping_its_fields(parity_dir, parity_audio, tmp_path, capsys):
    audio = tmp_path / "audio"
    audio.mkdir()
    for name in parity_audio[:2]:
        (audio / Path(name).name).write_bytes(Path(name).read_bytes())
    first, second = (Path(name).name for name in parity_audio[:2])
    model = load_model(parity_dir / MODEL, device="cpu", dtype="float32")
    wave = read_audio(parity_audio[1])
    expected = [t.text for t in model.transcribe([read_audio(parity_audio[0]), wave[8000:24000], wave[24000:]])]
    manifest = _write_manifest(tmp_path / "train.json", [
        {"audio_filepath": f"audio/{first}", "text": expected[0], "speaker": "a"},  # relative to the manifest
        {"audio_filepath": str(audio / second), "offset": 0.5, "duration": 1.0},  # absolute, a stretch
        {"audio_filepath": f"audio/{second}", "offset": 1.5, "text": "not what was said at all"},
        "",  # blank lines are skipped
    ])
    assert main(["transcribe", "--model", str(parity_dir / MODEL), "--manifest", str(manifest),
                 "--format", "manifest"]) == 0
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["pred_text"] for line in lines] == expected
    first_s = len(read_audio(parity_audio[0])) / 16000
    assert lines[0]["speaker"] == "a" and lines[0]["duration"] == pytest.approx(first_s, abs=1e-4)
    assert lines[1]["offset"] == 0.5 and lines[1]["duration"] == 1.0  # kept as given
    assert all(line["avg_logprob"] < 0 for line in lines)
    reference = words_for_scoring("not what was said at all")  # the first line's reference is what it heard
    rate = edit_distance(reference, words_for_scoring(expected[2])) / (len(words_for_scoring(expected[0])) + 6)
    assert f"WER {rate:.2%} over 2 lines with a reference text" in err and "most errors: train.json:3" in err
    # the other formats take a manifest's audio too
    assert main(["transcribe", "--model", str(parity_dir / MODEL), "--manifest", str(manifest)]) == 0
    assert capsys.readouterr().out.splitlines() == expected


def test_files_become_a_manifest(parity_dir, parity_audio, capsys):
    assert main(["transcribe", "--model", str(parity_dir / MODEL), "--format", "manifest", *parity_audio[:2]]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["audio_filepath"] for line in lines] == parity_audio[:2]
    assert all(line["pred_text"] and line["duration"] > 0 for line in lines)


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", "train.json:2: "),
    ('["a list"]', "train.json:2: each line must be a JSON object with an audio_filepath"),
    ('{"text": "no audio"}', "train.json:2: each line must be a JSON object with an audio_filepath"),
    ('{"audio_filepath": "a.wav", "offset": "ten"}', "train.json:2: offset is a number of seconds, not 'ten'"),
    ('{"audio_filepath": "a.wav", "duration": 0}', "train.json:2: .*a duration is more than 0 s"),
    ('{"audio_filepath": "a.wav", "offset": -3}', "train.json:2: .*an offset is 0 s or more"),
])
def test_a_bad_manifest_line_is_refused_before_the_model_loads(tmp_path, capsys, line, message):
    manifest = _write_manifest(tmp_path / "train.json", [{"audio_filepath": "a.wav"}, line])
    assert main(["transcribe", "--model", str(tmp_path / "no-such-model.nemo"), "--manifest", str(manifest)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and re.search(message, err), err


def test_a_manifest_with_a_byte_order_mark_or_a_byte_that_is_not_utf8(tmp_path):
    """A byte order mark (Windows editors write one) refused line 1 as not JSON; a byte that is not UTF-8 was an
    error without a line number, raised while the file was read."""
    from service.manifest import read_manifest

    marked = tmp_path / "marked.json"
    marked.write_bytes(b"\xef\xbb\xbf" + json.dumps({"audio_filepath": "a.wav"}).encode() + b"\n")
    assert [entry.clip.path.name for entry in read_manifest(marked)] == ["a.wav"]
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'{"audio_filepath": "a.wav"}\n{"audio_filepath": "caf\xe9.wav"}\n')
    with pytest.raises(ValueError, match=r"latin.json:2: .*utf-8"):
        read_manifest(latin)


def test_unreadable_lines_are_reported_by_line_and_the_rest_transcribed(parity_dir, parity_audio, tmp_path, capsys):
    (tmp_path / "noise.wav").write_bytes(b"not audio at all" * 100)
    manifest = _write_manifest(tmp_path / "m.json", [
        {"audio_filepath": parity_audio[0]}, {"audio_filepath": "gone.wav"}, {"audio_filepath": "noise.wav"},
        {"audio_filepath": parity_audio[0], "offset": 99.0},
    ])
    assert main(["transcribe", "--model", str(parity_dir / MODEL), "--manifest", str(manifest),
                 "--format", "manifest"]) == 1
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 1
    assert "error: m.json:2: " in err and "no such audio file" in err
    assert "error: m.json:3: " in err and "cannot decode audio" in err
    assert "error: m.json:4: " in err and "offset lies past the end" in err
    assert "3 of 4 manifest lines could not be read" in err


def test_a_manifest_run_refuses_what_it_cannot_do(parity_audio, tmp_path, capsys):
    manifest = _write_manifest(tmp_path / "m.json", [{"audio_filepath": parity_audio[0]}] * 2)
    _write_manifest(tmp_path / "empty.json", [""])
    for args, message in [
        (["--manifest", str(manifest), parity_audio[0]], "not both"),
        ([], "no audio: give files, directories or --manifest"),
        (["--manifest", str(manifest), "--output-dir", str(tmp_path / "out")], "no --output-dir"),
        (["--format", "manifest", "--output-dir", str(tmp_path / "out"), parity_audio[0]],
         "--output FILE, not --output-dir"),
        (["--manifest", str(manifest), "--format", "srt"], "the manifest has 2"),
        (["--manifest", str(tmp_path / "empty.json")], "no lines"),
        (["--manifest", str(tmp_path / "absent.json")], "absent.json"),
    ]:
        assert main(["transcribe", *args]) == 2
        assert message in capsys.readouterr().err


def test_scoring_ignores_case_and_punctuation_and_skips_lines_without_a_reference():
    rate = ErrorRate()
    clip = AudioClip(Path("a.wav"))
    rate.add(ManifestEntry({"text": "Hello, World! It's me."}, clip, "m:1"), "hello world its me")
    rate.add(ManifestEntry({}, clip, "m:2"), "anything")
    assert (rate.errors, rate.words, rate.lines) == (1, 4, 1)  # "it's" against "its"
    assert rate.report().startswith("WER 25.00% over 1 lines") and ErrorRate().report() == ""


def test_a_run_cut_short_resumes_where_it_stopped(parity_dir, parity_audio, tmp_path, capsys):
    """--output FILE appends a line a result; --skip-existing leaves out the inputs already there, a line torn by
    a kill included: the file ends as one whole run writes it."""
    manifest = _write_manifest(tmp_path / "m.json", [
        {"audio_filepath": parity_audio[0]}, {"audio_filepath": parity_audio[1], "offset": 0.5},
        {"audio_filepath": parity_audio[0]},  # listed twice: transcribed twice
        {"audio_filepath": parity_audio[2], "duration": 1.0},
    ])
    run = ["transcribe", "--model", str(parity_dir / MODEL), "--manifest", str(manifest), "--format", "manifest"]
    whole, cut = tmp_path / "whole.json", tmp_path / "cut.json"
    assert main([*run, "--output", str(whole)]) == 0
    lines = whole.read_text().splitlines(keepends=True)
    assert len(lines) == 4 and capsys.readouterr().out == ""
    cut.write_text(lines[0] + lines[1] + lines[2][:25])  # killed while writing the third line
    assert main([*run, "--output", str(cut), "--skip-existing"]) == 0
    assert cut.read_text() == whole.read_text()
    assert "2 inputs already in" in capsys.readouterr().err
    assert main([*run, "--output", str(cut), "--skip-existing"]) == 0  # all done: nothing to do
    assert cut.read_text() == whole.read_text() and "4 inputs already in" in capsys.readouterr().err
    # files as jsonl, likewise
    files = ["transcribe", "--model", str(parity_dir / MODEL), "--format", "jsonl", *parity_audio[:3]]
    assert main([*files, "--output", str(tmp_path / "all.jsonl")]) == 0
    records = (tmp_path / "all.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "part.jsonl").write_text(records[0])
    assert main([*files, "--output", str(tmp_path / "part.jsonl"), "--skip-existing"]) == 0
    assert (tmp_path / "part.jsonl").read_text() == "".join(records)


def test_output_takes_line_formats_and_its_own_lines(parity_audio, tmp_path, capsys):
    (tmp_path / "other.json").write_text('"a string"\n')
    for args, message in [
        (["--format", "text", "--output", str(tmp_path / "o.txt")], "--output takes the line formats"),
        (["--format", "jsonl", "--output", str(tmp_path / "o"), "--output-dir", str(tmp_path)], "without --output-dir"),
        (["--format", "manifest", "--output", str(tmp_path / "other.json"), "--skip-existing"],
         "other.json:1: not a result line"),
    ]:
        assert main(["transcribe", *args, parity_audio[0]]) == 2
        assert message in capsys.readouterr().err


def test_a_manifest_submitted_as_a_bulk_job_gives_what_transcribe_gives(redis_server, parity_dir, parity_audio,
                                                                        tmp_path, capsys):
    """`submit --manifest --wait --format manifest`: each stretch uploaded as the samples read here, so its
    prediction is transcribe's, token for token; through a server and straight into Redis alike."""
    (tmp_path / "broken.wav").write_bytes(b"RIFF....not audio at all")
    manifest = _write_manifest(tmp_path / "m.json", [
        {"audio_filepath": parity_audio[0], "text": "a reference"},  # a whole file: uploaded as it is
        {"audio_filepath": parity_audio[1], "offset": 0.5, "duration": 1.0, "speaker": 3},
        {"audio_filepath": "broken.wav"},
        {"audio_filepath": parity_audio[1], "offset": 1.5},  # 16-bit: its own frames, in FLAC
        {"audio_filepath": "float.wav", "offset": 0.25, "duration": 1.5},  # float: the 16 kHz samples, float32
        {"audio_filepath": parity_audio[0], "offset": 0.5, "duration": 60.0},  # past its end: said, kept
    ])
    sf.write(tmp_path / "float.wav", read_audio(parity_audio[2]), 16000, subtype="FLOAT")
    model_path = str(parity_dir / MODEL)
    assert main(["transcribe", "--model", model_path, "--manifest", str(manifest), "--format", "manifest"]) == 1
    captured = capsys.readouterr()
    expected = [json.loads(line) for line in captured.out.splitlines()]
    assert "warning: m.json:6: the audio ends " in captured.err  # and the line keeps its duration (below)
    model = load_model(model_path, device="cpu", dtype="float32")
    with run_server(Settings(redis_url=redis_server.url, max_wait_ms=20), model) as running:
        for target in (["--server", running.url], ["--redis-url", redis_server.url]):
            out = tmp_path / "out.json"
            status = main(["submit", *target, "--manifest", str(manifest), "--wait", "--format", "manifest",
                           "--output", str(out)])
            err = capsys.readouterr().err
            lines = [json.loads(line) for line in out.read_text().splitlines()]
            assert status == 1 and "error: m.json:3: failed:" in err  # the broken line, by its line
            assert [line["pred_text"] for line in lines] == [line["pred_text"] for line in expected]
            assert [line["audio_filepath"] for line in lines] == [line["audio_filepath"] for line in expected]
            assert lines[1]["speaker"] == 3 and lines[1]["duration"] == 1.0
            assert lines[2]["duration"] == pytest.approx(expected[2]["duration"], abs=1e-3)
            assert len(lines) == 5 and lines[3]["pred_text"] and lines[4]["duration"] == 60.0
            assert "warning: m.json:6: the audio ends " in err and "short of the line's duration of 60 s" in err
            assert "over 1 lines with a reference text" in err


@pytest.mark.parametrize(("name", "rate", "channels", "subtype", "multichannel", "kind"), [
    ("speech.wav", 16000, 1, "PCM_16", False, "flac"),
    ("call.wav", 8000, 1, "ULAW", False, "flac"),  # telephony: a sixth of the float32 samples
    ("bytes.wav", 8000, 1, "PCM_U8", False, "flac"),
    ("studio.flac", 16000, 2, "PCM_24", True, "flac"),
    ("stereo.wav", 16000, 2, "PCM_16", False, "flac"),  # mixed down by the worker, as here
    ("high.wav", 48000, 1, "PCM_24", False, "wav"),  # its own frames would be larger than 16 kHz float32
    ("float.wav", 16000, 1, "FLOAT", False, "wav"),
    ("call.m4a", 16000, 1, None, False, "wav"),  # FFmpeg's frames: not read as integers
])
def test_a_stretch_is_uploaded_as_what_decodes_to_the_samples_read_here(parity_audio, tmp_path, name, rate,
                                                                          channels, subtype, multichannel, kind):
    wave = resample(read_audio(parity_audio[3]), 16000, rate)
    wave = np.stack([wave, -0.5 * wave], axis=1) if channels == 2 else wave
    path = tmp_path / name
    if subtype is None:
        path.write_bytes(encode(wave, "m4a"))
    else:
        sf.write(path, wave, rate, subtype=subtype)
    for clip in (AudioClip(path, 0.3, 1.2), AudioClip(path, 0.7)):
        file_name, body, content_type = stretch_upload(clip, multichannel)
        assert file_name.endswith(f".{kind}") and content_type == f"audio/{kind}"
        here = read_audio(clip, mix=not multichannel)
        assert np.array_equal(read_audio(body, mix=not multichannel), here)  # the very samples, bit for bit
        float32_bytes = here.size * 4
        assert len(body) <= upload_size(clip, multichannel)
        assert (len(body) < float32_bytes) == (kind == "flac")
    with pytest.raises(AudioError, match="offset lies past the end"):
        stretch_upload(AudioClip(path, 60.0), multichannel)


def test_submit_takes_a_manifest_or_files_and_manifest_lines_need_one(parity_audio, tmp_path, capsys):
    # a stretch counts its frames toward --job-bytes (16-bit at 16 kHz, as uploaded in FLAC at most)
    whole_s = len(read_audio(parity_audio[0])) / 16000
    assert upload_size(AudioClip(Path(parity_audio[0]), 0.5, 1.0)) == 16000 * 2 + HEADER_BYTES
    assert upload_size(AudioClip(Path(parity_audio[0]), 1.0)) == int((whole_s - 1.0) * 16000 * 2) + HEADER_BYTES
    manifest = _write_manifest(tmp_path / "m.json", [{"audio_filepath": parity_audio[0]}])
    for args, message in [
        (["--manifest", str(manifest), parity_audio[0]], "not both"),
        (["--format", "manifest", "--wait", parity_audio[0]], "it needs --manifest and --wait"),
        (["--manifest", str(manifest), "--format", "manifest"], "it needs --manifest and --wait"),
        (["--manifest", str(manifest), "--wait", "--output-dir", str(tmp_path)], "--output-dir"),
    ]:
        assert main(["submit", "--redis-url", "redis://127.0.0.1:1", *args]) == 2
        assert message in capsys.readouterr().err


def test_submit_leaves_out_a_manifest_line_whose_audio_it_cannot_upload_naming_it(redis_server, parity_audio,
                                                                                  tmp_path, capsys):
    """A line whose file is gone, or whose stretch does not open as audio, is said by its line and left out, the rest
    submitted (status 1), as transcribe --manifest does: one bad file in thousands refused the whole manifest."""
    (tmp_path / "notes.wav").write_text("not audio\n")
    bad = [({"audio_filepath": "gone.wav"}, "no such audio file"),
           ({"audio_filepath": "gone.wav", "offset": 0.5, "duration": 1.0}, "no such audio file"),
           ({"audio_filepath": "notes.wav", "offset": 0.5, "duration": 1.0}, "cannot read audio")]
    manifest = _write_manifest(tmp_path / "m.json", [{"audio_filepath": parity_audio[0]}, *(line for line, _ in bad),
                                                     {"audio_filepath": parity_audio[1], "duration": 1.0}])
    assert main(["submit", "--redis-url", redis_server.url, "--manifest", str(manifest)]) == 1
    captured = capsys.readouterr()
    for number, (line, message) in enumerate(bad, start=2):
        assert f"error: m.json:{number}: {tmp_path / line['audio_filepath']}: {message}" in captured.err
    assert "3 manifest lines were not sent" in captured.err
    assert json.loads(captured.out)["total_items"] == 2
    # nothing left to send: refused, nothing sent (this Redis is not there)
    only_bad = _write_manifest(tmp_path / "bad.json", [line for line, _ in bad])
    assert main(["submit", "--redis-url", "redis://127.0.0.1:1", "--manifest", str(only_bad)]) == 2
    assert "bad.json: no line's audio could be read" in capsys.readouterr().err


def test_a_jobs_path_items_may_name_a_stretch_the_worker_reads_from_disk(redis_server, parity_dir, parity_audio,
                                                                        tmp_path):
    """POST /v1/jobs with `{"path", "offset", "duration"}` items: a worker reads just that stretch of a file on its
    disk (nothing of it goes through Redis), the same samples the Python API's AudioClip reads; the duration
    limit counts the stretch; an offset past the end fails only its item, with the reason."""
    roots = tmp_path / "inputs"
    roots.mkdir()
    long_file = roots / "call.wav"
    long_file.write_bytes(Path(parity_audio[1]).read_bytes())  # 3.2 s
    model = load_model(parity_dir / MODEL, device="cpu", dtype="float32")
    wave = read_audio(long_file)
    expected = [t.text for t in model.transcribe([wave[8000:24000], wave[24000:]])]
    settings = Settings(redis_url=redis_server.url, input_roots=[str(roots)], max_duration_s=2.0)
    with run_server(settings, model) as running:
        items = [{"path": str(long_file), "offset": 0.5, "duration": 1.0}, {"path": str(long_file), "offset": 1.5},
                 {"path": str(long_file)}, {"path": str(long_file), "offset": 9.0}]
        job = httpx.post(f"{running.url}/v1/jobs", json={"items": items}, timeout=30).json()
        done = wait_job(running.url, job["id"])
        lines = [json.loads(line) for line in
                 httpx.get(f"{running.url}/v1/jobs/{job['id']}/results", timeout=30).text.splitlines()]
        refused = [httpx.post(f"{running.url}/v1/jobs", json={"items": [{"path": str(long_file), **bad}]}, timeout=30)
                   for bad in ({"offset": -1}, {"duration": 0}, {"offset": "ten"},
                               {"offset": 1e308}, {"duration": 1e308})]  # finite, but infinitely many frames
        empty = httpx.post(f"{running.url}/v1/jobs", json={"items": []}, timeout=30).json()["error"]
    assert done["status"] == "completed_with_errors"
    assert [line["text"] for line in lines[:2]] == expected
    assert lines[0]["audio"] == f"{long_file} [0.5 s to 1.5 s]" and lines[1]["audio"] == f"{long_file} [1.5 s to end]"
    assert lines[2]["status"] == "failed" and "the limit is 2 s" in lines[2]["error"]  # the whole file is too long
    assert lines[3]["status"] == "failed" and "lies past the end of the audio" in lines[3]["error"]
    assert all(r.status_code == 400 and r.json()["error"]["code"] == "invalid_job" for r in refused)
    # the place and the problem in a line, not pydantic's dump of it
    assert refused[2].json()["error"]["param"] == "items.0.offset"
    assert refused[2].json()["error"]["message"].startswith("invalid job: items.0.offset: Input should be a valid")
    assert empty["param"] == "items" and empty["message"] == (
        "invalid job: items: List should have at least 1 item after validation, not 0")


def test_submit_paths_sends_where_the_files_are_not_their_bytes(redis_server, parity_dir, parity_audio, tmp_path,
                                                               capsys):
    """`submit --paths`: a manifest's files and stretches, and plain files, as path items that the workers read
    from the disk they share with the submitter; the same predictions as transcribe, through a server and
    straight into Redis; a file outside the workers' input roots refused before anything is queued."""
    roots = tmp_path / "inputs"
    roots.mkdir()
    for name in parity_audio[:2]:
        (roots / Path(name).name).write_bytes(Path(name).read_bytes())
    first, second = sorted(roots.iterdir())
    manifest = _write_manifest(roots / "m.json", [
        {"audio_filepath": first.name}, {"audio_filepath": second.name, "offset": 0.5, "duration": 1.0},
        {"audio_filepath": second.name, "offset": 1.5, "text": "a reference"},
    ])
    model_path = str(parity_dir / MODEL)
    assert main(["transcribe", "--model", model_path, "--manifest", str(manifest), "--format", "manifest"]) == 0
    expected = [json.loads(line)["pred_text"] for line in capsys.readouterr().out.splitlines()]
    model = load_model(model_path, device="cpu", dtype="float32")
    settings = Settings(redis_url=redis_server.url, input_roots=[str(roots)], max_wait_ms=20)
    with run_server(settings, model) as running:
        for target in (["--server", running.url], ["--redis-url", redis_server.url]):
            out = tmp_path / "out.json"
            assert main(["submit", *target, "--paths", "--manifest", str(manifest), "--wait", "--format", "manifest",
                         "--output", str(out)]) == 0
            assert [json.loads(line)["pred_text"] for line in out.read_text().splitlines()] == expected
            assert "WER" in capsys.readouterr().err
        assert main(["submit", "--server", running.url, "--paths", "--wait", "--output-dir", str(tmp_path / "txt"),
                     "--format", "text", str(first)]) == 0
        outside = main(["submit", "--server", running.url, "--paths", parity_audio[0]])
    assert (tmp_path / "txt" / f"{first.stem}.txt").read_text() == expected[0] + "\n"
    assert outside == 2 and "outside the input roots" in capsys.readouterr().err


def test_a_manifest_written_into_another_folder_reads_back_from_there(parity_dir, parity_audio, tmp_path,
                                                                     monkeypatch, capsys):
    """audio_filepath was written as given (relative to the working folder) and is read, as NeMo reads it,
    relative to the manifest's folder: a manifest made into another folder named no file there."""
    monkeypatch.chdir(tmp_path)
    Path("clips").mkdir()
    for i, source in enumerate(parity_audio[:2]):
        Path(f"clips/{i}.wav").write_bytes(Path(source).read_bytes())
    model = ["transcribe", "--model", str(parity_dir / MODEL)]
    made, again = Path("manifests/made.jsonl"), Path("out/deep/again.jsonl")
    made.parent.mkdir()
    again.parent.mkdir(parents=True)
    assert main([*model, "clips", "--format", "manifest", "--output", str(made)]) == 0
    assert [json.loads(line)["audio_filepath"] for line in made.read_text().splitlines()] == [
        "../clips/0.wav", "../clips/1.wav"]
    rewrite = [*model, "--manifest", str(made), "--format", "manifest", "--output", str(again)]
    assert main(rewrite) == 0
    lines = [json.loads(line) for line in again.read_text().splitlines()]
    assert [line["audio_filepath"] for line in lines] == ["../../clips/0.wav", "../../clips/1.wav"]
    capsys.readouterr()
    assert main([*rewrite, "--skip-existing"]) == 0  # resumed: the lines as written are what it matches
    assert "2 inputs already in" in capsys.readouterr().err
    assert main([*model, "--manifest", str(again), "--format", "manifest"]) == 0  # read back from its folder
    assert [json.loads(line)["pred_text"] for line in capsys.readouterr().out.splitlines()] == [
        line["pred_text"] for line in lines]
    Path("link").symlink_to(tmp_path / "out" / "deep")  # written through a link: relative to where it leads,
    assert main([*model, "--manifest", str(made), "--format", "manifest", "--output", "link/via.jsonl"]) == 0
    via = [json.loads(line)["audio_filepath"] for line in Path("link/via.jsonl").read_text().splitlines()]
    assert via == ["../../clips/0.wav", "../../clips/1.wav"]  # as the file system (and NeMo) opens them
    assert main([*model, "--manifest", "link/via.jsonl", "--format", "jsonl"]) == 0
