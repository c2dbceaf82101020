"""The server's peak memory while many long uploads arrive at once: `batchasr serve` in a process of its own,
`--clients` uploads of `--minutes` of 48 kHz stereo WAV sent together, then the process's peak resident set
(VmHWM) read from /proc. Run it with different BATCHASR_MAX_INTAKE_BYTES to see what the intake budget holds.

    python loadtest/intake_memory.py --clients 24 --minutes 4 --intake-mib 256
    python loadtest/intake_memory.py --clients 24 --minutes 4 --intake-mib 65536
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import soundfile as sf

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.servers import free_port, wait_ready  # noqa: E402


def long_wav(minutes: float, rate: int = 48000) -> bytes:
    t = np.arange(int(minutes * 60 * rate)) / rate
    tone = (0.2 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    buffer = io.BytesIO()
    sf.write(buffer, np.stack([tone, tone], axis=1), rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


async def send_all(url: str, data: bytes, clients: int) -> list[int]:
    async with httpx.AsyncClient(timeout=1800) as client:
        async def one() -> int:
            response = await client.post(f"{url}/v1/transcribe", content=data, headers={"content-type": "audio/wav"})
            return response.status_code
        return await asyncio.gather(*(one() for _ in range(clients)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=24)
    parser.add_argument("--minutes", type=float, default=4.0)
    parser.add_argument("--intake-mib", type=int, default=2048)
    parser.add_argument("--model", default=None, help="a .nemo (default: the embedded model)")
    args = parser.parse_args()
    data = long_wav(args.minutes)
    port = free_port()
    env = {**os.environ, "BATCHASR_MAX_INTAKE_BYTES": str(args.intake_mib * 2**20), "BATCHASR_PORT": str(port),
           "BATCHASR_MAX_DURATION_S": "36000"}
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
        idle = peak_rss_mib(server.pid)
        started = time.perf_counter()
        codes = asyncio.run(send_all(url, data, args.clients))
        wall_s = time.perf_counter() - started
        print(f"{args.clients} uploads of {len(data) / 2**20:.0f} MiB ({args.minutes:g} min 48 kHz stereo), intake "
              f"budget {args.intake_mib} MiB: peak RSS {peak_rss_mib(server.pid):.0f} MiB (ready: {idle:.0f} MiB), "
              f"{wall_s:.1f} s, statuses {sorted(set(codes))}")
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
