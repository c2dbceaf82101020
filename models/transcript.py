"""Transcripts: what ``ASRModel.transcribe`` returns, with word timings derived from token frames."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from decoding.types import Hypothesis

from .tokenizer import Tokenizer

SCORE_DECIMALS = 4  # log-probabilities and confidences as transcripts keep them


@dataclass(frozen=True)
class Word:
    word: str
    start_s: float
    end_s: float
    # the probability of its least sure token (NeMo's default word aggregation): 0..1, None without scores
    confidence: float | None = None


@dataclass
class Transcript:
    text: str
    tokens: list[int]  # label ids, blanks removed
    token_frames: list[int]  # encoder frame of each token
    duration_s: float  # length of the audio
    words: list[Word] = field(default_factory=list)
    token_durations: list[int] | None = None  # frames each token covers (TDT and CTC)
    token_logprobs: list[float] | None = None  # natural log-probability of each token (decoding.scores)

    @property
    def avg_logprob(self) -> float | None:
        """The mean token log-probability (Whisper's ``avg_logprob``): None without tokens or scores."""
        return mean_logprob(self.token_logprobs or [])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_transcript(hyp: Hypothesis, tokenizer: Tokenizer | None, frame_s: float, duration_s: float) -> Transcript:
    """Text and word timings for one hypothesis.

    A word starts at its first token's frame and ends where its last token's span ends (its duration,
    at least one frame), but never after the next word starts or the audio ends.
    """
    logprobs = None if hyp.logprobs is None else [rounded(x) for x in hyp.logprobs]
    if tokenizer is None:  # a built-in architecture with random weights has no vocabulary to render
        return Transcript(text="", tokens=hyp.tokens, token_frames=hyp.frames, duration_s=duration_s,
                          token_durations=hyp.durations, token_logprobs=logprobs)
    spans = tokenizer.words(hyp.tokens)
    words = []
    # times are given to the millisecond: the last word ends by the audio's end however its duration is rounded
    last_ms_s = math.floor(duration_s * 1000) / 1000
    for i, span in enumerate(spans):
        start_frame = hyp.frames[span.first]
        covered = hyp.durations[span.last] if hyp.durations is not None else 1
        end_frame = hyp.frames[span.last] + max(covered, 1)
        if i + 1 < len(spans):
            end_frame = min(end_frame, max(hyp.frames[spans[i + 1].first], start_frame))
        start_s = min(round(start_frame * frame_s, 3), last_ms_s)
        end_s = min(round(end_frame * frame_s, 3), last_ms_s)
        confidence = None if hyp.logprobs is None else word_confidence(hyp.logprobs[span.first : span.last + 1])
        words.append(Word(word=span.text, start_s=start_s, end_s=max(end_s, start_s), confidence=confidence))
    return Transcript(text=tokenizer.ids_to_text(hyp.tokens), tokens=hyp.tokens, token_frames=hyp.frames,
                      duration_s=duration_s, words=words, token_durations=hyp.durations, token_logprobs=logprobs)


def word_confidence(logprobs: list[float]) -> float:
    """A word's tokens' log-probabilities -> the probability of the least sure one. A word is as doubtful as its
    weakest piece: the mean would let a sure ending vouch for a guessed beginning."""
    return rounded(math.exp(min(logprobs)))


def mean_logprob(scores: list[float]) -> float | None:
    """Tokens' mean log-probability, as transcripts keep it (None for no tokens): a transcript's, a
    conversation's, a subtitle segment's ``avg_logprob``."""
    return rounded(sum(scores) / len(scores)) if scores else None


def rounded(score: float) -> float:
    """A log-probability or confidence as transcripts keep it: ``SCORE_DECIMALS`` places, never -0.0."""
    return round(score, SCORE_DECIMALS) + 0.0
