"""What ``wait_replicas`` costs a submission when all is well: a private primary and its replica, clients
submitting one-item jobs through `JobStore` back to back for a while, with the Redis URL's ``wait_replicas`` at each
value given; jobs a second and the submit latency's median and 99th percentile.

    python loadtest/replica_wait_cost.py
    python loadtest/replica_wait_cost.py --clients 32 --seconds 10 --wait-replicas 0 1
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from service.job_types import ItemInput  # noqa: E402
from service.jobs import JobStore  # noqa: E402
from tests.redis_server import RedisServer, start_replica  # noqa: E402

ITEM = ItemInput(audio="a.wav", url="https://media.example/a.wav")


async def submit_for(store: JobStore, seconds: float, latencies: list[float]) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.perf_counter()
        await store.submit([ITEM])
        latencies.append(time.perf_counter() - started)


async def measure(url: str, wait_replicas: int, clients: int, seconds: float) -> None:
    store = JobStore.from_url(url + (f"?wait_replicas={wait_replicas}" if wait_replicas else ""))
    latencies: list[float] = []
    try:
        await store.submit([ITEM])  # connected, scripts loaded
        await asyncio.gather(*(submit_for(store, seconds, latencies) for _ in range(clients)))
    finally:
        await store.close()
    p99 = statistics.quantiles(latencies, n=100)[98]
    print(f"wait_replicas={wait_replicas}: {len(latencies) / seconds:.0f} jobs/s, submit "
          f"p50 {statistics.median(latencies) * 1000:.2f} ms, p99 {p99 * 1000:.2f} ms ({clients} clients)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8, help="concurrent submitters")
    parser.add_argument("--seconds", type=float, default=5.0, help="how long each setting is measured")
    parser.add_argument("--wait-replicas", type=int, nargs="+", default=[0, 1])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        (root / "primary").mkdir()
        (root / "replica").mkdir()
        primary = RedisServer(root / "primary").start()
        replica = start_replica(root / "replica", primary)
        try:
            for wait_replicas in args.wait_replicas:
                asyncio.run(measure(primary.url, wait_replicas, args.clients, args.seconds))
        finally:
            replica.stop()
            primary.stop()


if __name__ == "__main__":
    main()
