"""Render transcripts as subtitles (SRT, WebVTT) and JSON-ready dicts; shared by the CLI and the HTTP API.

A ``Conversation`` (channels transcribed apart) renders as its utterances in time order, each saying its channel:
a subtitle cue per piece of an utterance, the speaker in front (WebVTT's voice tag).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from models.conversation import Conversation, Utterance
from models.transcript import Transcript, Word

MAX_CUE_S = 6.0  # a subtitle cue spans at most this long
MAX_CUE_CHARS = 84  # two lines of 42 characters, the usual broadcast limit


@dataclass(frozen=True)
class Cue:
    start_s: float
    end_s: float
    text: str
    speaker: str | None = None  # whose words, in a conversation


def cues(words: list[Word], max_s: float = MAX_CUE_S, max_chars: int = MAX_CUE_CHARS) -> list[Cue]:
    """Group words into subtitle cues that stay within ``max_s`` seconds and ``max_chars`` characters."""
    out: list[Cue] = []
    group: list[Word] = []
    for word in words:
        if group:
            text = " ".join(w.word for w in [*group, word])
            if word.end_s - group[0].start_s > max_s or len(text) > max_chars:
                out.append(Cue(group[0].start_s, group[-1].end_s, " ".join(w.word for w in group)))
                group = []
        group.append(word)
    if group:
        out.append(Cue(group[0].start_s, group[-1].end_s, " ".join(w.word for w in group)))
    return out


def _timestamp(seconds: float, decimal: str) -> str:
    ms = round(seconds * 1000)
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{decimal}{ms:03d}"


def _cues_of(transcript: Transcript | Conversation) -> list[Cue]:
    if isinstance(transcript, Transcript):
        return cues(transcript.words)
    return [Cue(c.start_s, c.end_s, c.text, transcript.speaker(u.channel))
            for u in transcript.utterances() for c in cues(u.words)]


def to_srt(transcript: Transcript | Conversation) -> str:
    def text(c: Cue) -> str:
        return c.text if c.speaker is None else f"[{c.speaker}] {c.text}"

    blocks = [f"{i}\n{_timestamp(c.start_s, ',')} --> {_timestamp(c.end_s, ',')}\n{text(c)}\n"
              for i, c in enumerate(_cues_of(transcript), start=1)]
    return "\n".join(blocks)


def to_vtt(transcript: Transcript | Conversation) -> str:
    def text(c: Cue) -> str:
        return c.text if c.speaker is None else f"<v {c.speaker}>{c.text}"

    blocks = [f"{_timestamp(c.start_s, '.')} --> {_timestamp(c.end_s, '.')}\n{text(c)}\n"
              for c in _cues_of(transcript)]
    return "WEBVTT\n\n" + "\n".join(blocks)


def word_dicts(words: list[Word]) -> list[dict[str, Any]]:
    return [{"word": w.word, "start": w.start_s, "end": w.end_s, **_confidence(w)} for w in words]


def _confidence(word: Word) -> dict[str, float]:
    return {} if word.confidence is None else {"confidence": word.confidence}


def utterance_dict(u: Utterance, speaker: str) -> dict[str, Any]:
    return {"channel": u.channel, "speaker": speaker, "start": u.start_s, "end": u.end_s, "text": u.text}


def to_record(transcript: Transcript | Conversation, audio: str | None = None) -> dict[str, Any]:
    """The JSON object for one transcript (the CLI's jsonl line). A conversation's has its labelled text, every
    word in time order with its channel, the utterances, and each channel's own transcript; its ``tokens`` and
    ``token_frames`` are each channel's."""
    record: dict[str, Any] = {} if audio is None else {"audio": audio}
    if isinstance(transcript, Transcript):
        record.update(text=transcript.text, tokens=transcript.tokens, token_frames=transcript.token_frames,
                      token_logprobs=transcript.token_logprobs, avg_logprob=transcript.avg_logprob,
                      duration_s=round(transcript.duration_s, 6), words=word_dicts(transcript.words))
        return record
    record.update(
        text=transcript.text, tokens=None, token_frames=None, token_logprobs=None, avg_logprob=transcript.avg_logprob,
        duration_s=round(transcript.duration_s, 6),
        words=[{**word_dicts([w])[0], "channel": c} for c, w in transcript.timed_words()],
        utterances=[utterance_dict(u, transcript.speaker(u.channel)) for u in transcript.utterances()],
        channels=[{"channel": i, **_name(transcript, i), **to_record(t), **_repeats(transcript, i)}
                  for i, t in enumerate(transcript.channels)],
    )
    return record


def _name(conversation: Conversation, channel: int) -> dict[str, str]:
    return {"name": conversation.names[channel]} if channel < len(conversation.names) else {}


def _repeats(conversation: Conversation, channel: int) -> dict[str, int]:
    """``duplicate_of`` for a channel that repeats an earlier one (and was not transcribed)."""
    return {"duplicate_of": conversation.duplicates[channel]} if channel in conversation.duplicates else {}


def render(transcript: Transcript | Conversation, audio: str, format: str) -> str:
    """One transcript as the command line writes it: ``text``, ``jsonl`` (one line), ``json``, ``srt`` or ``vtt``."""
    if format == "text":
        return transcript.text + "\n"
    if format in ("srt", "vtt"):
        return to_srt(transcript) if format == "srt" else to_vtt(transcript)
    return json.dumps(to_record(transcript, audio), ensure_ascii=False, indent=2 if format == "json" else None) + "\n"


def from_record(record: dict[str, Any]) -> Transcript | Conversation:
    """A job item's result (its text, tokens, words and duration; or its channels') as a transcript, to render as
    ``render`` does."""
    if record.get("channels") is not None:
        channels = record["channels"]
        named = [c["name"] for c in channels if "name" in c]
        return Conversation([_transcript_from(c) for c in channels],
                            {c["channel"]: c["duplicate_of"] for c in channels if "duplicate_of" in c}, named)
    return _transcript_from(record)


def _transcript_from(record: dict[str, Any]) -> Transcript:
    words = [Word(w["word"], w["start"], w["end"], w.get("confidence")) for w in record.get("words") or []]
    return Transcript(text=record["text"], tokens=record.get("tokens") or [], token_frames=record.get("token_frames")
                      or [], duration_s=record.get("duration_s") or 0.0, words=words,
                      token_logprobs=record.get("token_logprobs"))
