"""The ``batchasr submit`` and ``batchasr jobs`` commands: their options, and what they check before anything is
sent (what they then do: service.jobs_cli)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from .cli_options import (
    CHANNEL_NAMES_HELP,
    HOTWORDS_HELP,
    MULTICHANNEL_HELP,
    SKIP_SILENCE_HELP,
    add_layout_options,
    names,
    phrases,
)
from .cli_options import layout as subtitle_layout

if TYPE_CHECKING:
    from .formats import SubtitleLayout
    from .manifest import ErrorRate, ManifestEntry


def submit_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("submit", help="submit audio files (and directories of them) or URLs as one bulk job")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--redis-url", help="submit straight into Redis (default: BATCHASR_REDIS_URL)")
    target.add_argument("--server", help="submit through a batchasr server's /v1/jobs (e.g. http://host:8000)")
    p.add_argument("--api-key", help="Bearer key for --server")
    p.add_argument("--wait", action="store_true", help="wait for the job, with a progress bar, then print results")
    p.add_argument("--output", type=Path, help="write result lines here instead of stdout")
    p.add_argument("--idempotency-key", help="resubmitting with the same key returns the same job (default: a key of "
                   "this command's own, under which it tries a job again through an outage)")
    p.add_argument("--webhook-url", help="POSTed to (signed) when the job finishes; the server must allow it")
    p.add_argument("--priority", choices=["high", "normal", "low"], default="normal",
                   help="workers take high jobs' items before normal ones', and normal before low (default normal)")
    p.add_argument("--multichannel", action="store_true", help=MULTICHANNEL_HELP)
    p.add_argument("--channel-names", type=names, default=[], metavar="NAMES", help=CHANNEL_NAMES_HELP)
    p.add_argument("--skip-silence", action="store_true", help=SKIP_SILENCE_HELP)
    p.add_argument("--hotwords", type=phrases, default=[], metavar="PHRASES", help=HOTWORDS_HELP)
    p.add_argument("--output-dir", type=Path,
                   help="with --wait: write one <name>.<format> per input here (named as transcribe --output-dir "
                        "names them; a URL by its path's last part) instead of result lines")
    p.add_argument("--format", default="json", choices=("text", "json", "srt", "vtt", "manifest"),
                   help="with --output-dir: each file's format (default: json, the item's result record); "
                        "manifest: with --manifest and --wait, the result lines as its lines with their pred_text")
    p.add_argument("--manifest", type=Path, metavar="FILE",
                   help="submit the audio a NeMo manifest names (a stretch of a file, with offset and duration, "
                        "uploaded as its samples) instead of files or URLs")
    p.add_argument("--paths", dest="paths_not_bytes", action="store_true",
                   help="send files' paths, not their bytes: the workers read them (and a manifest's stretches of "
                        "them) from a filesystem they share with you, under their BATCHASR_INPUT_ROOTS")
    add_layout_options(p)
    p.add_argument("--job-bytes", default="256M", metavar="SIZE",
                   help="uploads a job holds at most (e.g. 256M, 1G); more audio goes as several jobs, in order "
                        "(default 256M; a server takes at most BATCHASR_MAX_JOB_UPLOAD_BYTES a job)")
    p.add_argument("--url-list", action="append", default=[], metavar="FILE",
                   help="http(s) URLs to submit, one a line ('-': standard input); the workers fetch them")
    p.add_argument("paths", nargs="*", metavar="FILES_DIRS_OR_URLS")
    p.set_defaults(func=cmd_submit)


def server_url_problem(url: str) -> str | None:
    """What keeps ``url`` from being a server's address (None: nothing): one without its scheme was tried again for
    minutes as an outage, and one httpx cannot parse (a port past 65535, an unclosed IPv6 bracket) a traceback."""
    import httpx

    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError) as exc:
        return f"not a URL ({exc})"
    if parsed.scheme not in ("http", "https") or not parsed.host:
        return "not an http:// or https:// address (e.g. http://asr:8000)"
    if parsed.port is not None and not 0 < parsed.port < 65536:
        return f"port {parsed.port} is not one (1 to 65535)"
    return None


def has_target(args: argparse.Namespace) -> bool:
    """submit, jobs: whether there is a server or a Redis to talk to; without --server or --redis-url, Redis is
    BATCHASR_REDIS_URL's (as for the worker; blank: unset, as for the server). Said on stderr when there is none, or
    the Redis URL is not one."""
    from .config import SettingProblem
    from .redis_pools import check_url

    from_environment = not (args.server or args.redis_url)
    if from_environment:
        args.redis_url = os.environ.get("BATCHASR_REDIS_URL", "").strip() or None
    if not (args.server or args.redis_url):
        print(f"error: {args.command} needs --server or --redis-url (or BATCHASR_REDIS_URL)", file=sys.stderr)
        return False
    if args.server and (problem := server_url_problem(args.server)):
        print(f"error: --server {args.server!r}: {problem}", file=sys.stderr)
        return False
    if args.redis_url and not args.server:
        try:
            check_url(args.redis_url)
        except ValueError as exc:  # said as the server says a bad setting, not as a traceback
            problem = SettingProblem("redis_url", args.redis_url, str(exc), overridden=not from_environment)
            print(f"error: {problem.line({'redis_url': '--redis-url'})}", file=sys.stderr)
            return False
    return True


def cmd_submit(args: argparse.Namespace) -> int:
    from models.audio_io import AudioClip

    from .job_types import JobOptions, JobPriority
    from .jobs_cli import run_submit
    from .line_output import cannot_write, open_results
    from .submit_inputs import WorkerPath, collect_audio, parse_size

    if not has_target(args):
        return 2
    if problem := _misplaced_output_option(args):  # before --output is opened (and emptied)
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        job_bytes = parse_size(args.job_bytes)
        entries, unreadable = _submitted_manifest(args)
        inputs = collect_audio(args.paths, args.url_list) if entries is None else [
            entry.clip.path if entry.clip.whole else entry.clip
            for entry in entries]
        if args.paths_not_bytes:
            inputs = [s if isinstance(s, str) else WorkerPath(AudioClip(s) if isinstance(s, Path) else s)
                      for s in inputs]
        elif gone := next((s for s in inputs if isinstance(s, Path) and not s.is_file()), None):
            # uploaded from here: a file named, or a directory's link to nothing, is refused by name before any
            # job is sent (a mistyped argument; a manifest's line whose file is gone is left out, by its line)
            raise ValueError(f"{gone}: no such audio file")
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not inputs:
        print("error: no audio files or URLs found", file=sys.stderr)
        return 2
    if args.channel_names and not args.multichannel:
        print("error: --channel-names names the channels of --multichannel", file=sys.stderr)
        return 2
    write_result = None
    if args.output_dir is not None:
        if not args.wait:
            print("error: --output-dir writes the results, so it needs --wait", file=sys.stderr)
            return 2
        try:
            write_result = _result_files(args, inputs)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:  # an output folder that cannot be made: refused before any job is sent
            return cannot_write(exc)
    from .manifest import ErrorRate

    scored = ErrorRate()  # of a manifest's lines with a reference, written with --format manifest
    with contextlib.ExitStack() as stack:
        try:  # opened before any job is sent: results that would have nowhere to go are refused first
            out = open_results(stack, args.output, "w")
        except OSError as exc:
            return cannot_write(exc)
        if args.format == "manifest":
            write_result = _manifest_writer(entries or [], out, scored)
        status = asyncio.run(run_submit(inputs, args.redis_url, args.server, args.api_key, args.wait, out,
                                        args.idempotency_key, job_bytes=job_bytes,
                                        options=JobOptions(args.webhook_url, JobPriority(args.priority),
                                                           args.multichannel, args.skip_silence,
                                                           channel_names=tuple(args.channel_names),
                                                           hotwords=tuple(args.hotwords)),
                                        write_result=write_result))
    sys.stderr.write(scored.report())
    if unreadable:
        print(f"{unreadable} manifest lines were not sent: their audio could not be read here", file=sys.stderr)
        return max(status, 1)
    return status


def _misplaced_output_option(args: argparse.Namespace) -> str | None:
    """What is wrong with where and how ``submit``'s results are written, as ``jobs`` checks its own
    (``_misplaced_results_option``): both places given, the manifest read given as the place, or a file format
    with no files to take it."""
    from .line_output import output_is_input

    if args.output is not None and args.output_dir is not None:
        return "--output writes result lines, --output-dir a file per input: give one"
    if problem := output_is_input(args.output, args.manifest):
        return problem
    if args.format in ("text", "srt", "vtt") and args.output_dir is None:
        return f"--format {args.format} is the format of --output-dir's files: result lines are JSON"
    return None


def _submitted_manifest(args: argparse.Namespace) -> tuple[list[ManifestEntry] | None, int]:
    """``submit --manifest``'s lines to send (None without it) and how many were left out (``_uploadable``), the
    options checked; ValueError saying what is wrong."""
    from .manifest import read_manifest, rebase_paths

    if args.format == "manifest" and (args.manifest is None or not args.wait or args.output_dir is not None):
        raise ValueError("--format manifest writes a --manifest's lines with their results: it needs --manifest and "
                         "--wait, and no --output-dir")
    if args.manifest is None:
        return None, 0
    if args.paths or args.url_list:
        raise ValueError("give files, directories and URLs, or --manifest, not both")
    if args.output_dir is not None:
        raise ValueError("--manifest writes result lines (a manifest's lines may share a file): no --output-dir")
    entries = read_manifest(args.manifest)
    if not entries:
        raise ValueError(f"{args.manifest}: no lines")
    if args.format == "manifest":
        rebase_paths(entries, args.manifest.parent, args.output)
    if args.paths_not_bytes:  # the workers read them: a line they cannot read fails as its item
        return entries, 0
    uploadable = [entry for entry in entries if _uploadable(entry, args.multichannel)]
    if not uploadable:
        raise ValueError(f"{args.manifest}: no line's audio could be read")
    return uploadable, len(entries) - len(uploadable)


def _uploadable(entry: ManifestEntry, multichannel: bool) -> bool:
    """Whether a line's audio can be uploaded from here; if not (a file that is not there, or a stretch of one that
    does not open as audio), said on stderr by its line and left out, the rest sent, as ``transcribe --manifest``
    reports such a line and transcribes the rest. A whole file goes as its bytes: one that is no audio fails as its
    item."""
    from .stretch_upload import stretch_upload_size

    clip = entry.clip
    if not clip.path.is_file():
        print(f"error: {entry.where}: {clip.path}: no such audio file", file=sys.stderr)
        return False
    if not clip.whole:
        try:
            stretch_upload_size(clip, multichannel)  # opens it: its header is read again when jobs are split
        except (OSError, ValueError, RuntimeError, TypeError) as exc:  # libsndfile's errors are RuntimeErrors
            print(f"error: {entry.where}: {clip.path}: cannot read audio ({exc})", file=sys.stderr)
            return False
    return True


def _manifest_writer(entries: list[ManifestEntry], out: TextIO, scored: ErrorRate
                     ) -> Callable[[Path | str, dict], None]:
    """``submit --manifest --format manifest``: each result written to ``out`` as its line (results come in input
    order, one a line, so the n-th is the n-th line's) and scored against its reference; a failed item's error on
    stderr, naming its line."""
    from .manifest import record_line, short_stretch

    pending = iter(entries)

    def write(_source: Path | str, record: dict) -> None:
        entry = next(pending)
        if record["status"] != "completed":
            print(f"error: {entry.where}: {record['status']}: {record.get('error') or ''}", file=sys.stderr)
            return
        scored.add(entry, record["text"])
        if warning := short_stretch(entry, record.get("duration_s") or 0.0):
            print(warning, file=sys.stderr)
        out.write(record_line(entry, record))

    return write


def _result_files(args: argparse.Namespace, inputs: list) -> Callable[[Any, dict], None]:
    """``submit --output-dir``: each completed item's result written to its own file, whole; a failed item's error
    on stderr. ValueError if two inputs would share a file."""
    from .output_files import file_suffix, output_names
    from .submit_inputs import WorkerPath

    layout = subtitle_layout(args)
    given = set(args.paths)
    # in input order (the arguments, then --url-list's URLs), as the results come and jobs --results numbers them
    file_names = output_names([*args.paths, *(i for i in inputs if isinstance(i, str) and i not in given)],
                              file_suffix(args.format))
    args.output_dir.mkdir(parents=True, exist_ok=True)

    def write(source: Path | str | WorkerPath, record: dict) -> None:
        if isinstance(source, WorkerPath):  # --paths: named as the file would be
            source = source.clip.path
        _write_item_file(args.output_dir / file_names[source], record, str(source), args.format, layout)

    return write


def _recorded_files(args: argparse.Namespace) -> Callable[[dict], None]:
    """``jobs --results --output-dir``: each completed item's result written to its own file, whole, named by the
    name it was submitted under (``RecordedNames``); a failed or cancelled item's error on stderr."""
    from .output_files import RecordedNames, file_suffix

    layout = subtitle_layout(args)
    file_names = RecordedNames(file_suffix(args.format))
    args.output_dir.mkdir(parents=True, exist_ok=True)

    def write(record: dict) -> None:
        audio = record.get("audio") or "item"
        _write_item_file(args.output_dir / file_names.name(audio), record, audio, args.format, layout)

    return write


def _write_item_file(path: Path, record: dict, audio: str, format: str, layout: SubtitleLayout) -> None:
    """A completed item's result written whole to ``path`` as ``format`` has it (json: the record itself); a failed
    or cancelled item's error on stderr instead; an item not ended yet, nothing."""
    from .formats import from_record, render
    from .output_files import write_whole

    if record["status"] in ("failed", "cancelled"):
        print(f"error: {audio}: {record['status']}: {record.get('error') or ''}", file=sys.stderr)
    elif record["status"] == "completed" and format == "json":
        write_whole(path, json.dumps(record, ensure_ascii=False, indent=2) + "\n")
    elif record["status"] == "completed":
        write_whole(path, render(from_record(record), audio, format, layout))


def jobs_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("jobs", help="list bulk jobs, newest first; or cancel, purge or retry some, or write their "
                                    "results")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--server", help="a batchasr server's /v1/jobs: the jobs of --api-key (or, on a server "
                                         "without keys, every job)")
    target.add_argument("--redis-url", help="straight from Redis: the jobs submitted without an API key (default: "
                                            "BATCHASR_REDIS_URL)")
    p.add_argument("--api-key", help="Bearer key for --server")
    p.add_argument("--status", choices=["queued", "in_progress", "completed", "completed_with_errors", "failed",
                                        "cancelled"], help="only jobs in this state")
    p.add_argument("--limit", type=int, default=20, help="at most this many (default 20)")
    p.add_argument("--json", action="store_true", help="one JSON object a line, as GET /v1/jobs/{id} gives it")
    action = p.add_mutually_exclusive_group()
    action.add_argument("--cancel", nargs="+", metavar="JOB_ID", help="cancel these jobs instead of listing: items "
                                                                        "not finished are dropped")
    action.add_argument("--purge", nargs="+", metavar="JOB_ID", help="delete these jobs at once instead of "
                                                                       "listing: records, results, uploaded audio")
    action.add_argument("--retry", nargs="+", metavar="JOB_ID", help="queue these jobs' failed items again instead "
                                                                       "of listing (those of paths and URLs; under "
                                                                       "a queued-items limit, waiting for room)")
    action.add_argument("--results", nargs="+", metavar="JOB_ID",
                        help="write these jobs' results instead of listing: a JSON line per item in item order, the "
                             "record as the job holds it (an item not ended says its state)")
    p.add_argument("--wait", action="store_true", help="with --results: wait for the jobs to end first, with a "
                                                       "progress bar")
    p.add_argument("--output", type=Path, metavar="FILE", help="with --results: write the lines here, not to stdout")
    p.add_argument("--output-dir", type=Path, metavar="DIR",
                   help="with --results: write each completed item's result to a file of its own here, named by the "
                        "name it was submitted under (a path stays a path inside DIR, a URL is its path's last part; "
                        "a name met again is numbered: call.srt, call.2.srt)")
    p.add_argument("--format", choices=("text", "json", "srt", "vtt"),
                   help="with --output-dir: each file's format (default: json, the item's result record)")
    add_layout_options(p)
    p.set_defaults(func=cmd_jobs)


def cmd_jobs(args: argparse.Namespace) -> int:
    from .jobs_cli import run_action, run_list

    if not has_target(args):
        return 2
    if problem := _misplaced_results_option(args):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.results:
        return _write_results(args)
    for action in ("cancel", "purge", "retry"):
        if job_ids := getattr(args, action):
            return asyncio.run(run_action(args.redis_url, args.server, args.api_key, job_ids, action, sys.stdout))
    if args.limit < 1:
        print("error: --limit must be at least 1", file=sys.stderr)
        return 2
    return asyncio.run(run_list(args.redis_url, args.server, args.api_key, args.limit, args.status, args.json,
                                sys.stdout))


def _misplaced_results_option(args: argparse.Namespace) -> str | None:
    """What is wrong with the options that say where and how ``--results`` are written, where anything is."""
    given = [option for option, value in (("--wait", args.wait), ("--output", args.output),
                                          ("--output-dir", args.output_dir), ("--format", args.format)) if value]
    if given and not args.results:
        return f"{', '.join(given)}: these say how --results are written, and there is no --results"
    if args.output is not None and args.output_dir is not None:
        return "--output writes result lines, --output-dir a file per item: give one"
    if args.format is not None and args.output_dir is None:
        return "--format is the format of --output-dir's files: the lines of --results are JSON"
    return None


def _write_results(args: argparse.Namespace) -> int:
    """``jobs --results``: the output opened, or its folder made, before anything is read."""
    from .jobs_cli import run_results
    from .line_output import cannot_write, open_results

    args.format = args.format or "json"
    write_result = None
    with contextlib.ExitStack() as stack:
        try:
            if args.output_dir is not None:
                write_result = _recorded_files(args)
            out = open_results(stack, args.output, "w")
        except ValueError as exc:  # a subtitle layout out of range
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            return cannot_write(exc)
        return asyncio.run(run_results(args.redis_url, args.server, args.api_key, args.results, args.wait, out,
                                       write_result))
