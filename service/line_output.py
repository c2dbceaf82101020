"""``batchasr transcribe --output FILE``: results as lines of one file (jsonl, a manifest), each written and flushed as
it comes, so that a run cut short keeps what it did and ``--skip-existing`` resumes it; and where ``transcribe``'s and
``submit``'s results go, and what a failed write says."""

from __future__ import annotations

import contextlib
import json
import os
import sys
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


def open_results(stack: contextlib.ExitStack, path: str | Path | None, mode: str) -> TextIO:
    """Where a command's results go: standard output, or ``path`` opened (``OSError`` where it cannot be) and
    closed when ``stack`` ends, quietly: a write that failed has been told (``cannot_write``), and the buffered
    rest cannot go either, so its close raising the same error again is left unsaid."""
    if path is None:
        return sys.stdout
    out = open(path, mode, encoding="utf-8")  # noqa: SIM115 - closed by the stack
    stack.callback(_close_quietly, out)
    return out


def _close_quietly(out: TextIO) -> None:
    with contextlib.suppress(OSError):
        out.close()


def cannot_write(exc: OSError, detail: str = "") -> int:
    """Results that cannot be written (a full disk, an output path that cannot be made, a closed pipe) end the
    command with one error line and status 2: every later result would fail alike, and 1 means an input could not
    be read. What was written stays."""
    print(f"error: cannot write the results: {exc}{detail}", file=sys.stderr)
    if isinstance(exc, BrokenPipeError):  # nothing more reaches the reader, nor should Python's flush at exit try
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 2
