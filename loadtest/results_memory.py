"""What `batchasr submit --wait` holds in memory to write a job's results: a private redis-server, a job of
`--items` path items finished with results of 25 words each, then the results read as one list (as the job store's
`results` gives them) and streamed as `submit --wait` writes them (`service.job_clients`), with each one's peak
traced Python memory; then what a download an outage cut short with 1,000 results to go costs to finish: read from
where it stopped (`start`), or from the start again, skipping what it has (as it was done before `start`);
`--tail` sets how many were still to come.

    python loadtest/results_memory.py --items 20000
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from service.job_clients import RedisClient, results_in_order  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402
from tests.servers import finished_job  # noqa: E402


async def measure(url: str, job_id: str, sources: list[Path], tail: int) -> None:
    client = RedisClient(url)
    try:
        await client.store.get(job_id)  # the connection first: it is not the results'
        tracemalloc.start()
        records = await client.store.results(job_id)
        print(f"{len(records)} results as a list: peak {tracemalloc.get_traced_memory()[1] / 2**20:.0f} MiB")
        del records
        tracemalloc.stop()
        tracemalloc.start()
        count = 0
        async for _ in results_in_order(client, job_id, sources):
            count += 1
        print(f"{count} results streamed: peak {tracemalloc.get_traced_memory()[1] / 2**20:.0f} MiB")
        tracemalloc.stop()
        stopped = max(0, len(sources) - tail)
        for label, start in (("from where it stopped", stopped), ("from the start again, skipping", 0)):
            began = time.perf_counter()
            read = sum([1 async for _ in client.results(job_id, start)])
            print(f"the last {len(sources) - stopped} after an outage, {label}: {read} read, "
                  f"{time.perf_counter() - began:.2f} s")
    finally:
        await client.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=20000)
    parser.add_argument("--tail", type=int, default=1000, help="results still to come when the outage struck")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as directory:
        redis = RedisServer(Path(directory)).start()
        try:
            job_id, sources = finished_job(redis.url, args.items, words_each=25)
            asyncio.run(measure(redis.url, job_id, sources, args.tail))
        finally:
            redis.stop()


if __name__ == "__main__":
    main()
