"""What a worker's reads cost as API keys add streams: a private redis-server holding, for each of ``--keys`` keys,
a job of ``--items`` URL items at each priority (a stream per key and priority, beside the three shared ones); then
the job store's per-step calls timed, each the mean of ``--repeat`` calls: ``read_items`` of 64 (the streams
listed, their counts, the reads), ``stream_lag`` (the lag metric, once a second), ``trim_acknowledged`` (every
reclaim interval) and ``prune_idle_streams`` (every minute; its look, with every stream in use, prunes none).

    python loadtest/stream_reads.py --keys 0 1 10 100
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from service.job_types import ItemInput, JobOptions, JobPriority  # noqa: E402
from service.jobs import JobStore  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402


async def mean_ms(call: Callable[[], Awaitable[object]], repeat: int) -> float:
    started = time.perf_counter()
    for _ in range(repeat):
        await call()
    return (time.perf_counter() - started) / repeat * 1000


async def one_count(url: str, keys: int, items: int, repeat: int) -> str:
    store = JobStore.from_url(url)
    try:
        await store.redis.flushall()
        job = [ItemInput(audio=f"{i}.wav", url=f"https://media.example/{i}.wav") for i in range(items)]
        for key in range(keys):
            for priority in JobPriority:
                await store.submit(job, options=JobOptions(owner=f"{key:024x}", priority=priority))
        read = await mean_ms(lambda: store.read_items("bench", 64, block_ms=0), repeat)
        lag = await mean_ms(store.stream_lag, repeat)
        trim = await mean_ms(store.trim_acknowledged, repeat)
        prune = await mean_ms(store.prune_idle_streams, repeat)
    finally:
        await store.close()
    return f"| {keys} | {3 + 3 * keys} | {read:.2f} ms | {lag:.2f} ms | {trim:.2f} ms | {prune:.2f} ms |"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, nargs="+", default=[0, 1, 10, 100])
    parser.add_argument("--items", type=int, default=200, help="items per job (each key has three jobs)")
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args(argv)
    print("| keys | item streams | read_items(64) | stream_lag | trim_acknowledged | prune_idle_streams |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as directory:
        redis_server = RedisServer(Path(directory)).start()
        try:
            for keys in args.keys:
                print(asyncio.run(one_count(redis_server.url, keys, args.items, args.repeat)), flush=True)
        finally:
            redis_server.stop()


if __name__ == "__main__":
    main()
