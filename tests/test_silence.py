"""``skip_silence``: long quiet stretches found by energy and left out; what is said around them is transcribed as
it would be alone, in the recording's own time."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from models import load_model
from models.segmenter import plan_pieces
from models.silence import MIN_SILENCE_S, PAD_S, speech_regions

DATA = Path(__file__).parent / "data" / "default_model"
EXPECTED = json.loads((DATA / "expected.json").read_text())
RATE = 16000
FRAME = 1280  # the default model's encoder frame: 80 ms
NOISE = 0.002


def _clip(name: str) -> np.ndarray:
    return sf.read(DATA / name, dtype="float32")[0]


def _recording(parts: list[tuple[float, np.ndarray]], seconds: float, noise: float = NOISE) -> np.ndarray:
    """``parts`` (start in seconds, samples) over line noise."""
    wave = (np.random.default_rng(1).standard_normal(int(seconds * RATE)) * noise).astype(np.float32)
    for start_s, samples in parts:
        start = int(start_s * RATE)
        wave[start : start + len(samples)] += samples
    return wave


def test_long_quiet_stretches_are_found_and_short_ones_kept():
    a, b = _clip("sentences_000028.wav"), _clip("voice_000142.wav")  # 3.2 s and 2.9 s
    wave = _recording([(4.0, a), (4.0 + len(a) / RATE + 1.5, b), (20.0, a)], seconds=24.5)
    regions = speech_regions(wave, RATE, FRAME)
    assert len(regions) == 2  # 4 s of noise before, 1.5 s between (kept), 7.6 s between (skipped), 1.3 s after
    (first_start, first_end), (second_start, second_end) = regions
    assert first_start % FRAME == 0 and second_start % FRAME == 0
    assert 4.0 - PAD_S - 0.1 <= first_start / RATE <= 4.0  # the speech keeps its pad of quiet
    assert first_end / RATE >= 4.0 + (len(a) + len(b)) / RATE + 1.5
    assert 20.0 - PAD_S - 0.1 <= second_start / RATE <= 20.0
    assert second_end == len(wave)  # less than MIN_SILENCE_S after: kept to the end
    assert (second_start - first_end) / RATE >= MIN_SILENCE_S


@pytest.mark.parametrize(("name", "wave", "expected"), [
    ("digital silence", np.zeros(5 * RATE, np.float32), []),
    ("bare noise: nothing stands out", (np.random.default_rng(0).standard_normal(5 * RATE) * 0.01)
     .astype(np.float32), [(0, 5 * RATE)]),
    ("shorter than a skippable stretch", np.zeros(RATE, np.float32), [(0, RATE)]),
    # what tools export as silence, and a muted line sounds like: read as 25 words, where zeros read as none
    ("16-bit dither", np.random.default_rng(0).integers(-1, 2, 8 * RATE).astype(np.float32) / 32768, []),
])
def test_recordings_with_no_speech_to_find(name, wave, expected):
    assert speech_regions(wave, RATE, FRAME) == expected


def test_quiet_speech_and_a_single_short_word_are_kept():
    a = _clip("sentences_000028.wav")
    quiet = _recording([(3.0, a * 0.02)], seconds=12.0, noise=0.0005)  # speech 30 dB down, still over the floor
    (start, end), = speech_regions(quiet, RATE, FRAME)
    assert start / RATE <= 3.0 and end / RATE >= 3.0 + len(a) / RATE
    word = _clip("voice_000142.wav")[int(0.25 * RATE) : int(0.75 * RATE)]  # half a second in a minute
    (start, end), = speech_regions(_recording([(30.0, word)], seconds=60.0), RATE, FRAME)
    assert start / RATE <= 30.0 <= 31.0 <= end / RATE <= 31.0 + 2 * PAD_S


@pytest.fixture(scope="module")
def model():
    return load_model(device="cpu")


def test_what_is_said_around_a_skipped_stretch_reads_as_it_does_alone_in_the_recordings_time(model):
    a, b = _clip("sentences_000028.wav"), _clip("sentences_000110.wav")
    wave = _recording([(1.0, a), (15.0, b)], seconds=20.0)
    pieces = plan_pieces(wave, RATE, 30.0, 2.0, FRAME, skip_silence=True)
    assert len(pieces) == 2 and sum(p.end - p.start for p in pieces) < 0.6 * len(wave)
    (skipped,) = model.transcribe(wave, skip_silence=True)
    assert skipped.text == f"{EXPECTED['sentences_000028.wav']} {EXPECTED['sentences_000110.wav']}"
    tokens, frames = [], []
    for piece, alone in zip(pieces, model.transcribe([wave[p.start : p.end] for p in pieces]), strict=True):
        tokens += alone.tokens
        frames += [f + piece.start // FRAME for f in alone.token_frames]
    assert skipped.tokens == tokens and skipped.token_frames == frames
    assert skipped.duration_s == pytest.approx(20.0)
    assert 14.5 <= skipped.words[len(EXPECTED["sentences_000028.wav"].split())].start_s <= 15.5
    # the whole recording, cut only for length, reads the same here: the skipped noise held no words
    assert model.transcribe(wave, max_segment_s=30)[0].text == skipped.text


def test_a_silent_recording_costs_nothing_and_reads_empty(model):
    (silent,) = model.transcribe(np.zeros(10 * RATE, np.float32), skip_silence=True)
    assert silent.text == "" and silent.tokens == [] and silent.duration_s == 10.0


def test_a_channel_that_starts_after_a_long_quiet_gets_no_stray_word(model):
    """On the embedded model, seconds of line noise before a channel's first words can read as a word; skipped,
    they cannot."""
    customer = _recording([(3.9, _clip("sentences_000110.wav"))], seconds=9.0)
    assert model.transcribe(customer)[0].text != EXPECTED["sentences_000110.wav"]  # "judge a port city ..."
    assert model.transcribe(customer, skip_silence=True)[0].text == EXPECTED["sentences_000110.wav"]


def test_step_power_is_computed_a_chunk_at_a_time_with_the_same_result():
    """Squared as float64 whole, a recording's power held four times its float32 waveform (3 GB more for a
    3.5 hour call with skip_silence); chunks of steps give each step the same mean."""
    import tracemalloc

    from models.silence import step_power

    samples = np.random.default_rng(3).standard_normal(16000 * 600 + 123).astype(np.float32)
    for step in (1, 320, 16000):
        n = len(samples) // step
        at_once = np.square(samples[: n * step].astype(np.float64)).reshape(n, step).mean(axis=1)
        assert np.array_equal(step_power(samples, step), at_once), step
    tracemalloc.start()
    try:
        step_power(samples, 320)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < samples.nbytes, f"{peak / samples.nbytes:.2f} times the waveform held"
