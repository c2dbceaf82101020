"""The GPU bench table for docs/benchmarks.md (run by scripts/gpu_check.sh).

Each architecture is built (random weights, calibrated blank) and its audio synthesised once, then measured
at every batch size with every decoder algorithm and graph mode, as ``batchasr bench`` measures one setting. The
algorithms are compared on the greedy search alone; the conditional mode is measured again with the tokens'
log-probabilities the service also computes (decoding.scores), with the encoder's fused-attention option, and with
20 hotwords in every row (decoding.boosting: a boosted batch replays graphs captured with the boosting). A CTC
model is measured plain and with the 20 hotwords (its boosted rows decode frame by frame, 16 frames a graph).

    PYTHONPATH=. python scripts/bench_table.py --out DIR [--models M ...] [--batch-sizes 128 16 1]
        [--dtype bfloat16] [--budget-s S]

Batch sizes are taken in the order given, every model at each, so that a budget (``--budget-s``: no setting is
begun after it) cuts the last batch size rather than the last model. Writes DIR/bench.jsonl (one
``batchasr bench --json`` object a line, or an ``error`` line) and DIR/bench_table.md (markdown, one row per
setting, rewritten after each, so a run stopped from outside keeps what it measured).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path

from service.bench import BenchResult, Budget, Workload, add_budget_option, measure, prepare

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


class Table:
    """The rows so far, in DIR/bench.jsonl and DIR/bench_table.md; the models, each prepared when first needed."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.jsonl = (args.out / "bench.jsonl").open("w")
        self.rows: list[str] = []
        self.skipped: list[str] = []
        self.works: dict[str, Workload | None] = {}  # None: it could not be prepared (tried once)

    def work(self, name: str) -> Workload | None:
        if name not in self.works:
            started = time.perf_counter()
            try:
                work = prepare(name, device=self.args.device, dtype=self.args.dtype, seed=0,
                               n_utterances=self.args.n_utterances)
            except Exception as exc:  # the other models' rows still come
                traceback.print_exc()
                self.add({"model": name, "error": f"preparing: {exc!r}"}, None)
                work = None
            else:
                print(f"{name}: ready in {time.perf_counter() - started:.0f} s (blank bias {work.blank_bias})",
                      flush=True)
            self.works[name] = work
        return self.works[name]

    def add(self, record: dict, row: str | None) -> None:
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if row is not None:
            self.rows.append(row)
            print(row, flush=True)
        self.write()

    def write(self) -> None:
        notes = "".join(f"\nNot measured (budget spent): {s}" for s in self.skipped)
        (self.args.out / "bench_table.md").write_text(HEADER + "\n" + "\n".join(self.rows) + "\n" + notes)


def bench_batch_size(table: Table, name: str, batch_size: int, budget: Budget) -> None:
    if budget.spent:
        table.skipped.append(f"{name} at batch {batch_size}")
        table.write()
        return
    work = table.work(name)
    if work is None:
        return
    subset = dataclasses.replace(work, waveforms=work.waveforms[:UTTERANCES.get(batch_size, len(work.waveforms))])
    baseline = None
    settings = CTC_SETTINGS if work.decoder == "ctc" else TRANSDUCER_SETTINGS
    for n, (algorithm, graphs, kernel, scores, hotwords) in enumerate(settings):
        if budget.spent:
            table.skipped.append(f"{name} at batch {batch_size}: {len(settings) - n} of {len(settings)} settings")
            table.write()
            return
        work.model.encoder.set_attention_kernel(kernel)
        try:
            result = measure(subset, batch_size, table.args.repeat, algorithm, graphs, scores, hotwords)
        except Exception as exc:  # one failing setting must not lose the rest of the table
            traceback.print_exc()
            table.add({"model": name, "batch_size": batch_size, "decoder_algorithm": algorithm, "cuda_graphs": graphs,
                       "attention_kernel": kernel, "scores": scores, "hotwords": hotwords, "error": repr(exc)}, None)
            continue
        if algorithm == "frame_looping":
            baseline = result.stage_s["decoder"]
        table.add(dataclasses.asdict(result), table_row(result, baseline))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[128, 16, 1])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--n-utterances", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=1)
    add_budget_option(parser)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget_s)
    table = Table(args)
    for batch_size in args.batch_sizes:
        for name in args.models:
            bench_batch_size(table, name, batch_size, budget)
    table.jsonl.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
