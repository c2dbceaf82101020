"""How long `JobStore.submit` takes to write a job of uploads into Redis, for jobs of a few shapes (many tiny
files to a few large ones): a private redis-server, the store in this process, the uploads as bytes in memory.

    python loadtest/job_submit_time.py
    python loadtest/job_submit_time.py --shapes 100000x200 20x20000000
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

from service.job_types import ItemInput  # noqa: E402
from service.jobs import JobStore  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

SHAPES = ("100000x200", "5000x50000", "100x2000000", "20x20000000")  # items x bytes each


async def time_submissions(url: str, shapes: list[tuple[int, int]], repeat: int) -> None:
    store = JobStore.from_url(url)
    try:
        for items, size in shapes:
            uploads = [ItemInput(audio=f"{i}.wav", upload=bytes([i % 256]) * size) for i in range(items)]
            times = []
            for _ in range(repeat):
                started = time.perf_counter()
                job, _ = await store.submit(uploads)
                times.append(time.perf_counter() - started)
                await store.delete(job.id)
            print(f"{items} items of {size} bytes ({items * size / 2**20:.0f} MiB): best of {repeat} "
                  f"{min(times):.2f} s, mean {sum(times) / len(times):.2f} s")
    finally:
        await store.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="ITEMSxBYTES each")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes]
    with tempfile.TemporaryDirectory() as directory:
        redis = RedisServer(Path(directory)).start()
        try:
            asyncio.run(time_submissions(redis.url, shapes, args.repeat))
        finally:
            redis.stop()


if __name__ == "__main__":
    main()
