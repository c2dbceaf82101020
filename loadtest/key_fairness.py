"""How long one API key's requests wait while another key floods the server: `batchasr serve` (a subprocess, the
embedded model unless ``--model``) with two API keys; ``--flood`` clients of the flooding key send long requests
(the test clips joined, about ``--flood-s`` seconds each) back to back; meanwhile one client sends ``--light``
short requests one after another, timing each. Run twice: the light client with a key of its own (its requests
take turns with the flood's in the batcher), then with the flooding key (first come, first served behind it).

    python loadtest/key_fairness.py [--model M] [--flood 64] [--flood-s 20] [--light 20] [--batch-size 8]

Prints, for each run: the light requests' latency (median, 90th percentile) and the flood's audio seconds per
wall second over the same time.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadtest.http_bench import client_session, free_port, start_server
from models.asr_model import DEFAULT_MODEL

AUDIO = Path(__file__).resolve().parent.parent / "tests" / "data" / "default_model"
KEYS = ("flood-key", "light-key")


def clips(flood_s: float) -> tuple[bytes, float, bytes]:
    """A long request (the clips joined, again while under ``flood_s``), its seconds, and one short clip."""
    waves = [sf.read(path, dtype="float32")[0] for path in sorted(AUDIO.glob("*.wav"))]
    joined: list[np.ndarray] = []
    while sum(map(len, joined)) < flood_s * 16000:
        joined.append(waves[len(joined) % len(waves)])
    long_wave = np.concatenate(joined)
    return _wav(long_wave), len(long_wave) / 16000, _wav(min(waves, key=len))


def _wav(wave: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, wave, 16000, subtype="PCM_16", format="WAV")
    return buffer.getvalue()


async def post(http, url: str, key: str, body: bytes) -> float:
    started = time.perf_counter()
    async with http.post(f"{url}/v1/transcribe", data=body,
                         headers={"content-type": "audio/wav", "Authorization": f"Bearer {key}"}) as response:
        response.raise_for_status()
        await response.read()
    return time.perf_counter() - started


async def one_run(url: str, args: argparse.Namespace, light_key: str) -> dict[str, float]:
    long_body, long_s, short_body = clips(args.flood_s)
    done = asyncio.Event()
    flooded = [0]

    async def flood(http) -> None:
        while not done.is_set():
            await post(http, url, KEYS[0], long_body)
            flooded[0] += 1

    async with client_session() as http:
        flooding = [asyncio.create_task(flood(http)) for _ in range(args.flood)]
        await asyncio.sleep(args.warm_s)  # the flood's requests fill the queue first
        started, before = time.perf_counter(), flooded[0]
        latencies = [await post(http, url, light_key, short_body) for _ in range(args.light)]
        wall = time.perf_counter() - started
        done.set()
        await asyncio.gather(*flooding)
    return {"median_s": statistics.median(latencies), "p90_s": statistics.quantiles(latencies, n=10)[8],
            "flood_audio_s_per_s": (flooded[0] - before) * long_s / wall}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--flood", type=int, default=64, help="clients of the flooding key")
    parser.add_argument("--flood-s", type=float, default=20.0, help="seconds of audio in each flood request")
    parser.add_argument("--light", type=int, default=20, help="requests the other client times")
    parser.add_argument("--warm-s", type=float, default=5.0, help="how long the flood runs before the timing")
    parser.add_argument("--batch-size", type=int, default=8, help="the server's: well below --flood, so that "
                        "the flood's requests queue")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--attention-kernel", default="auto")
    args = parser.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as directory:
        server = start_server(args.model, port, None, 0, 50 * 1024 * 1024, args, Path(directory) / "serve.log",
                              {"BATCHASR_API_KEYS": ",".join(KEYS)})
        try:
            for label, key in (("a key of its own", KEYS[1]), ("the flooding key", KEYS[0])):
                result = asyncio.run(one_run(url, args, key))
                print(f"light requests under {label}: median {result['median_s']:.2f} s, 90th percentile "
                      f"{result['p90_s']:.2f} s; the flood meanwhile {result['flood_audio_s_per_s']:.1f} audio s/s",
                      flush=True)
        finally:
            server.terminate()
            server.wait(60)


if __name__ == "__main__":
    main()
