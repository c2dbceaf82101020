"""The GPU bench table for docs/benchmarks.md (run by scripts/gpu_check.sh).

Each architecture is built (random weights, calibrated blank) and its audio synthesised once, then measured
at every batch size with every decoder algorithm and graph mode, as ``batchasr bench`` measures one setting (the
model's cached label-looping decoders are dropped between batch sizes: their buffers only grow, so batch 16
after 128 would search 128 rows). The algorithms are compared on the greedy search alone; the conditional mode
is measured again with the tokens' log-probabilities the service also computes (decoding.scores), with the
encoder's fused-attention option, and with 20 hotwords in every row (decoding.boosting: a boosted batch replays
graphs captured with the boosting). A CTC model is measured plain and with the 20 hotwords (its boosted rows
decode frame by frame, 16 frames a graph). With conditional nodes switched off (BATCHASR_CONDITIONAL_NODES=0,
as gpu_check.sh does when its smoke decode fails) or unavailable on the GPU, the conditional rows are measured
in no_while mode, and the table says so.

The settings issue 3's goals are judged on (frame looping eager, and label looping conditional with and without
token scores, at batch 128) get ``--goal-repeat`` timed passes; the others ``--repeat``. Each row's stage times
are the median pass's.

    PYTHONPATH=. python scripts/bench_table.py --out DIR [--models M ...] [--batch-sizes 128 16 1]
        [--dtype bfloat16] [--n-utterances 256] [--goal-repeat 5] [--budget-s S]

Batch sizes are taken in the order given, every model at each, so that a budget (``--budget-s``, counted from
the process's start: no setting is begun after it) cuts the last batch size rather than the last model. Writes
DIR/bench.jsonl (one ``batchasr bench --json`` object a line, an ``error`` line for a setting or model that
failed, a ``not_measured`` line for what the budget left out) and DIR/bench_table.md (markdown, one row per
setting, failures included, rewritten after each, so a run stopped from outside keeps what it measured). Exits
1 when any setting or model failed.
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
CTC_SETTINGS = (  # the algorithm does not apply to CTC; graphs "auto" as the service: boosted CTC replays them
    ("label_looping", "auto", "reference", True, 0),
    ("label_looping", "auto", "reference", True, HOTWORDS),
)
GOAL_BATCH = 128  # issue 3's goals are judged at this batch size, on these settings (scripts/gpu_goals.py)
GOAL_SETTINGS = TRANSDUCER_SETTINGS[0], TRANSDUCER_SETTINGS[3], TRANSDUCER_SETTINGS[4]
UTTERANCES = {1: 48, 16: 128}  # smaller batches are slow with eager frame looping: fewer utterances; others all


def table_row(r: BenchResult, baseline_decoder_s: float | None) -> str:
    median = r.stage_median_s or r.stage_s  # one pass's stage times
    audio_s = r.audio_s / r.repeat if r.stage_median_s else r.audio_s
    speedup = f"{baseline_decoder_s / median['decoder']:.1f}x" if baseline_decoder_s else ""
    algorithm = "ctc" if r.decoder == "ctc" else r.decoder_algorithm
    return (f"| {r.model} | {r.batch_size} | {algorithm} | {r.mode} | {'yes' if r.scores else 'no'} | "
            f"{r.hotwords} | {r.attention_kernel} | {r.n_utterances} x {r.repeat} | "
            f"{r.rtfx:.0f} | {audio_s / median['encoder']:.0f} | "
            f"{audio_s / median['decoder']:.0f} | {r.decoder_share:.1%} | {speedup} | "
            f"{r.tokens_per_frame:.2f} | {r.tokens_sha1[:8]} |")


def error_row(record: dict) -> str:
    """A failed setting (or model) in the table's columns: what was asked, and why it failed."""
    error = record["error"].replace("|", "/").replace("\n", " ")
    error = error if len(error) <= 160 else error[:157] + "..."
    asked = [record.get(k, "") for k in ("decoder_algorithm", "cuda_graphs")]
    scores = {True: "yes", False: "no"}.get(record.get("scores"), "")
    cells = [record["model"], record.get("batch_size", ""), *asked, scores, record.get("hotwords", ""),
             record.get("attention_kernel", ""), "", f"**failed**: {error}"]
    return "| " + " | ".join(map(str, cells)) + " |" + " |" * (COLUMNS - len(cells))


HEADER = ("| model | batch | algorithm | mode | token scores | hotwords | attention | utterances x timed passes | "
          "RTFx (all passes) | encoder RTFx (median pass) | decoder RTFx (median pass) | decoder share | "
          "decoder speed-up vs frame looping eager | "
          "tokens/frame | tokens_sha1 |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
COLUMNS = HEADER.splitlines()[0].count("|") - 1


def conditional_nodes_off(device: str) -> str | None:
    """Why conditional nodes cannot be used on ``device``'s GPU (None where they can, or on a CPU): forced
    conditional rows would all fail, and the goals read on them would vanish."""
    from decoding.cuda_conditional import SWITCH, conditional_support, switched_off

    if switched_off():
        return f"switched off ({SWITCH}=0)"
    if torch.device(device).type != "cuda":
        return None
    usable, why = conditional_support()
    return None if usable else why


def transducer_settings(conditional_off: str | None) -> list[tuple]:
    """The settings, conditional rows in no_while mode when conditional nodes are off (a row that becomes one
    already there is measured once)."""
    return list(dict.fromkeys(_standing_in(TRANSDUCER_SETTINGS, conditional_off)))


def goal_settings(conditional_off: str | None) -> list[tuple]:
    """The settings issue 3's goals read: with conditional nodes off, their no_while stand-ins."""
    return _standing_in(GOAL_SETTINGS, conditional_off)


def _standing_in(settings: tuple[tuple, ...], conditional_off: str | None) -> list[tuple]:
    if not conditional_off:
        return list(settings)
    return [(a, "no_while" if g == "conditional" else g, *rest) for a, g, *rest in settings]


def forget_decoders(work: Workload) -> None:
    """Drop the model's cached decoders (their buffers and graphs): each batch size is measured as a fresh
    ``batchasr bench --batch-size N`` would measure it, not on buffers a larger batch left."""
    for cache in ("_label_loopers", "_ctc_boost_loops"):
        work.model.__dict__.pop(cache, None)
    if work.model.device.type == "cuda":
        torch.cuda.empty_cache()


def decoder_of(name: str) -> str | None:
    """A built-in architecture's kind, known before it is built (for a line on a model the budget left out)."""
    from models.architectures import ARCHITECTURES

    if name not in ARCHITECTURES:
        return None
    return "transducer" if "joint" in ARCHITECTURES[name] else "ctc"


class Table:
    """The rows so far, in DIR/bench.jsonl and DIR/bench_table.md; the models, each prepared when first needed."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.jsonl = (args.out / "bench.jsonl").open("w")
        self.rows: list[str] = []
        self.skipped: list[str] = []
        self.failed = False
        self.conditional_off = conditional_nodes_off(args.device)
        self.works: dict[str, Workload | None] = {}  # None: it could not be prepared (tried once)

    def work(self, name: str, batch_size: int) -> Workload | None:
        if name not in self.works:
            started = time.perf_counter()
            try:
                work = prepare(name, device=self.args.device, dtype=self.args.dtype, seed=0,
                               n_utterances=self.args.n_utterances)
            except Exception as exc:  # the other models' rows still come
                traceback.print_exc()
                self.fail({"model": name, "batch_size": batch_size, "decoder": decoder_of(name),
                           "error": f"preparing: {exc!r}"})
                work = None
            else:
                print(f"{name}: ready in {time.perf_counter() - started:.0f} s (blank bias {work.blank_bias})",
                      flush=True)
            self.works[name] = work
        return self.works[name]

    def add(self, record: dict, row: str) -> None:
        self._write_record(record)
        self.rows.append(row)
        print(row, flush=True)
        self.write()

    def fail(self, record: dict) -> None:
        self.failed = True
        self.add(record, error_row(record))

    def skip(self, records: list[dict], what: str) -> None:
        """What the budget left out: a line each in bench.jsonl, for the goals, and ``what`` in the table's notes."""
        for record in records:
            self._write_record({**record, "not_measured": "budget spent"})
        self.skipped.append(what)
        self.write()

    def _write_record(self, record: dict) -> None:
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()

    def write(self) -> None:
        notes = ""
        if self.conditional_off:
            notes += (f"\nConditional nodes off: {self.conditional_off}. The conditional rows were measured in "
                      "no_while mode, and issue 3's goals are read on those.\n")
        notes += "".join(f"\nNot measured (budget spent): {s}" for s in self.skipped)
        (self.args.out / "bench_table.md").write_text(HEADER + "\n" + "\n".join(self.rows) + "\n" + notes)


def bench_batch_size(table: Table, name: str, batch_size: int, budget: Budget) -> None:
    if budget.spent:
        table.skip([{"model": name, "batch_size": batch_size, "decoder": decoder_of(name)}],
                   f"{name} at batch {batch_size}")
        return
    work = table.work(name, batch_size)
    if work is None:
        return
    forget_decoders(work)
    subset = dataclasses.replace(work, waveforms=work.waveforms[:UTTERANCES.get(batch_size, len(work.waveforms))])
    baseline = None
    settings = CTC_SETTINGS if work.decoder == "ctc" else transducer_settings(table.conditional_off)
    for n, setting in enumerate(settings):
        asked = setting_record(name, batch_size, work.decoder, setting, table.conditional_off)
        if budget.spent:
            table.skip([setting_record(name, batch_size, work.decoder, later, table.conditional_off)
                        for later in settings[n:]],
                       f"{name} at batch {batch_size}: {len(settings) - n} of {len(settings)} settings")
            return
        algorithm, graphs, kernel, scores, hotwords = setting
        goal_setting = batch_size == GOAL_BATCH and setting in goal_settings(table.conditional_off)
        repeat = table.args.goal_repeat if goal_setting else table.args.repeat
        work.model.encoder.set_attention_kernel(kernel)
        try:
            result = measure(subset, batch_size, repeat, algorithm, graphs, scores, hotwords)
        except Exception as exc:  # one failing setting must not lose the rest of the table
            traceback.print_exc()
            table.fail({**asked, "error": repr(exc)})
            continue
        if algorithm == "frame_looping":
            baseline = (result.stage_median_s or result.stage_s)["decoder"]
        record = dataclasses.asdict(result)
        if "conditional_nodes" in asked:
            record["conditional_nodes"] = asked["conditional_nodes"]
        table.add(record, table_row(result, baseline))


def setting_record(name: str, batch_size: int, decoder: str, setting: tuple, conditional_off: str | None) -> dict:
    """What a setting asks, for its line in bench.jsonl when it fails or is not measured."""
    record = {"model": name, "batch_size": batch_size, "decoder": decoder,
              **dict(zip(("decoder_algorithm", "cuda_graphs", "attention_kernel", "scores", "hotwords"), setting,
                         strict=True))}
    if conditional_off:
        record["conditional_nodes"] = f"off: {conditional_off}"
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[128, 16, 1])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--n-utterances", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=1, help="timed passes of a setting")
    parser.add_argument("--goal-repeat", type=int, default=5,
                        help=f"timed passes of a setting issue 3's goals are read on, at batch {GOAL_BATCH}")
    add_budget_option(parser)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    budget = Budget.from_launch(args.budget_s)
    table = Table(args)
    for batch_size in args.batch_sizes:
        for name in args.models:
            bench_batch_size(table, name, batch_size, budget)
    table.jsonl.close()
    return 1 if table.failed else 0


if __name__ == "__main__":
    sys.exit(main())
