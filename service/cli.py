"""The ``batchasr`` command: transcribe | serve | worker | submit | jobs | bench.

Each subcommand imports what it needs when it runs, so ``batchasr transcribe`` never loads the web stack.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from .config import SettingProblem, Settings
    from .formats import SubtitleLayout
    from .manifest import ErrorRate, ManifestEntry

FORMATS = ("text", "json", "jsonl", "srt", "vtt", "manifest")
MULTICHANNEL_HELP = ("transcribe each channel apart (a call's agent and customer) and give each file as a "
                     "conversation: utterances in time order, each naming its channel")
CHANNEL_NAMES_HELP = "with --multichannel: the speakers, one a channel in order (e.g. agent,customer)"
SKIP_SILENCE_HELP = ("leave out quiet stretches of 2 s or more (near the recording's noise floor): they cost nothing "
                     "and give no words")
HOTWORDS_HELP = ("comma-separated words or phrases to make likelier, as the model writes them (product names, "
                 "people); 'acme:3' gives one its own bonus (others: 2.0, or a server's BATCHASR_HOTWORD_BOOST)")


def _phrases(text: str) -> list[str]:
    from .hotwords import split_hotwords

    return split_hotwords([text])


def _segment_seconds(text: str) -> float:
    """--max-segment-s: 0 (every file whole), or at least what the service's BATCHASR_MAX_SEGMENT_S takes; refused
    here, before the model loads."""
    from models.segmenter import MIN_SEGMENT_S, SEGMENT_TOO_SHORT

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if value != 0 and not value >= MIN_SEGMENT_S:  # NaN too
        raise argparse.ArgumentTypeError(f"{SEGMENT_TOO_SHORT} (or 0: every file whole), not {text}")
    return value


def _names(text: str) -> list[str]:
    from models.conversation import parse_names

    try:
        return parse_names(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="a .nemo file or unpacked checkpoint directory (default: embedded model)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="weights of encoder and heads (default: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--attention-kernel", choices=("auto", "reference", "sdpa"),
                        help="reference: NeMo's sequence of operations; sdpa: torch's fused attention, the same "
                             "result up to rounding; auto: sdpa on CPU, reference on CUDA (default: auto; "
                             "BATCHASR_ATTENTION_KERNEL for serve and worker)")


def _add_head_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--decoder", default="auto", choices=("auto", "ctc", "rnnt", "tdt"),
                        help="which head decodes (hybrids have two; default: the transducer)")


def _add_decoding_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--decoder-algorithm", default="label_looping", choices=("label_looping", "frame_looping"),
                        help="transducer greedy search (default: label_looping; frame_looping is the reference)")
    parser.add_argument("--cuda-graphs", default="auto", choices=("auto", "conditional", "no_while", "off"),
                        help="how label looping runs on CUDA (default: auto, the best mode available)")


def _transcribe_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("transcribe", help="transcribe audio files offline")
    _add_model_options(p)
    p.add_argument("--batch-size", type=int, default=16, help="utterances per batch (default: 16)")
    _add_head_option(p)
    _add_decoding_options(p)
    p.add_argument("--format", default="text", choices=FORMATS,
                   help="output format (default: text); manifest: a NeMo manifest, each line with its pred_text")
    p.add_argument("--manifest", type=Path, metavar="FILE",
                   help="transcribe the audio a NeMo manifest names (JSON lines: audio_filepath, and offset and "
                        "duration for a stretch of a file) instead of files; lines with a text are scored (WER)")
    p.add_argument("--multichannel", action="store_true", help=MULTICHANNEL_HELP)
    p.add_argument("--channel-names", type=_names, default=[], metavar="NAMES", help=CHANNEL_NAMES_HELP)
    p.add_argument("--skip-silence", action="store_true", help=SKIP_SILENCE_HELP)
    p.add_argument("--hotwords", type=_phrases, default=[], metavar="PHRASES", help=HOTWORDS_HELP)
    p.add_argument("--length-bucket-s", type=float, default=None, metavar="S",
                   help="fixed batch shapes: batches of one length bucket of S seconds, padded to its end and to "
                        "--batch-size rows, so bf16 results do not depend on the other inputs (costs the padding)")
    p.add_argument("--output-dir", type=Path,
                   help="write one <name>.<format> per input here instead of printing to stdout")
    p.add_argument("--output", type=Path, metavar="FILE",
                   help="jsonl, manifest: append the results to FILE, a line each as it comes, instead of printing")
    p.add_argument("--skip-existing", action="store_true",
                   help="with --output-dir or --output: leave out inputs whose result is already there (to resume "
                        "a run)")
    _add_layout_options(p)
    p.add_argument("--max-segment-s", type=_segment_seconds, default=30.0,
                   help="cut longer audio at quiet points into pieces this long, as the service does, and stitch "
                        "them back (default: 30; at least 5, as BATCHASR_MAX_SEGMENT_S; 0: take every file whole, "
                        "as NeMo does)")
    p.add_argument("audio", nargs="*", help="audio files (WAV, FLAC, OGG, MP3, M4A, MP4, WebM, ...: see the README) "
                                            "and directories of them")
    p.set_defaults(func=cmd_transcribe)


def _add_layout_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-line-width", type=int, metavar="CHARS",
                   help="srt, vtt: characters a subtitle line holds at most (default 42)")
    p.add_argument("--max-line-count", type=int, metavar="LINES",
                   help="srt, vtt: lines a subtitle cue holds at most (default 2)")


def _layout(args: argparse.Namespace) -> SubtitleLayout:
    """The subtitle layout the options ask for; ValueError for one out of range."""
    from .formats import SubtitleLayout

    given = {"max_line_width": args.max_line_width, "max_line_count": args.max_line_count}
    return SubtitleLayout(**{name: value for name, value in given.items() if value is not None})


def cmd_transcribe(args: argparse.Namespace) -> int:
    from .transcribe_cli import run_transcribe

    try:
        layout = _layout(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return run_transcribe(args, layout)


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the HTTP API (and the job consumer when --redis-url is given)")
    _add_model_options(p)
    p.add_argument("--host", help="bind address (default: 127.0.0.1; BATCHASR_HOST)")
    p.add_argument("--port", type=int, help="port (default: 8000; BATCHASR_PORT)")
    p.add_argument("--redis-url", help="Redis for bulk jobs (BATCHASR_REDIS_URL)")
    p.add_argument("--frontends", type=int,
                   help="HTTP front-end processes beside the engine's, for request rates one event loop cannot "
                        "parse (default: 0, HTTP in the engine's process; BATCHASR_FRONTENDS)")
    p.set_defaults(func=cmd_serve)


def raise_open_files_limit() -> None:
    """Let the process hold as many sockets as the system allows it: a server at saturation keeps thousands of
    connections open, and a soft limit of 1024 is common."""
    try:
        import resource
    except ImportError:  # not on this platform
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# the settings serve and worker take from their options: a bad value is named as the option that gave it
SETTING_OPTIONS = {"model": "--model", "device": "--device", "dtype": "--dtype", "host": "--host", "port": "--port",
                   "redis_url": "--redis-url", "attention_kernel": "--attention-kernel", "frontends": "--frontends",
                   "worker_name": "--name"}


def _read_settings(**options: object) -> Settings | None:
    """Settings from the environment and the options that override it; None, with a line on stderr for each bad
    setting (its variable or option, its value, what is wrong), where any is refused. A variable that no setting
    reads is warned of."""
    from .config import InvalidSettings, get_settings, unread_variables

    for line in unread_variables():
        print(f"warning: {line}", file=sys.stderr)
    try:
        settings = get_settings(**options)
    except InvalidSettings as exc:
        for line in exc.lines(SETTING_OPTIONS):
            print(f"error: {line}", file=sys.stderr)
        return None
    for root in settings.input_roots:  # a volume not mounted: every job item naming a file under it would fail
        if not Path(root).is_dir():
            print(f"warning: BATCHASR_INPUT_ROOTS: {root} is not a directory here; job items under it will fail "
                  "as not found", file=sys.stderr)
    problems = _model_and_device_problems(settings, {k for k, v in options.items() if v is not None})
    for problem in problems:
        print(f"error: {problem.line(SETTING_OPTIONS)}", file=sys.stderr)
    return None if problems else settings


def _model_and_device_problems(settings: Settings, given: set[str]) -> list[SettingProblem]:
    """What would stop the model loading that can be told at once: a model file that is not there, a device this
    machine lacks (found by the server's start-up as a traceback in its log, and exit status 3)."""
    from models.asr_model import resolve_device

    from .config import SettingProblem

    problems: list[SettingProblem] = []
    if settings.model is not None and not Path(settings.model).exists():
        problems.append(SettingProblem("model", settings.model, "no such file", "model" in given))
    try:
        resolve_device(settings.device)
    except ValueError as exc:
        problems.append(SettingProblem("device", settings.device, str(exc), "device" in given))
    return problems


def cmd_serve(args: argparse.Namespace) -> int:
    device = None if args.device == "auto" else args.device
    dtype = None if args.dtype == "auto" else args.dtype
    settings = _read_settings(model=args.model, device=device, dtype=dtype, host=args.host, port=args.port,
                              redis_url=args.redis_url, attention_kernel=args.attention_kernel,
                              frontends=args.frontends)
    if settings is None:
        return 2
    import uvicorn

    from .api import create_app
    from .head_limit import HTTP_PROTOCOL
    from .logs import configure_json_logging

    level = logging.DEBUG if args.verbose else logging.INFO
    configure_json_logging(level)
    raise_open_files_limit()  # front-end processes inherit it
    if settings.job_consumers and not settings.frontends:
        print("error: job consumer processes (BATCHASR_JOB_CONSUMERS) need front-end processes (--frontends)",
              file=sys.stderr)
        return 2
    if settings.frontends:
        from .processes import run_async, run_engine_process

        return run_async(run_engine_process(settings, http=True, log_level=level))
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_config=None, http=HTTP_PROTOCOL,
                timeout_graceful_shutdown=int(settings.request_timeout_s))
    return 0


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="offline throughput: RTFx end to end and per stage",
                       description="--model also takes a built-in architecture name (random weights, blank "
                                   "calibrated to about one token per 3 frames), e.g. parakeet-tdt-0.6b-v2, "
                                   "parakeet-rnnt-1.1b, parakeet-ctc-1.1b.")
    _add_model_options(p)
    p.add_argument("--audio", nargs="+", metavar="DIR_OR_FILE",
                   help="audio files or directories (default: a synthetic LibriSpeech-like duration mix)")
    p.add_argument("--batch-size", type=int, default=16, help="utterances per batch (default: 16)")
    p.add_argument("--repeat", type=int, default=1, help="timed passes over the audio (default: 1)")
    _add_decoding_options(p)
    _add_head_option(p)
    p.add_argument("--hotwords", type=int, default=0, metavar="N",
                   help="boost N random phrases (1-3 tokens) in every row, as a request's hotwords (default: 0)")
    p.add_argument("--n-utterances", type=int, default=128,
                   help="synthetic utterances when no --audio is given (default: 128, about 16 min)")
    p.add_argument("--seed", type=int, default=0, help="synthetic audio and random weights (default: 0)")
    p.add_argument("--no-scores", action="store_true",
                   help="time the greedy search alone, without the tokens' log-probabilities the service gives")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import cmd_bench as run

    return run(args)


def _worker_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="consume bulk jobs from Redis (no HTTP): one per GPU for scale-out")
    _add_model_options(p)
    p.add_argument("--redis-url", help="Redis holding the job stream (BATCHASR_REDIS_URL)")
    p.add_argument("--name", help="consumer name in the group (default: host-pid)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    p.set_defaults(func=cmd_worker)


def cmd_worker(args: argparse.Namespace) -> int:
    settings = _read_settings(model=args.model, device=None if args.device == "auto" else args.device,
                              dtype=None if args.dtype == "auto" else args.dtype, redis_url=args.redis_url,
                              worker_name=args.name, attention_kernel=args.attention_kernel)
    if settings is None:
        return 2
    from .jobs_cli import run_worker
    from .logs import configure_json_logging

    level = logging.DEBUG if args.verbose else logging.INFO
    configure_json_logging(level)
    if not settings.redis_url:
        print("error: a worker needs --redis-url (or BATCHASR_REDIS_URL)", file=sys.stderr)
        return 2
    if settings.job_consumers:  # the consumers in processes of their own, the model in this one
        from .processes import run_async, run_engine_process

        return run_async(run_engine_process(settings, http=False, metrics_port=args.metrics_port, log_level=level))
    return asyncio.run(run_worker(settings, args.metrics_port))


def _submit_parser(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument("--channel-names", type=_names, default=[], metavar="NAMES", help=CHANNEL_NAMES_HELP)
    p.add_argument("--skip-silence", action="store_true", help=SKIP_SILENCE_HELP)
    p.add_argument("--hotwords", type=_phrases, default=[], metavar="PHRASES", help=HOTWORDS_HELP)
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
    _add_layout_options(p)
    p.add_argument("--job-bytes", default="256M", metavar="SIZE",
                   help="uploads a job holds at most (e.g. 256M, 1G); more audio goes as several jobs, in order "
                        "(default 256M; a server takes at most BATCHASR_MAX_JOB_UPLOAD_BYTES a job)")
    p.add_argument("--url-list", action="append", default=[], metavar="FILE",
                   help="http(s) URLs to submit, one a line ('-': standard input); the workers fetch them")
    p.add_argument("paths", nargs="*", metavar="FILES_DIRS_OR_URLS")
    p.set_defaults(func=cmd_submit)


def _has_target(args: argparse.Namespace) -> bool:
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

    if not _has_target(args):
        return 2
    try:
        job_bytes = parse_size(args.job_bytes)
        entries = _submitted_manifest(args)
        inputs = collect_audio(args.paths, args.url_list) if entries is None else [
            entry.clip.path if entry.clip.whole else entry.clip
            for entry in entries]
        if args.paths_not_bytes:
            inputs = [s if isinstance(s, str) else WorkerPath(AudioClip(s) if isinstance(s, Path) else s)
                      for s in inputs]
        elif gone := next((s for s in inputs if isinstance(s, Path) and not s.is_file()), None):
            # uploaded from here: a link to nothing (directories list them, for reading to report) is refused by
            # name before any job is sent, as a manifest's missing file is
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
    return status


def _submitted_manifest(args: argparse.Namespace) -> list[ManifestEntry] | None:
    """``submit --manifest``'s lines (None without it), the options checked; ValueError saying what is wrong."""
    from .manifest import read_manifest

    if args.format == "manifest" and (args.manifest is None or not args.wait or args.output_dir is not None):
        raise ValueError("--format manifest writes a --manifest's lines with their results: it needs --manifest and "
                         "--wait, and no --output-dir")
    if args.manifest is None:
        return None
    if args.paths or args.url_list:
        raise ValueError("give files, directories and URLs, or --manifest, not both")
    if args.output_dir is not None:
        raise ValueError("--manifest writes result lines (a manifest's lines may share a file): no --output-dir")
    entries = read_manifest(args.manifest)
    if not args.paths_not_bytes:  # uploaded from here: a line whose audio cannot be read here is refused, by its line
        _check_uploadable(entries, args.multichannel)
    return entries


def _check_uploadable(entries: list[ManifestEntry], multichannel: bool) -> None:
    """ValueError naming the first line whose audio cannot be uploaded: a file that is not there, or a stretch of a
    file that does not open as audio (before any job is sent, as a bad line is refused before transcribe loads its
    model)."""
    from .stretch_upload import stretch_upload_size

    for entry in entries:
        clip = entry.clip
        if not clip.path.is_file():
            raise ValueError(f"{entry.where}: {clip.path}: no such audio file")
        if not clip.whole:
            try:
                stretch_upload_size(clip, multichannel)  # opens it: its header is read again when jobs are split
            except (OSError, ValueError, RuntimeError, TypeError) as exc:  # libsndfile's errors are RuntimeErrors
                raise ValueError(f"{entry.where}: {clip.path}: cannot read audio ({exc})") from exc


def _manifest_writer(entries: list[ManifestEntry], out: TextIO, scored: ErrorRate
                     ) -> Callable[[Path | str, dict], None]:
    """``submit --manifest --format manifest``: each result written to ``out`` as its line (results come in input
    order, one a line, so the n-th is the n-th line's) and scored against its reference; a failed item's error on
    stderr, naming its line."""
    from .manifest import record_line

    pending = iter(entries)

    def write(_source: Path | str, record: dict) -> None:
        entry = next(pending)
        if record["status"] != "completed":
            print(f"error: {entry.where}: {record['status']}: {record.get('error') or ''}", file=sys.stderr)
            return
        scored.add(entry, record["text"])
        out.write(record_line(entry, record))

    return write


def _result_files(args: argparse.Namespace, inputs: list) -> Callable[[Any, dict], None]:
    """``submit --output-dir``: each completed item's result written to its own file, whole; a failed item's error
    on stderr. ValueError if two inputs would share a file."""
    from .formats import from_record, render
    from .output_files import is_url, output_names, write_whole
    from .submit_inputs import WorkerPath

    suffix = f".{args.format}"
    layout = _layout(args)
    names = output_names([*(a for a in args.paths if not is_url(a)), *(i for i in inputs if isinstance(i, str))],
                         suffix)
    args.output_dir.mkdir(parents=True, exist_ok=True)

    def write(source: Path | str | WorkerPath, record: dict) -> None:
        if isinstance(source, WorkerPath):  # --paths: named as the file would be
            source = source.clip.path
        if record["status"] != "completed":
            print(f"error: {source}: {record['status']}: {record.get('error') or ''}", file=sys.stderr)
        elif args.format == "json":
            write_whole(args.output_dir / names[source], json.dumps(record, ensure_ascii=False, indent=2) + "\n")
        else:
            write_whole(args.output_dir / names[source], render(from_record(record), str(source), args.format,
                                                                layout))

    return write


def _jobs_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("jobs", help="list bulk jobs, newest first; or cancel or purge some")
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
                                                                        "not started are dropped")
    action.add_argument("--purge", nargs="+", metavar="JOB_ID", help="delete these jobs at once instead of "
                                                                       "listing: records, results, uploaded audio")
    action.add_argument("--retry", nargs="+", metavar="JOB_ID", help="queue these jobs' failed items again instead "
                                                                       "of listing (those of paths and URLs)")
    p.set_defaults(func=cmd_jobs)


def cmd_jobs(args: argparse.Namespace) -> int:
    from .jobs_cli import run_action, run_list

    if not _has_target(args):
        return 2
    for action in ("cancel", "purge", "retry"):
        if job_ids := getattr(args, action):
            return asyncio.run(run_action(args.redis_url, args.server, args.api_key, job_ids, action, sys.stdout))
    if args.limit < 1:
        print("error: --limit must be at least 1", file=sys.stderr)
        return 2
    return asyncio.run(run_list(args.redis_url, args.server, args.api_key, args.limit, args.status, args.json,
                                sys.stdout))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchasr", description="High-throughput batch transcription.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = parser.add_subparsers(dest="command", required=True)
    _transcribe_parser(sub)
    _serve_parser(sub)
    _worker_parser(sub)
    _submit_parser(sub)
    _jobs_parser(sub)
    _bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from models.errors import CheckpointError

    try:
        return args.func(args)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
