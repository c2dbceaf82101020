"""``batchasr transcribe``: files, directories or a NeMo manifest's lines, transcribed in bounded memory by a model
loaded here; each result written as it comes (to stdout, a file per input, or the lines of one file that a run
cut short resumes), then the run's summary."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from .formats import SubtitleLayout
from .line_output import LINE_FORMATS, cannot_write, open_results, output_is_input
from .manifest import ManifestEntry

if TYPE_CHECKING:
    import torch


def run_transcribe(args: argparse.Namespace, layout: SubtitleLayout) -> int:
    """Files (and directories of them), or a manifest's lines, transcribed in bounded memory, each result written
    as it comes (a run over thousands of files keeps what it has done); a file that cannot be read is reported and
    skipped."""
    from models import load_model

    try:
        inputs = _transcribe_inputs(args)
    except (OSError, ValueError) as exc:  # OSError: a --manifest that is a directory or cannot be read
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        try:  # where the results go, made before the model loads: a run that cannot keep them does not start
            if args.output_dir is not None:
                args.output_dir.mkdir(parents=True, exist_ok=True)
            out = open_results(stack, args.output, "a")
        except OSError as exc:
            return cannot_write(exc)
        try:  # read once the file is locked: another run's lines could be coming meanwhile
            inputs = _left_to_do(args, inputs)
        except ValueError as exc:  # a file that is not this command's results: left as it is
            print(f"error: {exc}", file=sys.stderr)
            return 2
        try:
            model = load_model(args.model, device=args.device, dtype=args.dtype,
                               attention_kernel=args.attention_kernel or "auto")
        except ValueError as exc:  # no CUDA here, an unknown device or dtype
            print(f"error: {exc}", file=sys.stderr)
            return 2
        try:
            _check_cuda_graphs(args.cuda_graphs, model.device)
            outcomes = model.transcribe_iter([entry.clip for entry in inputs.entries], batch_size=args.batch_size,
                                             decoder=args.decoder, decoder_algorithm=args.decoder_algorithm,
                                             cuda_graphs=args.cuda_graphs, max_segment_s=args.max_segment_s or None,
                                             return_errors=True, multichannel=args.multichannel,
                                             skip_silence=args.skip_silence, hotwords=args.hotwords,
                                             length_bucket_s=args.length_bucket_s)
        except (ValueError, RuntimeError) as exc:  # hotwords this model cannot boost, or bad options
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return _write_results(args, inputs, outcomes, layout, out)


def _check_cuda_graphs(requested: str, device: torch.device) -> None:
    """A forced CUDA graph mode this device cannot run, refused now (ValueError, or RuntimeError where CUDA lacks
    conditional nodes): the decoder would find it only at its first batch, inside the iteration, as a traceback."""
    from decoding.cuda_graphs import choose_mode

    if requested in ("conditional", "no_while"):
        choose_mode(requested, device)


def _write_results(args: argparse.Namespace, inputs: TranscribeInputs, outcomes: Iterable, layout: SubtitleLayout,
                   out: TextIO) -> int:
    """Each outcome written as it comes (to ``out``, or its file under --output-dir), errors reported; then the
    run's summary. The exit status: 1 if an input could not be read."""
    from models.conversation import Conversation

    from .formats import render, to_record
    from .manifest import ErrorRate, short_stretch, transcript_line
    from .output_files import write_whole
    from .run_summary import RunSummary

    records, failed, summary, scored = [], 0, RunSummary(), ErrorRate()
    for entry, output, outcome in zip(inputs.entries, inputs.outputs, outcomes, strict=True):
        if isinstance(outcome, Conversation):
            outcome.names = args.channel_names
        if isinstance(outcome, Exception):
            failed += 1
            print(f"error: {entry.where}: {outcome}" if inputs.from_manifest else f"error: {outcome}",
                  file=sys.stderr)
            continue
        summary.add(entry.where, outcome)
        scored.add(entry, outcome.text)
        if warning := short_stretch(entry, outcome.duration_s):  # files given have no duration to run past
            print(warning, file=sys.stderr)
        try:
            if output is not None:
                write_whole(output, render(outcome, str(entry.clip), args.format, layout))
            elif args.format == "json":  # one array: written at the end
                records.append(to_record(outcome, str(entry.clip)))
            else:
                out.write(transcript_line(entry, outcome) if args.format == "manifest"
                          else render(outcome, str(entry.clip), args.format, layout))
                out.flush()  # each result kept as it comes: a run cut short resumes with --skip-existing
        except OSError as exc:
            return cannot_write(exc)
    if args.format == "json" and args.output_dir is None:
        try:
            out.write(json.dumps(records, ensure_ascii=False, indent=2) + "\n")
            out.flush()
        except OSError as exc:
            return cannot_write(exc)
    if failed:
        what = "manifest lines" if inputs.from_manifest else "files"
        print(f"{failed} of {len(inputs.entries)} {what} could not be read", file=sys.stderr)
    if len(inputs.entries) > 1:
        sys.stderr.write(summary.report())
    sys.stderr.write(summary.noise_hint(args.skip_silence))
    sys.stderr.write(scored.report())
    return 1 if failed else 0


@dataclass
class TranscribeInputs:
    entries: list[ManifestEntry]  # what to transcribe: files as manifest lines, or a manifest's own
    outputs: list[Path | None]  # where each result goes under --output-dir (None: stdout)
    from_manifest: bool


def _transcribe_inputs(args: argparse.Namespace) -> TranscribeInputs:
    """What ``transcribe`` was given, checked before any model loads; ValueError (or FileNotFoundError) saying
    what is wrong."""
    from .manifest import file_entries, read_manifest, rebase_paths
    from .output_files import file_suffix, output_names

    if bool(args.manifest) == bool(args.audio):
        raise ValueError("give audio files and directories, or --manifest, not both" if args.audio
                         else "no audio: give files, directories or --manifest")
    if args.format == "manifest" and args.output_dir is not None:
        raise ValueError("--format manifest writes one manifest: --output FILE, not --output-dir")
    if args.output is not None and (args.output_dir is not None or args.format not in LINE_FORMATS):
        raise ValueError(f"--output takes the line formats ({', '.join(LINE_FORMATS)}), without --output-dir")
    if args.channel_names and not args.multichannel:
        raise ValueError("--channel-names names the channels of --multichannel")
    if args.skip_existing and args.output is None and args.output_dir is None:  # printed results: nothing to resume
        raise ValueError("--skip-existing resumes a run that writes --output FILE or --output-dir")
    if args.manifest is not None:
        if args.output_dir is not None:
            raise ValueError("--manifest prints its results (a manifest's lines may share a file): no --output-dir")
        if problem := output_is_input(args.output, args.manifest):
            raise ValueError(problem)
        entries = read_manifest(args.manifest)
        if not entries:
            raise ValueError(f"{args.manifest}: no lines")
        if args.format in ("srt", "vtt") and len(entries) > 1:
            raise ValueError(f"--format {args.format} prints one transcript; the manifest has {len(entries)}")
        if args.format == "manifest":
            rebase_paths(entries, args.manifest.parent, args.output)
        return TranscribeInputs(entries, [None] * len(entries), from_manifest=True)
    named = output_names(args.audio, file_suffix(args.format), files=args.output_dir is not None)  # else one stream
    if not named:
        raise ValueError("no audio files found")
    if args.format in ("srt", "vtt") and len(named) > 1 and args.output_dir is None:
        raise ValueError(f"--format {args.format} prints one file; use --output-dir for several")
    if args.output_dir is not None and args.skip_existing:
        done = [path for path, name in named.items() if (args.output_dir / name).is_file()]
        named = {path: name for path, name in named.items() if path not in done}
        print(f"{len(done)} files already transcribed in {args.output_dir}; {len(named)} to go", file=sys.stderr)
    outputs = [None if args.output_dir is None else args.output_dir / name for name in named.values()]
    entries = file_entries(named)
    if args.format == "manifest":  # a manifest of files, read back from its own folder
        rebase_paths(entries, Path(), args.output)
    return TranscribeInputs(entries, outputs, from_manifest=False)


def _left_to_do(args: argparse.Namespace, inputs: TranscribeInputs) -> TranscribeInputs:
    """With ``--output FILE --skip-existing``, the inputs whose lines the file does not hold yet; ValueError where
    it holds anything but this command's result lines (``lines_done``)."""
    from .line_output import inputs_done, lines_done

    if args.output is None or not args.skip_existing:
        return inputs
    lines = [entry.fields if args.format == "manifest" else {"audio": str(entry.clip)} for entry in inputs.entries]
    found = inputs_done(args.format, lines_done(args.output, args.format), lines)
    left = TranscribeInputs([], [], inputs.from_manifest)
    for entry, output, done in zip(inputs.entries, inputs.outputs, found, strict=True):
        if not done:
            left.entries.append(entry)
            left.outputs.append(output)
    skipped = len(inputs.entries) - len(left.entries)
    print(f"{skipped} inputs already in {args.output}; {len(left.entries)} to go", file=sys.stderr)
    return left
