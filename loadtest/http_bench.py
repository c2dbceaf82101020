"""HTTP throughput at saturation vs the offline engine, and latency at half load; bulk jobs vs offline.

Starts `batchasr serve` (and Redis for --jobs) on 127.0.0.1 in subprocesses, so the load generator never
shares an interpreter with the server. Prints one JSON object (also written to --out); `docs/benchmarks.md`
records the results.

The offline baselines run the same audio in this process, on the same device: ``ASRModel.transcribe`` (the
ceiling for a server, which also decodes uploads) and ``batchasr bench``'s model stages (features, encoder,
decoder; the issue's "offline engine").

    python loadtest/http_bench.py --model MODEL.nemo|ARCHITECTURE [--audio-dir DIR] [--requests 200]
        [--concurrency 64] [--batch-size 32] [--device auto] [--dtype auto] [--attention-kernel auto]
        [--frontends N[,N...]] [--jobs] [--out FILE] [--budget-s S]

``--model`` may name a built-in architecture (random weights, calibrated blank, as ``batchasr bench``); without
``--audio-dir`` the audio is ``batchasr bench``'s LibriSpeech-like synthetic mix, sent as 16-bit WAV. With
``--budget-s`` (counted from the process's start), no server run (and no half-load run) is begun once it is
spent; --out is rewritten after each step, and each server's log is written beside it. With ``--jobs`` each
server times the bulk job right after saturation, in place of the half-load run. ``--cache-dir`` keeps the
random-weight checkpoint and the offline baseline for a later run on the same clips (the GPU run's http and bulk
stages); ``--offline-baselines bench`` leaves out ``transcribe``'s, which no goal reads.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import io
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
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import aiohttp
import httpx
import numpy as np
import soundfile as sf
import torch

from models import load_model
from models.architectures import ARCHITECTURES
from models.fastconformer import ATTENTION_KERNEL_OPTIONS
from service.bench import (
    Budget,
    Workload,
    add_budget_option,
    measure,
    save_random_checkpoint,
    synthetic_audio,
    timed_passes,
)
from service.cli import raise_open_files_limit
from service.processes import process_title
from service.timing import STAGES  # batchasr_stage_seconds's stages, kept apart

try:
    from uvloop import run as run_client  # keeps the load generator's own CPU per request low
except ImportError:
    from asyncio import run as run_client

SAMPLE_RATE = 16000
DISTINCT_CLIPS = 512  # synthetic clips made; more requests take them again (the mix's durations are kept)
SERVER_LOG_MAX_BYTES = 2 << 20  # a server's log kept with the results: its start and its end
OFFLINE_BASELINES = ("bench", "transcribe")
FRONT_END_TITLE = process_title("batchasr-frontend-")  # as ps shows a front end


@dataclass
class Clip:
    name: str
    body: bytes  # what is uploaded
    waveform: np.ndarray  # the same audio decoded, for the offline runs
    duration_s: float


def file_clips(audio_dir: Path, n: int) -> list[Clip]:
    if not audio_dir.is_dir():
        raise ValueError(f"--audio-dir {audio_dir}: not a directory")
    sources = sorted(p for p in audio_dir.iterdir() if p.suffix.lower() in (".wav", ".flac"))
    if not sources:
        raise ValueError(f"--audio-dir {audio_dir}: no .wav or .flac files")
    distinct = [_clip(p.name, p.read_bytes()) for p in sources]
    return [distinct[i % len(distinct)] for i in range(n)]


def synthetic_clips(n: int, seed: int = 0) -> list[Clip]:
    """``n`` requests of ``batchasr bench``'s synthetic mix: at most DISTINCT_CLIPS of them made, then taken again
    in turn (making one costs about 15 ms of CPU: thousands would spend device time waiting)."""
    clips = []
    for i, wave in enumerate(synthetic_audio(min(n, DISTINCT_CLIPS), seed)):
        buffer = io.BytesIO()
        sf.write(buffer, wave, SAMPLE_RATE, subtype="PCM_16", format="WAV")
        clips.append(_clip(f"synthetic_{i:05d}.wav", buffer.getvalue()))
    return [clips[i % len(clips)] for i in range(n)]


def _clip(name: str, body: bytes) -> Clip:
    try:
        wave, rate = sf.read(io.BytesIO(body), dtype="float32")
    except sf.LibsndfileError as exc:
        raise ValueError(f"{name}: not audio the bench can read ({exc.error_string})") from exc
    if wave.ndim > 1 or rate != SAMPLE_RATE:
        raise ValueError(f"{name}: the bench wants 16 kHz mono audio")
    return Clip(name, body, wave, len(wave) / SAMPLE_RATE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def offline_rtfx(model_path: str, clips: list[Clip], args: argparse.Namespace) -> dict:
    """The same audio in this process: ``batchasr bench``'s timed model stages (the offline engine the goals
    compare with) and, where asked, ``ASRModel.transcribe`` (decoded waveforms in memory; a warm-up pass
    first)."""
    batch_size = args.batch_size
    model = load_model(model_path, device=args.device, dtype=args.dtype, attention_kernel=args.attention_kernel)
    waves = [c.waveform for c in clips]
    audio_s = sum(c.duration_s for c in clips)
    bench = measure(Workload(model_path, model, waves, model.default_decoder, None), batch_size)
    offline = {"audio_s": round(audio_s, 2), "requests": len(clips), "device": str(model.device),
               "dtype": str(model.dtype),
               "attention_kernel": model.encoder.attention_kernel,  # what "auto" resolved to; the server does the same
               "bench": {"wall_s": bench.wall_s, "rtfx": bench.rtfx, "stage_s": bench.stage_s, "mode": bench.mode}}
    if "transcribe" in args.offline_baselines:
        wall = timed_passes(partial(model.transcribe, waves, batch_size=batch_size), model.device).median_s
        offline["transcribe"] = {"wall_s": round(wall, 3), "rtfx": round(audio_s / wall, 2)}
    return offline


def offline_baseline(model_path: str, clips: list[Clip], args: argparse.Namespace) -> dict:
    """``offline_rtfx``, or what an earlier run measured on the same model file, settings and distinct clips
    (taken again in turn: the same mix, whatever the number of requests) where ``--cache-dir`` kept it."""
    if args.cache_dir is None:
        return offline_rtfx(model_path, clips, args)
    model = Path(model_path)
    key = _digest([model.resolve(), model.stat().st_size, model.stat().st_mtime_ns, args.device, args.dtype,
                   args.batch_size, args.attention_kernel, sorted(args.offline_baselines),
                   sorted({(c.name, c.duration_s) for c in clips})])
    cached = args.cache_dir / f"offline_{key}.json"
    if cached.exists():
        offline = json.loads(cached.read_text())
        offline["reused"] = f"measured by an earlier run on the same clips ({offline['requests']} requests)"
        return offline
    offline = offline_rtfx(model_path, clips, args)
    _write_whole(cached, json.dumps(offline))
    return offline


def random_checkpoint(architecture: str, clips: list[Clip], device: str, cache_dir: Path | None,
                      workdir: Path) -> tuple[Path, float]:
    """``architecture`` with random weights as a .nemo file, and its blank shift: in ``cache_dir``, made once for
    the same calibration clips (a 0.6B model's file is 2.4 GB, and a stage's seconds are few)."""
    calibration = clips[:4]
    directory = cache_dir or workdir
    path = directory / f"{architecture}_{_digest([c.body for c in calibration])}.nemo"
    shift_file = path.with_suffix(".shift")
    if cache_dir and path.exists() and shift_file.exists():
        return path, float(shift_file.read_text())
    shift = save_random_checkpoint(architecture, path, device, [c.waveform for c in calibration], seed=0)  # atomic
    _write_whole(shift_file, repr(shift))
    return path, shift


def _digest(parts: list) -> str:
    sha1 = hashlib.sha1()
    for part in parts:
        sha1.update(part if isinstance(part, bytes) else repr(part).encode())
    return sha1.hexdigest()[:12]


def _write_whole(path: Path, text: str) -> None:
    """Written under another name, then renamed: a run stopped mid-write leaves no half file to be reused."""
    partial_path = path.with_name(path.name + ".part")
    partial_path.write_text(text)
    partial_path.replace(path)


SERVER_SERIES = ("batchasr_audio_seconds_total", "batchasr_compute_seconds_total", "batchasr_batch_size_sum",
                 "batchasr_batch_size_count", "batchasr_queue_wait_seconds_sum", "batchasr_queue_wait_seconds_count",
                 "batchasr_padding_ratio_sum")


def server_counters(url: str) -> dict[str, float]:
    """The series above from the server's /metrics, each summed over its labels; and each engine stage's seconds
    (``stage:encoder``)."""
    return parse_counters(httpx.get(f"{url}/metrics", timeout=10).text)


def parse_counters(exposition: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in exposition.splitlines():
        series, _, value = line.rpartition(" ")
        name, _, labels = series.partition("{")
        if name in SERVER_SERIES:
            values[name] = values.get(name, 0.0) + float(value)
        elif name == "batchasr_stage_seconds_sum":
            stage = next((s for s in STAGES if f'stage="{s}"' in labels), None)
            if stage:
                values[f"stage:{stage}"] = values.get(f"stage:{stage}", 0.0) + float(value)
    return values


def engine_view(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict:
    """What the server saw over a run: a busy share near 1 with a low engine RTFx means the engine is slowed
    (contention); a low busy share means the front end does not feed it fast enough."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in (*SERVER_SERIES, *(f"stage:{s}" for s in STAGES))}
    compute = delta["batchasr_compute_seconds_total"]
    batches = delta["batchasr_batch_size_count"]
    # the engine's compute is its stages' sum: set against the offline bench's stage_s, what padding and batch size
    # cost each stage
    return {"engine_busy_share": round(compute / wall_s, 3),
            "stage_s": {stage: round(delta[f"stage:{stage}"], 4) for stage in STAGES},
            "engine_rtfx": round(delta["batchasr_audio_seconds_total"] / compute, 2) if compute else None,
            "mean_batch_size": round(delta["batchasr_batch_size_sum"] / batches, 2) if batches else None,
            "mean_padding_ratio": round(delta["batchasr_padding_ratio_sum"] / batches, 3) if batches else None,
            "mean_queue_wait_s": round(delta["batchasr_queue_wait_seconds_sum"]
                                       / max(delta["batchasr_queue_wait_seconds_count"], 1), 4)}


@dataclass(frozen=True)
class ServerCpu:
    """CPU seconds a server has used (Linux /proc). The engine's process: all its threads, and its event loop's
    thread (the main thread), which with HTTP in this process parses every request and runs every handler, and
    with front-end processes moves their samples in and results out. The loop cannot spread over cores, so its
    CPU per request caps the server at 1 / that many requests a second, whatever the GPU. Front-end processes
    (``--frontends``): all their threads, and their loops, by pid."""
    process_s: float
    event_loop_s: float
    front_ends_s: dict[int, float]
    front_end_loops_s: dict[int, float]

    @classmethod
    def read(cls, pid: int) -> ServerCpu | None:
        try:
            front_ends = _front_end_pids(pid)
            return cls(_cpu_s(pid), _cpu_s(pid, pid), {f: _cpu_s(f) for f in front_ends},
                       {f: _cpu_s(f, f) for f in front_ends})
        except OSError:  # no /proc here, or a front end exited between the listing and the read
            return None


def _cpu_s(pid: int, thread: int | None = None) -> float:
    stat = Path(f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _front_end_pids(pid: int) -> list[int]:
    """The server's front-end processes: its children named as front ends (not its job consumers)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if parent == pid and (stat.parent / "comm").read_text().startswith(FRONT_END_TITLE):
                pids.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
    return sorted(pids)


def front_end_view(before: ServerCpu | None, after: ServerCpu | None, requests: int, audio_s: float,
                   wall_s: float) -> dict | None:
    """The server's CPU over a run: the engine process's event loop, its busy share and the ceiling it sets, in
    requests (or job items) a second and in RTFx for this audio, if it did nothing else; with front-end
    processes, their CPU per request and their busiest loop's share."""
    if before is None or after is None:
        return None
    loop_s = after.event_loop_s - before.event_loop_s
    view = {"event_loop_cpu_ms_per_request": round(1000 * loop_s / requests, 3),
            "event_loop_busy_share": round(loop_s / wall_s, 3),
            "event_loop_ceiling_requests_per_s": round(requests / loop_s, 1) if loop_s else None,
            "event_loop_ceiling_rtfx": round(audio_s / loop_s, 1) if loop_s else None,
            "process_cpu_ms_per_request": round(1000 * (after.process_s - before.process_s) / requests, 3)}
    kept = after.front_ends_s.keys() & before.front_ends_s.keys()  # a front end restarted meanwhile is left out
    if kept:
        cpu = sum(after.front_ends_s[f] - before.front_ends_s[f] for f in kept)
        loops = [after.front_end_loops_s[f] - before.front_end_loops_s[f] for f in kept]
        view["front_end_processes"] = {"count": len(kept), "cpu_ms_per_request": round(1000 * cpu / requests, 3),
                                       "loop_cpu_ms_per_request": round(1000 * sum(loops) / requests, 3),
                                       "busiest_loop_busy_share": round(max(loops) / wall_s, 3)}
    return view


def client_session(connections: int = 0) -> aiohttp.ClientSession:
    """The load generator's HTTP client: aiohttp costs about 0.2 ms of client CPU a request where httpx costs
    3.6, which matters when client and server share a CPU, and on a GPU, where one client process must carry
    hundreds of requests a second. ``connections=0``: no limit."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections),
                                 timeout=aiohttp.ClientTimeout(total=600))


def p99(latencies: list[float]) -> float:
    """The 99th percentile, between the two nearest ranks (numpy's default): of 100 latencies, not the largest."""
    if len(latencies) < 2:
        return latencies[0]
    return statistics.quantiles(latencies, n=100, method="inclusive")[98]


async def post_audio(http: aiohttp.ClientSession, url: str, body: bytes) -> float:
    """One `/v1/transcribe` round trip; its latency in seconds."""
    started = time.perf_counter()
    async with http.post(f"{url}/v1/transcribe", data=body, headers={"content-type": "audio/wav"}) as response:
        response.raise_for_status()
        await response.read()
    return time.perf_counter() - started


async def saturate(url: str, bodies: list[bytes], durations: list[float], concurrency: int) -> dict:
    """Closed loop: ``concurrency`` clients, each sending the next request as soon as one returns."""
    queue = list(range(len(bodies)))

    async def client(http: aiohttp.ClientSession) -> None:
        while queue:
            await post_audio(http, url, bodies[queue.pop()])

    async with client_session(concurrency) as http:
        started, cpu_started = time.perf_counter(), time.process_time()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        wall, client_cpu = time.perf_counter() - started, time.process_time() - cpu_started
    audio_s = sum(durations)
    return {"requests": len(bodies), "concurrency": concurrency, "wall_s": round(wall, 3),
            "rtfx": round(audio_s / wall, 2), "requests_per_s": round(len(bodies) / wall, 2),
            "client_cpu_ms_per_request": round(1000 * client_cpu / len(bodies), 3)}


async def open_loop(url: str, bodies: list[bytes], rate_per_s: float, seed: int = 0) -> dict:
    """Poisson arrivals at ``rate_per_s``: latency percentiles at a given load."""
    rng = random.Random(seed)
    async with client_session() as http:
        tasks = []
        for body in bodies:
            tasks.append(asyncio.create_task(post_audio(http, url, body)))
            await asyncio.sleep(rng.expovariate(rate_per_s))
        latencies = sorted(await asyncio.gather(*tasks))
    return {"rate_per_s": round(rate_per_s, 2), "p50_s": round(statistics.median(latencies), 4),
            "p99_s": round(p99(latencies), 4)}


async def _job(response: aiohttp.ClientResponse) -> dict:
    """A job's JSON; an error status raises with the server's reason (not a KeyError on a missing field)."""
    if response.status >= 400:
        raise RuntimeError(f"{response.method} {response.url.path}: HTTP {response.status}: "
                           f"{(await response.text())[:200]}")
    return await response.json()


async def bulk_job(url: str, clips: list[Clip]) -> dict:
    """One job of every clip, submitted and polled to its end. Throughput only when every item completed: a job
    with failed items would count their audio as transcribed."""
    form = aiohttp.FormData()
    for c in clips:
        form.add_field("files", c.body, filename=c.name, content_type="audio/wav")
    async with client_session() as http:
        started = time.perf_counter()
        async with http.post(f"{url}/v1/jobs", data=form) as response:
            job = await _job(response)
        while job["status"] not in ("completed", "completed_with_errors", "failed", "cancelled"):
            await asyncio.sleep(0.05)
            async with http.get(f"{url}/v1/jobs/{job['id']}") as response:
                job = await _job(response)
        wall = time.perf_counter() - started
    done = job["status"] == "completed"
    return {"items": len(clips), "status": job["status"], "counts": job.get("counts"), "wall_s": round(wall, 3),
            "items_per_s": round(len(clips) / wall, 2) if done else None,
            "rtfx_wall": round(sum(c.duration_s for c in clips) / wall, 2) if done else None,
            "rtfx_engine": job["rtfx"] if done else None}


def start_server(model: str, port: int, redis_url: str | None, frontends: int, max_upload_bytes: int,
                 args: argparse.Namespace, log: Path, settings: dict[str, str] | None = None) -> subprocess.Popen:
    """`batchasr serve` in a subprocess (with ``settings``: more BATCHASR_* variables), its output in ``log``;
    returned once /readyz says ready. A server that exits first, or is not ready in 10 minutes, raises at once with
    the end of its log."""
    env = {**os.environ, **(settings or {}), "BATCHASR_MAX_BATCH_SIZE": str(args.batch_size),
           "BATCHASR_MAX_QUEUE": "100000",
           "BATCHASR_MAX_BATCH_AUDIO_S": str(args.batch_size * 36.0),  # room for full batches of the longest clips
           # the bulk job is one submission of every clip: its uploads may total as much as one upload
           "BATCHASR_MAX_UPLOAD_BYTES": str(max_upload_bytes), "BATCHASR_MAX_JOB_UPLOAD_BYTES": str(max_upload_bytes),
           "BATCHASR_MAX_INTAKE_BYTES": str(max(2 << 30, max_upload_bytes))}
    command = [sys.executable, "-m", "service.cli", "serve", "--model", model, "--port", str(port),
               "--device", args.device, "--dtype", args.dtype, "--attention-kernel", args.attention_kernel]
    if redis_url:
        command += ["--redis-url", redis_url]
    if frontends:
        command += ["--frontends", str(frontends)]
    with log.open("wb") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600  # a large model on a GPU: load, warm-up, graph capture
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.2)  # a 503 while warming up too: polled flat out, it took the warm-up's GIL
    why = "did not become ready" if process.poll() is None else f"exited with status {process.returncode}"
    process.kill()
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
    raise RuntimeError(f"batchasr serve {why}; the end of its output:\n{tail}")


def server_run(run: dict, model: str, clips: list[Clip], offline: dict, redis_url: str | None,
               args: argparse.Namespace, budget: Budget, save: Callable[[], None]) -> None:
    """One `batchasr serve` configuration (``run["frontends"]``) into ``run``, ``save`` after each step:
    saturation, then the bulk job (with Redis) or else half load; ratios to the offline runs."""
    bodies, durations = [c.body for c in clips], [c.duration_s for c in clips]
    frontends = run["frontends"]
    port = free_port()
    log = server_log(args.out, frontends)
    # the bulk job is one upload of every clip
    server = start_server(model, port, redis_url, frontends, max(200 << 20, 2 * sum(map(len, bodies))), args, log)
    url = f"http://127.0.0.1:{port}"
    try:
        warm = min(len(bodies), args.concurrency)  # every client connection opened, first-batch costs paid
        run_client(saturate(url, bodies[:warm], durations[:warm], args.concurrency))
        before, cpu_before = server_counters(url), ServerCpu.read(server.pid)
        saturation = run["http_saturation"] = run_client(saturate(url, bodies, durations, args.concurrency))
        saturation["front_end"] = front_end_view(cpu_before, ServerCpu.read(server.pid), len(bodies),
                                                 sum(durations), saturation["wall_s"])
        saturation["server"] = engine_view(before, server_counters(url), saturation["wall_s"])
        run.update(_ratios(saturation["rtfx"], offline, "http"))
        save()
        if redis_url:  # what the stage is for: begun whatever the budget says (its tail allows for it)
            run["http_half_load"] = "not measured: --jobs times the bulk job instead"
            cpu_before = ServerCpu.read(server.pid)
            bulk = run["bulk_job"] = run_client(bulk_job(url, clips))
            bulk["front_end"] = front_end_view(cpu_before, ServerCpu.read(server.pid), len(clips), sum(durations),
                                               bulk["wall_s"])  # the job consumer's loop is the engine process's
            if bulk["rtfx_wall"] is not None:
                run.update(_ratios(bulk["rtfx_wall"], offline, "bulk"))
        elif budget.spent:
            run["http_half_load"] = "not measured: budget spent"
        else:
            run["http_half_load"] = run_client(open_loop(url, bodies, saturation["requests_per_s"] / 2))
        save()
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:  # left running, it would share the device with the next layout's
            server.kill()
            server.wait()
        trim_log(log)


def _ratios(rtfx: float, offline: dict, what: str) -> dict[str, float]:
    """``rtfx`` over each offline baseline measured: {what}_vs_bench, {what}_vs_transcribe."""
    return {f"{what}_vs_{baseline}": round(rtfx / offline[baseline]["rtfx"], 3)
            for baseline in OFFLINE_BASELINES if baseline in offline}


def server_log(out: Path | None, frontends: int) -> Path:
    """Beside the report (so it comes back with the results), else in the temporary folder."""
    if out is None:
        return Path(tempfile.gettempdir()) / f"http_bench_serve_{os.getpid()}_{frontends}.log"
    return out.with_name(f"{out.stem}_serve_{frontends}.log")


def trim_log(log: Path, max_bytes: int = SERVER_LOG_MAX_BYTES) -> None:
    """Keep a log's first quarter and its end, within ``max_bytes``: a server that logged a line a request
    would fill the results."""
    try:
        size = log.stat().st_size
    except FileNotFoundError:
        return
    if size <= max_bytes:
        return
    with log.open("rb") as f:
        head = f.read(max_bytes // 4)
        f.seek(size - (max_bytes - len(head)))
        tail = f.read()
    log.write_bytes(head + f"\n[... {size - len(head) - len(tail)} bytes cut ...]\n".encode() + tail)


def _counts(text: str) -> list[int]:
    counts = [int(part) for part in text.split(",")]
    if any(n < 0 for n in counts):
        raise argparse.ArgumentTypeError("front-end counts are >= 0")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a .nemo file or a built-in architecture's name")
    parser.add_argument("--audio-dir", type=Path, help="16 kHz mono WAV/FLAC files (default: synthetic speech)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--attention-kernel", default="auto", choices=ATTENTION_KERNEL_OPTIONS)
    parser.add_argument("--frontends", type=_counts, default=[0], metavar="N[,N...]",
                        help="serve HTTP from this many front-end processes (`batchasr serve --frontends`); "
                             "several: one server after another on the same audio (default: 0)")
    parser.add_argument("--jobs", action="store_true",
                        help="also time a bulk job through Redis, right after saturation (no half-load run)")
    parser.add_argument("--out", type=Path, help="also write the JSON report here, and the servers' logs beside it")
    parser.add_argument("--offline-baselines", nargs="+", choices=OFFLINE_BASELINES, default=list(OFFLINE_BASELINES),
                        help="the offline runs to measure (default: both)")
    parser.add_argument("--cache-dir", type=Path,
                        help="keep the random-weight checkpoint and the offline baseline here for a later run")
    add_budget_option(parser)
    args = parser.parse_args()
    budget = Budget.from_launch(args.budget_s)
    raise_open_files_limit()  # a socket per request in flight
    try:
        clips = file_clips(args.audio_dir, args.requests) if args.audio_dir else synthetic_clips(args.requests)
    except ValueError as exc:
        parser.error(str(exc))
    if args.cache_dir:
        args.cache_dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp())
    model = args.model
    report: dict = {"model": model, "attention_kernel": args.attention_kernel, "requests": len(clips),
                    "concurrency": args.concurrency, "batch_size": args.batch_size,
                    "audio_s": round(sum(c.duration_s for c in clips), 2), "servers": []}
    redis = None
    try:
        if model in ARCHITECTURES:
            device = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
            path, report["blank_shift"] = random_checkpoint(args.model, clips, device, args.cache_dir, workdir)
            model = str(path)
        report["offline"] = offline_baseline(model, clips, args)
        write_report(report, args.out)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the server is another process on the same GPU
        redis_url = None
        if args.jobs:
            redis_port = free_port()
            redis = subprocess.Popen([shutil.which("redis-server"), "--port", str(redis_port), "--save", "",
                                      "--dir", str(workdir)], stdout=subprocess.DEVNULL)
            redis_url = f"redis://127.0.0.1:{redis_port}/0"
            time.sleep(0.5)
        gpu = torch.cuda.get_device_name() if report["offline"]["device"].startswith("cuda") else None
        report["machine"] = f"{os.cpu_count()} CPU cores, " + (gpu or "no GPU")
        for frontends in args.frontends:
            run = {"frontends": frontends}
            report["servers"].append(run)
            if budget.spent:
                run["not_measured"] = "budget spent"
            else:
                try:
                    server_run(run, model, clips, report["offline"], redis_url, args, budget,
                               partial(write_report, report, args.out))
                except Exception as exc:  # a server that would not start or failed: the next layout still runs
                    traceback.print_exc()
                    run["error"] = f"{type(exc).__name__}: {exc}"[:400]
            write_report(report, args.out)
    except KeyboardInterrupt:  # the stage's time ran out (SIGINT): what was measured stays in the report
        report["stopped"] = "interrupted (the stage's time ran out)"
        write_report(report, args.out)
        sys.exit(130)
    except Exception as exc:  # before any server (the checkpoint, the offline baseline): the report says why
        report["error"] = f"{type(exc).__name__}: {exc}"[:400]
        write_report(report, args.out)
        raise
    finally:
        if redis is not None:
            redis.terminate()
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(report, indent=2))


def write_report(report: dict, out: Path | None) -> None:
    if out:
        _write_whole(out, json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
