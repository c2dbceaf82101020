"""How much of each batch the batcher pads, with so many items waiting (docs/benchmarks.md).

The engine computes every padded sample, so padding costs throughput one for one. Behind HTTP at saturation the
queue holds what the clients keep in flight less what is being uploaded and computed; the offline pass sorts all of
its audio first and pads almost nothing. This keeps ``--queued`` items waiting (durations as ``batchasr bench``
draws them: a LibriSpeech-like mix, 7 s on average), takes ``--batches`` batches from ``service.batcher.Batcher``,
each replaced by as many new arrivals, and prints one JSON line per queue depth: the mean padded share of a
batch's samples, and its mean rows.

    python loadtest/batch_padding.py --queued 200 400 800 1600 --batch-size 128
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from service.batcher import Batcher, Priority, WorkItem
from service.bench import synthetic_durations

SAMPLE_RATE = 16000


def measure(queued: int, batch_size: int, batches: int, seed: int) -> dict:
    durations = iter(np.tile(synthetic_durations(4096, seed), 1 + (queued + batches * batch_size) // 4096))
    silence = np.zeros(int(40 * SAMPLE_RATE), dtype=np.float32)  # views of it: the batcher reads lengths only

    def arrivals(n: int) -> list[WorkItem]:
        return [WorkItem(silence[: int(next(durations) * SAMPLE_RATE)], Priority.INTERACTIVE, 3600.0)
                for _ in range(n)]

    batcher = Batcher(max_batch_size=batch_size, max_batch_audio_s=batch_size * 30.0, max_wait_ms=0.0,
                      max_queue=queued + batch_size)
    batcher.submit(arrivals(queued))
    padding, rows = [], []
    for _ in range(batches):
        batch = batcher.next_batch()
        padding.append(1 - batch.n_samples / batch.padded_samples)
        rows.append(len(batch.items))
        batcher.submit(arrivals(len(batch.items)))
    return {"queued": queued, "batch_size": batch_size, "batches": batches,
            "mean_padding": round(float(np.mean(padding)), 4), "mean_rows": round(float(np.mean(rows)), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queued", type=int, nargs="+", default=[200, 400, 800, 1600])
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for queued in args.queued:
        print(json.dumps(measure(queued, args.batch_size, args.batches, args.seed)), flush=True)


if __name__ == "__main__":
    main()
