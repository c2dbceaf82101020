"""Upload decoding: resampling block by block gives exactly the samples resampling the whole file gives."""

from __future__ import annotations

import io
import struct
import threading
import tracemalloc
from pathlib import Path
from tempfile import SpooledTemporaryFile

import numpy as np
import pytest
import soundfile as sf
import torch

from models.audio_io import (
    MAX_AMPLITUDE,
    AudioClip,
    AudioError,
    Stretch,
    check_waveform,
    read_audio,
    resample,
    to_mono,
)
from models.config import FeatureConfig
from models.features import LogMelFeatures
from service import audio
from service.audio import (
    AudioLimits,
    AudioRequestError,
    AudioTooLarge,
    DecodeStopped,
    decode_audio,
    decode_audio_file,
)
from tests.conftest import long_recording

LIMITS = AudioLimits(max_bytes=50 * 1024 * 1024, max_duration_s=60.0)


def _encode(samples: np.ndarray, rate: int, format: str, subtype: str | None = None) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, samples, rate, format=format, subtype=subtype)
    return buffer.getvalue()


def _whole_file_decode(data: bytes) -> np.ndarray:
    samples, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    return resample(to_mono(samples), rate, 16000)


@pytest.mark.parametrize(("rate", "channels", "format", "subtype"), [
    (48000, 2, "WAV", "PCM_16"), (44100, 1, "FLAC", None), (8000, 1, "WAV", "FLOAT"), (22050, 2, "OGG", "VORBIS"),
    (16000, 1, "WAV", "PCM_16"), (11025, 3, "WAV", "PCM_24"),
])
@pytest.mark.parametrize("block_frames", [4_001, 1 << 20])
def test_blockwise_decoding_equals_decoding_the_whole_file(monkeypatch, rate, channels, format, subtype,
                                                           block_frames):
    monkeypatch.setattr(audio, "BLOCK_FRAMES", block_frames)  # small blocks: dozens of them, and a short last one
    rng = np.random.default_rng(rate + channels)
    t = np.arange(int(rate * 3.3)) / rate
    tone = 0.3 * np.sin(2 * np.pi * 440 * t)[:, None] + 0.05 * rng.standard_normal((len(t), channels))
    data = _encode(tone.astype(np.float32), rate, format, subtype)
    decoded = decode_audio(data, LIMITS)
    assert decoded.dtype == np.float32 and decoded.ndim == 1
    np.testing.assert_array_equal(decoded, _whole_file_decode(data))


def test_a_non_finite_sample_in_a_late_block_is_refused(monkeypatch):
    monkeypatch.setattr(audio, "BLOCK_FRAMES", 1000)
    samples = np.zeros((48000, 2), dtype=np.float32)
    samples[40000, 1] = np.nan
    with pytest.raises(AudioRequestError, match="NaN or infinite"):
        decode_audio(_encode(samples, 48000, "WAV", "FLOAT"), LIMITS)


def test_a_decode_given_up_stops_at_its_next_block(monkeypatch, tmp_path):
    monkeypatch.setattr(audio, "BLOCK_FRAMES", 1000)
    blocks_read = []
    read_block = audio.sample_problem

    def counting(block):  # called once a block
        blocks_read.append(len(block))
        return read_block(block)

    monkeypatch.setattr(audio, "sample_problem", counting)
    data = _encode(np.zeros(48000, dtype=np.float32), 16000, "WAV", "PCM_16")
    path = tmp_path / "a.wav"
    path.write_bytes(data)
    stop = threading.Event()
    assert decode_audio(data, LIMITS, stop=stop).shape == (48000,)  # not set: decoded whole
    stop.set()
    for decode, source in ((decode_audio, data), (decode_audio_file, path)):
        blocks_read.clear()
        with pytest.raises(DecodeStopped):
            decode(source, LIMITS, stop=stop)
        assert len(blocks_read) == 1  # of 48


def test_samples_too_loud_for_the_features_are_refused(tmp_path):
    """A float WAV of finite samples of 1e20 passed the check for NaN and gave NaN features (the power spectrum
    overflows float32 from about 1e16), transcribed as unknown tokens with NaN scores. The largest samples accepted
    give finite features, even as a square wave at the Nyquist frequency, the spectrum's worst case."""
    square = np.tile(np.float32([1, -1]), 8000)
    featurizer = LogMelFeatures(FeatureConfig())
    feats, _ = featurizer(torch.from_numpy(square * MAX_AMPLITUDE)[None], torch.tensor([len(square)]))
    assert torch.isfinite(feats).all()
    tone = np.sin(np.arange(16000) / 9).astype(np.float32)
    loud = _encode(np.stack([tone, tone], axis=1) * 1e20, 16000, "WAV", "FLOAT")
    for multichannel in (False, True):
        with pytest.raises(AudioRequestError, match="samples past 1e\\+12 in magnitude"):
            decode_audio(loud, LIMITS, multichannel)
    (tmp_path / "loud.wav").write_bytes(loud)
    with pytest.raises(AudioError, match="samples past"):  # the Python API's files, and its arrays
        read_audio(tmp_path / "loud.wav")
    with pytest.raises(AudioError, match="samples past"):
        check_waveform(tone * 1e20, "audio[0]")
    at_int16_scale = decode_audio(_encode(tone * 32768, 16000, "WAV", "FLOAT"), LIMITS)  # as some tools write floats
    np.testing.assert_array_equal(at_int16_scale, tone * 32768)


def test_audio_longer_than_the_limit_is_refused(monkeypatch):
    monkeypatch.setattr(audio, "BLOCK_FRAMES", 1000)
    data = _encode(np.zeros(2 * 44100, dtype=np.float32), 44100, "FLAC")
    with pytest.raises(AudioTooLarge):
        decode_audio(data, AudioLimits(max_bytes=LIMITS.max_bytes, max_duration_s=1.0))


def test_a_file_decodes_from_disk_as_its_bytes_do_whatever_its_size(tmp_path):
    rng = np.random.default_rng(7)
    data = _encode((0.1 * rng.standard_normal((44100 * 5, 2))).astype(np.float32), 44100, "WAV", "PCM_16")
    path = tmp_path / "long.wav"
    path.write_bytes(data)
    small_uploads = AudioLimits(max_bytes=len(data) // 4, max_duration_s=60.0)
    with pytest.raises(AudioTooLarge):
        decode_audio(data, small_uploads)
    np.testing.assert_array_equal(decode_audio_file(path, small_uploads), decode_audio(data, LIMITS))
    with pytest.raises(AudioTooLarge, match="per its header"):
        decode_audio_file(path, AudioLimits(max_bytes=LIMITS.max_bytes, max_duration_s=2.0))


def test_a_truncated_or_empty_file_on_disk_is_refused_with_the_reason(tmp_path):
    data = _encode(np.zeros(16000 * 2, dtype=np.float32), 16000, "WAV", "PCM_16")
    cut = tmp_path / "cut.wav"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(AudioRequestError, match=r"truncated.* the file holds "):  # a worker's path: no upload
        decode_audio_file(cut, LIMITS)
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    with pytest.raises(AudioRequestError, match="empty"):
        decode_audio_file(empty, LIMITS)


@pytest.mark.parametrize("in_memory", [True, False])
def test_an_upload_decodes_from_its_temporary_file_within_the_same_limits(in_memory):
    rng = np.random.default_rng(8)
    data = _encode((0.1 * rng.standard_normal((44100 * 3, 2))).astype(np.float32), 44100, "FLAC")
    wav = _encode(np.zeros(16000 * 2, dtype=np.float32), 16000, "WAV", "PCM_16")

    def spooled(content: bytes) -> SpooledTemporaryFile:
        upload = SpooledTemporaryFile(max_size=len(content) + 1 if in_memory else 1)  # noqa: SIM115 - test's own
        upload.write(content)
        return upload  # left at its end: the decoder reads it from its start

    np.testing.assert_array_equal(decode_audio(spooled(data), LIMITS), decode_audio(data, LIMITS))
    with pytest.raises(AudioTooLarge, match=f"upload of {len(data)} bytes"):
        decode_audio(spooled(data), AudioLimits(max_bytes=len(data) - 1, max_duration_s=60.0))
    with pytest.raises(AudioTooLarge, match="per its header"):
        decode_audio(spooled(wav), AudioLimits(max_bytes=LIMITS.max_bytes, max_duration_s=1.0))
    with pytest.raises(AudioRequestError, match="truncated"):
        decode_audio(spooled(wav[: len(wav) // 2]), LIMITS)
    with pytest.raises(AudioRequestError, match="empty"):
        decode_audio(spooled(b""), LIMITS)


@pytest.mark.parametrize(("channels", "rate"), [(1, 16000), (2, 16000), (2, 8000)])
def test_audio_without_samples_read_with_its_channels_apart_is_an_audio_error(tmp_path, channels, rate):
    """A WAV of no frames read with its channels apart (``transcribe --multichannel``) failed to reshape its samples:
    a ValueError, which ended the run rather than being reported as that file's error."""
    path = tmp_path / "empty.wav"
    sf.write(path, np.zeros((0, channels), dtype=np.float32), rate)
    with pytest.raises(AudioError, match="no samples"):
        read_audio(path, mix=False)
    with pytest.raises(AudioRequestError, match="no samples"):
        decode_audio(path.read_bytes(), LIMITS, multichannel=True)


def test_a_stretch_of_a_damaged_mp3_is_an_audio_error(tmp_path):
    """Two free-format MPEG layer I frame headers and a few bytes: libsndfile counted 2,073 frames and decoded 1,152,
    and its seek to frame 2,072 landed at 5,912, where soundfile's next read asked numpy for a negative length. The
    ValueError ended a manifest's run (a line that cannot be read is reported, and the rest transcribed) and failed
    a job's item in numpy's words. FFmpeg, which reads MP3 now, refuses the file as it opens it."""
    path = tmp_path / "damaged.mp3"
    path.write_bytes(bytes.fromhex("ffff000000ffff0000c7e207ffecaac658b2cc0120802608f5c454"))
    offset_s = 2072 / 44100
    with pytest.raises(AudioError, match=r"cannot decode audio \(not a readable MP3 file"):
        read_audio(AudioClip(path, offset_s))
    with pytest.raises(AudioRequestError, match="cannot decode audio: not a readable MP3 file"):
        decode_audio_file(path, LIMITS, stretch=Stretch(offset_s))


@pytest.mark.parametrize("declared", [0xFFFFFFFF, 0x7FFFF000, 0x7FFF0000, 0x80000000, 0],
                         ids=["all-ones", "sox", "gstreamer", "arecord", "zero"])
def test_a_wav_streamed_through_a_pipe_decodes_whatever_size_its_header_guessed(declared):
    """A tool writing WAV to a pipe cannot go back to fill in the sizes: sox writes 0x7FFFF000 (some 11 hours at
    16 kHz), which was refused as too long; GStreamer's 0x7FFF0000 and arecord's 0x80000000 (`arecord > x.wav`)
    were refused as truncated, by the Python API too; older FFmpeg's 0 read as "no samples" (FFmpeg reads it now)."""
    data = bytearray(_encode(np.sin(np.arange(16000 * 2) / 9).astype(np.float32) * 0.3, 16000, "WAV", "PCM_16"))
    expected = decode_audio(bytes(data), LIMITS)
    at = data.index(b"data")
    struct.pack_into("<I", data, at + 4, declared)
    struct.pack_into("<I", data, 4, (declared + 36) & 0xFFFFFFFF)
    np.testing.assert_array_equal(decode_audio(bytes(data), LIMITS), expected)
    np.testing.assert_array_equal(read_audio(bytes(data)), expected)


def test_audio_over_a_limit_is_refused_as_that_whatever_type_its_client_declared():
    # curl sends a raw body as application/x-www-form-urlencoded: what decodes is audio, and its limits answer
    buffer = io.BytesIO()
    sf.write(buffer, np.zeros((16000, 3), dtype=np.float32), 16000, format="FLAC")
    limits = AudioLimits(max_bytes=LIMITS.max_bytes, max_duration_s=60.0, max_channels=2)
    with pytest.raises(audio.TooManyChannels):
        audio.decode_declared_audio(buffer.getvalue(), "application/x-www-form-urlencoded", limits, multichannel=True)
    with pytest.raises(audio.UnsupportedMediaType):  # what does not decode is still refused as its declared type
        audio.decode_declared_audio(b"not audio\n" * 50, "text/plain", limits)


@pytest.mark.parametrize(("channels", "format", "subtype"), [(9, "WAV", "PCM_U8"), (64, "OGG", "VORBIS")])
def test_audio_of_more_channels_than_the_limit_is_refused_even_mixed_down(channels, format, subtype):
    """Mixing down decodes every channel, a block of all of them at a time: 70 s of 255 silent Vorbis channels is
    a 78 kB upload that took a gigabyte. More channels than ``max_channels`` are refused whether kept apart or
    not; within it, mixing down is as before."""
    buffer = io.BytesIO()
    sf.write(buffer, np.zeros((16000, channels), dtype=np.float32), 16000, format=format, subtype=subtype)
    limits = AudioLimits(max_bytes=LIMITS.max_bytes, max_duration_s=60.0, max_channels=8)
    for multichannel in (False, True):
        with pytest.raises(audio.TooManyChannels, match=f"{channels} channels; at most 8"):
            decode_audio(buffer.getvalue(), limits, multichannel)
    buffer = io.BytesIO()
    sf.write(buffer, np.zeros((16000, 8), dtype=np.float32), 16000, format=format, subtype=subtype)
    assert decode_audio(buffer.getvalue(), limits).shape == (16000,)


def test_audio_of_a_sample_rate_past_the_limit_is_refused():
    """The duration limit counts seconds, and a second costs its samples: 60 s of silence at 655,350 Hz is a 142 kB
    FLAC that took 18 times the CPU of the same at 16 kHz to decode and resample."""
    limits = AudioLimits(max_bytes=LIMITS.max_bytes, max_duration_s=60.0)
    for rate, refused in ((200_000, True), (655_350, True), (audio.MAX_SAMPLE_RATE, False)):
        buffer = io.BytesIO()
        sf.write(buffer, np.zeros(rate // 10, dtype=np.float32), rate, format="FLAC")
        if refused:
            with pytest.raises(audio.UnsupportedSampleRate, match=f"{rate} Hz"):
                audio.decode_declared_audio(buffer.getvalue(), "text/plain", limits)  # whatever its declared type
        else:
            assert decode_audio(buffer.getvalue(), limits).shape == (1600,)


@pytest.mark.parametrize(("minutes", "format"), [(0.25, "WAV"), (1.5, "FLAC"), (2.0, "WAV")])
def test_decode_cost_makes_the_minutes_asked_for(minutes, format):
    """loadtest/decode_cost.py made whole minutes: --minutes 0.25 decoded (and reported as 0.25 min) a full one."""
    from tests.conftest import REPO, load_script

    cost = load_script(REPO / "loadtest" / "decode_cost.py")
    info = sf.info(io.BytesIO(cost.make_upload(minutes, 8000, 2, format)))
    assert (info.frames, info.channels) == (round(minutes * 60 * 8000), 2)


SPEECH = Path(__file__).parent / "data" / "default_model"


@pytest.mark.parametrize(("rate", "channels"), [(16000, 1), (44100, 2)])
def test_a_long_recording_is_held_once_while_it_decodes(rate, channels):
    """Blocks go straight into one array sized from the file's stated length, and the samples are checked without
    a copy: a list of blocks joined at the end, then np.abs of the whole, held 3.5 hours of FLAC three times over
    (2.4 GB where the waveform is 0.8 GB). What is held besides the waveform is a block's worth."""
    recording, _ = long_recording(sorted(SPEECH.glob("*.wav")), 20 * 60)
    wave = resample(recording, 16000, rate) if rate != 16000 else recording
    data = _encode(np.stack([wave] * channels, axis=1) if channels > 1 else wave, rate, "FLAC")
    limits = AudioLimits(max_bytes=len(data), max_duration_s=3600.0)
    for decode in (lambda: decode_audio(data, limits), lambda: read_audio(data)):
        tracemalloc.start()
        try:
            samples = decode()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert len(samples) == pytest.approx(len(recording), abs=16)
        assert peak < 1.3 * samples.nbytes, f"{peak / samples.nbytes:.2f} times the waveform held"


def test_a_flac_stating_an_unknown_length_decodes_and_is_held_to_the_limit_as_it_is_read(monkeypatch):
    """A FLAC encoded to a pipe states 0 samples, "unknown": libsndfile took that for 2^63 - 1 frames, so the
    service refused it as 576,460,752,303,423 s long "per its header", and the Python API failed reading it."""
    data = bytearray(_encode(np.sin(np.arange(16000 * 3) / 7).astype(np.float32) * 0.3, 16000, "FLAC"))
    expected = decode_audio(bytes(data), LIMITS)
    data[8 + 13] &= 0xF0  # STREAMINFO's 36-bit sample count, from the low half of its 14th byte: 0
    data[8 + 14 : 8 + 18] = bytes(4)
    np.testing.assert_array_equal(decode_audio(bytes(data), LIMITS), expected)
    np.testing.assert_array_equal(read_audio(bytes(data)), expected)
    monkeypatch.setattr(audio, "BLOCK_FRAMES", 4000)
    with pytest.raises(AudioTooLarge, match="longer than allowed"):
        decode_audio(bytes(data), AudioLimits(max_bytes=LIMITS.max_bytes, max_duration_s=2.0))


def test_a_stretch_running_past_the_end_of_its_file_is_what_the_file_holds():
    """Manifests round durations up: a 20 s file's item of 30.5 s (or of an hour) was refused as "30.5 s long (per
    its header)" against a 30 s limit."""
    data = _encode(np.sin(np.arange(16000 * 20) / 7).astype(np.float32) * 0.3, 16000, "WAV", "PCM_16")
    limits = AudioLimits(max_bytes=LIMITS.max_bytes, max_duration_s=30.0)
    whole = decode_audio(data, limits)
    for duration_s in (30.5, 3600.0):
        np.testing.assert_array_equal(decode_audio(data, limits, stretch=Stretch(0, duration_s)), whole)
    np.testing.assert_array_equal(decode_audio(data, limits, stretch=Stretch(15, 16.0)), whole[15 * 16000 :])


def test_audio_stating_no_length_is_held_to_the_limit_to_the_frame():
    """Read a frame past the limit, as a header stating it is refused: a frame more was let through."""
    limit_s = 16000 / 16000
    for frames, refused in ((16000, False), (16001, True)):
        data = _encode(np.full(frames, 0.1, dtype=np.float32), 16000, "WAV", "PCM_16")
        at = data.index(b"data")
        streamed = data[: at + 4] + struct.pack("<I", 0) + data[at + 8 :]  # states no length (FFmpeg reads it)
        limits = AudioLimits(max_bytes=LIMITS.max_bytes, max_duration_s=limit_s)
        if refused:
            with pytest.raises(AudioTooLarge, match="longer than allowed"):
                decode_audio(streamed, limits)
        else:
            assert len(decode_audio(streamed, limits)) == frames
