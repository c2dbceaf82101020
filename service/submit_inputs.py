"""What `batchasr submit` sends: the inputs it is given (files, directories, URLs, stretches of files, workers'
paths), as job items and as runs of them that make one job each."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.audio_io import AudioClip, find_audio_files

from .job_types import ItemInput
from .jobs import JSON_JOB_BYTES, MAX_JOB_ITEMS
from .output_files import is_url
from .stretch_upload import stretch_upload, stretch_upload_size

JOB_BYTES = 256 * 1024 * 1024  # uploads per job by default: well under a server's MAX_JOB_UPLOAD_BYTES (1 GiB)
JSON_FIELDS_ROOM = 1 << 20  # of a JSON job's body, left for its fields beside the items (webhook, hotwords, ...)
SIZE_SUFFIXES = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}


@dataclass(frozen=True)
class WorkerPath:
    """A file (or a stretch of it) the workers read from their own disk, under their input roots: its path is sent,
    not its bytes (``submit --paths``: a filesystem the submitter and the workers share)."""

    clip: AudioClip

    def __str__(self) -> str:
        return str(self.clip)

    def item(self) -> dict[str, Any]:
        """The JSON job item (POST /v1/jobs)."""
        item: dict[str, Any] = {"path": str(self.clip.path.resolve())}
        if not self.clip.whole:
            item.update(offset=self.clip.offset_s, duration=self.clip.duration_s)
        return item


# a local file, an http(s) URL the workers fetch, a stretch of a local file, or a file the workers read themselves
Input = Path | str | AudioClip | WorkerPath


def collect_audio(paths: list[str], url_lists: Sequence[str] = ()) -> list[Input]:
    """Files as given, audio files found under directories (sorted, recursively), URLs as given, and the URLs
    listed one a line in each of ``url_lists`` (``-``: standard input; blank lines and ``#`` comments skipped)."""
    found: list[Input] = []
    for raw in paths:
        found += [raw] if is_url(raw) else find_audio_files([raw])
    for listing in url_lists:
        text = sys.stdin.read() if listing == "-" else Path(listing).read_text(encoding="utf-8")
        for number, line in enumerate(text.splitlines(), start=1):
            line = line.strip()
            if line and not line.startswith("#"):
                if not is_url(line):
                    raise ValueError(f"{listing}:{number}: not an http(s) URL: {line[:200]}")
                found.append(line)
    return found


def parse_size(text: str) -> int:
    """Bytes from ``1048576``, ``512K``, ``256M`` or ``1G`` (binary multiples)."""
    number, suffix = (text[:-1], text[-1].upper()) if text[-1:].isalpha() else (text, "")
    if suffix not in SIZE_SUFFIXES or not number.isdigit() or int(number) < 1:
        raise ValueError(f"{text!r}: give a size as a number of bytes, or with K, M or G")
    return int(number) * SIZE_SUFFIXES[suffix]


def split_into_jobs(inputs: list[Input], max_bytes: int, multichannel: bool = False,
                    max_items: int = MAX_JOB_ITEMS) -> list[list[Input]]:
    """Runs of consecutive inputs whose uploads total at most ``max_bytes`` (a file larger than that goes alone),
    of at most ``max_items`` inputs, files and URLs in separate runs: each run one job, in input order. URLs and
    workers' paths count their JSON items' bytes, and their jobs' bodies stay within the server's JSON_JOB_BYTES."""
    jobs: list[list[Input]] = []
    size = 0
    for source in inputs:
        as_json = sent_as_json(source)
        n = len(json.dumps(json_item(source))) + 2 if as_json else upload_size(source, multichannel)
        limit = min(max_bytes, JSON_JOB_BYTES - JSON_FIELDS_ROOM) if as_json else max_bytes
        if (not jobs or size + n > limit or len(jobs[-1]) >= max_items
                or sent_as_json(jobs[-1][-1]) != as_json):
            jobs.append([])
            size = 0
        jobs[-1].append(source)
        size += n
    return jobs


def json_item(source: str | WorkerPath) -> dict[str, Any]:
    """A URL's or a worker's path's item in a JSON job (POST /v1/jobs)."""
    return {"url": source} if isinstance(source, str) else source.item()


def sent_as_json(source: Input) -> bool:
    """URLs and workers' paths go as a JSON job; files and stretches as uploads (split_into_jobs keeps them apart)."""
    return isinstance(source, (str, WorkerPath))


def upload_size(source: Input, multichannel: bool = False) -> int:
    """What an input adds to its job's uploads: a file's bytes, a URL's length, a stretch's most
    (``stretch_upload_size``)."""
    if isinstance(source, (str, WorkerPath)):
        return len(source) if isinstance(source, str) else len(str(source.clip.path))
    if isinstance(source, Path):
        return source.stat().st_size
    return stretch_upload_size(source, multichannel)


def item_input(source: Input, multichannel: bool = False) -> ItemInput:
    """A job item for a local file (uploaded: read as the job is written), a URL (fetched by the worker) or a
    stretch of a file (``stretch_upload``)."""
    if isinstance(source, str):
        return ItemInput(audio=source, url=source)
    if isinstance(source, WorkerPath):
        clip = source.clip
        stretch = None if clip.whole else clip.stretch
        return ItemInput(audio=str(clip), path=source.item()["path"], stretch=stretch)
    if isinstance(source, AudioClip):
        return ItemInput(audio=str(source), upload=stretch_upload(source, multichannel)[1])
    return ItemInput(audio=str(source), upload=source)
