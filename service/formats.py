"""Render transcripts as subtitles (SRT, WebVTT) and JSON-ready dicts; shared by the CLI and the HTTP API.

A ``Conversation`` (channels transcribed apart) renders as its utterances in time order, each saying its channel:
a subtitle cue per piece of an utterance, the speaker in front (WebVTT's voice tag).
"""

from __future__ import annotations

import dataclasses
import html
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from models.conversation import Conversation, Utterance
from models.transcript import Transcript, Word

MAX_CUE_S = 6.0  # a subtitle cue spans at most this long
MIN_CUE_S = 0.001  # and at least this: WebVTT wants a cue to end after it starts, and players drop one that does not


@dataclass(frozen=True)
class SubtitleLayout:
    """How cues are cut and laid out (Whisper's option names). The defaults are the usual broadcast limits: two
    lines of 42 characters, on screen at most 6 s."""

    max_line_width: int = 42
    max_line_count: int = 2
    max_cue_s: float = MAX_CUE_S

    def __post_init__(self) -> None:
        if not 1 <= self.max_line_width <= 1000:
            raise ValueError("max_line_width must be 1 to 1000 characters")
        if not 1 <= self.max_line_count <= 10:
            raise ValueError("max_line_count must be 1 to 10")


@dataclass(frozen=True)
class Cue:
    start_s: float
    end_s: float
    text: str  # on one line
    speaker: str | None = None  # whose words, in a conversation
    lines: tuple[str, ...] = ()  # as shown: the text broken into the layout's lines
    n_words: int = 0  # how many of the transcript's words it shows


def cues(words: list[Word], layout: SubtitleLayout = SubtitleLayout(), lead: int = 0) -> list[Cue]:
    """Group words into subtitle cues: each within ``layout.max_cue_s`` and laid out in at most
    ``max_line_count`` lines of ``max_line_width`` characters (a word longer than a line gets one of its own);
    ``lead`` characters shown before the first line (a speaker's label) count toward it."""
    out: list[Cue] = []
    start, fill = 0, _Fill(layout.max_line_width, lead)
    for i, word in enumerate(words):
        if i > start and (word.end_s - words[start].start_s > layout.max_cue_s
                          or fill.after(word.word) > layout.max_line_count):
            out.append(_cue(words[start:i], layout, lead))
            start, fill = i, _Fill(layout.max_line_width, lead)
        fill.add(word.word)
    if start < len(words):
        out.append(_cue(words[start:], layout, lead))
    return out


@dataclass
class _Fill:
    """Words laid into lines of ``width`` one after another, each line filled before the next (the fewest lines
    any layout can use)."""

    width: int
    used: int  # characters on the last line
    lines: int = 0

    def after(self, word: str) -> int:
        """Lines used once ``word`` is added."""
        return self.lines + (0 if self.lines and self.used + 1 + len(word) <= self.width else 1)

    def add(self, word: str) -> None:
        if self.lines and self.used + 1 + len(word) <= self.width:
            self.used += 1 + len(word)
        else:
            self.used = (self.used if not self.lines else 0) + len(word)  # the first line starts after the lead
            self.lines += 1


def _cue(words: list[Word], layout: SubtitleLayout, lead: int) -> Cue:
    texts = [w.word for w in words]
    # a word may take no time (a TDT token of duration 0 before the next word's, on one frame), and one alone may
    # span a long pause (a word read into the quiet of a tape, 12.9 s): on screen at least MIN_CUE_S, at most
    # max_cue_s
    end_s = min(max(words[-1].end_s, words[0].start_s + MIN_CUE_S), words[0].start_s + layout.max_cue_s)
    return Cue(words[0].start_s, end_s, " ".join(texts), lines=_balanced(texts, layout.max_line_width, lead),
               n_words=len(words))


def _lines(words: list[str], width: int, lead: int) -> list[list[str]]:
    fill, lines = _Fill(width, lead), []
    for word in words:
        if fill.after(word) > fill.lines:
            lines.append([])
        fill.add(word)
        lines[-1].append(word)
    return lines


def _balanced(words: list[str], width: int, lead: int) -> tuple[str, ...]:
    """``words`` in as few lines of ``width`` as they fill, with the longest line as short as can be: a two-line
    cue reads as two lines of like length, not a full line and a word. (The narrowest width that needs no more
    lines, found by bisection, then filled line by line.) No line passes ``width`` but one that a word (or the lead
    and the first word) alone passes it with: the search began at the longest word, so the short words around one
    too long were packed to its length."""
    n_lines = len(_lines(words, width, lead))
    narrow, wide = 1, width  # line counts only fall as the width grows: the narrowest with n_lines lies in here
    while narrow < wide:
        middle = (narrow + wide) // 2
        if len(_lines(words, middle, lead)) <= n_lines:
            wide = middle
        else:
            narrow = middle + 1
    return tuple(" ".join(line) for line in _lines(words, narrow, lead))


def _timestamp(seconds: float, decimal: str) -> str:
    ms = round(seconds * 1000)
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{decimal}{ms:03d}"


def _cues_of(transcript: Transcript | Conversation, layout: SubtitleLayout, label: Callable[[str], str]
             ) -> list[Cue]:
    """The transcript's cues; a conversation's by utterance, each with its speaker, whose ``label`` (as shown
    before the first line) counts toward that line's width, in order of start (utterances said over one another
    overlap: a player shows both)."""
    if isinstance(transcript, Transcript):
        return cues(transcript.words, layout)
    out = []
    for u in transcript.utterances():
        speaker = transcript.speaker(u.channel)
        out += [dataclasses.replace(c, speaker=speaker) for c in cues(u.words, layout, len(label(speaker)))]
    return sorted(out, key=lambda c: c.start_s)  # stable: a tie keeps the lower channel first


def _srt_label(speaker: str) -> str:
    return f"[{speaker}] "


def to_srt(transcript: Transcript | Conversation, layout: SubtitleLayout = SubtitleLayout()) -> str:
    def text(c: Cue) -> str:  # an arrow in the text would read as a timing line
        shown = "\n".join(line.replace("-->", "->") for line in c.lines)
        return shown if c.speaker is None else _srt_label(c.speaker) + shown

    blocks = [f"{i}\n{_timestamp(c.start_s, ',')} --> {_timestamp(c.end_s, ',')}\n{text(c)}\n"
              for i, c in enumerate(_cues_of(transcript, layout, _srt_label), start=1)]
    return "\n".join(blocks)


def to_vtt(transcript: Transcript | Conversation, layout: SubtitleLayout = SubtitleLayout()) -> str:
    def text(c: Cue) -> str:  # a voice tag is not shown: it takes no room on the line
        shown = "\n".join(html.escape(line, quote=False) for line in c.lines)  # & < > are markup in a cue's text
        return shown if c.speaker is None else f"<v {c.speaker}>{shown}"

    blocks = [f"{_timestamp(c.start_s, '.')} --> {_timestamp(c.end_s, '.')}\n{text(c)}\n"
              for c in _cues_of(transcript, layout, lambda speaker: "")]
    return "WEBVTT\n\n" + "\n".join(blocks)


def word_dict(w: Word, channel: int | None = None) -> dict[str, Any]:
    """A word as records give it: its confidence when scored, its channel in a conversation."""
    out: dict[str, Any] = {"word": w.word, "start": w.start_s, "end": w.end_s}
    if w.confidence is not None:
        out["confidence"] = w.confidence
    if channel is not None:
        out["channel"] = channel
    return out


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
                      duration_s=round(transcript.duration_s, 6), words=[word_dict(w) for w in transcript.words])
        return record
    record.update(
        text=transcript.text, tokens=None, token_frames=None, token_logprobs=None, avg_logprob=transcript.avg_logprob,
        duration_s=round(transcript.duration_s, 6),
        words=[word_dict(w, c) for c, w in transcript.timed_words()],
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


def render(transcript: Transcript | Conversation, audio: str, format: str,
           layout: SubtitleLayout = SubtitleLayout()) -> str:
    """One transcript as the command line writes it: ``text``, ``jsonl`` (one line), ``json``, ``srt`` or ``vtt``
    (cut and laid out by ``layout``)."""
    if format == "text":
        return transcript.text + "\n"
    if format in ("srt", "vtt"):
        return to_srt(transcript, layout) if format == "srt" else to_vtt(transcript, layout)
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
