"""A Redis that refuses writes for a while: a replica (a failover in progress, or a URL that names a replica), or a
primary without the replicas ``min-replicas-to-write`` asks for (cut off from them by a failover). Its refusals are
an outage, as Redis unreachable is: 503 with Retry-After, nothing of a job half written, consumers
waiting it out; once the address takes writes again (promoted, or a failover moved it to the new primary), all goes
on."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from models import load_model
from service.config import Settings
from service.job_types import ANONYMOUS, ItemInput
from service.jobs import JobStore
from service.redis_outages import REDIS_ERRORS
from tests.redis_server import RedisServer, primary_and_replica
from tests.servers import run_server, wait_job


@dataclass
class RefusingWrites:
    server: RedisServer
    says: str  # what the 503 calls it
    take_writes: Callable[[], object]  # what makes it take them again


@pytest.fixture
def replica(tmp_path):
    """A private redis-server replicating another (promoted with ``REPLICAOF NO ONE``)."""
    with primary_and_replica(tmp_path) as (_, server):
        yield server


@pytest.fixture(params=["replica", "no_replicas"])
def refusing(request, tmp_path):
    """A Redis that refuses writes: a replica of a primary (both private redis-servers; promoted with ``REPLICAOF NO
    ONE``), or a primary told to write only with a replica in sync, and without one (``min-replicas-to-write``, which
    keeps a primary cut off by a failover from taking writes the failover drops)."""
    if request.param == "no_replicas":
        server = RedisServer(tmp_path).start()
        server.client().config_set("min-replicas-to-write", 1)
        yield RefusingWrites(server, "without the replicas it writes to",
                             lambda: server.client().config_set("min-replicas-to-write", 0))
        server.stop()
        return
    server = request.getfixturevalue("replica")
    yield RefusingWrites(server, "read-only", lambda: server.client().replicaof("no", "one"))


@pytest.mark.parametrize("limit", [None, 100])  # with a queued-items limit, the reservation is refused first
def test_a_redis_refusing_writes_refuses_a_submission_as_an_outage(refusing, parity_audio, limit):
    async def scenario() -> None:
        store = JobStore.from_url(refusing.server.url, max_queued_items=limit)
        try:
            for items in ([ItemInput(audio="a.wav", upload=Path(parity_audio[0]).read_bytes())],
                          [ItemInput(audio="big.wav", upload=bytes(6 << 20))],  # written in pieces
                          [ItemInput(audio="a.wav", url="https://media.example/a.wav")]):
                with pytest.raises(REDIS_ERRORS):
                    await store.submit(items, idempotency_key="k")
            assert refusing.server.client().keys("batchasr:*") == []  # nothing of them written
            assert await store.queued_items(ANONYMOUS) == 0  # what only reads goes on (GET /v1/jobs counts them)
        finally:
            await store.close()

    asyncio.run(scenario())


def test_http_answers_503_while_redis_refuses_writes_and_goes_on_once_it_takes_them(refusing, parity_dir,
                                                                                     parity_audio):
    model = load_model(parity_dir / "tdt.nemo", device="cpu", dtype="float32")
    files = [("files", (Path(p).name, Path(p).read_bytes(), "audio/wav")) for p in parity_audio[:3]]
    with run_server(Settings(redis_url=refusing.server.url, max_wait_ms=20), model) as running:
        refused = httpx.post(f"{running.url}/v1/jobs", files=files, headers={"Idempotency-Key": "n-1"}, timeout=60)
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "redis_unavailable" and refusing.says in error["message"]
        assert refused.headers["retry-after"]
        assert httpx.get(f"{running.url}/healthz").status_code == 200
        refusing.take_writes()  # promoted, or a replica back: the same address takes writes now
        accepted = httpx.post(f"{running.url}/v1/jobs", files=files, headers={"Idempotency-Key": "n-1"}, timeout=60)
        assert accepted.status_code == 202, accepted.text
        # the server's own consumer met the refusals too (XREADGROUP writes), and waited them out
        job = wait_job(running.url, accepted.json()["id"], timeout_s=90)
        assert job["status"] == "completed" and job["counts"]["completed"] == 3
        assert httpx.delete(f"{running.url}/v1/jobs/{job['id']}").status_code == 200


class Endpoint:
    """One address for a Redis that a failover moves, as a managed service's primary endpoint (a DNS name) or a
    Kubernetes Service does: a TCP proxy whose new connections go to ``target``; those open stay where they went."""

    def __init__(self, target: int):
        self.target = target
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._pipe_to_target, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/0"

    async def _pipe_to_target(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target)

        async def copy(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(1 << 16):
                    sink.write(data)
                    await sink.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                sink.close()

        await asyncio.gather(copy(reader, upstream_writer), copy(upstream_reader, writer))

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()


def test_after_a_failover_behind_one_address_the_store_reaches_the_new_primary(tmp_path):
    """A failover behind one address demotes the old primary to a replica, which keeps its clients' connections:
    each pooled connection then met READONLY on every command for as long as it lived (redis-py keeps a connection
    through an error reply). A connection that meets READONLY now closes, and the next one made reaches the new
    primary."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    old, new = RedisServer(tmp_path / "a").start(), RedisServer(tmp_path / "b").start()
    new.client().replicaof("127.0.0.1", old.port)

    async def scenario() -> None:
        endpoint = Endpoint(old.port)
        store = JobStore.from_url(await endpoint.start())
        try:
            first, _ = await store.submit([ItemInput(audio="a.wav", url="https://media.example/a.wav")])
            assert old.client().wait(1, 5000) == 1  # the replica has the job
            new.client().replicaof("no", "one")  # the failover: promoted, and the old primary demoted under it
            old.client().replicaof("127.0.0.1", new.port)
            endpoint.target = new.port
            outcomes = []
            for _ in range(5):
                try:
                    await store.submit([ItemInput(audio="b.wav", url="https://media.example/b.wav")])
                    outcomes.append("queued")
                except REDIS_ERRORS as exc:
                    outcomes.append(type(exc).__name__)
            # the one pooled connection (submissions one at a time) refused once, and closed
            assert outcomes == ["ReadOnlyError"] + ["queued"] * 4, outcomes
            assert (await store.get(first.id)).total_items == 1
            assert new.client().hlen(f"batchasr:job:{first.id}") > 0
        finally:
            await store.close()
            await endpoint.stop()

    try:
        asyncio.run(scenario())
    finally:
        old.stop()
        new.stop()


def test_a_pipeline_sent_to_a_replica_hears_each_refusal_as_read_only(replica):
    """A connection that meets READONLY closes before its next command, not at once: a pipeline still reads its other
    commands' replies. Closed at once, the next reply read failed as "connection closed", and a job refused by a
    replica was answered as Redis unreachable. Values of 1 MiB, so that Redis answers the first before the rest come."""
    async def scenario() -> list[list[str]]:
        store = JobStore.from_url(replica.url)
        try:
            outcomes = []
            for _ in range(5):
                async with store.redis.pipeline(transaction=False) as pipe:
                    pipe.set("a", bytes(1 << 20)).get("b").set("c", bytes(1 << 20))
                    outcomes.append([type(reply).__name__ for reply in await pipe.execute(raise_on_error=False)])
            return outcomes
        finally:
            await store.close()

    assert asyncio.run(scenario()) == [["ReadOnlyError", "NoneType", "ReadOnlyError"]] * 5
