"""Long-audio planning and stitching."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from pydantic import ValidationError

from decoding.types import Hypothesis
from models import load_model
from models.audio_io import read_audio
from models.segmenter import ENERGY_WINDOW_S, NO_CUT, _quietest_point, plan_segments
from models.stitching import Stitcher, stitch
from service.config import Settings
from tests.conftest import REPO, load_script

FRAME = 1280  # samples per encoder frame


def test_short_audio_is_one_piece():
    assert plan_segments(16000 * 10, np.zeros(160000), 16000, 30, 2, FRAME)[0].cut_after == NO_CUT


def test_cuts_fall_in_silence_and_pieces_cover_everything():
    rng = np.random.default_rng(0)
    wave = rng.standard_normal(16000 * 95).astype(np.float32)
    quiet = [int(16000 * s) for s in (26.0, 52.5, 79.0)]
    for q in quiet:
        wave[q : q + 3200] = 0
    segments = plan_segments(len(wave), wave, 16000, 30, 2, FRAME)
    assert [s.cut_before for s in segments[1:]] == [q + 1600 - (q + 1600) % FRAME for q in quiet]
    assert segments[0].start == 0 and segments[-1].end == len(wave)
    for a, b in itertools.pairwise(segments):
        assert b.start < a.end  # they overlap
        assert a.cut_after == b.cut_before and b.start % FRAME == 0
        assert a.end - a.start <= 30 * 16000


def test_stitch_keeps_each_unit_once_in_order():
    segments = plan_segments(16000 * 40, np.ones(16000 * 40), 16000, 30, 2, FRAME)
    assert len(segments) == 2
    cut_frame = segments[0].cut_after // FRAME
    offset = segments[1].start // FRAME
    # piece 1 sees tokens every 10 frames up to its end; piece 2 the same from its start
    first = Hypothesis(tokens=list(range(0, cut_frame + 12, 10)), frames=list(range(0, cut_frame + 12, 10)))
    local = list(range(0, 200, 10))
    second = Hypothesis(tokens=[offset + f for f in local], frames=local)
    merged = stitch([(segments[0], first), (segments[1], second)], None, FRAME)
    assert merged.frames == sorted(merged.frames)
    assert len(set(merged.tokens)) == len(merged.tokens)  # nothing doubled at the cut
    assert all(t < cut_frame for t in merged.tokens if t in first.tokens and t not in second.tokens)


def test_words_a_later_piece_heard_as_one_with_a_cut_off_word_are_kept_from_the_earlier_piece():
    """The later piece starts inside a word: it heard that word's tail and the two words after the cut as one word
    (its middle before the cut, so it left it to the earlier piece), while the earlier piece heard the two words
    apart, their middles past the cut (so it left them to the later piece): both were lost. Now the earlier piece
    keeps its words up to the end of the later piece's word that reaches past the cut, and nothing is doubled."""
    segments = plan_segments(16000 * 40, np.ones(16000 * 40), 16000, 30, 2, FRAME)
    cut, offset = segments[0].cut_after // FRAME, segments[1].start // FRAME
    # frames of the original: the earlier piece's words 10 (before the cut), 11 and 12 (after it), 13 (later)
    earlier = Hypothesis(tokens=[10, 11, 12, 13], frames=[cut - 6, cut + 1, cut + 3, cut + 12],
                         durations=[3, 1, 2, 2])
    # the later piece: one word from its first frame to just past 12, then 13 and 14
    later = Hypothesis(tokens=[99, 13, 14], frames=[0, cut + 12 - offset, cut + 20 - offset], durations=[
        cut + 5 - offset, 2, 2])
    assert (0 + cut + 5 - offset) / 2 + offset < cut  # its middle lies before the cut
    merged = stitch([(segments[0], earlier), (segments[1], later)], None, FRAME)
    assert merged.tokens == [10, 11, 12, 13, 14]
    assert merged.frames == sorted(merged.frames)
    assert _streamed([(segments[0], earlier), (segments[1], later)]) == [[], [10, 11, 12, 13, 14]]  # 10: in the overlap


def _streamed(pieces) -> list[list[int]]:
    """The tokens a stream gives out as each piece finishes (the last with the rest), which add up to the stitched
    hypothesis's: nothing given out is taken back."""
    stitcher = Stitcher(None, FRAME)
    given = [[t for _, words in stitcher.add(piece) for word in words for t in word.tokens] for piece in pieces]
    given[-1] += [t for _, words in stitcher.finish() for word in words for t in word.tokens]
    assert list(itertools.chain.from_iterable(given)) == stitch(pieces, None, FRAME).tokens
    return given


def test_a_word_both_pieces_heard_across_the_cut_is_kept_once():
    """The earlier piece times a word a frame before the later one: its middle just before the cut there, just past
    it in the later piece, and both kept it ("both both" in a real transcript). The later piece's word with the same
    tokens and its middle before the earlier one's end is that word again. Another word there is kept: RNN-T can put
    the next word on the frame the last one ends on. A stream says the same."""
    segments = plan_segments(16000 * 40, np.ones(16000 * 40), 16000, 30, 2, FRAME)
    cut, offset = segments[0].cut_after // FRAME, segments[1].start // FRAME
    earlier = Hypothesis(tokens=[4, 5], frames=[cut - 10, cut - 2], durations=[2, 3])  # 5: middle cut - 0.5
    heard_again = Hypothesis(tokens=[5, 6], frames=[cut - 1 - offset, cut + 5 - offset], durations=[2, 2])
    another = Hypothesis(tokens=[7, 6], frames=[cut - offset, cut + 5 - offset], durations=None)  # 7: middle cut + 0.5
    for later, expected in ((heard_again, [4, 5, 6]), (another, [4, 5, 7, 6])):
        pieces = [(segments[0], earlier), (segments[1], later)]
        assert stitch(pieces, None, FRAME).tokens == expected
        assert list(itertools.chain.from_iterable(_streamed(pieces))) == expected


@pytest.mark.parametrize(("earlier_at", "later_at"), [(1, -1), (-2, 0), (0, 0), (-1, 2), (2, -2)])
def test_a_word_both_pieces_heard_near_the_cut_is_kept_once_on_whichever_side_each_timed_it(earlier_at, later_at):
    """The review's cases, each word given by the side of the cut its middle fell on: "of" timed just past the cut
    by the earlier piece and just before it by the later one was left by each to the other, and lost ("music
    citile"); "for" timed a frame later by the later piece, past the earlier one's end, was said twice. Where the
    pieces agree on the words there, the earlier piece's are kept up to the agreed word nearest the cut."""
    segments = plan_segments(16000 * 40, np.ones(16000 * 40), 16000, 30, 2, FRAME)
    cut, offset = segments[0].cut_after // FRAME, segments[1].start // FRAME
    music, of, city, after = 7, 8, 9, 10  # the same tokens in both pieces, each word of one token
    earlier = Hypothesis(tokens=[music, of, city], frames=[cut - 5, cut + earlier_at, cut + 3], durations=[3, 1, 4])
    later = Hypothesis(tokens=[music, of, city, after],
                       frames=[f - offset for f in (cut - 5, cut + later_at, cut + 3, cut + 9)], durations=[3, 1, 4, 2])
    pieces = [(segments[0], earlier), (segments[1], later)]
    merged = stitch(pieces, None, FRAME)
    assert merged.tokens == [music, of, city, after]
    assert merged.frames == sorted(merged.frames)
    assert list(itertools.chain.from_iterable(_streamed(pieces))) == merged.tokens


def test_a_word_said_twice_at_the_cut_is_said_twice():
    """Paired in order: the earlier piece's second "the" is not the later piece's first."""
    segments = plan_segments(16000 * 40, np.ones(16000 * 40), 16000, 30, 2, FRAME)
    cut, offset = segments[0].cut_after // FRAME, segments[1].start // FRAME
    the, end = 3, 4
    earlier = Hypothesis(tokens=[the, the], frames=[cut - 2, cut], durations=[2, 2])
    later = Hypothesis(tokens=[the, the, end], frames=[cut - 2 - offset, cut - offset, cut + 4 - offset],
                       durations=[2, 2, 2])
    assert stitch([(segments[0], earlier), (segments[1], later)], None, FRAME).tokens == [the, the, end]


def test_a_long_recording_cut_inside_a_word_says_it_as_often_as_uncut(parity_audio):
    """The review's case, with the embedded model: the ten parity clips joined (28 s) and cut every 5 s, one cut
    inside "both", which both pieces kept (three times in the transcript, twice uncut). The stitched transcript says
    it as often as the uncut one."""
    model = load_model("models/assets/default.nemo", device="cpu", dtype="float32")
    clips = [read_audio(path) for path in sorted(parity_audio)]
    rng = np.random.default_rng(0)
    for _ in range(3):  # the third joining of the ten is the one cut inside "both"
        order = rng.permutation(len(clips))
        gaps = [np.zeros(int(rng.integers(0, 3000)), np.float32) for _ in order]
        wave = np.concatenate([x for i, gap in zip(order, gaps, strict=True) for x in (clips[i], gap)])
    whole = [w.word for w in model.transcribe([wave])[0].words]
    cut = [w.word for w in model.transcribe([wave], max_segment_s=5.0)[0].words]
    assert cut.count("both") == whole.count("both"), cut


def test_audio_that_was_not_cut_keeps_every_token():
    tokenizer = load_model("models/assets/default.nemo", device="cpu").tokenizer
    lone_marker = tokenizer.pieces.index("▁")  # renders as no word: stitching pieces would drop it
    ids = [tokenizer.pieces.index("▁the"), lone_marker, tokenizer.pieces.index("▁the")]
    hyp = Hypothesis(tokens=ids, frames=[0, 3, 4], durations=[2, 1, 40])  # the last span runs past the end
    [segment] = plan_segments(16000 * 2, np.zeros(16000 * 2), 16000, 30, 2, FRAME)
    assert stitch([(segment, hyp)], tokenizer, FRAME) == hyp


def _quietest_by_convolution(waveform: np.ndarray, earliest: int, latest: int, sample_rate: int) -> int:
    """The cut point as first written: each window's energy by a direct convolution (40 ms a cut)."""
    window = int(ENERGY_WINDOW_S * sample_rate)
    region = waveform[earliest:latest].astype(np.float64)
    energy = np.convolve(region**2, np.ones(window), mode="valid")
    best = int(np.argmin(energy))
    quiet = energy <= energy[best] + 1e-9 * max(1.0, float(energy[best]))
    end = best + int(np.argmin(quiet[best:])) if not quiet[best:].all() else len(quiet)
    return earliest + (best + end - 1) // 2 + window // 2


def test_running_sums_pick_the_cut_a_convolution_picks():
    rng = np.random.default_rng(3)
    for trial in range(20):
        wave = (rng.standard_normal(16000 * 12) * rng.uniform(0.01, 1.0)).astype(np.float32)
        for _ in range(trial % 4):  # pauses, some of digital silence several windows long
            at = int(rng.integers(0, len(wave) - 8000))
            wave[at : at + int(rng.integers(800, 8000))] *= 0 if trial % 2 else 1e-3
        earliest, latest = int(rng.integers(0, 16000 * 4)), int(rng.integers(16000 * 6, 16000 * 12))
        assert _quietest_point(wave, earliest, latest, 16000) == _quietest_by_convolution(wave, earliest, latest,
                                                                                        16000)


def test_an_overlap_of_half_a_segment_or_more_is_refused():
    """It used to loop for ever (an overlap of 8 s in 5 s pieces) or cut pieces with negative starts."""
    wave = np.ones(16000 * 120, dtype=np.float32)
    for overlap in (15, 31, 8):
        with pytest.raises(ValueError, match="under half the segment"):
            plan_segments(len(wave), wave, 16000, 30 if overlap != 8 else 5, overlap, FRAME)
    with pytest.raises(ValidationError, match=r"segment_overlap_s\n.* under half of max_segment_s \(5\)"):
        Settings(max_segment_s=5, segment_overlap_s=8)
    assert Settings(max_segment_s=5, segment_overlap_s=2).segment_overlap_s == 2


def test_the_service_refuses_segments_and_buckets_with_no_length_in_samples():
    """BATCHASR_MAX_SEGMENT_S=inf failed the first long recording (OverflowError), and a length bucket that rounds
    to no samples (1e-9 s) divided by zero at the first batch: the settings refuse them, as the command line does."""
    for field, value, message in (("max_segment_s", "inf", "finite"), ("length_bucket_s", "1e-9", ">= 0.5"),
                                  ("length_bucket_s", "inf", ">= 0.5"), ("length_bucket_s", "0.1", ">= 0.5")):
        with pytest.raises(ValidationError, match=f"{field}\n.*{message}"):
            Settings(**{field: value})
    assert Settings(length_bucket_s=0.5).length_bucket_s == 0.5


def test_a_piece_longer_than_a_batch_may_hold_is_refused():
    """A 30 s piece ran alone in a batch of MAX_BATCH_AUDIO_S=20, past the limit that bounds the batch's memory."""
    with pytest.raises(ValidationError, match=r"max_batch_audio_s\n.*at least max_segment_s \(30\)"):
        Settings(max_batch_audio_s=20)
    assert Settings(max_batch_audio_s=20, max_segment_s=20).max_segment_s == 20


def test_the_cut_words_script_counts_words_both_pieces_heard():
    """loadtest/cut_words.py (docs/benchmarks.md) on a minute of continuous speech cut every 10 s."""
    script = load_script(REPO / "loadtest" / "cut_words.py")
    model = load_model("models/assets/default.nemo", device="cpu", dtype="float32")
    wave = script.continuous_speech(1.0, seed=3)
    assert len(wave) == 60 * 16000 and np.sqrt(np.mean(wave**2)) > 0.02  # speech throughout, no pauses
    row = script.cut_errors(model, wave, 10.0, near_s=0.4)
    assert row["cuts"] >= 5 and row["words_both_heard"] >= row["cuts"]
    assert (row["lost"], row["doubled"]) == (len(row["lost_at"]), len(row["doubled_at"]))
