"""Render transcripts as subtitles (SRT, WebVTT) and JSON-ready dicts; shared by the CLI and the HTTP API."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from models.transcript import Transcript, Word

MAX_CUE_S = 6.0  # a subtitle cue spans at most this long
MAX_CUE_CHARS = 84  # two lines of 42 characters, the usual broadcast limit


@dataclass(frozen=True)
class Cue:
    start_s: float
    end_s: float
    text: str


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


def to_srt(transcript: Transcript) -> str:
    blocks = [f"{i}\n{_timestamp(c.start_s, ',')} --> {_timestamp(c.end_s, ',')}\n{c.text}\n"
              for i, c in enumerate(cues(transcript.words), start=1)]
    return "\n".join(blocks)


def to_vtt(transcript: Transcript) -> str:
    blocks = [f"{_timestamp(c.start_s, '.')} --> {_timestamp(c.end_s, '.')}\n{c.text}\n"
              for c in cues(transcript.words)]
    return "WEBVTT\n\n" + "\n".join(blocks)


def to_record(transcript: Transcript, audio: str | None = None) -> dict[str, Any]:
    """The JSON object for one transcript (the CLI's jsonl line)."""
    record: dict[str, Any] = {} if audio is None else {"audio": audio}
    record.update(
        text=transcript.text,
        tokens=transcript.tokens,
        token_frames=transcript.token_frames,
        duration_s=round(transcript.duration_s, 6),
        words=[{"word": w.word, "start": w.start_s, "end": w.end_s} for w in transcript.words],
    )
    return record


def render(transcript: Transcript, audio: str, format: str) -> str:
    """One transcript as the command line writes it: ``text``, ``jsonl`` (one line), ``json``, ``srt`` or ``vtt``."""
    if format == "text":
        return transcript.text + "\n"
    if format in ("srt", "vtt"):
        return to_srt(transcript) if format == "srt" else to_vtt(transcript)
    return json.dumps(to_record(transcript, audio), ensure_ascii=False, indent=2 if format == "json" else None) + "\n"


def from_record(record: dict[str, Any]) -> Transcript:
    """A job item's result (its text, tokens, words and duration) as a transcript, to render as ``render`` does."""
    words = [Word(w["word"], w["start"], w["end"]) for w in record.get("words") or []]
    return Transcript(text=record["text"], tokens=record.get("tokens") or [], token_frames=[],
                      duration_s=record.get("duration_s") or 0.0, words=words)
