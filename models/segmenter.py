"""Long audio: split at quiet points with overlap, and stitch the pieces' hypotheses back into one.

Each cut point is the quietest 100 ms window in the last part of a segment, snapped to the encoder's frame
grid so that token frames of every piece map onto whole frames of the original. Pieces overlap by
``overlap_s`` around each cut; when stitching, a word belongs to the piece on whose side of the cut its
middle lies, so words at a cut are neither lost nor doubled; except that where the later piece heard a word
reaching past the cut with its middle before it (a cut-off word run together with the next), the earlier piece
keeps its own words up to that word's end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from decoding.types import Hypothesis

from .silence import Elsewhere, speech_regions
from .tokenizer import Tokenizer

ENERGY_WINDOW_S = 0.1  # length of the window whose energy picks a cut point
SEARCH_FRACTION = 0.3  # look for the cut in the last 30% of a segment
NO_CUT = 1 << 62  # the last piece keeps everything after its start cut, even a TDT span past the end
# the shortest pieces a recording may be cut into (``max_segment_s``), for the library, `batchasr transcribe` and the
# service alike: cuts overlap by 2 s, so a shorter piece would be mostly overlap, and the cuts must move on past it
MIN_SEGMENT_S = 5.0
# where longer recordings are cut by default (the service's and `batchasr transcribe`'s): about what the encoder
# was trained on, and what a batch's padded-audio budget is counted in when nothing else sets it
DEFAULT_MAX_SEGMENT_S = 30.0
SEGMENT_TOO_SHORT = f"must be at least {MIN_SEGMENT_S:g} seconds"
# the shortest length bucket (``length_bucket_s``): finer buckets rarely hold two pieces, so their batches are
# nearly all padding (pieces of speech's lengths, batches of 32: 9% of what was computed was audio at 0.1 s buckets,
# 79% at 2 s, 93% without buckets)
MIN_LENGTH_BUCKET_S = 0.5


def segment_problem(seconds: float) -> str | None:
    """What keeps ``seconds`` from being ``max_segment_s`` (None: nothing), for the library, the command and the
    service alike: too short (NaN too), or infinite (no length in samples: the first long recording failed)."""
    if not seconds >= MIN_SEGMENT_S:
        return SEGMENT_TOO_SHORT
    return "must be a finite number of seconds" if seconds == math.inf else None


def length_bucket_problem(seconds: float) -> str | None:
    """What keeps ``seconds`` from being ``length_bucket_s`` (None: nothing): a bucket is counted in whole samples,
    so NaN, infinity or a length that rounds to none failed at the first batch."""
    if not MIN_LENGTH_BUCKET_S <= seconds < math.inf:
        return f"must be a finite number of seconds >= {MIN_LENGTH_BUCKET_S:g}"
    return None


@dataclass(frozen=True)
class Segment:
    start: int  # first sample, inclusive
    end: int  # last sample, exclusive
    cut_before: int  # words whose middle lies before this sample (absolute) come from an earlier piece
    cut_after: int  # words whose middle lies at or after this sample come from a later piece

    @property
    def own_samples(self) -> int:
        """The samples only this piece accounts for: between its cuts (the overlaps counted once)."""
        return max(0, min(self.cut_after, self.end) - max(self.cut_before, self.start))


def plan_segments(n_samples: int, waveform: np.ndarray, sample_rate: int, max_segment_s: float,
                  overlap_s: float, frame_samples: int) -> list[Segment]:
    """Cut points every <= ``max_segment_s`` at the quietest window; pieces overlap by ``overlap_s``."""
    max_len = int(max_segment_s * sample_rate)
    if n_samples <= max_len:
        return [Segment(0, n_samples, 0, NO_CUT)]
    if not 0 <= overlap_s < max_segment_s / 2:  # a cut must move on past the overlap it leaves behind
        raise ValueError(f"overlap ({overlap_s:g} s) must be >= 0 and under half the segment ({max_segment_s:g} s)")
    half_overlap = int(overlap_s * sample_rate / 2) // frame_samples * frame_samples
    cuts = []
    start = 0
    while n_samples - start > max_len:
        # the next piece covers [start, cut + half_overlap), so the cut must leave room for the overlap
        latest = start + max_len - half_overlap
        earliest = max(start + half_overlap + frame_samples, latest - int(SEARCH_FRACTION * max_len))
        cut = _quietest_point(waveform, earliest, latest, sample_rate) // frame_samples * frame_samples
        cut = max(cut, start + frame_samples)
        cuts.append(cut)
        start = cut - half_overlap
    bounds = [0, *cuts, n_samples]
    segments = []
    for i in range(len(bounds) - 1):
        seg_start = 0 if i == 0 else bounds[i] - half_overlap
        seg_end = n_samples if i == len(bounds) - 2 else bounds[i + 1] + half_overlap
        cut_after = NO_CUT if i == len(bounds) - 2 else bounds[i + 1]
        segments.append(Segment(seg_start, seg_end, bounds[i], cut_after))
    return segments


def plan_pieces(waveform: np.ndarray, sample_rate: int, max_segment_s: float | None, overlap_s: float,
                frame_samples: int, skip_silence: bool = False, elsewhere: Elsewhere | None = None) -> list[Segment]:
    """Where a recording is cut for transcription: at quiet points every <= ``max_segment_s`` (None: whole), and
    with ``skip_silence`` around its long quiet stretches, which are left out (none at all for a silent one;
    ``elsewhere``: what of it is another channel's, which counts as quiet)."""
    n = len(waveform)
    regions = speech_regions(waveform, sample_rate, frame_samples, elsewhere) if skip_silence else [(0, n)]
    longest_s = max_segment_s if max_segment_s is not None else n / sample_rate + 1
    return plan_regions(waveform, regions, sample_rate, longest_s, overlap_s, frame_samples)


def plan_regions(waveform: np.ndarray, regions: list[tuple[int, int]], sample_rate: int, max_segment_s: float,
                 overlap_s: float, frame_samples: int) -> list[Segment]:
    """``plan_segments`` within each (start, end) region of ``waveform`` (starts on the frame grid), and nothing
    between them: the audio between two regions is not transcribed (models.silence)."""
    segments = []
    for i, (start, end) in enumerate(regions):
        # a region's last piece keeps its words up to the next region's start (nothing lies between)
        region_end = NO_CUT if i == len(regions) - 1 else regions[i + 1][0]
        for piece in plan_segments(end - start, waveform[start:end], sample_rate, max_segment_s, overlap_s,
                                   frame_samples):
            cut_after = region_end if piece.cut_after == NO_CUT else start + piece.cut_after
            segments.append(Segment(start + piece.start, start + piece.end, start + piece.cut_before, cut_after))
    return segments


def _quietest_point(waveform: np.ndarray, earliest: int, latest: int, sample_rate: int) -> int:
    """Middle of the lowest-energy window of ``ENERGY_WINDOW_S`` between two sample positions."""
    window = max(1, int(ENERGY_WINDOW_S * sample_rate))
    region = waveform[earliest:latest].astype(np.float64)
    if len(region) <= window:
        return (earliest + latest) // 2
    # each window's energy as a difference of running sums: a convolution took 40 ms a cut (23 s for 4 hours)
    running = np.concatenate(([0.0], np.cumsum(region**2)))
    energy = running[window:] - running[:-window]
    best = int(np.argmin(energy))
    # centre the cut in the run of equally quiet windows (a pause longer than one window)
    quiet = energy <= energy[best] + 1e-9 * max(1.0, float(energy[best]))
    end = best + int(np.argmin(quiet[best:])) if not quiet[best:].all() else len(quiet)
    return earliest + (best + end - 1) // 2 + window // 2


@dataclass(frozen=True)
class SaidWord:
    """The last word stitched from the pieces so far: where it ends (samples of the original) and its tokens. The
    piece after may hear it again across the cut, timed a frame or so later, its middle past the cut where the
    earlier piece had it before: both kept it. A word of the later piece with the same tokens whose middle lies
    before this end is that word again, kept once; another word there is not dropped (RNN-T may put the next word
    on the same frame)."""

    end: float
    tokens: tuple[int, ...]


NOTHING_SAID = SaidWord(-math.inf, ())


def stitch(pieces: list[tuple[Segment, Hypothesis]], tokenizer: Tokenizer | None, frame_samples: int,
           ) -> Hypothesis:
    """One hypothesis in the original's frames from pieces decoded separately (in order)."""
    if len(pieces) == 1 and _uncut(pieces[0][0]):
        return pieces[0][1]  # audio that was not cut: its hypothesis as decoded, every token kept
    out = Hypothesis(durations=[] if any(h.durations is not None for _, h in pieces) else None,
                     logprobs=[] if all(h.logprobs is not None for _, h in pieces) else None)
    units = [_units(segment, hyp, tokenizer, frame_samples) for segment, hyp in pieces]  # each piece's, once
    said = NOTHING_SAID
    for i, piece in enumerate(pieces):
        until = piece[0].cut_after
        if i + 1 < len(pieces):
            until = _handover(until, pieces[i + 1][0], units[i + 1])
        said = _add_words(out, piece, units[i], piece[0].cut_before, until, frame_samples, said) or said
    return out


def handover(piece: tuple[Segment, Hypothesis], following: tuple[Segment, Hypothesis], tokenizer: Tokenizer | None,
             frame_samples: int) -> int:
    """Where ``piece`` hands over to the piece after it: its cut, or past it (``_handover``)."""
    return _handover(piece[0].cut_after, following[0], _units(*following, tokenizer, frame_samples))


def _handover(cut: int, following: Segment, following_units: list[tuple[float, int, int, int]]) -> int:
    """The later piece begins inside the overlap, perhaps in the middle of a word: it may hear that word's cut-off
    tail and the words after the cut as one word reaching past the cut with its middle before it, which it leaves
    to the earlier piece, while the earlier piece left the real words (their middles past the cut) to it: both
    dropped them. So the earlier piece keeps its words up to the end of such a word."""
    if following.cut_before != cut:  # not the next piece of one stretch (skip_silence left a gap between)
        return cut
    return max([cut, *(end for middle, end, _, _ in following_units if middle < cut)])


def piece_words(piece: tuple[Segment, Hypothesis], start: int, end: int, tokenizer: Tokenizer | None,
                frame_samples: int, said: SaidWord = NOTHING_SAID) -> tuple[Hypothesis, SaidWord | None]:
    """The words of ``piece`` whose middles lie in [start, end) samples of the original, in the original's frames
    (all of its tokens where it is the whole recording, as ``stitch`` keeps them), but for ``said`` heard again (the
    last word of the pieces before); and the last of them (None: none). A stream's text as its pieces finish."""
    segment, hyp = piece
    if _uncut(segment) and start <= 0 and end >= NO_CUT:
        return hyp, None
    out = Hypothesis(durations=None if hyp.durations is None else [], logprobs=None if hyp.logprobs is None else [])
    last = _add_words(out, piece, _units(segment, hyp, tokenizer, frame_samples), start, end, frame_samples, said)
    return out, last


def _uncut(segment: Segment) -> bool:
    return segment.start == 0 and segment.cut_after == NO_CUT


def _add_words(out: Hypothesis, piece: tuple[Segment, Hypothesis], units: list[tuple[float, int, int, int]],
               start: int, end: int, frame_samples: int, said: SaidWord) -> SaidWord | None:
    """Those of ``piece``'s words (its ``units``) whose middles lie in [start, end), appended to ``out``, but for the
    pieces before's last word (``said``) heard again; returns the last word appended (None: none)."""
    segment, hyp = piece
    offset = segment.start // frame_samples
    appended = None
    for middle, word_end, first, last in units:
        if not start <= middle < end:
            continue
        tokens = tuple(hyp.tokens[first : last + 1])
        if middle < said.end and tokens == said.tokens:
            continue
        appended = SaidWord(word_end, tokens)
        out.tokens.extend(tokens)
        # Pieces see different context, so a word just after a cut may start a frame before the end of
        # the word kept just before it; frames stay non-decreasing by clamping.
        floor = out.frames[-1] if out.frames else 0
        out.frames.extend(max(offset + f, floor) for f in hyp.frames[first : last + 1])
        if out.durations is not None:
            covered = hyp.durations[first : last + 1] if hyp.durations else [1] * (last - first + 1)
            out.durations.extend(covered)
        if out.logprobs is not None:
            out.logprobs.extend(hyp.logprobs[first : last + 1])
    return appended


def _units(segment: Segment, hyp: Hypothesis, tokenizer: Tokenizer | None, frame_samples: int
           ) -> list[tuple[float, int, int, int]]:
    """A piece's words (tokens, with no vocabulary to find words with) as (middle, end: samples of the original;
    first token, last token)."""
    offset = segment.start // frame_samples
    if tokenizer is not None:
        spans = [(span.first, span.last) for span in tokenizer.words(hyp.tokens)]
    else:
        spans = [(i, i) for i in range(len(hyp.tokens))]
    units = []
    for first, last in spans:
        end_frame = hyp.frames[last] + max(hyp.durations[last] if hyp.durations else 1, 1)
        middle = (offset + (hyp.frames[first] + end_frame) / 2) * frame_samples
        units.append((middle, (offset + end_frame) * frame_samples, first, last))
    return units


def length_bucket_end(n_samples: int, bucket_samples: int, longest: int | None = None) -> int:
    """The end of the length bucket ``n_samples`` falls in: (0, b] -> b, (b, 2b] -> 2b, ..., the last bucket ending
    at ``longest``, the longest piece there can be (a recording's cut into pieces of at most ``max_segment_s``):
    padded past it, every batch of that bucket computed padding no piece could fill (7 s buckets padded 30 s pieces
    to 35 s)."""
    end = max(-(-n_samples // bucket_samples), 1) * bucket_samples
    return min(end, longest) if longest is not None and n_samples <= longest else end
