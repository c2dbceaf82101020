"""Sustained overload with request timeouts: does the server keep its throughput, and does it recover after?

Triton's batcher lost throughput for good once queue timeouts were on (triton-inference-server #8870: counters
drifted, and only a reload brought it back). Here requests past ``REQUEST_TIMEOUT_S`` are answered 504 and their
queued pieces dropped before the engine (``batchasr_dropped_items{reason="expired"}``); this checks, over minutes,
that the engine's rate stays where it was, that what it spends goes to requests still waiting, and that afterwards
the queue is empty and a closed loop runs as fast as before.

    python loadtest/overload.py [--model M] [--timeout-s 3] [--overload 3] [--overload-s 180] [--window-s 15]
        [--baseline-s 30] [--concurrency 16] [--audio-dir DIR] [--out FILE]

Phases, against one `batchasr serve` in a subprocess: (1) a closed loop of ``--concurrency`` clients for
``--baseline-s``: requests/s and the engine's audio seconds per wall second; (2) Poisson arrivals at
``--overload`` times that request rate for ``--overload-s``: per window of ``--window-s``, the answers by status,
the audio seconds answered 200 per second (goodput), and the engine's; (3) once the last answer is in: the queue
depth and the items dropped, then the closed loop again. Prints one JSON object (also written to --out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadtest.http_bench import Clip, client_session, file_clips, free_port, start_server, synthetic_clips
from models.asr_model import DEFAULT_MODEL

AUDIO_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "default_model"


def scrape(url: str) -> dict[str, float]:
    """Every sample on /metrics by its series and labels: ``batchasr_dropped_items_total{reason="expired"}``."""
    samples = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            samples[series] = float(value)
    return samples


def engine_audio_s(samples: dict[str, float]) -> float:
    return samples.get("batchasr_audio_seconds_total", 0.0)


async def send(http: aiohttp.ClientSession, url: str, clip: Clip) -> int:
    """One `/v1/transcribe` request; its status (0: no answer: the connection failed or was reset)."""
    try:
        async with http.post(f"{url}/v1/transcribe", data=clip.body,
                             headers={"content-type": "audio/wav"}) as response:
            await response.read()
            return response.status
    except (TimeoutError, aiohttp.ClientError, OSError):  # counted, not raised: the others go on
        return 0


async def closed_loop(url: str, clips: list[Clip], concurrency: int, seconds: float) -> dict:
    """``concurrency`` clients sending the next clip as soon as one returns, for ``seconds``."""
    statuses: Counter[int] = Counter()
    answered_audio_s = 0.0
    before = engine_audio_s(scrape(url))
    started = time.perf_counter()

    async def client(http: aiohttp.ClientSession, offset: int) -> None:
        nonlocal answered_audio_s
        i = offset
        while time.perf_counter() - started < seconds:
            clip = clips[i % len(clips)]
            status = await send(http, url, clip)
            statuses[status] += 1
            answered_audio_s += clip.duration_s if status == 200 else 0.0
            i += concurrency

    async with client_session(concurrency) as http:
        await asyncio.gather(*(client(http, k) for k in range(concurrency)))
    wall = time.perf_counter() - started
    return {"wall_s": round(wall, 2), "statuses": dict(statuses), "requests_per_s": round(statuses[200] / wall, 2),
            "goodput_audio_s_per_s": round(answered_audio_s / wall, 2),
            "engine_audio_s_per_s": round((engine_audio_s(scrape(url)) - before) / wall, 2)}


@dataclass
class Window:
    """What one window of the overload saw: answers by status as they came back, and the engine's audio seconds."""

    statuses: Counter[int] = field(default_factory=Counter)
    answered_audio_s: float = 0.0
    engine_audio_s: float = 0.0


async def overload(url: str, clips: list[Clip], rate_per_s: float, seconds: float, window_s: float,
                   seed: int = 0) -> list[Window]:
    """Poisson arrivals at ``rate_per_s`` for ``seconds``; every answer counted in the window it came back in."""
    rng = random.Random(seed)
    windows = [Window() for _ in range(int(seconds // window_s) + 1)]
    started = time.perf_counter()

    def window_now() -> Window:
        return windows[min(int((time.perf_counter() - started) // window_s), len(windows) - 1)]

    async def one(http: aiohttp.ClientSession, clip: Clip) -> None:
        status = await send(http, url, clip)
        window = window_now()
        window.statuses[status] += 1
        window.answered_audio_s += clip.duration_s if status == 200 else 0.0

    async def watch_engine() -> None:
        previous = engine_audio_s(await asyncio.to_thread(scrape, url))
        for index in range(len(windows)):
            await asyncio.sleep(max(0.0, started + (index + 1) * window_s - time.perf_counter()))
            now = engine_audio_s(await asyncio.to_thread(scrape, url))
            windows[index].engine_audio_s, previous = now - previous, now

    async with client_session() as http:
        watcher = asyncio.create_task(watch_engine())
        tasks, i = [], 0
        while time.perf_counter() - started < seconds:
            tasks.append(asyncio.create_task(one(http, clips[i % len(clips)])))
            i += 1
            await asyncio.sleep(rng.expovariate(rate_per_s))
        await asyncio.gather(*tasks)
        watcher.cancel()
    return windows[:int(seconds // window_s)]  # the last, partial window only drains


def window_report(windows: list[Window], window_s: float) -> list[dict]:
    return [{"statuses": dict(w.statuses), "goodput_audio_s_per_s": round(w.answered_audio_s / window_s, 2),
             "engine_audio_s_per_s": round(w.engine_audio_s / window_s, 2)} for w in windows]


def thirds(values: list[float]) -> tuple[float, float]:
    """The means of the first and last thirds: a decay shows as the second well under the first."""
    third = max(1, len(values) // 3)
    return statistics.fmean(values[:third]), statistics.fmean(values[-third:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a .nemo file (default: the embedded model)")
    parser.add_argument("--audio-dir", type=Path, default=AUDIO_DIR, help="16 kHz mono WAV/FLAC clips")
    parser.add_argument("--synthetic", type=int, default=0, help="use N clips of bench's synthetic mix instead")
    parser.add_argument("--timeout-s", type=float, default=3.0, help="the server's REQUEST_TIMEOUT_S")
    parser.add_argument("--overload", type=float, default=3.0, help="arrival rate, in multiples of the baseline's")
    parser.add_argument("--overload-s", type=float, default=180.0)
    parser.add_argument("--window-s", type=float, default=15.0)
    parser.add_argument("--baseline-s", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--attention-kernel", default="auto")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    clips = synthetic_clips(args.synthetic) if args.synthetic else file_clips(args.audio_dir, 64)
    port = free_port()
    os.environ["BATCHASR_REQUEST_TIMEOUT_S"] = str(args.timeout_s)  # start_server passes the environment on
    server = start_server(args.model or str(DEFAULT_MODEL), port, None, 0, 200 << 20, args,
                          Path(tempfile.gettempdir()) / f"overload_serve_{port}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(closed_loop(url, clips, args.concurrency, min(5.0, args.baseline_s)))  # warm: connections, batches
        baseline = asyncio.run(closed_loop(url, clips, args.concurrency, args.baseline_s))
        dropped_before = scrape(url)
        rate = args.overload * baseline["requests_per_s"]
        windows = window_report(asyncio.run(overload(url, clips, rate, args.overload_s, args.window_s)),
                                args.window_s)
        time.sleep(2)  # cancelled pieces leave the queue when the engine next looks
        after = scrape(url)
        recovered = asyncio.run(closed_loop(url, clips, args.concurrency, args.baseline_s))
    finally:
        server.terminate()
        server.wait(60)
    dropped = {series: after[series] - dropped_before.get(series, 0.0) for series in after
               if series.startswith("batchasr_dropped_items_total")}
    first, last = thirds([w["engine_audio_s_per_s"] for w in windows])
    good_first, good_last = thirds([w["goodput_audio_s_per_s"] for w in windows])
    report = {
        "timeout_s": args.timeout_s, "arrivals_per_s": round(rate, 2), "baseline": baseline,
        "overload_windows": windows, "dropped_items": dropped,
        "queue_depth_after": after.get("batchasr_queue_depth"),
        "engine_audio_s_per_s_first_vs_last_third": [round(first, 2), round(last, 2)],
        "goodput_first_vs_last_third": [round(good_first, 2), round(good_last, 2)],
        "recovered": recovered,
        "recovered_vs_baseline": round(recovered["requests_per_s"] / baseline["requests_per_s"], 3),
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
