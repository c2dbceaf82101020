"""Peak memory of the chunked transducer loss vs a naive full-joint one (forward + backward), on CPU.

Each variant runs in a fresh subprocess; peak = ru_maxrss at the end minus the resident size once the
inputs exist, so the allocator's high-water mark is all that is measured.

Usage: ``python -m models.training.loss_memory [--batch 8 --frames 400 --labels 100 --vocab 1024]``
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from .losses import LatticeLogProbs, transducer_log_likelihood, transducer_loss


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def naive_loss(enc, pred, targets, enc_len, tgt_len, joint, vocab_size):
    """The textbook way: the whole [B, T, U+1, V+1] log-softmax is built and kept for backward."""
    log_probs = joint(enc[:, :, None] + pred[:, None]).log_softmax(-1)  # (B, T, U+1, V+1)
    index = F.pad(targets, (0, 1))[:, None, :, None].expand(-1, enc.shape[1], -1, 1)
    lp = LatticeLogProbs(blank=log_probs[..., vocab_size], emit=log_probs.gather(-1, index).squeeze(-1),
                         duration=None)
    return -transducer_log_likelihood(lp, enc_len, tgt_len)


def measure(variant: str, batch: int, frames: int, labels: int, vocab: int, hidden: int) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    enc = torch.randn(batch, frames, hidden, requires_grad=True)
    pred = torch.randn(batch, labels + 1, hidden, requires_grad=True)
    joint = nn.Sequential(nn.ReLU(), nn.Linear(hidden, vocab + 1))
    targets = torch.randint(0, vocab, (batch, labels))
    enc_len, tgt_len = torch.full((batch,), frames), torch.full((batch,), labels)
    base = _rss_mib()
    start = time.perf_counter()
    if variant == "naive":
        loss = naive_loss(enc, pred, targets, enc_len, tgt_len, joint, vocab)
    else:
        loss = transducer_loss(enc, pred, targets, enc_len, tgt_len, joint, vocab)
    loss.sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux
    return {"variant": variant, "peak_mib": round(peak - base, 1), "seconds": round(time.perf_counter() - start, 1),
            "loss": round(float(loss.sum()), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--frames", type=int, default=400)
    parser.add_argument("--labels", type=int, default=100)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--variant", choices=["naive", "chunked"])
    args = parser.parse_args()
    shape = [str(x) for x in (args.batch, args.frames, args.labels, args.vocab, args.hidden)]
    if args.variant:
        print(json.dumps(measure(args.variant, args.batch, args.frames, args.labels, args.vocab, args.hidden)))
        return
    keys = ("--batch", "--frames", "--labels", "--vocab", "--hidden")
    flags = [x for pair in zip(keys, shape, strict=True) for x in pair]
    for variant in ("chunked", "naive"):
        out = subprocess.run([sys.executable, "-m", "models.training.loss_memory", "--variant", variant, *flags],
                             check=True, capture_output=True, text=True).stdout
        print(out.strip(), flush=True)


if __name__ == "__main__":
    main()
