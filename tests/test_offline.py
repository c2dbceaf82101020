"""Offline transcription (ASRModel.transcribe_iter, `batchasr transcribe`): long audio cut and stitched exactly as
the service does it, inputs read a window at a time, and an unreadable input reported in its place."""

from __future__ import annotations

import io
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf

from models import load_model
from models.audio_io import AudioError
from models.transcript import Transcript
from service.cli import main
from service.config import Settings
from tests.conftest import long_recording
from tests.servers import run_server


def test_long_audio_offline_equals_the_service(model, parity_audio):
    """The same cuts and the same stitching, batched differently: the same tokens, frames and words."""
    recording, _ = long_recording(parity_audio, 100)
    offline = model.transcribe([recording], batch_size=3, max_segment_s=30)[0]
    assert offline.duration_s == pytest.approx(len(recording) / 16000)
    buffer = io.BytesIO()
    sf.write(buffer, recording, 16000, format="FLAC")
    with run_server(Settings(max_segment_s=30, segment_overlap_s=2, max_batch_size=8), model) as running:
        served = httpx.post(f"{running.url}/v1/transcribe", content=buffer.getvalue(),
                            headers={"content-type": "audio/flac"}, timeout=300).json()
    assert served["segments"] >= 4
    assert (offline.tokens, offline.token_frames) == (served["tokens"], served["token_frames"])
    assert offline.text == served["text"]


def test_the_command_line_cuts_long_files_unless_told_not_to(parity_dir, parity_audio, tmp_path, capsys):
    recording, _ = long_recording(parity_audio, 70)
    path = tmp_path / "long.flac"
    sf.write(path, recording, 16000)
    model_file = str(parity_dir / "tdt.nemo")
    assert main(["transcribe", "--model", model_file, str(path)]) == 0
    cut = capsys.readouterr().out.strip()
    assert main(["transcribe", "--model", model_file, "--max-segment-s", "0", str(path)]) == 0
    whole = capsys.readouterr().out.strip()
    model = load_model(model_file, device="cpu", dtype="float32")
    cut_tokens = model.transcribe([recording], max_segment_s=30)[0]
    whole_tokens = model.transcribe([recording])[0]
    assert cut_tokens.tokens != whole_tokens.tokens  # (pieces see less context: here they decode differently)
    assert cut == cut_tokens.text and whole == whole_tokens.text


def test_inputs_are_read_a_window_at_a_time(model, parity_audio):
    waves = [sf.read(p, dtype="float32")[0] for p in parity_audio]
    taken: list[int] = []

    def inputs():
        for i in range(40):
            taken.append(i)
            yield waves[i % len(waves)]

    results = model.transcribe_iter(inputs(), batch_size=2, window=4)
    first = next(results)
    assert len(taken) <= 8  # this window and the next, read while this one is transcribed
    rest = list(results)
    assert len(taken) == 40 and len(rest) == 39
    whole = model.transcribe([waves[i % len(waves)] for i in range(40)], batch_size=2)
    assert [t.tokens for t in [first, *rest]] == [t.tokens for t in whole]  # windows change nothing


def _count_reads(model, monkeypatch) -> tuple[list[int], list[int]]:
    """Windows of 2 batches; the inputs read so far (their indices), and how many had been read as each batch
    was encoded."""
    from models import offline

    monkeypatch.setattr(offline, "WINDOW_BATCHES", 2)
    read: list[int] = []
    read_by_batch: list[int] = []
    load_audio, encode = model.load_audio, model.encode
    monkeypatch.setattr(model, "load_audio",
                        lambda item, index=0, *rest: read.append(index) or load_audio(item, index, *rest))
    monkeypatch.setattr(model, "encode", lambda waves, **kw: read_by_batch.append(len(read)) or encode(waves, **kw))
    return read, read_by_batch


def test_a_list_of_files_is_read_a_window_at_a_time(model, parity_audio, monkeypatch):
    """``transcribe`` of paths holds a window of their audio, not all of it; waveforms are sorted together."""
    read, read_by_first_batch = _count_reads(model, monkeypatch)
    paths = [parity_audio[i % len(parity_audio)] for i in range(40)]
    results = model.transcribe(paths, batch_size=2)
    assert len(read) == 40 and read_by_first_batch[0] <= 8  # this window of 2 batches and the next
    waves = [sf.read(p, dtype="float32")[0] for p in paths]
    read.clear(), read_by_first_batch.clear()
    assert [t.tokens for t in results] == [t.tokens for t in model.transcribe(waves, batch_size=2)]
    assert read_by_first_batch[0] == 40  # arrays: one window, every input sorted together


def test_long_recordings_come_out_a_few_at_a_time(model, parity_audio, tmp_path, monkeypatch):
    """A window was a count of inputs (16 batches): an archive of two-hour recordings was read 256 at a time, held
    whole, and nothing came out for hours. Now a window holds about 16 full batches of the longest pieces' audio
    (here 2 x 2 x 30 s): the first is read until it does, the next as many as the mean length allows."""
    from models import offline

    monkeypatch.setattr(offline, "WINDOW_BATCHES", 2)
    recording, _ = long_recording(parity_audio, 100)
    paths = []
    for i in range(6):
        paths.append(tmp_path / f"tape{i}.wav")
        sf.write(paths[-1], recording, 16000)
    read: list[int] = []
    load_audio = model.load_audio
    monkeypatch.setattr(model, "load_audio",
                        lambda item, index=0, *rest: read.append(index) or load_audio(item, index, *rest))
    options = offline.OfflineOptions(batch_size=2, max_segment_s=30.0, readers=1)
    outcomes = offline.transcribe_stream(model, [str(p) for p in paths], options)
    first = next(outcomes)
    assert len(read) <= 3  # the first window's two (200 s), and one read ahead
    rest = list(outcomes)
    assert len(read) == 6 and all(t.text == first.text for t in rest)
    small = offline.OfflineOptions(batch_size=2, max_segment_s=30.0, readers=1)  # short clips: windows of 2 batches
    read.clear()
    clips = offline.transcribe_stream(model, parity_audio[:8], small)
    next(clips)
    assert len(read) == 8  # the first window's 4, and the next 4 read ahead
    list(clips)


def test_an_unreadable_input_comes_out_in_its_place_or_raises(model, parity_audio, tmp_path):
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"not audio" * 50)
    inputs = [parity_audio[0], str(bad), parity_audio[1], str(tmp_path / "missing.wav")]
    outcomes = list(model.transcribe_iter(inputs, return_errors=True))
    assert [type(o) for o in outcomes] == [Transcript, AudioError, Transcript, FileNotFoundError]
    assert "bad.wav" in str(outcomes[1])
    assert outcomes[2].text == model.transcribe([parity_audio[1]])[0].text
    with pytest.raises(AudioError, match=r"bad\.wav"):
        model.transcribe(inputs)


def test_the_library_the_command_and_the_service_take_the_same_shortest_segment(model, parity_dir, parity_audio,
                                                                                capsys):
    """`batchasr transcribe --max-segment-s 4.5` was taken (the library refused only 4 s or less) while the
    service's BATCHASR_MAX_SEGMENT_S refused anything under 5: one minimum now, refused in the same words."""
    from pydantic import ValidationError

    from models.segmenter import MIN_SEGMENT_S

    words = f"must be at least {MIN_SEGMENT_S:g} seconds"
    assert MIN_SEGMENT_S == 5
    for short in (4.5, 3, float("nan")):
        with pytest.raises(ValueError, match=f"max_segment_s {words}"):
            model.transcribe([np.zeros(16000, dtype=np.float32)], max_segment_s=short)
        with pytest.raises(ValidationError, match=words):
            Settings(max_segment_s=short)
        with pytest.raises(SystemExit) as refused:  # before the model loads
            main(["transcribe", "--model", str(parity_dir / "tdt.nemo"), "--max-segment-s", str(short),
                  parity_audio[0]])
        assert refused.value.code == 2 and f"--max-segment-s: {words} (or 0: every file whole)" in \
            capsys.readouterr().err
    assert Settings(max_segment_s=MIN_SEGMENT_S).max_segment_s == MIN_SEGMENT_S
    assert model.transcribe([parity_audio[0]], max_segment_s=MIN_SEGMENT_S)[0].text
    assert main(["transcribe", "--model", str(parity_dir / "tdt.nemo"), "--max-segment-s", "5", "--format", "text",
                 parity_audio[0]]) == 0


def test_integer_pcm_arrays_are_scaled_as_their_files_decode(model, parity_audio):
    """int32 samples were taken at face value: about 65,536 times too loud, and transcribed as other words."""
    import soundfile as sf

    as_float = model.transcribe([parity_audio[3]])[0]
    for dtype in ("int16", "int32"):
        samples, _ = sf.read(parity_audio[3], dtype=dtype)
        got = model.transcribe([samples])[0]
        assert (got.text, got.tokens) == (as_float.text, as_float.tokens), dtype
    unsigned = (sf.read(parity_audio[3], dtype="int16")[0].astype(np.int32) // 256 + 128).astype(np.uint8)
    assert model.transcribe([unsigned])[0].text  # 8-bit PCM centred on 128 reads as speech, not a DC offset


@pytest.mark.parametrize("dtype", [np.bool_, np.complex64, np.complex128])
def test_arrays_of_no_samples_are_refused(model, dtype):
    """A bool array was transcribed as samples of 0 and 1; a complex one with its imaginary part dropped."""
    samples = (np.arange(16000) % 7 == 0).astype(dtype)
    with pytest.raises(AudioError, match=rf"audio\[1\]: expected float or integer PCM samples, got an array of "
                                         rf"{np.dtype(dtype)}"):
        model.transcribe([np.zeros(16000, dtype=np.float32), samples])


def test_a_truncated_wav_is_reported_by_the_command_line_as_over_http(parity_audio, tmp_path, capsys):
    """libsndfile decodes what is there: a half-downloaded file gave a part of its transcript, and exit 0."""
    data = Path(parity_audio[0]).read_bytes()
    cut = tmp_path / "cut.wav"
    cut.write_bytes(data[: len(data) // 3])
    assert main(["transcribe", "--model", "models/assets/default.nemo", str(cut), parity_audio[1]]) == 1
    err = capsys.readouterr().err
    assert f"{cut}: the audio is truncated: its header promises" in err and "the file holds" in err


def test_clips_are_read_like_files(model, parity_audio, monkeypatch):
    """A clip given alone is one input (it was iterated, a TypeError), and a list of clips is read a window at a
    time like a list of paths (it was read all at once, as arrays are)."""
    from models import AudioClip

    clip = AudioClip(Path(parity_audio[1]), 0.5, 1.0)
    wave = sf.read(parity_audio[1], dtype="float32")[0][8000:24000]
    (alone,) = model.transcribe(clip)
    assert (alone.tokens, alone.duration_s) == (model.transcribe([wave])[0].tokens, 1.0)
    read, read_by_first_batch = _count_reads(model, monkeypatch)
    clips = [AudioClip(Path(parity_audio[i % len(parity_audio)]), 0.25) for i in range(40)]
    assert len(model.transcribe(clips, batch_size=2)) == 40
    assert len(read) == 40 and read_by_first_batch[0] <= 8  # this window of 2 batches and the next


def test_an_array_of_any_strides_is_transcribed(model, parity_audio):
    """A reversed array (negative strides) raised torch's ValueError; a channel of a (samples, channels) array is
    a strided view."""
    wave = sf.read(parity_audio[2], dtype="float32")[0]
    reversed_wave, stereo = wave[::-1], np.stack([wave, -wave], axis=1)
    expected = model.transcribe([reversed_wave.copy(), wave])
    got = model.transcribe([reversed_wave, stereo[:, 0]])
    assert [t.tokens for t in got] == [t.tokens for t in expected]


def test_a_samples_by_channels_array_is_refused_not_taken_as_thousands_of_channels(model, parity_audio):
    """sf.read gives (samples, channels): with ``multichannel`` such an array was taken as 43,000 channels of two
    samples each, and comparing every channel with every other never finished."""
    wave = sf.read(parity_audio[0], dtype="float32")[0]
    stereo = np.stack([wave, 0.5 * wave[::-1]], axis=1)
    with pytest.raises(AudioError, match=r"expected \(channels, samples\).*array\.T"):
        model.transcribe(stereo, multichannel=True)
    (conversation,) = model.transcribe(stereo.T, multichannel=True)
    assert len(conversation.channels) == 2
