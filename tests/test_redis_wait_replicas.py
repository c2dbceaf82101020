"""``wait_replicas`` in the Redis URL: what the job store acknowledges (a job accepted, cancelled, retried, deleted) a
replica has confirmed first, so a failover to it keeps it; unconfirmed in time, it is refused as an outage (503
with Retry-After) and the client tries again. Against a real primary and its replica, paused (SIGSTOP) to stand
for one cut off or behind."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from models import load_model
from service.cli import main
from service.config import Settings
from service.job_keys import JOB_KEY
from service.job_types import ItemInput
from service.jobs import JobStore
from service.jobs_cli import run_action, run_submit
from service.redis_outages import REDIS_ERRORS, NotReplicatedError, outage
from service.redis_pools import check_url, split_wait_replicas
from tests.redis_server import RedisServer, primary_and_replica
from tests.servers import run_server, wait_job

URL_ITEM = ItemInput(audio="a.wav", url="https://media.example/a.wav")


@dataclass
class Replicated:
    primary: RedisServer
    replica: RedisServer

    @property
    def url(self) -> str:
        return self.primary.url

    def holds(self, job_id: str) -> bool:
        return bool(self.replica.client().exists(JOB_KEY.format(job_id=job_id)))


@pytest.fixture
def replicated(tmp_path):
    """A primary and its replica, in sync."""
    with primary_and_replica(tmp_path) as (primary, replica):
        yield Replicated(primary, replica)


@contextmanager
def paused(server: RedisServer):
    """``server`` stopped in its tracks (it acknowledges nothing), then let go on."""
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


@pytest.mark.parametrize("url, expected", [
    ("redis://h:6379/0", ("redis://h:6379/0", 0)),
    ("redis://h:6379/0?wait_replicas=1", ("redis://h:6379/0", 1)),
    ("unix:///run/redis.sock?db=2&wait_replicas=1", ("unix:///run/redis.sock?db=2", 1)),
    ("unix:///run/redis.sock?wait_replicas=1", ("unix:///run/redis.sock", 1)),
    ("rediss://:pw@h/2?ssl_cert_reqs=none&wait_replicas=2", ("rediss://:pw@h/2?ssl_cert_reqs=none", 2)),
    ("redis+sentinel://s1,s2/jobs?wait_replicas=1&sentinel_password=x%26y",
     ("redis+sentinel://s1,s2/jobs?sentinel_password=x%26y", 1)),
])
def test_wait_replicas_is_taken_from_the_url_and_the_rest_left_to_the_pool(url, expected):
    assert split_wait_replicas(url) == expected
    check_url(url)  # what is left is a URL the pool takes


@pytest.mark.parametrize("value", ["two", "-1", "101", ""])
def test_a_bad_wait_replicas_is_named_before_the_server_starts(value, capsys):
    url = f"redis://127.0.0.1:6379/0?wait_replicas={value}"
    with pytest.raises(ValueError, match="wait_replicas is the number of replicas"):
        Settings(redis_url=url)
    assert main(["worker", "--redis-url", url]) == 2
    assert f"not {value!r}" in capsys.readouterr().err


def test_writes_a_replica_has_not_confirmed_are_refused_as_an_outage_and_go_through_once_it_has(replicated):
    async def scenario() -> None:
        store = JobStore.from_url(replicated.url + "?wait_replicas=1")
        unconfirmed = JobStore.from_url(replicated.url)  # the same servers, without the setting
        too_many = JobStore.from_url(replicated.url + "?wait_replicas=2")
        try:
            job, _ = await store.submit([URL_ITEM])
            assert replicated.holds(job.id)  # there when acknowledged
            with paused(replicated.replica):
                await unconfirmed.submit([URL_ITEM])  # acknowledged, though no replica holds it
                for write in (lambda: store.submit([URL_ITEM], idempotency_key="k"), lambda: store.cancel(job.id),
                              lambda: store.retry_failed(job.id), lambda: store.delete(job.id)):
                    with pytest.raises(NotReplicatedError, match="0 of the 1 replica") as refused:
                        await write()
                    assert isinstance(refused.value, REDIS_ERRORS)
                    assert outage(refused.value) == "without the replicas it writes to"
            again, created = await store.submit([URL_ITEM], idempotency_key="k")  # the retry: the job first written
            assert not created and replicated.holds(again.id)
            with pytest.raises(NotReplicatedError, match="1 of the 2 replica"):  # more than there are
                await too_many.submit([URL_ITEM])
        finally:
            for client in (store, unconfirmed, too_many):
                await client.close()

    asyncio.run(scenario())


def test_the_store_names_replicas_without_wait_replicas_a_risk(replicated):
    async def risks(url: str) -> dict[str, str]:
        store = JobStore.from_url(url)
        try:
            return await store.durability_risks()
        finally:
            await store.close()

    said = asyncio.run(risks(replicated.url))["unconfirmed_replication"]
    assert "1 replica(s)" in said and "Add wait_replicas=1 to the Redis URL" in said
    assert "unconfirmed_replication" not in asyncio.run(risks(replicated.url + "?wait_replicas=1"))
    assert "unconfirmed_replication" not in asyncio.run(risks(replicated.replica.url))  # a replica has none of its own


def test_http_answers_503_while_no_replica_confirms_and_the_retry_takes_the_job_written(replicated, parity_dir,
                                                                                        parity_audio):
    model = load_model(parity_dir / "tdt.nemo", device="cpu", dtype="float32")
    files = [("files", (Path(p).name, Path(p).read_bytes(), "audio/wav")) for p in parity_audio[:2]]
    headers = {"Idempotency-Key": "batch-7"}
    with run_server(Settings(redis_url=replicated.url + "?wait_replicas=1", max_wait_ms=20), model) as running:
        with paused(replicated.replica):
            refused = httpx.post(f"{running.url}/v1/jobs", files=files, headers=headers, timeout=60)
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "redis_unavailable" and "without the replicas it writes to" in error["message"]
        assert refused.headers["retry-after"]
        retried = httpx.post(f"{running.url}/v1/jobs", files=files, headers=headers, timeout=60)
        assert retried.status_code == 200, retried.text  # the job the refused request wrote, not a second one
        job = wait_job(running.url, retried.json()["id"], timeout_s=90)
        assert job["status"] == "completed" and job["counts"]["completed"] == 2, job
        assert httpx.get(f"{running.url}/v1/jobs").json()["data"] == [job]


@pytest.mark.parametrize("through", ["redis", "server"])
def test_submit_rides_out_refusals_under_one_idempotency_key_and_makes_one_job(replicated, parity_dir, parity_audio,
                                                                               capsys, through):
    """`batchasr submit` tries a refused submission again (a 503 from the server, an outage from Redis) under the
    same idempotency key, one of its own where none is given: each refused try here wrote its job before no replica
    confirmed it, and the try that goes through gets that job, not a second one."""
    url = replicated.url + "?wait_replicas=1"

    async def scenario(server_url: str | None) -> tuple[int, str]:
        out = io.StringIO()
        with paused(replicated.replica):
            submitting = asyncio.create_task(run_submit([Path(parity_audio[0])], None if server_url else url,
                                                        server_url, None, False, out))
            await asyncio.sleep(2.5)  # a try a second or so, each refused
            assert not submitting.done()
        return await submitting, out.getvalue()

    if through == "server":
        model = load_model(parity_dir / "tdt.nemo", device="cpu", dtype="float32")
        with run_server(Settings(redis_url=url), model) as running:
            code, out = asyncio.run(scenario(running.url))
    else:
        code, out = asyncio.run(scenario(None))
    err = capsys.readouterr().err
    assert code == 0, err
    assert "warning: submitting: " in err and "trying again" in err
    jobs = [key.decode() for key in replicated.primary.client().keys("batchasr:job:*") if key.count(b":") == 2]
    assert jobs == [JOB_KEY.format(job_id=json.loads(out)["id"])]


@pytest.mark.parametrize("through", ["redis", "server"])
def test_jobs_cancel_and_purge_ride_out_refusals_and_a_purge_a_refused_try_did_is_done(replicated, parity_dir, capsys,
                                                                                      through):
    """`batchasr jobs --cancel`/`--purge` through refusals (a 503 from the server, an outage from Redis): each is
    tried again until a replica confirms it. A refused purge had deleted the job already (Redis refuses only after
    the write, which no replica confirmed), so the try that goes through finds no job: that is the purge done, not
    an error."""
    url = replicated.url + "?wait_replicas=1"

    async def scenario(server_url: str | None) -> list[tuple[int, list[dict]]]:
        store = JobStore.from_url(url)
        jobs = [(await store.submit([URL_ITEM]))[0].id for _ in range(2)]  # no worker of its own: queued
        await store.close()
        answers = []
        for action, job_id in (("cancel", jobs[0]), ("purge", jobs[1])):
            out = io.StringIO()
            with paused(replicated.replica):
                acting = asyncio.create_task(run_action(None if server_url else url, server_url, None, [job_id],
                                                        action, out))
                await asyncio.sleep(2.5)  # a try a second or so, each refused
                assert not acting.done()
            answers.append((await acting, [json.loads(line) for line in out.getvalue().splitlines()]))
        assert replicated.holds(jobs[0]) and not replicated.primary.client().exists(JOB_KEY.format(job_id=jobs[1]))
        return answers

    if through == "server":
        model = load_model(parity_dir / "tdt.nemo", device="cpu", dtype="float32")
        with run_server(Settings(redis_url=url), model) as running:
            (cancel_code, cancelled), (purge_code, purged) = asyncio.run(scenario(running.url))
    else:
        (cancel_code, cancelled), (purge_code, purged) = asyncio.run(scenario(None))
    err = capsys.readouterr().err
    assert (cancel_code, purge_code) == (0, 0), err
    # through the server, its consumer may have failed the item (its URL is nowhere) before the cancel: all one
    ended_first = through == "server" and cancelled[0]["finished_at"] is not None
    assert [job["status"] for job in cancelled] == ["cancelled"] or ended_first
    assert [answer["deleted"] for answer in purged] == [True]
    assert "warning: cancelling job " in err and "warning: purging job " in err and "trying again" in err


def test_a_cancel_and_a_purge_go_through_a_full_redis_confirmed_by_the_replica(replicated, parity_audio):
    """A full Redis is when an operator cancels or purges: both went through (or the purge not at all: its DELs were
    a transaction's, which a full Redis refuses), and then the mark that WAIT confirms was refused for memory: a 500
    for a cancel that was done. Both are now written, and confirmed, there."""
    from redis.exceptions import OutOfMemoryError

    from tests.servers import upload_items

    client = replicated.primary.client()

    async def scenario() -> None:
        store = JobStore.from_url(f"{replicated.url}?wait_replicas=1")
        try:
            kept, _ = await store.submit(upload_items(parity_audio, 3))
            purged, _ = await store.submit(upload_items(parity_audio, 3))
            client.config_set("maxmemory-policy", "noeviction")
            client.config_set("maxmemory", 1)  # full, whatever the replica's buffers (which are not counted) hold
            with pytest.raises(OutOfMemoryError):
                await store.submit([URL_ITEM])
            job, _ = await store.cancel(kept.id)
            assert job.status.value == "cancelled"
            await store.delete(purged.id)
            assert not client.keys(f"*{purged.id}*") and client.keys(f"*{kept.id}*")
            assert not replicated.replica.client().keys(f"*{purged.id}*")
        finally:
            await store.close()

    asyncio.run(scenario())
