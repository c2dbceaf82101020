"""The GPU bench table for docs/benchmarks.md (run by scripts/gpu_check.sh).

Each architecture is built (random weights, calibrated blank) and its audio synthesised once, then measured
at every batch size with every decoder algorithm and graph mode, as ``batchasr bench`` measures one setting. The
algorithms are compared on the greedy search alone; the conditional mode is measured again with the tokens'
log-probabilities the service also computes (decoding.scores), with the encoder's fused-attention option, and with
20 hotwords in every row (decoding.boosting: a boosted batch replays graphs captured with the boosting). A CTC
model is measured plain and with the 20 hotwords (its boosted rows decode frame by frame).

    PYTHONPATH=. python scripts/bench_table.py --out DIR [--models M ...] [--batch-sizes 1 16 128] [--dtype bfloat16]

Writes DIR/bench.jsonl (one ``batchasr bench --json`` object a line, or an ``error`` line) and
DIR/bench_table.md (markdown, one row per setting).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from service.bench import BenchResult, measure, prepare

MODELS = ("parakeet-tdt-0.6b-v2", "parakeet-rnnt-1.1b", "parakeet-ctc-1.1b")
HOTWORDS = 20  # a request's list: a few product names
TRANSDUCER_SETTINGS = (  # (decoder algorithm, cuda graphs, attention kernel, token scores, hotwords): baseline first
    ("frame_looping", "off", "reference", False, 0),
    ("label_looping", "off", "reference", False, 0),
    ("label_looping", "no_while", "reference", False, 0),
    ("label_looping", "conditional", "reference", False, 0),
    ("label_looping", "conditional", "reference", True, 0),  # what the service runs: the search and the scores
    ("label_looping", "conditional", "sdpa", True, 0),  # the encoder's fused-attention option, against the row above
    ("label_looping", "conditional", "reference", True, HOTWORDS),  # boosted, against the row two above
)
CTC_SETTINGS = (
    ("label_looping", "off", "reference", True, 0),  # the algorithm and graphs do not apply to CTC
    ("label_looping", "off", "reference", True, HOTWORDS),
)
UTTERANCES = {1: 48}  # batch 1 is slow with eager frame looping: fewer utterances; others get --n-utterances


def table_row(r: BenchResult, baseline_decoder_s: float | None) -> str:
    speedup = f"{baseline_decoder_s / r.stage_s['decoder']:.1f}x" if baseline_decoder_s else ""
    algorithm = "ctc" if r.decoder == "ctc" else r.decoder_algorithm
    return (f"| {r.model} | {r.batch_size} | {algorithm} | {r.mode} | {'yes' if r.scores else 'no'} | "
            f"{r.hotwords} | {r.attention_kernel} | "
            f"{r.rtfx:.0f} | {r.audio_s / r.stage_s['encoder']:.0f} | "
            f"{r.audio_s / r.stage_s['decoder']:.0f} | {r.decoder_share:.1%} | {speedup} | "
            f"{r.tokens_per_frame:.2f} | {r.tokens_sha1[:8]} |")


HEADER = ("| model | batch | algorithm | mode | token scores | hotwords | attention | RTFx | encoder RTFx | "
          "decoder RTFx | decoder share | decoder speed-up vs frame looping eager | tokens/frame | tokens_sha1 |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def bench_model(name: str, args: argparse.Namespace, jsonl, rows: list[str]) -> None:
    started = time.perf_counter()
    work = prepare(name, device=args.device, dtype=args.dtype, seed=0, n_utterances=args.n_utterances)
    print(f"{name}: ready in {time.perf_counter() - started:.0f} s (blank bias {work.blank_bias})", flush=True)
    for batch_size in args.batch_sizes:
        n_utterances = UTTERANCES.get(batch_size, len(work.waveforms))
        subset = dataclasses.replace(work, waveforms=work.waveforms[:n_utterances])
        baseline = None
        settings = CTC_SETTINGS if work.decoder == "ctc" else TRANSDUCER_SETTINGS
        for algorithm, graphs, kernel, scores, hotwords in settings:
            work.model.encoder.set_attention_kernel(kernel)
            try:
                result = measure(subset, batch_size, args.repeat, algorithm, graphs, scores, hotwords)
            except Exception as exc:  # one failing setting must not lose the rest of the table
                traceback.print_exc()
                jsonl.write(json.dumps({"model": name, "batch_size": batch_size, "decoder_algorithm": algorithm,
                                        "cuda_graphs": graphs, "attention_kernel": kernel, "scores": scores,
                                        "hotwords": hotwords, "error": repr(exc)}) + "\n")
                continue
            jsonl.write(json.dumps(dataclasses.asdict(result)) + "\n")
            jsonl.flush()
            if algorithm == "frame_looping":
                baseline = result.stage_s["decoder"]
            rows.append(table_row(result, baseline))
            print(rows[-1], flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16, 128])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--n-utterances", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[str] = []
    with (args.out / "bench.jsonl").open("w") as jsonl:
        for name in args.models:
            bench_model(name, args, jsonl, rows)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the next architecture needs the memory
    (args.out / "bench_table.md").write_text(HEADER + "\n" + "\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
