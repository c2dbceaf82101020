"""Long audio: where it is cut into pieces, at quiet points with overlap (models.stitching joins them back).

Each cut point is the quietest 100 ms window in the last part of a segment, snapped to the encoder's frame
grid so that token frames of every piece map onto whole frames of the original. Pieces overlap by
``overlap_s`` around each cut.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .silence import Elsewhere, speech_regions

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


def length_bucket_end(n_samples: int, bucket_samples: int, longest: int | None = None) -> int:
    """The end of the length bucket ``n_samples`` falls in: (0, b] -> b, (b, 2b] -> 2b, ..., the last bucket ending
    at ``longest``, the longest piece there can be (a recording's cut into pieces of at most ``max_segment_s``):
    padded past it, every batch of that bucket computed padding no piece could fill (7 s buckets padded 30 s pieces
    to 35 s)."""
    end = max(-(-n_samples // bucket_samples), 1) * bucket_samples
    return min(end, longest) if longest is not None and n_samples <= longest else end
