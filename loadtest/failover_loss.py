"""Jobs accepted and then lost across a Redis Sentinel failover that leaves the old primary up (as a partition does):
a private primary, its replica and one sentinel; clients submitting jobs through the store on a Sentinel URL; a
forced failover mid-run; then every job the store said it queued is looked for on the new primary.

    python loadtest/failover_loss.py                           # the store as it ships
    python loadtest/failover_loss.py --primary-check-s 1e9     # redis-py's pool alone: asks Sentinel only to connect
    python loadtest/failover_loss.py --min-replicas-to-write 1 # servers that refuse writes without a replica in sync
    python loadtest/failover_loss.py --wait-replicas 1         # the store confirms each write with a replica first
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import service.redis_pools as redis_pools  # noqa: E402
from service.job_types import ItemInput  # noqa: E402
from service.jobs import JobStore  # noqa: E402
from service.redis_outages import REDIS_ERRORS, outage  # noqa: E402
from tests.redis_server import RedisSentinel, RedisServer, start_replica  # noqa: E402

ITEM = ItemInput(audio="a.wav", url="https://media.example/a.wav")


async def submit_until(store: JobStore, stop: asyncio.Event, accepted: list[str], refused: Counter) -> None:
    while not stop.is_set():
        try:
            job, _ = await store.submit([ITEM])
            accepted.append(job.id)
        except REDIS_ERRORS as exc:
            refused[outage(exc)] += 1
        await asyncio.sleep(0.01)


async def measure(sentinel: RedisSentinel, old: RedisServer, new: RedisServer, clients: int, after_s: float,
                  wait_replicas: int) -> None:
    store = JobStore.from_url(sentinel.url() + (f"?wait_replicas={wait_replicas}" if wait_replicas else ""))
    accepted: list[str] = []
    refused: Counter = Counter()
    stop = asyncio.Event()
    tasks = [asyncio.create_task(submit_until(store, stop, accepted, refused)) for _ in range(clients)]
    try:
        await asyncio.sleep(2)
        await asyncio.to_thread(sentinel.fail_over, new)
        switched = time.monotonic()
        while old.client().info("replication")["role"] != "slave":
            await asyncio.sleep(0.1)
        demoted_s = time.monotonic() - switched
        await asyncio.sleep(after_s)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        await store.close()
    while old.client().info("replication").get("master_link_status") != "up":  # resynced: its own writes dropped
        await asyncio.sleep(0.1)
    client = new.client()
    lost = sum(not client.exists(f"batchasr:job:{job_id}") for job_id in accepted)
    print(f"primary check every {redis_pools.PRIMARY_CHECK_S:g} s, wait_replicas {wait_replicas}: {len(accepted)} "
          f"jobs accepted, {lost} of them "
          f"lost; refused: {dict(refused) or 'none'}; old primary demoted {demoted_s:.1f} s after Sentinel switched")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8, help="concurrent submitters")
    parser.add_argument("--primary-check-s", type=float, default=redis_pools.PRIMARY_CHECK_S,
                        help="how often the store asks the sentinels which server is primary")
    parser.add_argument("--min-replicas-to-write", type=int, default=0, help="set on both servers")
    parser.add_argument("--wait-replicas", type=int, default=0, help="the Redis URL's wait_replicas")
    parser.add_argument("--after-s", type=float, default=3.0, help="submissions go on this long after the demotion")
    args = parser.parse_args()
    redis_pools.PRIMARY_CHECK_S = args.primary_check_s
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        for name in ("primary", "replica", "sentinel"):
            (root / name).mkdir()
        primary = RedisServer(root / "primary").start()
        replica = start_replica(root / "replica", primary)
        sentinel = RedisSentinel(root / "sentinel", primary, (replica,)).start()
        try:
            for server in (primary, replica):
                server.client().config_set("min-replicas-to-write", args.min_replicas_to_write)
                server.client().config_set("min-replicas-max-lag", 1)
            asyncio.run(measure(sentinel, primary, replica, args.clients, args.after_s, args.wait_replicas))
        finally:
            sentinel.stop()
            replica.stop()
            primary.stop()


if __name__ == "__main__":
    main()
