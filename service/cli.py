"""The ``batchasr`` command: transcribe | serve | worker | submit | jobs | bench.

Each subcommand imports what it needs when it runs, so ``batchasr transcribe`` never loads the web stack.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .cli_options import (
    CHANNEL_NAMES_HELP,
    HOTWORDS_HELP,
    MULTICHANNEL_HELP,
    SKIP_SILENCE_HELP,
    add_layout_options,
    layout,
    names,
    phrases,
)
from .job_commands import jobs_parser, submit_parser

if TYPE_CHECKING:
    from .config import SettingProblem, Settings

FORMATS = ("text", "json", "jsonl", "srt", "vtt", "manifest")
STARTUP_FAILURE = 3  # uvicorn's exit status when the app's start-up fails


def _seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None


def _segment_seconds(text: str) -> float:
    """--max-segment-s: 0 (every file whole), or what the service's BATCHASR_MAX_SEGMENT_S takes; refused here,
    before the model loads."""
    from models.segmenter import segment_problem

    value = _seconds(text)
    if value != 0 and (problem := segment_problem(value)):
        raise argparse.ArgumentTypeError(f"{problem} (or 0: every file whole), not {text}")
    return value


def _bucket_seconds(text: str) -> float:
    """--length-bucket-s: what the service's BATCHASR_LENGTH_BUCKET_S takes; refused here, before the model loads."""
    from models.segmenter import length_bucket_problem

    value = _seconds(text)
    if problem := length_bucket_problem(value):
        raise argparse.ArgumentTypeError(f"{problem}, not {text}")
    return value


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
                        help="how label looping runs on CUDA (default: auto, plain graphs; conditional nodes where "
                             "BATCHASR_CONDITIONAL_NODES=1)")


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
    p.add_argument("--channel-names", type=names, default=[], metavar="NAMES", help=CHANNEL_NAMES_HELP)
    p.add_argument("--skip-silence", action="store_true", help=SKIP_SILENCE_HELP)
    p.add_argument("--hotwords", type=phrases, default=[], metavar="PHRASES", help=HOTWORDS_HELP)
    p.add_argument("--length-bucket-s", type=_bucket_seconds, default=None, metavar="S",
                   help="fixed batch shapes: batches of one length bucket of S seconds, padded to its end and to "
                        "--batch-size rows, so bf16 results do not depend on the other inputs (costs the padding)")
    p.add_argument("--output-dir", type=Path,
                   help="write one <name>.<format> per input here instead of printing to stdout")
    p.add_argument("--output", type=Path, metavar="FILE",
                   help="jsonl, manifest: append the results to FILE, a line each as it comes, instead of printing")
    p.add_argument("--skip-existing", action="store_true",
                   help="with --output-dir or --output: leave out inputs whose result is already there (to resume "
                        "a run)")
    add_layout_options(p)
    p.add_argument("--max-segment-s", type=_segment_seconds, default=30.0,  # DEFAULT_MAX_SEGMENT_S; models load late
                   help="cut longer audio at quiet points into pieces this long, as the service does, and stitch "
                        "them back (default: 30; at least 5, as BATCHASR_MAX_SEGMENT_S; 0: take every file whole, "
                        "as NeMo does)")
    p.add_argument("audio", nargs="*", help="audio files (WAV, FLAC, OGG, MP3, M4A, MP4, WebM, ...: see docs/cli.md) "
                                            "and directories of them")
    p.set_defaults(func=cmd_transcribe)


def cmd_transcribe(args: argparse.Namespace) -> int:
    from .transcribe_cli import run_transcribe

    try:
        subtitles = layout(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return run_transcribe(args, subtitles)


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the HTTP API (and the job consumer when --redis-url is given)")
    _add_model_options(p)
    p.add_argument("--host", help="bind address (default: 127.0.0.1; BATCHASR_HOST)")
    p.add_argument("--port", type=int, help="port (default: 8000; BATCHASR_PORT)")
    p.add_argument("--redis-url", help="Redis for bulk jobs (BATCHASR_REDIS_URL)")
    p.add_argument("--frontends", type=int,
                   help="HTTP front-end processes beside the engine's, for request rates one event loop cannot "
                        "parse; 0: HTTP in the engine's process (default: 4 on a GPU, or half the cores if fewer; "
                        "0 on a CPU; BATCHASR_FRONTENDS)")
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
    from .logs import configure_json_logging

    level = logging.DEBUG if args.verbose else logging.INFO
    configure_json_logging(level)
    raise_open_files_limit()  # front-end processes inherit it
    if settings.frontends is None:
        settings = _frontends_chosen(settings)
    if settings.job_consumers and not settings.frontends:
        print("error: job consumer processes (BATCHASR_JOB_CONSUMERS) need front-end processes (--frontends)",
              file=sys.stderr)
        return 2
    if settings.frontends:
        from .processes import run_async, run_engine_process

        return _unless_cannot_start(lambda: run_async(run_engine_process(settings, http=True, log_level=level)))
    return _unless_cannot_start(lambda: _serve_here(settings))


def _frontends_chosen(settings: Settings) -> Settings:
    """``frontends`` unset: as many as ``auto_frontends`` gives for this device and this process's cores."""
    from models.asr_model import resolve_device

    from .config import auto_frontends, usable_cores

    device, cores = resolve_device(settings.device), usable_cores()
    frontends = auto_frontends(device.type, cores)
    logging.getLogger("batchasr.serve").info("%d HTTP front-end processes (BATCHASR_FRONTENDS unset; %s, %d cores)",
                                             frontends, device.type, cores)
    return settings.model_copy(update={"frontends": frontends})


def _serve_here(settings: Settings) -> int:
    """HTTP and the engine in this process. As with front ends, the port is bound first and held (a taken one is
    refused before the model loads, with no window for another to take it after), and the model loads, its head
    checked, before the server starts: in the app's start-up, each was a traceback in the JSON log and exit status 3."""
    import uvicorn

    from .api import create_app
    from .head_limit import HTTP_PROTOCOL
    from .processes import listening_socket
    from .runtime import load_serving_model

    class _Server(uvicorn.Server):
        async def startup(self, sockets: list | None = None) -> None:
            """uvicorn on a socket given to it logs no address: said here once it listens, as it says it for a port
            it binds itself."""
            await super().startup(sockets)
            self._loop = asyncio.get_running_loop()
            host = f"[{settings.host}]" if ":" in settings.host else settings.host
            logging.getLogger("uvicorn.error").info("Uvicorn running on http://%s:%d (Press CTRL+C to quit)", host,
                                                    self.config.port)

        def handle_exit(self, sig: int, frame: Any) -> None:
            """The job consumer stops taking items at the signal, as the server stops taking requests: stopped by
            the app's shutdown, it went on until every request had finished (a slow upload: minutes)."""
            super().handle_exit(sig, frame)
            stack = app.state.service.stack
            if stack is not None and getattr(self, "_loop", None) is not None:
                self._loop.call_soon_threadsafe(stack.request_stop)

    sock = listening_socket(settings.host, settings.port)
    sock.set_inheritable(False)  # no front ends to hand it to
    try:
        app = create_app(settings, load_serving_model(settings))
        server = _Server(uvicorn.Config(app, host=settings.host, port=sock.getsockname()[1], log_config=None,
                                           http=HTTP_PROTOCOL,
                                           timeout_graceful_shutdown=settings.shutdown_grace_s))
        with contextlib.suppress(KeyboardInterrupt):  # SIGINT, raised again once it has stopped: as uvicorn.run
            server.run(sockets=[sock])
    finally:
        sock.close()
    return 0 if server.started else STARTUP_FAILURE


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

        return _unless_cannot_start(lambda: run_async(run_engine_process(
            settings, http=False, metrics_port=args.metrics_port, log_level=level)))
    return _unless_cannot_start(lambda: asyncio.run(run_worker(settings, args.metrics_port)))


def _unless_cannot_start(run: Callable[[], int]) -> int:
    """``run()``'s exit status, or 2 with one line where a port or the engine's socket stops it before the model
    loads, or the model loaded lacks the head BATCHASR_DECODER names."""
    from .processes import CannotStart

    try:
        return run()
    except CannotStart as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchasr", description="High-throughput batch transcription.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = parser.add_subparsers(dest="command", required=True)
    _transcribe_parser(sub)
    _serve_parser(sub)
    _worker_parser(sub)
    submit_parser(sub)
    jobs_parser(sub)
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
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback from wherever it landed (torch, asyncio)
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
