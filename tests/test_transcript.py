"""Word grouping, word timings and subtitle rendering."""

from __future__ import annotations

import itertools
import re

import pytest

from decoding.types import Hypothesis
from models import load_model
from models.conversation import Conversation
from models.transcript import Transcript, Word, build_transcript
from service.formats import SubtitleLayout, cues, to_srt, to_vtt


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
    # a duration between milliseconds (117.11525 s): the word ends by it however the duration is rounded
    words = build_transcript(hyp, hybrid.tokenizer, frame_s=0.08, duration_s=0.50025).words
    assert words[1].end_s == 0.5 <= round(0.50025, 3)


def test_cues_split_on_duration_and_length():
    words = [Word(f"w{i}", i * 1.0, i * 1.0 + 0.5) for i in range(10)]
    groups = cues(words, SubtitleLayout(max_cue_s=3.0))
    assert [c.text for c in groups] == ["w0 w1 w2", "w3 w4 w5", "w6 w7 w8", "w9"]
    assert all(c.end_s - c.start_s <= 3.0 for c in groups)
    # a word alone that spans a long pause (read into a tape's quiet) is on screen for the cue's longest, no more
    long = cues([Word("distantly", 627.28, 640.16), Word("after", 641.0, 641.3)], SubtitleLayout())
    assert [(c.text, c.start_s, c.end_s) for c in long] == [("distantly", 627.28, 633.28), ("after", 641.0, 641.3)]


SENTENCE = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "and", "then", "it", "runs", "far",
            "away", "into", "the", "deep", "dark", "forest", "of", "southwestern", "north", "america"]


def _words(texts: list[str]) -> list[Word]:
    return [Word(text, i * 0.2, i * 0.2 + 0.15) for i, text in enumerate(texts)]


@pytest.mark.parametrize("width,count", [(42, 2), (20, 1), (30, 3), (12, 2)])
def test_cues_are_laid_out_in_lines_of_like_length_within_the_layout(width, count):
    layout = SubtitleLayout(max_line_width=width, max_line_count=count)
    groups = cues(_words(SENTENCE), layout)
    assert " ".join(line for c in groups for line in c.lines) == " ".join(SENTENCE)  # every word once, in order
    for c in groups:
        assert " ".join(c.lines) == c.text and 1 <= len(c.lines) <= count
        assert all(len(line) <= width or " " not in line for line in c.lines)
    # each cue is as full as the layout allows: its next word would not have fitted
    for c, following in itertools.pairwise(groups):
        wider = cues(_words([*c.text.split(), following.text.split()[0]]), layout)
        assert len(wider) == 2


def test_a_two_line_cue_reads_as_two_lines_of_like_length():
    (cue,) = cues(_words(SENTENCE[-7:]))  # deep dark forest of southwestern north america
    assert cue.lines == ("deep dark forest of", "southwestern north america")  # not 39 characters and 7
    first, _ = cues(_words(SENTENCE))
    assert first.lines == ("the quick brown fox jumps over the lazy", "dog and then it runs far away into the")


def test_a_speakers_label_counts_toward_the_first_line_and_a_long_word_gets_a_line():
    for c in cues(_words(SENTENCE), lead=len("[customer] ")):
        assert len("[customer] ") + len(c.lines[0]) <= 42 and all(len(line) <= 42 for line in c.lines)
    long = "pneumonoultramicroscopicsilicovolcanoconiosis"  # 45 characters
    assert [c.lines for c in cues(_words(["a", long, "b"]))] == [("a", long), ("b",)]


def test_a_conversations_srt_counts_the_speakers_label_and_its_vtt_does_not():
    channel = Transcript(text=" ".join(SENTENCE), tokens=[], token_frames=[], duration_s=10.0, words=_words(SENTENCE))
    conversation = Conversation([channel], names=["customer"])
    srt_cues = [block.splitlines()[2:] for block in to_srt(conversation).strip().split("\n\n")]
    assert all(cue[0].startswith("[customer] ") for cue in srt_cues)
    assert all(len(line) <= 42 for cue in srt_cues for line in cue)
    vtt_cues = [block.splitlines()[1:] for block in to_vtt(conversation).split("\n\n")[1:] if block.strip()]
    assert all(cue[0].startswith("<v customer>") for cue in vtt_cues)
    shown = [line.removeprefix("<v customer>") for cue in vtt_cues for line in cue]
    assert all(len(line) <= 42 for line in shown) and max(len(line) for line in shown) > 42 - len("[customer] ")


def test_a_layout_out_of_range_is_refused():
    for options in ({"max_line_width": 0}, {"max_line_width": 1001}, {"max_line_count": 0}, {"max_line_count": 11}):
        with pytest.raises(ValueError, match=next(iter(options))):
            SubtitleLayout(**options)


def test_srt_and_vtt_parse_back(hybrid, parity_audio):
    t = hybrid.transcribe(parity_audio[:1])[0]
    stamp = r"(\d\d):(\d\d):(\d\d)[,.](\d\d\d)"
    srt_blocks = to_srt(t).strip().split("\n\n")
    assert [b.splitlines()[0] for b in srt_blocks] == [str(i) for i in range(1, len(srt_blocks) + 1)]
    assert " ".join(line for b in srt_blocks for line in b.splitlines()[2:]) == t.text
    vtt = to_vtt(t)
    assert vtt.startswith("WEBVTT\n\n")
    times = [m.groups() for m in re.finditer(stamp, vtt)]
    seconds = [int(h) * 3600 + int(m) * 60 + int(s) + int(ms) / 1000 for h, m, s, ms in times]
    assert seconds == sorted(seconds) and seconds[-1] <= t.duration_s + 1e-3


def test_short_words_beside_one_too_long_keep_to_the_width():
    """The search for like lines began at the longest word's length: beside a word longer than a line, the short
    words were packed to its length ("please pay the", 14 characters in lines of 12)."""
    words = ["please", "pay", "the", "bill", "for", "telecommunications"]
    (cue,) = cues(_words(words), SubtitleLayout(max_line_width=12, max_line_count=3))
    assert cue.lines == ("please pay", "the bill for", "telecommunications")
    label = len("[a speaker of thirty characters] ")  # the label and the first word pass the width alone
    for c in cues(_words(SENTENCE), SubtitleLayout(max_line_width=42), lead=label):
        assert all(len(line) <= 42 for line in c.lines[1:])


def test_cue_text_cannot_break_the_format_and_a_cue_takes_time():
    """Words went into cues as they were: <, & and --> broke WebVTT, and --> an SRT reader. A word that takes no
    time (a TDT token of duration 0) made a cue that ends as it starts, which WebVTT players drop."""
    words = [Word("a<b>", 0.8, 0.8), Word("&", 0.8, 0.9), Word("x-->y", 0.9, 1.0)]
    transcript = Transcript(text="a<b> & x-->y", tokens=[], token_frames=[], duration_s=2.0, words=words)
    vtt = to_vtt(transcript)
    assert "a&lt;b&gt; &amp; x--&gt;y" in vtt and vtt.count("-->") == 1
    assert "x->y" in to_srt(transcript) and to_srt(transcript).count("-->") == 1
    (alone,) = cues([Word("okay", 0.8, 0.8)])
    assert (alone.start_s, alone.end_s) == (0.8, 0.801)
    assert "00:00:00.800 --> 00:00:00.801" in to_vtt(Transcript(text="okay", tokens=[], token_frames=[],
                                                                duration_s=2.0, words=[Word("okay", 0.8, 0.8)]))
