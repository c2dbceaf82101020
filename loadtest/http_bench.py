"""HTTP throughput at saturation vs the offline engine, and latency at half load; bulk jobs vs offline.

Starts `batchasr serve` (and Redis for --jobs) on 127.0.0.1 in subprocesses, so the load generator never
shares an interpreter with the server. Prints one JSON object; `docs/benchmarks.md` records the results.

    python loadtest/http_bench.py --model MODEL.nemo --audio-dir DIR [--requests 200] [--concurrency 64]
                                  [--jobs]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import soundfile as sf

from models import load_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def offline_rtfx(model_path: str, files: list[Path], batch_size: int) -> dict:
    """The same audio through ASRModel.transcribe in one process: the ceiling for the server."""
    model = load_model(model_path, device="cpu")
    model.transcribe([str(files[0])])  # warm-up
    audio_s = sum(sf.info(str(f)).duration for f in files)
    started = time.perf_counter()
    model.transcribe([str(f) for f in files], batch_size=batch_size)
    wall = time.perf_counter() - started
    return {"audio_s": round(audio_s, 2), "wall_s": round(wall, 3), "rtfx": round(audio_s / wall, 2)}


async def saturate(url: str, bodies: list[bytes], durations: list[float], concurrency: int) -> dict:
    """Closed loop: ``concurrency`` clients, each sending the next request as soon as one returns."""
    queue = list(range(len(bodies)))
    latencies: list[float] = []

    async def client(http: httpx.AsyncClient) -> None:
        while queue:
            i = queue.pop()
            started = time.perf_counter()
            r = await http.post(f"{url}/v1/transcribe", content=bodies[i], headers={"content-type": "audio/wav"})
            r.raise_for_status()
            latencies.append(time.perf_counter() - started)

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency)) as http:
        started = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        wall = time.perf_counter() - started
    audio_s = sum(durations)
    return {"requests": len(bodies), "concurrency": concurrency, "wall_s": round(wall, 3),
            "rtfx": round(audio_s / wall, 2), "requests_per_s": round(len(bodies) / wall, 2)}


async def open_loop(url: str, bodies: list[bytes], rate_per_s: float, seed: int = 0) -> dict:
    """Poisson arrivals at ``rate_per_s``: latency percentiles at a given load."""
    rng = random.Random(seed)
    latencies: list[float] = []

    async def one(http: httpx.AsyncClient, body: bytes) -> None:
        started = time.perf_counter()
        r = await http.post(f"{url}/v1/transcribe", content=body, headers={"content-type": "audio/wav"})
        r.raise_for_status()
        latencies.append(time.perf_counter() - started)

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1000)) as http:
        tasks = []
        for body in bodies:
            tasks.append(asyncio.create_task(one(http, body)))
            await asyncio.sleep(rng.expovariate(rate_per_s))
        await asyncio.gather(*tasks)
    latencies.sort()
    return {"rate_per_s": round(rate_per_s, 2), "p50_s": round(statistics.median(latencies), 4),
            "p99_s": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 4)}


async def bulk_job(url: str, files: list[Path], durations: list[float]) -> dict:
    async with httpx.AsyncClient(timeout=600) as http:
        parts = [("files", (f.name, f.read_bytes(), "audio/wav")) for f in files]
        started = time.perf_counter()
        job = (await http.post(f"{url}/v1/jobs", files=parts)).json()
        while job["status"] not in ("completed", "completed_with_errors", "failed", "cancelled"):
            await asyncio.sleep(0.05)
            job = (await http.get(f"{url}/v1/jobs/{job['id']}")).json()
        wall = time.perf_counter() - started
    return {"items": len(files), "status": job["status"], "wall_s": round(wall, 3),
            "items_per_s": round(len(files) / wall, 2), "rtfx_wall": round(sum(durations) / wall, 2),
            "rtfx_engine": job["rtfx"]}


def start_server(model: str, port: int, redis_url: str | None, batch_size: int) -> subprocess.Popen:
    env = {**os.environ, "BATCHASR_MAX_BATCH_SIZE": str(batch_size), "BATCHASR_MAX_QUEUE": "100000"}
    command = [sys.executable, "-m", "service.cli", "serve", "--model", model, "--port", str(port)]
    if redis_url:
        command += ["--redis-url", redis_url]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("server did not become ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--audio-dir", required=True, type=Path)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--jobs", action="store_true", help="also time a bulk job through Redis")
    args = parser.parse_args()
    sources = sorted(p for p in args.audio_dir.iterdir() if p.suffix in (".wav", ".flac"))
    files = [sources[i % len(sources)] for i in range(args.requests)]
    bodies = [f.read_bytes() for f in files]
    durations = [sf.info(str(f)).duration for f in files]
    report = {"offline": offline_rtfx(args.model, files, args.batch_size)}
    redis_dir, redis = None, None
    redis_url = None
    if args.jobs:
        redis_dir = tempfile.mkdtemp()
        redis_port = free_port()
        redis = subprocess.Popen([shutil.which("redis-server"), "--port", str(redis_port), "--save", "",
                                  "--dir", redis_dir], stdout=subprocess.DEVNULL)
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        time.sleep(0.5)
    port = free_port()
    server = start_server(args.model, port, redis_url, args.batch_size)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(saturate(url, bodies[:16], durations[:16], 8))  # warm-up
        report["http_saturation"] = asyncio.run(saturate(url, bodies, durations, args.concurrency))
        report["http_vs_offline"] = round(report["http_saturation"]["rtfx"] / report["offline"]["rtfx"], 3)
        half_rate = report["http_saturation"]["requests_per_s"] / 2
        report["http_half_load"] = asyncio.run(open_loop(url, bodies, half_rate))
        if args.jobs:
            report["bulk_job"] = asyncio.run(bulk_job(url, files, durations))
            report["bulk_vs_offline"] = round(report["bulk_job"]["rtfx_wall"] / report["offline"]["rtfx"], 3)
    finally:
        server.terminate()
        server.wait(60)
        if redis is not None:
            redis.terminate()
            shutil.rmtree(redis_dir, ignore_errors=True)
    report["machine"] = f"{os.cpu_count()} CPU cores, no GPU"
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
