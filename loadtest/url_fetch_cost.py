"""What fetching a job's audio by URL costs a job consumer's event loop: CPU per fetch, for the consumer's
fetcher (aiohttp) and for httpx doing the same GETs, from a local HTTP server in a thread of this process.

    python loadtest/url_fetch_cost.py [--audio-dir DIR] [--fetches 1000] [--concurrency 32]

The event loop's CPU is its thread's (``time.thread_time``), so the server's threads do not count. Prints one
JSON object per client.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import io
import json
import threading
import time
from collections.abc import Awaitable, Callable
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from service.url_inputs import UrlFetcher

REPO = Path(__file__).resolve().parent.parent


class _QuietHandler(SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as object stores and CDNs answer

    def log_message(self, *args: object) -> None:
        pass


async def _measure(fetch: Callable[[str], Awaitable[int]], urls: list[str], concurrency: int) -> dict:
    """``fetch`` gets a URL's body and gives its size."""
    gate = asyncio.Semaphore(concurrency)

    async def one(url: str) -> int:
        async with gate:
            return await fetch(url)

    await asyncio.gather(*(one(url) for url in urls[:50]))  # connections open, code warm
    cpu, wall = time.thread_time(), time.perf_counter()
    sizes = await asyncio.gather(*(one(url) for url in urls))
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    return {"fetches": len(urls), "mean_kb": round(sum(sizes) / len(sizes) / 1e3, 1),
            "loop_cpu_ms_per_fetch": round(cpu / len(urls) * 1e3, 3), "wall_s": round(wall, 3)}


async def _run(base: str, urls: list[str], concurrency: int) -> None:
    fetcher = UrlFetcher([base], max_bytes=1 << 30)

    async def fetched(url: str) -> int:
        with await fetcher.fetch(url) as body:  # its temporary file
            return body.seek(0, io.SEEK_END)

    try:
        print(json.dumps({"client": "UrlFetcher (aiohttp)", **await _measure(fetched, urls, concurrency)}))
    finally:
        await fetcher.close()
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64, max_keepalive_connections=64)) as client:
        async def get(url: str) -> int:
            response = await client.get(url)
            response.raise_for_status()
            return len(response.content)

        print(json.dumps({"client": "httpx", **await _measure(get, urls, concurrency)}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--audio-dir", type=Path, default=REPO.parent / "shared" / "fixtures" / "nemo-parity" / "audio")
    parser.add_argument("--fetches", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args(argv)
    names = sorted(p.name for p in args.audio_dir.iterdir() if p.is_file()) if args.audio_dir.is_dir() else []
    if not names:
        parser.error(f"--audio-dir {args.audio_dir}: no files to serve")
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(args.audio_dir)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        asyncio.run(_run(base, [base + names[i % len(names)] for i in range(args.fetches)], args.concurrency))
    finally:
        server.shutdown()
        server.server_close()


if __name__ == "__main__":
    main()
