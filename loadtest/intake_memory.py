"""The server's peak memory while many long uploads arrive at once: `batchasr serve` in a process of its own,
`--clients` uploads of `--minutes` of WAV (48 kHz stereo unless `--rate`, `--channels`) sent together, as raw
bodies to /v1/transcribe, as multipart forms to /v1/audio/transcriptions, or as bulk jobs of `--files` uploads
each to /v1/jobs (`--route`), then the process's peak resident set (VmHWM) read from /proc. Run it with different
BATCHASR_MAX_INTAKE_BYTES to see what the intake budget holds, or with one long upload to see what an upload costs
beside its decoded samples.

Jobs need Redis: a private redis-server is started, and the server runs one HTTP front end (`--frontends 1`) so
that what a submission costs (the front end's peak) is measured apart from the engine that transcribes the items.

    python loadtest/intake_memory.py --clients 24 --minutes 4 --intake-mib 256
    python loadtest/intake_memory.py --clients 24 --minutes 4 --intake-mib 65536
    python loadtest/intake_memory.py --clients 1 --minutes 210 --rate 16000 --channels 1 --route multipart
    python loadtest/intake_memory.py --clients 4 --files 8 --minutes 4 --route job [--transcribed]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
import soundfile as sf

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.ports import free_port  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402
from tests.servers import wait_ready  # noqa: E402


def long_wav(minutes: float, rate: int = 48000, channels: int = 2) -> bytes:
    t = np.arange(int(minutes * 60 * rate)) / rate
    tone = (0.2 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    buffer = io.BytesIO()
    sf.write(buffer, np.repeat(tone[:, None], channels, axis=1), rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


async def send_all(url: str, data: bytes, clients: int, route: str = "raw", files: int = 1
                   ) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=1800) as client:
        async def one() -> httpx.Response:
            if route == "job":
                response = await client.post(f"{url}/v1/jobs", files=[("files", (f"long{i}.wav", data, "audio/wav"))
                                                                      for i in range(files)])
            elif route == "multipart":
                response = await client.post(f"{url}/v1/audio/transcriptions",
                                             files={"file": ("long.wav", data, "audio/wav")})
            else:
                response = await client.post(f"{url}/v1/transcribe", content=data,
                                             headers={"content-type": "audio/wav"})
            return response
        return await asyncio.gather(*(one() for _ in range(clients)))


async def wait_for_jobs(url: str, job_ids: list[str]) -> list[str]:
    """Each job's status once all have finished."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        while True:
            jobs = [(await client.get(f"/v1/jobs/{job_id}")).json() for job_id in job_ids]
            if all(job["status"] not in ("queued", "in_progress") for job in jobs):
                return [job["status"] for job in jobs]
            await asyncio.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=24)
    parser.add_argument("--minutes", type=float, default=4.0)
    parser.add_argument("--intake-mib", type=int, default=2048)
    parser.add_argument("--rate", type=int, default=48000, help="the WAV's sample rate")
    parser.add_argument("--channels", type=int, default=2, help="the WAV's channels (mixed down by the server)")
    parser.add_argument("--route", choices=("raw", "multipart", "job"), default="raw",
                        help="a raw body to /v1/transcribe, a multipart form to /v1/audio/transcriptions, or a job")
    parser.add_argument("--files", type=int, default=1, help="uploads in each job (--route job)")
    parser.add_argument("--transcribed", action="store_true",
                        help="jobs: wait until they finish and give the engine process's peak as well (the worker's)")
    parser.add_argument("--model", default=None, help="a .nemo (default: the embedded model)")
    args = parser.parse_args()
    data = long_wav(args.minutes, args.rate, args.channels)
    port = free_port()
    env = {**os.environ, "BATCHASR_MAX_INTAKE_BYTES": str(args.intake_mib * 2**20), "BATCHASR_PORT": str(port),
           "BATCHASR_MAX_DURATION_S": "36000", "BATCHASR_MAX_UPLOAD_BYTES": str(max(len(data), 200 * 2**20)),
           "BATCHASR_REQUEST_TIMEOUT_S": "3600"}
    with contextlib.ExitStack() as stack:
        if args.route == "job":
            redis_dir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            redis = RedisServer(redis_dir).start()
            stack.callback(redis.stop)
            env |= {"BATCHASR_REDIS_URL": redis.url, "BATCHASR_FRONTENDS": "1",
                    "BATCHASR_MAX_JOB_UPLOAD_BYTES": str(max(len(data) * args.files, 2**30))}
        measure(args, data, env, port)


def measure(args: argparse.Namespace, data: bytes, env: dict[str, str], port: int) -> None:
    command = [sys.executable, "-m", "service.cli", "serve", *(["--model", args.model] if args.model else [])]
    log = Path(tempfile.gettempdir()) / f"intake_memory_serve_{port}.log"
    with log.open("wb") as out:
        server = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        if not wait_ready(url, 120, alive=lambda: server.poll() is None):  # not two minutes for one that exited
            why = "did not become ready" if server.poll() is None else f"exited with status {server.returncode}"
            # the ends of its JSON log lines: a traceback's reason is at the end of its line
            tail = "\n".join(line[-300:] for line in log.read_text(errors="replace").splitlines()[-10:])
            raise SystemExit(f"the server {why}; the end of its output ({log}):\n{tail}")
        # jobs: the front end parses and stores each submission (the engine's process transcribes the items)
        measured = max(psutil.Process(server.pid).children(), key=lambda p: p.memory_info().rss) \
            if args.route == "job" else psutil.Process(server.pid)
        idle = peak_rss_mib(measured.pid)
        started = time.perf_counter()
        responses = asyncio.run(send_all(url, data, args.clients, args.route, args.files))
        codes = [response.status_code for response in responses]
        wall_s = time.perf_counter() - started
        what = f"jobs of {args.files} uploads" if args.route == "job" else f"{args.route} uploads"
        whose = "the front end's peak RSS" if args.route == "job" else "peak RSS"
        print(f"{args.clients} {what} of {len(data) / 2**20:.0f} MiB ({args.minutes:g} min "
              f"{args.rate / 1000:g} kHz, {args.channels} channels), intake budget {args.intake_mib} MiB: {whose} "
              f"{peak_rss_mib(measured.pid):.0f} MiB (ready: {idle:.0f} MiB), {wall_s:.1f} s, statuses "
              f"{sorted(set(codes))}")
        if args.route == "job" and args.transcribed and codes == [202] * len(codes):
            started = time.perf_counter()
            statuses = asyncio.run(wait_for_jobs(url, [response.json()["id"] for response in responses]))
            print(f"transcribed: the engine process's peak RSS {peak_rss_mib(server.pid):.0f} MiB, "
                  f"{time.perf_counter() - started:.1f} s, jobs {sorted(set(statuses))}")
    finally:
        if args.route == "job":  # its items are not waited for
            for process in [*psutil.Process(server.pid).children(recursive=True), server]:
                process.kill()
        else:
            server.terminate()
        server.wait(60)

if __name__ == "__main__":
    main()
