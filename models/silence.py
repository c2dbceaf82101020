"""Long quiet stretches found by their energy, so that they need not be transcribed (``skip_silence``).

A channel of a stereo call is quiet for about half of it (the other speaker's turns), and a recording of a
meeting or a voicemail line may be mostly room noise. Transcribing those stretches costs as much as speech and
can put a stray word in the transcript. A stretch is skipped only when it is long (``MIN_SILENCE_S``) and every
window of it lies close to the recording's own noise floor (``ABOVE_FLOOR_DB``); the speech either side keeps
``PAD_S`` of it, so the model still hears each word start and end as it would in the whole file.

The floor is the recording's tenth-percentile window level, so the test is relative: a loud line's hiss and a
digital silence are both the floor, and speech that stands out from the floor, however quiet, is kept.

A channel of a call may also carry the other speaker faintly (echo on the line). Where it is known to
(``Elsewhere``, from models.crosstalk), that sound counts as quiet too: it is the other channel's to transcribe.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WINDOW_S = 0.05  # energy is measured over windows this long
MIN_SILENCE_S = 2.0  # only quiet stretches at least this long are skipped
PAD_S = 0.5  # the quiet kept either side of the speech
ABOVE_FLOOR_DB = 6.0  # a window is quiet when its level is within this of the floor
FLOOR_PERCENTILE = 10
LEVEL_EPS = 1e-10  # rms added before the logarithm: digital silence is -200 dB, not -inf
# a recording (a channel) that never rises above this is silent, whatever its floor: 16-bit dither (+-1 LSB, about
# -90 dBFS), what tools export as silence and a muted line of a call sounds like, was read as a sentence of words
SILENT_DBFS = -70.0


@dataclass(frozen=True)
class Elsewhere:
    """Where a recording's sound is another channel's, heard faintly: a flag for each step of ``step`` samples."""

    flags: np.ndarray
    step: int

    def windows(self, window: int, n_windows: int) -> np.ndarray:
        """A flag for each window of ``window`` samples: set when every step in it is."""
        per_window = max(1, window // self.step)
        flags = np.zeros(n_windows * per_window, dtype=bool)
        known = self.flags[: len(flags)]
        flags[: len(known)] = known
        return flags.reshape(n_windows, per_window).all(axis=1)


def speech_regions(waveform: np.ndarray, sample_rate: int, frame_samples: int, elsewhere: Elsewhere | None = None
                   ) -> list[tuple[int, int]]:
    """(start, end) sample ranges of ``waveform`` to transcribe, in order, on the encoder's frame grid (starts
    whole frames from the beginning): everything but the long quiet stretches (counting as quiet what
    ``elsewhere`` flags). ``[(0, len)]`` when none is found; ``[]`` when the whole recording is quiet (all of it at
    the floor: digital silence or bare noise is not).
    """
    n = len(waveform)
    window = max(1, int(WINDOW_S * sample_rate))
    n_windows = n // window
    if n_windows == 0 or n < MIN_SILENCE_S * sample_rate:
        return [(0, n)] if n else []
    level_db = 20 * np.log10(np.sqrt(step_power(waveform, window)) + LEVEL_EPS)
    floor_db = np.percentile(level_db, FLOOR_PERCENTILE)
    loud = level_db > floor_db + ABOVE_FLOOR_DB
    if not loud.any():
        # nothing stands out from the floor: silence (digital, or dither) is skipped, anything else is noise or
        # steady sound (a tone, music) and is transcribed whole, since there is no floor to tell speech from
        return [] if np.max(level_db) <= SILENT_DBFS else [(0, n)]
    if elsewhere is not None:
        loud &= ~elsewhere.windows(window, n_windows)
        if not loud.any():
            return []  # all that stands out is another channel's: nothing of this one's to transcribe
    pad, min_quiet = int(PAD_S * sample_rate), int(MIN_SILENCE_S * sample_rate)
    regions: list[tuple[int, int]] = []
    for first, last in _runs(loud):
        start, end = max(0, first * window - pad), min(n, (last + 1) * window + pad)
        if regions and start - regions[-1][1] < min_quiet:
            regions[-1] = (regions[-1][0], end)  # the quiet between is too short to skip
        else:
            regions.append((start, end))
    if regions[0][0] < min_quiet:
        regions[0] = (0, regions[0][1])
    if n - regions[-1][1] < min_quiet:
        regions[-1] = (regions[-1][0], n)
    return [(start // frame_samples * frame_samples, end) for start, end in regions]


POWER_CHUNK_SAMPLES = 1 << 20  # samples squared at once: float64 copies of a whole recording were 4x its size


def step_power(samples: np.ndarray, step: int) -> np.ndarray:
    """Mean square of each whole step of ``step`` samples (a trailing part step is left out). A chunk of steps at
    a time: each step's mean is its own, so the result is the same as at once."""
    n = len(samples) // step
    power = np.empty(n)
    per_chunk = max(1, POWER_CHUNK_SAMPLES // step)
    for first in range(0, n, per_chunk):
        last = min(n, first + per_chunk)
        chunk = samples[first * step : last * step].astype(np.float64)
        power[first:last] = np.square(chunk, out=chunk).reshape(last - first, step).mean(axis=1)
    return power


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(first, last) indices of each run of True."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), (np.flatnonzero(edges == -1) - 1).tolist(), strict=True))
