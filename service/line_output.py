"""``batchasr transcribe --output FILE``: results as lines of one file (jsonl, a manifest), each written and flushed as
it comes, so that a run cut short keeps what it did and ``--skip-existing`` resumes it."""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

LINE_FORMATS = ("jsonl", "manifest")
ADDED_FIELDS = ("pred_text", "avg_logprob", "duration")  # what a manifest line gains (service.manifest)


def line_key(format: str, line: dict[str, Any]) -> str:
    """What identifies an input in a result line, and in the line it came from: a jsonl record's ``audio``; a
    manifest line's own fields (its ``duration`` left out: it is added where a line had none)."""
    if format == "jsonl":
        return str(line.get("audio"))
    return json.dumps({k: v for k, v in line.items() if k not in ADDED_FIELDS}, sort_keys=True, ensure_ascii=False)


def lines_done(path: Path, format: str) -> Counter[str]:
    """The inputs whose lines ``path`` holds (by ``line_key``, counted: an input may be listed twice). A last line
    without its newline, torn when a run was killed while writing it, is cut off so that it is written again."""
    if not path.is_file():
        return Counter()
    data = path.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    if len(whole) < len(data):
        with path.open("r+b") as f:
            f.truncate(len(whole))
    done: Counter[str] = Counter()
    for number, line in enumerate(whole.decode("utf-8").splitlines(), start=1):
        if line.strip():
            try:
                done[line_key(format, json.loads(line))] += 1
            except (ValueError, AttributeError) as exc:
                raise ValueError(f"{path}:{number}: not a result line this command wrote ({exc})") from exc
    return done


def close_quietly(out: TextIO) -> None:
    """Close a results file whose write failed (a full disk): the failure has been told, and the buffered rest
    cannot go either, so its close raising the same error again is left unsaid."""
    with contextlib.suppress(OSError):
        out.close()
