"""Transcripts as the routes' response bodies: word timings, OpenAI's words, segments and token log-probabilities,
and a multichannel request's conversation."""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

from models.transcript import Transcript, Word, mean_logprob

from .formats import cues
from .http import ServiceState
from .schemas import (
    ChannelTranscription,
    NativeTranscription,
    OpenAIWord,
    Segment,
    TokenLogprob,
    UtteranceTiming,
    WordTiming,
)
from .transcriber import ConversationResult

if TYPE_CHECKING:  # front-end processes shape answers without the model (or torch)
    from models.tokenizer import Tokenizer


def word_timing(w: Word, channel: int | None = None) -> WordTiming:
    return WordTiming(word=w.word, start=w.start_s, end=w.end_s, confidence=w.confidence, channel=channel)


def word_timings(words: list[Word]) -> list[WordTiming]:
    return [word_timing(w) for w in words]


def openai_words(words: list[Word]) -> list[OpenAIWord]:
    return [OpenAIWord(word=w.word, start=w.start_s, end=w.end_s, probability=w.confidence) for w in words]


def transcript_segments(transcript: Transcript, tokenizer: Tokenizer | None) -> list[Segment]:
    """Subtitle-sized segments, each with its words' tokens (a token between words goes with the word before it).
    Given by time, a word's last token on the frame the next segment starts on went to that segment (TDT and RNN-T
    often put it there), and a segment's tokens no longer spelt its text."""
    groups = cues(transcript.words)
    tokens: list[list[int]] = [[] for _ in groups]
    scores: list[list[float]] = [[] for _ in groups]
    if groups and tokenizer is not None:
        cue_of_word = [c for c, cue in enumerate(groups) for _ in range(cue.n_words)]
        cue_starting_at = {span.first: cue for span, cue in zip(tokenizer.words(transcript.tokens), cue_of_word,
                                                               strict=False)}
        logprobs = transcript.token_logprobs or [0.0] * len(transcript.tokens)
        group = 0
        for k, (token, logprob) in enumerate(zip(transcript.tokens, logprobs, strict=True)):
            group = cue_starting_at.get(k, group)
            tokens[group].append(token)
            scores[group].append(logprob)
    return [Segment(id=i, seek=0, start=c.start_s, end=c.end_s, text=c.text, tokens=tokens[i],
                    avg_logprob=mean_logprob(scores[i]) or 0.0,
                    compression_ratio=compression_ratio(c.text))
            for i, c in enumerate(groups)]


def compression_ratio(text: str) -> float:
    """Whisper's repetition check: the text's UTF-8 bytes over their zlib-compressed size. A model stuck repeating
    itself compresses well (Whisper takes above 2.4 as a failure); ordinary sentences stay near 1."""
    data = text.encode()
    return round(len(data) / len(zlib.compress(data)), 3) if data else 0.0


def openai_logprobs(tokens: list[int], logprobs: list[float] | None, tokenizer: Tokenizer | None,
                    starts_text: bool = True) -> list[TokenLogprob]:
    """OpenAI's ``logprobs``: each token's text, log-probability and UTF-8 bytes."""
    if tokenizer is None or logprobs is None:
        return []
    texts = tokenizer.token_texts(tokens, starts_text)
    return [TokenLogprob(token=text, logprob=logprob, bytes=list(text.encode()))
            for text, logprob in zip(texts, logprobs, strict=True)]


def conversation_body(service: ServiceState, result: ConversationResult) -> NativeTranscription:
    conversation = result.conversation
    return NativeTranscription(
        model=service.model_id, text=conversation.text, avg_logprob=conversation.avg_logprob,
        words=[word_timing(w, channel) for channel, w in conversation.timed_words()],
        duration_s=round(conversation.duration_s, 6), queue_s=round(result.queue_s, 6),
        compute_s=round(result.compute_s, 6), rtfx=round(result.rtfx, 3), segments=result.n_segments,
        utterances=[UtteranceTiming(channel=u.channel, speaker=conversation.speaker(u.channel), start=u.start_s,
                                    end=u.end_s, text=u.text) for u in conversation.utterances()],
        channels=[ChannelTranscription(channel=i, name=conversation.names[i] if i < len(conversation.names) else None,
                                       text=t.text, tokens=t.tokens, token_frames=t.token_frames,
                                       token_logprobs=t.token_logprobs, avg_logprob=t.avg_logprob,
                                       words=word_timings(t.words), duplicate_of=conversation.duplicates.get(i))
                  for i, t in enumerate(conversation.channels)],
    )
