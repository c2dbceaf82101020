"""The ``batchasr`` command: transcribe | serve | worker | submit | bench.

Each subcommand imports what it needs when it runs, so ``batchasr transcribe`` never loads the web stack.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

FORMATS = ("text", "json", "jsonl", "srt", "vtt")


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="a .nemo file or unpacked checkpoint directory (default: embedded model)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="weights of encoder and heads (default: bfloat16 on CUDA, float32 on CPU)")


def _transcribe_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("transcribe", help="transcribe audio files offline")
    _add_model_options(p)
    p.add_argument("--batch-size", type=int, default=16, help="utterances per batch (default: 16)")
    p.add_argument("--decoder", default="auto", choices=("auto", "ctc", "rnnt", "tdt"),
                   help="which head decodes (hybrids have two; default: the transducer)")
    p.add_argument("--format", default="text", choices=FORMATS, help="output format (default: text)")
    p.add_argument("--output-dir", type=Path,
                   help="write one <name>.<format> per input here instead of printing to stdout")
    p.add_argument("audio", nargs="+", help="audio files (WAV, FLAC, OGG, MP3: whatever libsndfile reads)")
    p.set_defaults(func=cmd_transcribe)


def cmd_transcribe(args: argparse.Namespace) -> int:
    from models import load_model
    from models.audio_io import AudioError

    from .formats import to_record, to_srt, to_vtt

    if args.format in ("srt", "vtt") and len(args.audio) > 1 and args.output_dir is None:
        print(f"error: --format {args.format} prints one file; use --output-dir for several", file=sys.stderr)
        return 2
    model = load_model(args.model, device=args.device, dtype=args.dtype)
    try:
        transcripts = model.transcribe(args.audio, batch_size=args.batch_size, decoder=args.decoder)
    except (AudioError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    render = {
        "text": lambda t, a: t.text + "\n",
        "jsonl": lambda t, a: json.dumps(to_record(t, a), ensure_ascii=False) + "\n",
        "json": lambda t, a: json.dumps(to_record(t, a), ensure_ascii=False, indent=2) + "\n",
        "srt": lambda t, a: to_srt(t),
        "vtt": lambda t, a: to_vtt(t),
    }[args.format]
    if args.output_dir is not None:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        for path, transcript in zip(args.audio, transcripts, strict=True):
            (args.output_dir / f"{Path(path).stem}.{args.format}").write_text(render(transcript, path),
                                                                             encoding="utf-8")
    elif args.format == "json":
        records = [to_record(t, a) for a, t in zip(args.audio, transcripts, strict=True)]
        sys.stdout.write(json.dumps(records, ensure_ascii=False, indent=2) + "\n")
    else:
        for path, transcript in zip(args.audio, transcripts, strict=True):
            sys.stdout.write(render(transcript, path))
    return 0


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the HTTP API (and the job consumer when --redis-url is given)")
    _add_model_options(p)
    p.add_argument("--host", help="bind address (default: 127.0.0.1; BATCHASR_HOST)")
    p.add_argument("--port", type=int, help="port (default: 8000; BATCHASR_PORT)")
    p.add_argument("--redis-url", help="Redis for bulk jobs (BATCHASR_REDIS_URL)")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .api import create_app
    from .config import get_settings
    from .logs import configure_json_logging

    configure_json_logging(logging.DEBUG if args.verbose else logging.INFO)
    device = None if args.device == "auto" else args.device
    dtype = None if args.dtype == "auto" else args.dtype
    settings = get_settings(model=args.model, device=device, dtype=dtype, host=args.host, port=args.port,
                            redis_url=args.redis_url)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_config=None,
                timeout_graceful_shutdown=int(settings.request_timeout_s))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchasr", description="High-throughput batch transcription.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = parser.add_subparsers(dest="command", required=True)
    _transcribe_parser(sub)
    _serve_parser(sub)
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
