"""How long a large job takes to be queued under a queued-items limit (JOB_MAX_QUEUED_ITEMS) while the same key
keeps submitting small jobs: a private redis-server, the store in this process, URL items (nothing uploaded). A
limit enforced by watching the key's streams aborted the large job's transaction at each small job's items (and at
each trim), and the large one, seconds to send, was never queued; a reservation counts it once.

    python loadtest/quota_contention.py
    python loadtest/quota_contention.py --items 100000 --every-ms 100 --timeout-s 60
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from service.job_types import ItemInput, JobOptions  # noqa: E402
from service.jobs import JobStore  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402


async def contend(url: str, items: int, every_ms: int, timeout_s: float) -> None:
    store = JobStore.from_url(url, max_queued_items=10 * items)
    large = [ItemInput(audio=f"{i}.wav", url=f"https://media.example/{i}.wav") for i in range(items)]
    options = JobOptions(owner="one-key")
    done = asyncio.Event()
    small_jobs = 0

    async def small_ones() -> None:
        nonlocal small_jobs
        while not done.is_set():
            await store.submit(large[:1], options=options)
            small_jobs += 1
            await asyncio.sleep(every_ms / 1000)

    beside = asyncio.create_task(small_ones())
    started = time.perf_counter()
    try:
        await asyncio.wait_for(store.submit(large, options=options), timeout_s)
        print(f"a job of {items} items queued in {time.perf_counter() - started:.1f} s; "
              f"{small_jobs} one-item jobs of the same key meanwhile")
    except TimeoutError:
        print(f"a job of {items} items not queued in {timeout_s:.0f} s; {small_jobs} one-item jobs of the same key "
              "meanwhile")
    finally:
        done.set()
        await beside
        await store.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=100_000, help="the large job's items")
    parser.add_argument("--every-ms", type=int, default=100, help="a one-item job of the same key this often")
    parser.add_argument("--timeout-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as directory:
        redis = RedisServer(Path(directory)).start()
        try:
            asyncio.run(contend(redis.url, args.items, args.every_ms, args.timeout_s))
        finally:
            redis.stop()


if __name__ == "__main__":
    main()
