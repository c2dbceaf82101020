"""How long an urgent job waits behind a backlog: a `batchasr worker` (a process of its own, on a private Redis)
works through a backfill of ``--backlog`` items; a few seconds in, a small job is submitted: once at the
backfill's own priority (what every job got before priorities), once at high priority, and once at the backfill's
priority but by another API key (owner) than the backfill's.

    python loadtest/priority_latency.py [--model M] [--backlog 2000] [--urgent 8] [--delay-s 3]

Prints, for each run: the small job's time from submission to completion, and the backfill's total time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from service.http import owner_of
from service.job_types import ItemInput, JobOptions, JobPriority
from service.jobs import JobStore
from tests.redis_server import RedisServer

AUDIO = Path(__file__).resolve().parent.parent / "tests" / "data" / "default_model"


def uploads(n: int) -> list[ItemInput]:
    clips = sorted(AUDIO.glob("*.wav"))
    return [ItemInput(audio=clips[i % len(clips)].name, upload=clips[i % len(clips)].read_bytes()) for i in range(n)]


def check_running(worker: subprocess.Popen, log: Path) -> None:
    """Raises, with the end of its output, once the worker has exited: its jobs would never finish."""
    if worker.poll() is not None:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"the worker exited with status {worker.returncode}; the end of its output:\n{tail}")


async def wait_done(store: JobStore, job_id: str, worker: subprocess.Popen, log: Path) -> float:
    while not (job := await store.get(job_id)).finished:
        check_running(worker, log)
        await asyncio.sleep(0.05)
    return job.finished_at


# each run: (what it is, the backfill's job options, the urgent job's)
RUNS = (
    ("urgent job at the backlog's priority (normal)", JobOptions(), JobOptions()),
    ("urgent job at high priority, backlog low", JobOptions(priority=JobPriority.LOW),
     JobOptions(priority=JobPriority.HIGH)),
    ("urgent job of another API key, both normal", JobOptions(owner=owner_of("backfill-key")),
     JobOptions(owner=owner_of("urgent-key"))),
)


async def one_run(redis_url: str, args: argparse.Namespace, backfill_options: JobOptions,
                  urgent_options: JobOptions, log: Path) -> dict[str, float]:
    store = JobStore.from_url(redis_url)
    backfill, _ = await store.submit(uploads(args.backlog), options=backfill_options)
    model = ["--model", args.model] if args.model else []
    with log.open("wb") as out:
        worker = subprocess.Popen([sys.executable, "-m", "service.cli", "worker", *model, "--redis-url", redis_url,
                                   "--name", "w"], stdout=out, stderr=subprocess.STDOUT,
                                  env={**os.environ, "BATCHASR_MAX_WAIT_MS": "20"})
    try:
        while (await store.get(backfill.id)).counts["completed"] == 0:  # the worker is up and working
            check_running(worker, log)
            await asyncio.sleep(0.1)
        await asyncio.sleep(args.delay_s)
        submitted = time.time()
        urgent, _ = await store.submit(uploads(args.urgent), options=urgent_options)
        urgent_done = await wait_done(store, urgent.id, worker, log)
        backfill_done = await wait_done(store, backfill.id, worker, log)
        started = (await store.get(backfill.id)).started_at
        return {"urgent_s": urgent_done - submitted, "backfill_s": backfill_done - started}
    finally:
        worker.terminate()
        worker.wait(60)
        await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a .nemo file (default: the embedded model)")
    parser.add_argument("--backlog", type=int, default=2000)
    parser.add_argument("--urgent", type=int, default=8)
    parser.add_argument("--delay-s", type=float, default=3.0)
    args = parser.parse_args()
    for label, backfill_options, urgent_options in RUNS:
        with tempfile.TemporaryDirectory() as directory:
            redis_server = RedisServer(Path(directory)).start()
            try:
                result = asyncio.run(one_run(redis_server.url, args, backfill_options, urgent_options,
                                             Path(directory) / "worker.log"))
            except RuntimeError as exc:
                raise SystemExit(f"priority_latency: {exc}") from exc
            finally:
                redis_server.stop()
        print(f"{label}: {args.urgent} items done {result['urgent_s']:.2f} s after submission; the backlog of "
              f"{args.backlog} took {result['backfill_s']:.1f} s", flush=True)


if __name__ == "__main__":
    main()
