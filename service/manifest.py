"""NeMo manifests for ``batchasr transcribe``: what a dataset builder has, and what NeMo's tools read.

In: JSON lines, each naming its audio by ``audio_filepath`` (relative paths from the manifest's folder, as NeMo
reads them), with ``offset`` and ``duration`` in seconds to take one stretch of a longer recording. Out: each
line as it came (its ``audio_filepath`` made relative to the folder of the manifest written, where that is
another), with ``pred_text`` added (NeMo's ``transcribe_speech`` convention), ``avg_logprob`` for
filtering pseudo-labels, and ``duration`` where the line had none. Lines with a reference ``text`` are scored:
the run ends with their word error rate.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models.audio_io import AudioClip
from models.conversation import Conversation
from models.transcript import Transcript, rounded
from models.wer import edit_distance

AUDIO_FIELD = "audio_filepath"
SHORT_BY_S = 0.05  # a stretch this much shorter than its line's duration is said to run past the end of its audio
_NOT_A_WORD = re.compile(r"[^\w\s']")  # punctuation: dropped before scoring, with case


@dataclass
class ManifestEntry:
    """One line: its fields (kept, and written back with the prediction) and the audio they name."""

    fields: dict[str, Any]
    clip: AudioClip
    where: str  # "manifest.json:3", for messages


def read_manifest(path: Path) -> list[ManifestEntry]:
    """A manifest's lines (blank ones skipped); ValueError naming the line for one that is not a JSON object with
    an ``audio_filepath``, or whose ``offset`` or ``duration`` is not a number of seconds (0 or more, more than 0)."""
    entries = []
    with path.open("rb") as lines:  # decoded a line at a time: a byte that is not UTF-8 is reported by its line
        for number, raw in enumerate(lines, start=1):
            where = f"{path.name}:{number}"
            try:
                # a UTF-8 byte order mark (Windows editors write one) is not the line's
                line = raw.decode("utf-8").removeprefix("\ufeff" if number == 1 else "")
                if not line.strip():
                    continue
                fields = json.loads(line)
                audio = fields.get(AUDIO_FIELD) if isinstance(fields, dict) else None
                if not isinstance(audio, str) or not audio:
                    raise ValueError(f"each line must be a JSON object with an {AUDIO_FIELD}")
                entries.append(ManifestEntry(fields, AudioClip(path.parent / audio, _seconds(fields, "offset", 0.0),
                                                               _seconds(fields, "duration", None)), where))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{where}: {exc}") from exc
    return entries


def _seconds(fields: dict[str, Any], name: str, default: float | None) -> float | None:
    value = fields.get(name, default)
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return value
    raise ValueError(f"{name} is a number of seconds, not {value!r}")


def file_entries(paths: Iterable[Path]) -> list[ManifestEntry]:
    """Audio files as manifest lines: a manifest made from a folder."""
    return [ManifestEntry({AUDIO_FIELD: str(path)}, AudioClip(path), str(path)) for path in paths]


def rebase_paths(entries: list[ManifestEntry], base: Path, output: Path | None) -> None:
    """The relative ``audio_filepath`` of ``entries`` (relative to ``base``: the manifest's folder, or the working
    folder for files given) rewritten relative to the folder of ``output``, the manifest they are written into, so
    that it reads them back (as NeMo does) wherever it is; left as they came where the two folders are one, or where
    the lines go to standard output or a descriptor (``is_named_file``: they have no folder of their own)."""
    from .line_output import is_named_file

    if output is None or not is_named_file(output):
        return
    base, to = os.path.realpath(base), os.path.realpath(output.parent)  # as the files are opened: through links
    if base == to:
        return
    for entry in entries:
        audio = entry.fields[AUDIO_FIELD]
        if not os.path.isabs(audio):  # its folder through links, its own name as given (a link, maybe)
            folder, name = os.path.split(os.path.join(base, audio))
            entry.fields = {**entry.fields, AUDIO_FIELD: os.path.relpath(os.path.join(os.path.realpath(folder), name),
                                                                         to)}


def prediction_line(entry: ManifestEntry, text: str, avg_logprob: float | None, duration_s: float) -> str:
    """The entry's line with the prediction: ``pred_text``, ``avg_logprob``, and ``duration`` if it had none."""
    line = dict(entry.fields)
    line.setdefault("duration", rounded(duration_s))
    line["pred_text"] = text
    line["avg_logprob"] = avg_logprob
    return json.dumps(line, ensure_ascii=False) + "\n"


def short_stretch(entry: ManifestEntry, duration_s: float) -> str | None:
    """A warning where the line's ``duration`` runs past the end of its audio (its line keeps the duration it came
    with, which filters and buckets for training would take as the audio's), else None."""
    asked = entry.clip.duration_s
    if asked is None or duration_s >= asked - SHORT_BY_S:
        return None
    return (f"warning: {entry.where}: the audio ends {duration_s:.2f} s after its offset, short of the line's duration "
            f"of {asked:g} s")


def transcript_line(entry: ManifestEntry, transcript: Transcript | Conversation) -> str:
    return prediction_line(entry, transcript.text, transcript.avg_logprob, transcript.duration_s)


def record_line(entry: ManifestEntry, record: dict[str, Any]) -> str:
    """``prediction_line`` for a job item's result record."""
    return prediction_line(entry, record["text"], record.get("avg_logprob"), record.get("duration_s") or 0.0)


def words_for_scoring(text: str) -> list[str]:
    """Lowercase words without punctuation: a reference written with it and a model that writes none (or the
    other way round) are scored on what was said."""
    return _NOT_A_WORD.sub(" ", text.lower()).split()


@dataclass
class ErrorRate:
    """Word errors against the references of the lines that have one (``text``)."""

    errors: int = 0
    words: int = 0
    lines: int = 0
    worst: list[tuple[float, str]] = field(default_factory=list)  # (line's WER, where)

    def add(self, entry: ManifestEntry, hypothesis: str) -> None:
        reference = entry.fields.get("text")
        if not isinstance(reference, str):
            return
        said = words_for_scoring(reference)
        errors = edit_distance(said, words_for_scoring(hypothesis))
        self.errors, self.words, self.lines = self.errors + errors, self.words + len(said), self.lines + 1
        self.worst.append((errors / max(len(said), 1), entry.where))

    def report(self, shown: int = 5) -> str:
        if not self.lines:
            return ""
        worst = ", ".join(f"{where} ({rate:.0%})" for rate, where in sorted(self.worst, reverse=True)[:shown])
        return (f"WER {self.errors / max(self.words, 1):.2%} over {self.lines} lines with a reference text "
                f"({self.words} words; lowercased, punctuation dropped); most errors: {worst}\n")
