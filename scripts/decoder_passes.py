"""How many passes label looping's two loops make on one batch of a bench workload.

A graph's decoder time follows these counts (each pass is a fixed set of kernels), so this says what the
decoder stage of ``batchasr bench`` is made of, and it needs no GPU: the counts are the same on any device.
The batch is encoded in slices of ``--encode-batch`` rows (a large model's activations for a whole batch of
long utterances need more memory than a CPU machine has), then decoded as one batch, longest rows included.

    python scripts/decoder_passes.py --model parakeet-tdt-0.6b-v2 --batch-size 128 --device cpu
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from decoding.label_looping import LoopPasses, label_looping_greedy
from service.bench import prepare


def encode_in_slices(model, waveforms, rows_per_slice: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, d) encoder output and (B,) lengths of all ``waveforms``, encoded a slice at a time."""
    parts = [model.encode(waveforms[i : i + rows_per_slice]) for i in range(0, len(waveforms), rows_per_slice)]
    width = max(part.encoded.shape[1] for part in parts)
    encoded = torch.cat([F.pad(part.encoded, (0, 0, 0, width - part.encoded.shape[1])) for part in parts])
    return encoded, torch.cat([part.lengths for part in parts])


def count_passes(model, encoded: torch.Tensor, lengths: torch.Tensor) -> tuple[LoopPasses, list[int]]:
    """The loops' passes over one batch, and each row's token count."""
    transducer = model.config.transducer
    passes = LoopPasses()
    hyps = label_looping_greedy(encoded, lengths, model.decoder, model.joint, transducer.durations,
                                transducer.max_symbols, passes=passes)
    return passes, [len(h.tokens) for h in hyps]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a .nemo file or a built-in architecture (random weights)")
    parser.add_argument("--batch-size", type=int, default=128, help="rows decoded together")
    parser.add_argument("--audio", nargs="*", help="audio files or directories (default: synthetic speech-like)")
    parser.add_argument("--encode-batch", type=int, default=8, help="rows encoded at a time")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    work = prepare(args.model, args.device, args.dtype, args.seed, args.audio, n_utterances=args.batch_size)
    if work.decoder == "ctc":
        parser.error(f"{args.model} decodes with CTC: no loops to count")
    waveforms = sorted(work.waveforms[: args.batch_size], key=len)  # as the engine batches: by length
    with torch.inference_mode():
        encoded, lengths = encode_in_slices(work.model, waveforms, args.encode_batch)
    passes, tokens = count_passes(work.model, encoded, lengths)
    frames = lengths.tolist()
    print(json.dumps({
        "model": args.model, "rows": len(frames), "frames_max": max(frames), "frames_total": sum(frames),
        "tokens_per_frame": round(sum(tokens) / max(sum(frames), 1), 3), "longest_hypothesis": max(tokens),
        "outer_passes": passes.outer, "inner_passes": passes.inner,
        "inner_per_outer": round(passes.inner / max(passes.outer, 1), 2), "blank_bias": work.blank_bias,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
