"""A Redis that refuses writes for a while: a replica (a failover in progress, or a URL that names a replica). Its
refusals are an outage, as Redis unreachable is: 503 with Retry-After, nothing of a job half written, consumers
waiting it out; once the address takes writes again (promoted), all goes on."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from models import load_model
from service.config import Settings
from service.job_types import ItemInput
from service.jobs import JobStore
from service.redis_outages import REDIS_ERRORS
from tests.redis_server import RedisServer
from tests.servers import run_server, wait_job


@pytest.fixture
def replica(tmp_path):
    """A replica of a primary (both private redis-servers); promote it with ``REPLICAOF NO ONE``."""
    (tmp_path / "primary").mkdir()
    (tmp_path / "replica").mkdir()
    primary = RedisServer(tmp_path / "primary").start()
    server = RedisServer(tmp_path / "replica").start()
    server.client().replicaof("127.0.0.1", primary.port)
    deadline = time.monotonic() + 10
    while server.client().info("replication").get("master_link_status") != "up":
        assert time.monotonic() < deadline, "the replica did not sync"
        time.sleep(0.05)
    yield server
    server.stop()
    primary.stop()


def test_a_read_only_redis_refuses_a_submission_as_an_outage(replica, parity_audio):
    async def scenario() -> None:
        store = JobStore.from_url(replica.url)
        try:
            for items in ([ItemInput(audio="a.wav", upload=Path(parity_audio[0]).read_bytes())],
                          [ItemInput(audio="big.wav", upload=bytes(6 << 20))],  # written in pieces
                          [ItemInput(audio="a.wav", url="https://media.example/a.wav")]):
                with pytest.raises(REDIS_ERRORS):
                    await store.submit(items, idempotency_key="k")
        finally:
            await store.close()

    asyncio.run(scenario())


def test_http_answers_503_while_redis_is_read_only_and_goes_on_once_it_takes_writes(replica, parity_dir,
                                                                                    parity_audio):
    model = load_model(parity_dir / "tdt.nemo", device="cpu", dtype="float32")
    files = [("files", (Path(p).name, Path(p).read_bytes(), "audio/wav")) for p in parity_audio[:3]]
    with run_server(Settings(redis_url=replica.url, max_wait_ms=20), model) as running:
        refused = httpx.post(f"{running.url}/v1/jobs", files=files, headers={"Idempotency-Key": "n-1"}, timeout=60)
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "redis_unavailable" and "read-only" in error["message"]
        assert refused.headers["retry-after"]
        assert httpx.get(f"{running.url}/healthz").status_code == 200
        replica.client().replicaof("no", "one")  # promoted: the same address takes writes now
        accepted = httpx.post(f"{running.url}/v1/jobs", files=files, headers={"Idempotency-Key": "n-1"}, timeout=60)
        assert accepted.status_code == 202, accepted.text
        # the server's own consumer met the refusals too (XREADGROUP writes), and waited them out
        job = wait_job(running.url, accepted.json()["id"], timeout_s=90)
        assert job["status"] == "completed" and job["counts"]["completed"] == 3
        assert httpx.delete(f"{running.url}/v1/jobs/{job['id']}").status_code == 200
