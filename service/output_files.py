"""Results written one file per input under an output directory (`batchasr transcribe`, `batchasr submit` and
`batchasr jobs --results` with ``--output-dir``): how each is named, and writing each whole."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlsplit

from models.audio_io import find_audio_files


def is_url(text: str) -> bool:
    return text.startswith(("http://", "https://"))


def file_suffix(format: str) -> str:
    """The file name suffix of a result in ``format``: ``.txt`` for text, as editors and whisper name it."""
    return ".txt" if format == "text" else f".{format}"


def _url_name(url: str) -> Path:
    """A URL's result named by its path's last part (``index`` for none): ``https://h/x/c%20d.mp3?sig=1`` is c d.mp3."""
    return Path(PurePosixPath(unquote(urlsplit(url).path)).name or "index")


def output_names(arguments: Iterable[str], suffix: str, files: bool = True) -> dict[Path | str, Path]:
    """Each input the arguments name, and the name of its result: a file given by name as <stem><suffix>, a file
    found under a directory at its path inside it, a URL by the last part of its path. With ``files`` (results
    written to files of those names), ValueError if two files would share one, and a name an earlier input's result
    has is numbered, in input order (``audio.txt``, ``audio.2.txt``: a list of thousands of ``<id>/audio.wav`` URLs
    cannot be split into runs), as ``jobs --results`` numbers the same inputs' results."""
    named: dict[Path | str, Path] = {}
    for argument in arguments:
        if is_url(argument):
            named[argument] = _url_name(argument).with_suffix(suffix)
            continue
        root = Path(argument)
        for path in find_audio_files([argument]):
            named[path] = (path.relative_to(root) if root.is_dir() else Path(path.name)).with_suffix(suffix)
    if not files:
        return named
    seen: dict[Path, Path | str] = {}
    for source, name in named.items():
        if isinstance(source, str):  # a URL: numbered below
            continue
        if name in seen:
            raise ValueError(f"{seen[name]} and {source} would both be written as {name}: give them in separate runs")
        seen[name] = source
    # in input order, not files first: a file after a URL of its name is numbered, as jobs --results numbers it
    numbered = RecordedNames(suffix)
    return {source: numbered.name(source) if isinstance(source, str) else numbered.numbered(name)
            for source, name in named.items()}


STRETCH_LABEL = re.compile(r" \[[^\]]*\]$")  # a stretch of a recording, as AudioClip names it: "a.wav [1 s to 5 s]"


class RecordedNames:
    """Names for the results of a job's items, known only by the names they were submitted under (``jobs --results
    --output-dir``): a URL by its path's last part, anything else (a path, an upload's file name) by its path as
    given, inside the output directory whatever that path says (its root and any ``..`` dropped: the names are
    whoever submitted's); a name already given in this run gets a number, in order (``call.srt``, ``call.2.srt``)."""

    def __init__(self, suffix: str) -> None:
        self.suffix = suffix
        self.given: set[Path] = set()  # names given already

    def name(self, audio: str) -> Path:
        if is_url(audio):
            name = _url_name(audio)
        else:
            parts = [part for part in PurePosixPath(STRETCH_LABEL.sub("", audio)).parts if part not in ("/", ".", "..")]
            name = Path(*parts) if parts else Path("item")
        return self.numbered(name.with_name(name.stem + self.suffix))

    def numbered(self, name: Path) -> Path:
        """``name`` (ending in the suffix), numbered where this run gave it already."""
        stem, number = name.stem, 1
        while name in self.given:
            number += 1
            name = name.with_name(f"{stem}.{number}{self.suffix}")
        self.given.add(name)
        return name


def write_whole(path: Path, text: str) -> None:
    """Written under a temporary name, flushed to disk, then renamed: a run cut short, even by a power cut, leaves
    no half-written or empty result behind (which --skip-existing would take for a finished one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())  # a rename can reach the disk before the data it names
    partial.replace(path)
