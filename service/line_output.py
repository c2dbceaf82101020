"""``batchasr transcribe --output FILE``: results as lines of one file (jsonl, a manifest), each written and flushed as
it comes, so that a run cut short keeps what it did and ``--skip-existing`` resumes it; and where ``transcribe``'s and
``submit``'s results go, and what a failed write says."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import sys
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

LINE_FORMATS = ("jsonl", "manifest")
DESCRIPTOR_FOLDERS = ("/dev/", "/proc/")  # paths that stand for a descriptor or a device, not a file of their own
PREDICTION_FIELDS = ("pred_text", "avg_logprob")  # what a manifest line gains (service.manifest), and ``duration``
# where it had none
RESULT_FIELDS = {"jsonl": ("audio", "text"), "manifest": ("audio_filepath", "pred_text")}  # in every result line


def line_key(format: str, line: dict[str, Any]) -> str:
    """What identifies an input in a result line, and in the line it came from: a jsonl record's ``audio``; a
    manifest line's own fields (its prediction left out; its ``duration`` kept: two stretches of one file differ by
    it, and ``inputs_done`` matches a line that had none)."""
    if format == "jsonl":
        return str(line.get("audio"))
    return json.dumps({k: v for k, v in line.items() if k not in PREDICTION_FIELDS}, sort_keys=True,
                      ensure_ascii=False)


def inputs_done(format: str, done: Counter[str], lines: list[dict[str, Any]]) -> list[bool]:
    """Which input ``lines`` have a result line among ``done`` (``lines_done``), each result line taken once. A
    manifest line with its own ``duration`` is matched by it first; then a line without one, whose result gained
    one, by the rest of its fields."""
    left = done.copy()
    found = [False] * len(lines)
    has_duration = [format == "jsonl" or "duration" in line for line in lines]
    for i in (i for i, exact in enumerate(has_duration) if exact):
        found[i] = _take(left, line_key(format, lines[i]))
    rest = [i for i, exact in enumerate(has_duration) if not exact]  # manifest lines only
    unmatched: Counter[str] = Counter()  # the result lines not taken, their (added) duration left out
    for key, count in left.items() if rest else ():
        unmatched[_without_duration(key)] += max(count, 0)
    for i in rest:
        found[i] = _take(unmatched, line_key(format, lines[i]))
    return found


def _take(counts: Counter[str], key: str) -> bool:
    if counts[key] <= 0:
        return False
    counts[key] -= 1
    return True


def _without_duration(key: str) -> str:
    line = json.loads(key)
    line.pop("duration", None)
    return json.dumps(line, sort_keys=True, ensure_ascii=False)


def lines_done(path: Path, format: str) -> Counter[str]:
    """The inputs whose lines ``path`` holds (by ``line_key``, counted: an input may be listed twice). A last line
    without its newline, torn when a run was killed while writing it, is cut off so that it is written again; but
    only once every whole line is known to be a result line and the torn one starts as a record does: ValueError
    otherwise, the file left as it was (it is not this command's results)."""
    if not path.is_file():
        return Counter()
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    done = _counted_lines(path, data[:end], format)  # first: a file that is not ours is refused untouched
    torn = data[end:]
    if torn.strip():
        if not torn.lstrip().startswith(b"{"):
            last = data.count(b"\n") + 1
            raise ValueError(f"{path}:{last}: not a result line this command wrote (a last line "
                             "without its newline that does not start a record)")
        with path.open("r+b") as f:
            f.truncate(end)
    return done


def _counted_lines(path: Path, whole: bytes, format: str) -> Counter[str]:
    """The inputs of whole lines ``whole`` (``lines_done``), counted; ValueError naming the first that is not a
    result line of ``format``: a manifest being read, or another format's results, are not taken as done."""
    done: Counter[str] = Counter()
    for number, line in enumerate(whole.decode("utf-8").splitlines(), start=1):
        if line.strip():
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError(f"JSON, but not an object: {line[:40]}")
                if missing := [name for name in RESULT_FIELDS[format] if name not in record]:
                    raise ValueError(f"no {' or '.join(missing)}: not --format {format}'s result")
                done[line_key(format, record)] += 1
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: not a result line this command wrote ({exc})") from exc
    return done


def open_results(stack: contextlib.ExitStack, path: str | Path | None, mode: str) -> TextIO:
    """Where a command's results go: standard output, or ``path`` opened (``OSError`` where it cannot be, or another
    command holds it), locked against other commands, and closed when ``stack`` ends, quietly: a write that failed
    has been told (``cannot_write``), and the buffered rest cannot go either, so its close raising the same error
    again is left unsaid."""
    if path is None:
        return sys.stdout
    out = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by the stack; emptied (mode "w") once locked
    stack.callback(_close_quietly, out)
    if is_named_file(path, out.fileno()):
        _lock(out, path)
        if mode == "w":
            out.truncate(0)
    return out


def is_named_file(path: str | Path, fd: int | None = None) -> bool:
    """Whether ``path`` is a file of its own: not /dev/null, a pipe, or a descriptor (/dev/stdout, /dev/fd/N)
    standing for whatever the shell gave, which several commands may share (``... --output /dev/stdout >> f``)."""
    if os.path.abspath(path).startswith(DESCRIPTOR_FOLDERS):
        return False
    with contextlib.suppress(OSError):
        return stat.S_ISREG(os.fstat(fd).st_mode if fd is not None else os.stat(path).st_mode)
    return True  # not there yet: it will be one


def _lock(out: TextIO, path: str | Path) -> None:
    """An exclusive lock on the results file, held until the command ends: two runs appending to one file wrote
    every result twice. Where the file system has no locks (Lustre without flock, NFS without lockd), said and
    gone on without one."""
    try:
        fcntl.flock(out.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise OSError(f"{path}: another batchasr command is writing its results there") from None
    except OSError as exc:  # ENOLCK, ENOSYS, EOPNOTSUPP, EINVAL: no locking there
        print(f"warning: {path}: cannot be locked ({exc.strerror}): make sure no other command writes it",
              file=sys.stderr)


def output_is_input(output: Path | None, manifest: Path | None) -> str | None:
    """What is wrong where ``--output`` names the manifest being read (a link, or another spelling, to it
    included): its lines would be appended to, or emptied; None where it does not."""
    if output is None or manifest is None:
        return None
    try:
        same = os.path.samefile(output, manifest)
    except OSError:  # one is not there yet
        same = output.resolve() == manifest.resolve()
    return f"--output {output} is the manifest being read: write the results to another file" if same else None


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
