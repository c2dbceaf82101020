"""How long the items of a killed worker wait: two `batchasr worker` processes on a private Redis transcribe one job;
one is killed (SIGKILL) while it holds items, and the job's completion is timed from the kill. Killed for good, as a
pod rescheduled under a new name is, or started again under its name (--restart), as a container restarted in place.

    python loadtest/worker_loss.py                    # the worker gone: another takes its items
    python loadtest/worker_loss.py --restart          # the worker started again under its name
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from service.job_keys import GROUP, ITEM_STREAM, JOB_KEY  # noqa: E402
from service.jobs import JobStore  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402
from tests.servers import upload_items  # noqa: E402

DEFAULT_AUDIO = REPO / "tests" / "data" / "default_model"


def start_worker(redis_url: str, name: str, model: str | None) -> subprocess.Popen:
    env = {**os.environ, "BATCHASR_MAX_WAIT_MS": "100", "BATCHASR_JOB_PREFETCH": "8"}
    command = [sys.executable, "-m", "service.cli", "worker", "--redis-url", redis_url, "--name", name]
    command += ["--model", model] if model else []
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def measure(server: RedisServer, items: int, audio: list[str], model: str | None, restart: bool,
            timeout_s: float) -> None:
    job, _ = asyncio.run(JobStore.from_url(server.url).submit(upload_items(audio, items)))
    client = server.client()

    def done() -> int:
        return int(client.hget(JOB_KEY.format(job_id=job.id), "n_completed") or 0)

    def held() -> int:
        return len(client.xpending_range(ITEM_STREAM, GROUP, "-", "+", items, consumername="pod-0"))

    workers = [start_worker(server.url, f"pod-{i}", model) for i in range(2)]
    try:
        while not (held() and done()):  # pod-0 under way
            assert all(worker.poll() is None for worker in workers), "a worker exited"
            time.sleep(0.05)
        workers[0].send_signal(signal.SIGKILL)
        killed, holding, completed = time.monotonic(), held(), done()
        if restart:
            workers.append(start_worker(server.url, "pod-0", model))
        taken_s = None
        while client.hget(JOB_KEY.format(job_id=job.id), "status") != b"completed":
            assert time.monotonic() - killed < timeout_s, f"the job was not completed {timeout_s:.0f} s after the kill"
            if taken_s is None and not held():
                taken_s = time.monotonic() - killed
            time.sleep(0.1)
        taken_s = time.monotonic() - killed if taken_s is None else taken_s
        print(f"pod-0 killed holding {holding} items ({completed} of {items} completed); "
              f"{'started again under its name' if restart else 'not started again'}: its items taken back "
              f"{taken_s:.1f} s after the kill, the job completed {time.monotonic() - killed:.1f} s after it")
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=100)
    parser.add_argument("--audio", nargs="+", default=sorted(str(path) for path in DEFAULT_AUDIO.glob("*.wav")))
    parser.add_argument("--model", help="a .nemo file (default: the embedded model)")
    parser.add_argument("--restart", action="store_true", help="start the killed worker again under its name")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        server = RedisServer(Path(directory)).start()
        try:
            measure(server, args.items, args.audio, args.model, args.restart, args.timeout_s)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
