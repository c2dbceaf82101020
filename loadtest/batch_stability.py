"""How stable a transcript is under dynamic batching: the same utterances decoded alone (batch 1) and inside batches
of other audio, token by token.

The engine batches whatever arrives together, so an utterance meets different neighbours and padding each time it
is sent. In float32 on a CPU its tokens should not move at all. In bf16 the kernels a batch's shape selects round
differently, and a near-tie in the joint can flip a token. The share of utterances whose tokens change, and the
token edit rate, are what a user who sends a file twice may see. Two batchings are measured: the batcher's own
(longest first, neighbours of similar length) and shuffled (neighbours of any length, so more padding).

    python loadtest/batch_stability.py --model parakeet-tdt-0.6b-v2 --device cuda --dtype bfloat16 \\
        --n-utterances 256 --batch-size 128 --shuffles 3 [--json]

--through-engine instead submits every utterance at once to a running engine (its batcher forms the batches),
twice, in two random orders, and counts the utterances whose tokens or scores differ between the two, with
the engine's RTFx; --length-bucket-s gives that engine fixed batch shapes (BATCHASR_LENGTH_BUCKET_S).

--runs does several runs in one process, one result (a JSON line with --json) each: DTYPE decodes alone and in
batches, DTYPE:engine through the engine. A run that fails prints its error and the next one runs (exit status 1).

--model takes a checkpoint or a built-in architecture (random weights, blank calibrated as `batchasr bench` does);
without --model, the embedded default model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.wer import edit_distance
from service.bench import prepare, run_batches


def decode_in(work, batches: list[list[int]]) -> dict[int, list[int]]:
    """Each utterance's tokens, decoded in ``batches`` (lists of indices)."""
    return run_batches(work.model, work.waveforms, batches, work.decoder, "label_looping", "auto", False, (),
                       None).tokens


def compare(reference: dict[int, list[int]], got: dict[int, list[int]]) -> dict[str, Any]:
    changed = [i for i in reference if got[i] != reference[i]]
    edits = sum(edit_distance(reference[i], got[i]) for i in changed)
    return {"changed": len(changed), "utterances": len(reference),
            "changed_share": round(len(changed) / max(len(reference), 1), 4),
            "token_edit_rate": round(edits / max(sum(map(len, reference.values())), 1), 6)}


def measure(model: str | None, device: str, dtype: str, n_utterances: int, batch_size: int, shuffles: int,
            seed: int = 0, audio: list[str] | None = None) -> dict[str, Any]:
    work = prepare(model, device, dtype, seed, audio, n_utterances=n_utterances)
    n = len(work.waveforms)
    alone = decode_in(work, [[i] for i in range(n)])
    longest_first = sorted(range(n), key=lambda i: len(work.waveforms[i]), reverse=True)
    orders = {"longest_first": longest_first}
    rng = np.random.default_rng(seed)
    orders.update((f"shuffled_{k}", rng.permutation(n).tolist()) for k in range(shuffles))
    batchings = {name: compare(alone, decode_in(work, [order[i : i + batch_size] for i in range(0, n, batch_size)]))
                 for name, order in orders.items()}
    return {"model": model or "embedded default", "device": str(work.model.device),
            "dtype": str(work.model.dtype).removeprefix("torch."), "decoder": work.decoder, "batch_size": batch_size,
            "utterances": n, "tokens_alone": sum(map(len, alone.values())), "batchings": batchings}


def through_engine(model: str | None, device: str, dtype: str, n_utterances: int, batch_size: int,
                   length_bucket_s: float | None, seed: int = 0, audio: list[str] | None = None) -> dict[str, Any]:
    from service.batcher import Batcher, WorkItem
    from service.engine import Engine
    from service.metrics import Metrics

    work = prepare(model, device, dtype, seed, audio, n_utterances=n_utterances)
    n, rate = len(work.waveforms), work.model.sample_rate
    rng = np.random.default_rng(seed)
    runs = []
    for order in (rng.permutation(n).tolist() for _ in range(2)):
        batcher = Batcher(batch_size, 1e9, 1000.0, n, rate, length_bucket_s=length_bucket_s)
        engine = Engine(work.model, batcher, Metrics(), decoder=work.decoder)
        engine.start()
        try:
            if not engine.wait_ready(600):
                raise RuntimeError(f"the engine did not start: {engine.error}")
            items = [WorkItem(work.waveforms[i]) for i in order]
            started = time.perf_counter()
            batcher.submit(items)
            results = [item.future.result(3600) for item in items]
            wall_s = time.perf_counter() - started
        finally:
            engine.stop(60)
        outputs = {i: (r.hypothesis.tokens, r.hypothesis.logprobs) for i, r in zip(order, results, strict=True)}
        runs.append((sum(map(len, work.waveforms)) / rate / wall_s, outputs))
    (rtfx_a, a), (rtfx_b, b) = runs
    return {"model": model or "embedded default", "device": str(work.model.device),
            "dtype": str(work.model.dtype).removeprefix("torch."), "batch_size": batch_size,
            "length_bucket_s": length_bucket_s, "utterances": n, "rtfx": [round(rtfx_a, 1), round(rtfx_b, 1)],
            "tokens_moved": sum(a[i][0] != b[i][0] for i in a), "scores_moved": sum(a[i][1] != b[i][1] for i in a)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint or built-in architecture (default: embedded)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--audio", nargs="+", default=None,
                        help="audio files or folders (default: --n-utterances of synthetic speech)")
    parser.add_argument("--n-utterances", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--shuffles", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    parser.add_argument("--through-engine", action="store_true",
                        help="two random submission orders through a running engine, compared")
    parser.add_argument("--length-bucket-s", type=float, default=None,
                        help="with --through-engine: fixed batch shapes, buckets of this many seconds")
    parser.add_argument("--runs", nargs="+", metavar="DTYPE[:engine]",
                        help="several runs in this process (its start and CUDA's paid once): DTYPE alone and in "
                             "batches, DTYPE:engine through the engine (instead of --dtype and --through-engine)")
    args = parser.parse_args(argv)
    if args.n_utterances < 1 or args.batch_size < 1 or args.shuffles < 0:
        parser.error("--n-utterances and --batch-size must be >= 1, --shuffles >= 0")
    runs = args.runs or [f"{args.dtype}:engine" if args.through_engine else args.dtype]
    if any(spec.partition(":")[2] not in ("", "engine") for spec in runs):
        parser.error("a run is DTYPE or DTYPE:engine")
    engine_runs = any(spec.endswith(":engine") for spec in runs)
    if args.length_bucket_s is not None and (not engine_runs or args.length_bucket_s <= 0):
        parser.error("--length-bucket-s needs --through-engine (or a DTYPE:engine run) and must be > 0")
    failed = False
    for spec in runs:
        try:
            run(spec, args)
        except Exception as exc:  # one run failing must not lose the others
            traceback.print_exc()
            print(json.dumps({"run": spec, "error": repr(exc)}) if args.json else f"{spec}: failed: {exc!r}",
                  flush=True)
            failed = True
    return 1 if failed else 0


def run(spec: str, args: argparse.Namespace) -> None:
    """One run, ``DTYPE`` or ``DTYPE:engine``, its result printed at once."""
    dtype, _, how = spec.partition(":")
    if how == "engine":
        result = through_engine(args.model, args.device, dtype, args.n_utterances, args.batch_size,
                                args.length_bucket_s, args.seed, args.audio)
        print(json.dumps(result) if args.json else
              f"{result['model']} on {result['device']}, {result['dtype']}, batches of {result['batch_size']}, "
              f"length buckets {result['length_bucket_s'] or 'off'}: RTFx {result['rtfx'][0]} / "
              f"{result['rtfx'][1]}; of {result['utterances']} utterances, tokens moved in "
              f"{result['tokens_moved']}, scores in {result['scores_moved']}", flush=True)
        return
    result = measure(args.model, args.device, dtype, args.n_utterances, args.batch_size, args.shuffles,
                     args.seed, args.audio)
    if args.json:
        print(json.dumps(result), flush=True)
        return
    print(f"{result['model']} on {result['device']}, {result['dtype']}, {result['decoder']}: "
          f"{result['utterances']} utterances ({result['tokens_alone']} tokens) alone vs in batches of "
          f"{result['batch_size']}")
    for name, r in result["batchings"].items():
        print(f"  {name:15} {r['changed']:4d} changed ({r['changed_share']:.2%}), token edit rate "
              f"{r['token_edit_rate']:.4%}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
