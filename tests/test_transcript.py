"""Word grouping, word timings and subtitle rendering."""

from __future__ import annotations

import re

import pytest

from decoding.types import Hypothesis
from models import load_model
from models.transcript import Word, build_transcript
from service.formats import cues, to_srt, to_vtt


@pytest.fixture(scope="module")
def hybrid(parity_dir):
    return load_model(parity_dir / "tdt_ctc_hybrid.nemo", device="cpu")


def test_words_join_to_the_text_and_times_are_monotonic(hybrid, parity_audio):
    for decoder in ("tdt", "ctc"):
        for t in hybrid.transcribe(parity_audio, decoder=decoder):
            assert " ".join(w.word for w in t.words) == t.text
            previous_end = 0.0
            for w in t.words:
                assert previous_end <= w.start_s <= w.end_s <= t.duration_s
                previous_end = w.end_s


def test_word_pieces_group_at_boundary_markers(hybrid):
    pieces = hybrid.tokenizer.pieces
    ids = [pieces.index(p) for p in ("▁th", "er", "e", "▁", "w", "▁wh")]
    hyp = Hypothesis(tokens=ids, frames=[0, 1, 2, 5, 6, 9], durations=[1, 1, 2, 1, 1, 1])
    t = build_transcript(hyp, hybrid.tokenizer, frame_s=0.08, duration_s=1.0)
    assert [w.word for w in t.words] == ["there", "w", "wh"]
    assert [(w.start_s, w.end_s) for w in t.words] == [(0.0, 0.32), (0.4, 0.56), (0.72, 0.8)]


def test_word_end_never_passes_the_next_word_or_the_audio(hybrid):
    pieces = hybrid.tokenizer.pieces
    ids = [pieces.index("▁th"), pieces.index("▁wh")]
    hyp = Hypothesis(tokens=ids, frames=[3, 3], durations=[4, 4])
    words = build_transcript(hyp, hybrid.tokenizer, frame_s=0.08, duration_s=0.5).words
    assert words[0].end_s == words[0].start_s == words[1].start_s == 0.24
    assert words[1].end_s == 0.5


def test_cues_split_on_duration_and_length():
    words = [Word(f"w{i}", i * 1.0, i * 1.0 + 0.5) for i in range(10)]
    groups = cues(words, max_s=3.0)
    assert [c.text for c in groups] == ["w0 w1 w2", "w3 w4 w5", "w6 w7 w8", "w9"]
    assert all(c.end_s - c.start_s <= 3.0 for c in groups)


def test_srt_and_vtt_parse_back(hybrid, parity_audio):
    t = hybrid.transcribe(parity_audio[:1])[0]
    stamp = r"(\d\d):(\d\d):(\d\d)[,.](\d\d\d)"
    srt_blocks = to_srt(t).strip().split("\n\n")
    assert [b.splitlines()[0] for b in srt_blocks] == [str(i) for i in range(1, len(srt_blocks) + 1)]
    assert " ".join(b.splitlines()[2] for b in srt_blocks) == t.text
    vtt = to_vtt(t)
    assert vtt.startswith("WEBVTT\n\n")
    times = [m.groups() for m in re.finditer(stamp, vtt)]
    seconds = [int(h) * 3600 + int(m) * 60 + int(s) + int(ms) / 1000 for h, m, s, ms in times]
    assert seconds == sorted(seconds) and seconds[-1] <= t.duration_s + 1e-3
