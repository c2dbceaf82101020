"""Per-stage timing of engine batches (features, encoder, decoder), shared by the engine and `batchasr bench`."""

from __future__ import annotations

import time
from typing import Any

import torch

STAGES = ("features", "encoder", "decoder")


class StageClock:
    """Stage boundaries: CUDA events on a GPU (read once at the end), ``perf_counter`` on a CPU.

    On a CPU the process's CPU time is kept too: on a shared machine it is far steadier than wall time.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.marks: list[list[Any]] = []  # per batch: start, after features, after encoder, after decoder

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter(), time.process_time()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))  # the model's device, which need not be the current one
        return event

    def stage_seconds(self, cpu_time: bool = False) -> dict[str, float]:
        """Seconds per stage, summed over batches: wall (GPU: event) time, or CPU time (CPU only)."""
        if self.cuda and self.marks:  # the last mark, on the stream of them all: not the device, whose other
            self.marks[-1][-1].synchronize()  # streams (the next batch's upload) need not be waited for
        totals = dict.fromkeys(STAGES, 0.0)
        for marks in self.marks:
            for stage, start, end in zip(STAGES, marks, marks[1:], strict=False):
                if self.cuda:
                    totals[stage] += start.elapsed_time(end) / 1000
                else:
                    totals[stage] += end[int(cpu_time)] - start[int(cpu_time)]
        return totals

