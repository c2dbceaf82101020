"""How fast the engine thread can issue small torch ops while the event loop runs Python in the same process.

On a GPU the engine thread mostly launches kernels, a few microseconds of Python each, and it needs the
interpreter lock for every one. This measures its launch rate alone and beside an event loop that is busy a
given share of the time (bursts of 100 us callbacks, as request handling looks), at a given switch interval.

    python scripts/gil_share.py [--busy 0.25 0.5 0.8] [--switch-ms 5 0.5] [--ops 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time

import torch

CALLBACK_S = 100e-6  # Python work per event-loop callback
PERIOD_S = 0.005  # one burst of callbacks and one idle gap per period


def launch_rate(n_ops: int) -> float:
    """Small ops a second on this thread; each releases and retakes the interpreter lock, as a launch does."""
    x = torch.zeros(4)
    started = time.perf_counter()
    for _ in range(n_ops):
        x = torch.add(x, 1.0)
    return n_ops / (time.perf_counter() - started)


async def busy_loop(share: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        burst_end = time.perf_counter() + PERIOD_S * share
        while time.perf_counter() < burst_end:
            started = time.perf_counter()
            while time.perf_counter() - started < CALLBACK_S:
                pass
            await asyncio.sleep(0)  # back to the loop between callbacks, which keeps the lock
        await asyncio.sleep(PERIOD_S * (1 - share))


async def measure(share: float, n_ops: int) -> float:
    stop, rates = asyncio.Event(), []
    front_end = asyncio.create_task(busy_loop(share, stop)) if share > 0 else None
    await asyncio.sleep(0.05)
    engine = threading.Thread(target=lambda: rates.append(launch_rate(n_ops)))
    engine.start()
    while engine.is_alive():
        await asyncio.sleep(0.01)
    stop.set()
    if front_end is not None:
        await front_end
    return rates[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", type=float, nargs="+", default=[0.25, 0.5, 0.8])
    parser.add_argument("--switch-ms", type=float, nargs="+", default=[5.0, 0.5])
    parser.add_argument("--ops", type=int, default=20000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    try:
        from uvloop import run
    except ImportError:
        from asyncio import run
    launch_rate(args.ops)  # warm-up
    alone = run(measure(0.0, args.ops))
    print(f"event loop idle: {alone:10,.0f} ops/s")
    for share in (s for s in args.busy if s > 0):
        for switch_ms in args.switch_ms:
            sys.setswitchinterval(switch_ms / 1000)
            rate = run(measure(share, args.ops))
            print(f"event loop busy {share:4.0%}, switch interval {switch_ms:g} ms: "
                  f"{rate:10,.0f} ops/s ({rate / alone:.2f} of idle)")

if __name__ == "__main__":
    main()
