"""Words a channel picked up from another channel (echo on the line, a headset hearing the other party), dropped.

A stereo call's channels are seldom perfectly apart: each speaker is often heard faintly on the other side too.
Transcribed apart, such a channel repeats the other's words (on the embedded model, an echo 30 dB down turned a
4% word error rate into 36%). A word is taken for such an echo only when three things hold over its span:

- another channel has a word there too;
- that channel is at least ``ECHO_BELOW_DB`` louder (an echo is always quieter than its source);
- this channel's loudness rises and falls with that channel's, up to ``MAX_ECHO_DELAY_S`` later (their
  envelopes correlate by ``ECHO_CORRELATION`` or more).

The last keeps two people who talk over each other, each on their own channel: their envelopes do not follow
each other, whatever their levels (a customer's line 12 dB quieter than the agent's keeps every word).

``heard_elsewhere`` puts the same test to every moment of a channel, before it is transcribed, so that with
``skip_silence`` the echo is skipped like silence rather than transcribed and dropped.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from decoding.types import Hypothesis

from .silence import Elsewhere, step_power
from .tokenizer import Tokenizer

ECHO_BELOW_DB = 10.0
ECHO_CORRELATION = 0.75
MAX_ECHO_DELAY_S = 0.2
ENVELOPE_S = 0.01  # loudness is followed in steps this long
MIN_SPAN_S = 0.5  # a word is measured over at least this long (shorter spans correlate by chance)


@dataclass(frozen=True)
class WordSpan:
    first: int  # the word's first token
    last: int  # its last token
    start: int  # first sample
    end: int  # last sample, exclusive


def word_spans(hyp: Hypothesis, tokenizer: Tokenizer, frame_samples: int, min_samples: int) -> list[WordSpan]:
    """Each word of a hypothesis (frames in the recording's time) and the samples it covers."""
    spans = []
    for word in tokenizer.words(hyp.tokens):
        covered = hyp.durations[word.last] if hyp.durations is not None else 1
        start = hyp.frames[word.first] * frame_samples
        end = (hyp.frames[word.last] + max(covered, 1)) * frame_samples
        spans.append(WordSpan(word.first, word.last, start, max(end, start + min_samples)))
    return spans


def drop_crosstalk(hypotheses: list[Hypothesis], channels: Sequence[np.ndarray], tokenizer: Tokenizer | None,
                   frame_samples: int, sample_rate: int) -> list[Hypothesis]:
    """Each channel's hypothesis without the words that are another channel's speech heard on it."""
    if len(hypotheses) < 2 or tokenizer is None:
        return hypotheses
    spans = [word_spans(h, tokenizer, frame_samples, int(MIN_SPAN_S * sample_rate)) for h in hypotheses]
    # the latest end so far: word spans start in order, and bisecting these finds the first that reaches a time
    ends = [np.maximum.accumulate([s.end for s in channel_spans]).tolist() if channel_spans else []
            for channel_spans in spans]
    step, max_delay = int(ENVELOPE_S * sample_rate), int(MAX_ECHO_DELAY_S / ENVELOPE_S)
    kept = []
    for x, hyp in enumerate(hypotheses):
        words = [w for w in spans[x] if not any(
            _has_word_over(spans[y], ends[y], w) and _is_echo(channels[x], channels[y], w, step, max_delay)
            for y in range(len(hypotheses)) if y != x)]
        kept.append(hyp if len(words) == len(spans[x]) else _keep(hyp, words))
    return kept


def _has_word_over(spans: list[WordSpan], ends: list[int], word: WordSpan) -> bool:
    """Whether a word of ``spans`` (in time order; ``ends`` the latest end up to each) overlaps ``word``'s
    samples."""
    i = bisect.bisect_right(ends, word.start)  # the first that ends after the word starts
    return i < len(spans) and spans[i].start < word.end


def _is_echo(heard: np.ndarray, source: np.ndarray, span: WordSpan, step: int, max_delay: int) -> bool:
    """Whether ``heard`` over ``span`` is ``source`` heard faintly: much quieter, and its envelope following the
    source's at some delay of up to ``max_delay`` steps."""
    ours, theirs = heard[span.start : span.end], source[span.start : span.end]
    if len(ours) == 0 or _power_db(theirs) - _power_db(ours) < ECHO_BELOW_DB:
        return False
    envelope = _envelope_db(ours, step)
    if len(envelope) < 3 or envelope.std() == 0:
        return False
    first = max(0, span.start - max_delay * step)
    before = (span.start - first) // step  # whole steps of the source available before the span
    source_envelope = _envelope_db(source[span.start - before * step : span.end], step)
    lagged = (source_envelope[before - delay : before - delay + len(envelope)] for delay in range(before + 1))
    return any(len(s) == len(envelope) and s.std() > 0 and np.corrcoef(envelope, s)[0, 1] >= ECHO_CORRELATION
               for s in lagged)


def heard_elsewhere(channels: Sequence[np.ndarray], sample_rate: int) -> list[Elsewhere]:
    """For each channel, for each ``ENVELOPE_S`` step: whether its sound there is another channel's, heard
    faintly, as ``drop_crosstalk`` judges a word over the ``MIN_SPAN_S`` centred on the step. Vectorised over the
    steps, a delay at a time (an hour of a call: a fraction of a second); each channel's levels are measured once.
    """
    step, block = int(ENVELOPE_S * sample_rate), int(MIN_SPAN_S / ENVELOPE_S)
    powers = [step_power(channel, step) for channel in channels]
    levels = [_centred_db(power) for power in powers]
    return [Elsewhere(_echo_flags(powers, levels, x, block), step) for x in range(len(channels))]


def _echo_flags(powers: list[np.ndarray], levels: list[np.ndarray], x: int, block: int) -> np.ndarray:
    """Channel ``x``'s flags for ``heard_elsewhere``, from every channel's step powers and centred levels."""
    ours, ours_db = powers[x], levels[x]
    flags = np.zeros(len(ours), dtype=bool)
    if len(ours) < block:
        return flags
    for y in range(len(powers)):
        if y == x:
            continue
        theirs, theirs_db = powers[y][: len(ours)], levels[y][: len(ours)]
        louder = _rolling_sum(theirs, block) >= _rolling_sum(ours, block) * 10 ** (ECHO_BELOW_DB / 10)
        best = np.full(len(louder), -1.0)
        for delay in range(int(MAX_ECHO_DELAY_S / ENVELOPE_S) + 1):  # ours follows theirs, ``delay`` steps later
            lagged = np.concatenate([np.full(delay, theirs_db[0]), theirs_db[: len(theirs_db) - delay]])
            best = np.maximum(best, _rolling_correlation(ours_db, lagged, block))
        echo = louder & (best >= ECHO_CORRELATION)  # of the block starting at each step
        flags[block // 2 : block // 2 + len(echo)] |= echo
    return flags


def _centred_db(power: np.ndarray) -> np.ndarray:
    """Levels in dB, floored at -120 and centred: rolling sums of their squares stay exact over hours."""
    level = np.maximum(10 * np.log10(power + 1e-20), -120.0)
    return level - level.mean()


def _rolling_sum(values: np.ndarray, width: int) -> np.ndarray:
    total = np.concatenate([[0.0], np.cumsum(values)])
    return total[width:] - total[:-width]


def _rolling_correlation(a: np.ndarray, b: np.ndarray, width: int) -> np.ndarray:
    """Pearson correlation of ``a`` and ``b`` over each window of ``width`` (-1 where either is flat)."""
    mean_a, mean_b = _rolling_sum(a, width) / width, _rolling_sum(b, width) / width
    covariance = _rolling_sum(a * b, width) / width - mean_a * mean_b
    variance = (_rolling_sum(a * a, width) / width - mean_a**2) * (_rolling_sum(b * b, width) / width - mean_b**2)
    flat = variance <= 1e-9
    return np.where(flat, -1.0, covariance / np.sqrt(np.where(flat, 1.0, variance)))


def _power_db(samples: np.ndarray) -> float:
    return float(10 * np.log10(np.mean(np.square(samples.astype(np.float64))) + 1e-20))


def _envelope_db(samples: np.ndarray, step: int) -> np.ndarray:
    return 10 * np.log10(step_power(samples, step) + 1e-20)


def _keep(hyp: Hypothesis, words: list[WordSpan]) -> Hypothesis:
    indices = [i for w in words for i in range(w.first, w.last + 1)]
    return hyp.take(indices)
