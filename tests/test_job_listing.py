"""`GET /v1/jobs`: each API key's own jobs, newest first, a page at a time; one key cannot see, read or cancel
another's jobs. Against a real redis-server and a real server."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import httpx
import pytest
import redis

from service.config import Settings
from service.http import owner_of
from service.job_keys import JOB_KEY, OWNER_JOBS_KEY
from service.job_types import ItemInput
from service.jobs import JobStore
from service.jobs_cli import run_list
from tests.servers import finished_job, run_server

KEYS = ("key-of-team-a", "key-of-team-b")


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _submit(url: str, key: str | None, audio: bytes, **headers: str) -> dict:
    response = httpx.post(f"{url}/v1/jobs", files=[("files", ("a.wav", audio, "audio/wav"))],
                          headers={**(_auth(key) if key else {}), **headers}, timeout=60)
    assert response.status_code in (200, 202), response.text
    return response.json()


def _list(url: str, key: str | None, **params) -> httpx.Response:
    return httpx.get(f"{url}/v1/jobs", params=params, headers=_auth(key) if key else {}, timeout=30)


def _wait_finished(url: str, key: str, job_ids: list[str]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if all(httpx.get(f"{url}/v1/jobs/{j}", headers=_auth(key)).json()["finished_at"] for j in job_ids):
            return
        time.sleep(0.1)
    raise AssertionError("the jobs did not finish")


def test_each_key_lists_and_reaches_only_its_own_jobs(redis_server, model, parity_audio):
    audio = Path(parity_audio[0]).read_bytes()
    with run_server(Settings(redis_url=redis_server.url, api_keys=list(KEYS)), model) as running:
        url = running.url
        a_jobs = [_submit(url, KEYS[0], audio)["id"] for _ in range(5)]
        b_job = _submit(url, KEYS[1], audio)["id"]
        listed = _list(url, KEYS[0]).json()
        assert listed["object"] == "list" and listed["has_more"] is False
        assert listed["max_queued_items"] is None and 0 <= listed["queued_items"] <= 5  # no limit; being done
        assert [j["id"] for j in listed["data"]] == a_jobs[::-1]  # newest first
        assert (listed["first_id"], listed["last_id"]) == (a_jobs[-1], a_jobs[0])
        assert [j["id"] for j in _list(url, KEYS[1]).json()["data"]] == [b_job]
        # another key's job is not there for it: not to read, not for its results, not to cancel
        for method, path in (("GET", ""), ("GET", "/results"), ("DELETE", "")):
            response = httpx.request(method, f"{url}/v1/jobs/{a_jobs[0]}{path}", headers=_auth(KEYS[1]))
            assert response.status_code == 404 and response.json()["error"]["code"] == "job_not_found"
        assert httpx.get(f"{url}/v1/jobs/{a_jobs[0]}", headers=_auth(KEYS[0])).status_code == 200
        assert _list(url, None).status_code == 401
        # pages: `after` the last id of one page gives the next
        first = _list(url, KEYS[0], limit=2).json()
        second = _list(url, KEYS[0], limit=2, after=first["last_id"]).json()
        third = _list(url, KEYS[0], limit=2, after=second["last_id"]).json()
        assert first["has_more"] and second["has_more"] and not third["has_more"]
        assert [j["id"] for page in (first, second, third) for j in page["data"]] == a_jobs[::-1]
        # by status, once the worker has done them all
        _wait_finished(url, KEYS[0], a_jobs)
        assert len(_list(url, KEYS[0], status="completed").json()["data"]) == 5
        assert _list(url, KEYS[0], status="queued").json()["data"] == []
        # the command line: a table, or JSON lines, paged through
        command = [sys.executable, "-m", "service.cli", "jobs", "--server", url, "--api-key", KEYS[0]]
        table = subprocess.run([*command, "--limit", "3"], capture_output=True, text=True, timeout=60)
        assert table.returncode == 0, table.stderr
        header, *rows = table.stdout.splitlines()
        assert header.split()[:3] == ["ID", "STATUS", "PRIORITY"]
        assert [row.split()[:4] for row in rows] == [[j, "completed", "normal", "1/1"] for j in a_jobs[:-4:-1]]
        assert header.split()[-1] == "AVG_LOGPROB" and all(float(row.split()[-1]) < 0 for row in rows)
        room = table.stderr.splitlines()[-1]  # under the table: the key's room (its items done: none, or the last)
        assert room.startswith("items queued or in progress: ") and room.endswith(" (no limit)"), table.stderr
        lines = subprocess.run([*command, "--json", "--limit", "150"], capture_output=True, text=True, timeout=60)
        assert [json.loads(line)["id"] for line in lines.stdout.splitlines()] == a_jobs[::-1]
        # one idempotency key, two owners: two jobs
        again_a = _submit(url, KEYS[0], audio, **{"Idempotency-Key": "nightly-batch"})
        again_b = _submit(url, KEYS[1], audio, **{"Idempotency-Key": "nightly-batch"})
        assert again_a["id"] != again_b["id"]
        assert _submit(url, KEYS[1], audio, **{"Idempotency-Key": "nightly-batch"})["id"] == again_b["id"]
        # what the list refuses
        for params, param in (({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"status": "sleeping"}, "status"),
                              ({"after": "job_nothing"}, "after"), ({"after": b_job}, "after")):
            response = _list(url, KEYS[0], **params)
            assert response.status_code == 400, (params, response.text)
            assert param in (response.json()["error"]["param"] or response.json()["error"]["message"])
    # jobs are kept under a hash of the key: Redis never holds a key itself
    client = redis.Redis.from_url(redis_server.url)
    assert client.zcard(OWNER_JOBS_KEY.format(owner=owner_of(KEYS[0]))) == 6
    assert not [k for k in client.keys("*") if any(key.encode() in k for key in KEYS)]
    job = client.hgetall(JOB_KEY.format(job_id=a_jobs[0]))
    assert job[b"owner"] == owner_of(KEYS[0]).encode() and not any(KEYS[0].encode() in v for v in job.values())


def test_without_keys_every_client_is_one_owner_and_expired_jobs_leave_the_list(redis_server, model, parity_audio):
    audio = Path(parity_audio[0]).read_bytes()
    with run_server(Settings(redis_url=redis_server.url), model) as running:
        jobs = [_submit(running.url, None, audio)["id"] for _ in range(3)]
        straight, _ = asyncio.run(JobStore.from_url(redis_server.url).submit([ItemInput(audio="b.wav",
                                                                                        upload=audio)]))
        listed = _list(running.url, None).json()
        assert [j["id"] for j in listed["data"]] == [straight.id, *jobs[::-1]]  # `batchasr submit --redis-url` too
        client = redis.Redis.from_url(redis_server.url)
        client.delete(JOB_KEY.format(job_id=jobs[1]))  # as if it had expired
        assert [j["id"] for j in _list(running.url, None).json()["data"]] == [straight.id, jobs[2], jobs[0]]
        owned = OWNER_JOBS_KEY.format(owner="anonymous")
        assert client.zscore(owned, jobs[1]) is None  # pruned as it was listed
        assert client.ttl(owned) > 0
        command = [sys.executable, "-m", "service.cli", "jobs", "--redis-url", redis_server.url]
        listed = subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=60)
        assert [json.loads(line)["id"] for line in listed.stdout.splitlines()] == [straight.id, jobs[2], jobs[0]]
        cancelled = subprocess.run([*command, "--cancel", jobs[2], "job_gone"], capture_output=True, text=True,
                                   timeout=60)
        assert cancelled.returncode == 2 and "job_gone: no such job" in cancelled.stderr
        assert json.loads(cancelled.stdout)["id"] == jobs[2]  # the first, before the one that is not there


def test_the_table_straight_from_redis_counts_the_items_queued_under_no_limit(redis_server, parity_audio, capsys):
    """Straight to Redis is the operator's way in, which the API's queued-items limit does not govern; the items
    the jobs there have queued still count (no worker here: they stay queued)."""
    audio = Path(parity_audio[0]).read_bytes()

    async def submitted() -> str:
        store = JobStore.from_url(redis_server.url)
        try:
            job, _ = await store.submit([ItemInput(audio=f"{n}.wav", upload=audio) for n in range(3)])
        finally:
            await store.close()
        return job.id

    job_id = asyncio.run(submitted())
    table = io.StringIO()
    assert asyncio.run(run_list(redis_server.url, None, None, 20, None, False, table)) == 0
    assert [row.split()[:4] for row in table.getvalue().splitlines()[1:]] == [[job_id, "queued", "normal", "0/3"]]
    assert capsys.readouterr().err.splitlines()[-1] == "items queued or in progress: 3 (no limit)"


def test_listing_while_redis_is_down_is_a_503(tmp_path, model):
    from tests.redis_server import RedisServer

    server = RedisServer(tmp_path).start()
    with run_server(Settings(redis_url=server.url), model) as running:
        server.stop()
        response = _list(running.url, None)
        assert response.status_code == 503 and response.json()["error"]["code"] == "redis_unavailable"


# --- deleting a job ------------------------------------------------------------------------------------------------


def test_purge_deletes_everything_of_a_job_at_once(redis_server, model, parity_audio):
    """`DELETE /v1/jobs/{id}?purge=true` (a caller's data deleted on request): nothing of the job is left in Redis,
    its idempotency key is free again, and another key cannot purge it."""
    audio = Path(parity_audio[0]).read_bytes()
    client = redis.Redis.from_url(redis_server.url)
    with run_server(Settings(redis_url=redis_server.url, api_keys=list(KEYS)), model) as running:
        url = running.url
        job = _submit(url, KEYS[0], audio, **{"Idempotency-Key": "call-1234"})
        _wait_finished(url, KEYS[0], [job["id"]])
        assert client.keys(f"*{job['id']}*")
        refused = httpx.delete(f"{url}/v1/jobs/{job['id']}", params={"purge": "true"}, headers=_auth(KEYS[1]))
        assert refused.status_code == 404
        deleted = httpx.delete(f"{url}/v1/jobs/{job['id']}", params={"purge": "true"}, headers=_auth(KEYS[0]))
        assert deleted.status_code == 200
        assert deleted.json() == {"id": job["id"], "object": "transcription.job.deleted", "deleted": True}
        assert not client.keys(f"*{job['id']}*")
        assert httpx.get(f"{url}/v1/jobs/{job['id']}", headers=_auth(KEYS[0])).status_code == 404
        assert _list(url, KEYS[0]).json()["data"] == []
        again = _submit(url, KEYS[0], audio, **{"Idempotency-Key": "call-1234"})["id"]
        assert again != job["id"]
        # the command line: another key's job is refused, one's own is purged
        command = [sys.executable, "-m", "service.cli", "jobs", "--server", url]
        refused = subprocess.run([*command, "--api-key", KEYS[1], "--purge", again], capture_output=True, text=True,
                                 timeout=60)
        assert refused.returncode == 2 and f"{again}: no such job" in refused.stderr
        purged = subprocess.run([*command, "--api-key", KEYS[0], "--purge", again], capture_output=True, text=True,
                                timeout=60)
        assert purged.returncode == 0 and json.loads(purged.stdout)["deleted"] is True
        assert not client.keys(f"*{again}*")


def test_an_item_in_progress_when_its_job_is_deleted_leaves_nothing_behind(redis_server):
    store = JobStore.from_url(redis_server.url)
    client = redis.Redis.from_url(redis_server.url)

    async def run() -> tuple[int, str, str]:
        job, _ = await store.submit([ItemInput(audio=f"{i}.wav", upload=b"RIFF") for i in range(3)])
        await store.start_item(job.id, 0)  # a worker has it
        await store.delete(job.id)
        await store.record_error(job.id, 0, "decoder fell over")  # the worker, late
        outcome = await store.finish_item(job.id, 0, "completed", {"text": "hello"}, audio_s=1.0, compute_s=0.1)
        return outcome, (await store.start_item(job.id, 1)).state, job.id

    outcome, later_state, job_id = asyncio.run(run())
    assert outcome == 0 and later_state == "missing"
    assert not client.keys(f"*{job_id}*")


def test_keys_written_after_submission_expire_with_their_job(redis_server):
    """Attempts, errors and results are written as items run; each expires with its job, even a job that never
    finishes."""
    store = JobStore.from_url(redis_server.url, input_ttl_s=600, result_ttl_s=600)
    client = redis.Redis.from_url(redis_server.url)

    async def run() -> str:
        job, _ = await store.submit([ItemInput(audio=f"{i}.wav", upload=b"RIFF") for i in range(2)])
        await store.start_item(job.id, 0)
        await store.record_error(job.id, 0, "a first try failed")
        await store.finish_item(job.id, 0, "failed", {"error": "no"}, error="no")
        return job.id

    job_id = asyncio.run(run())
    for template in ("batchasr:job:{job_id}:attempts", "batchasr:job:{job_id}:errors",
                     "batchasr:job:{job_id}:results"):
        assert 0 < client.ttl(template.format(job_id=job_id)) <= 1200, template


# --- submit --wait: a job's results as they stream in ----------------------------------------------------------


def test_submit_wait_streams_a_jobs_results_rather_than_holding_them(redis_server):
    """A job of 100,000 items was a list of its results in memory before the first line was written: 12 KB each
    as Python objects (1.2 GB)."""
    from service.job_clients import RedisClient, results_in_order

    job_id, sources = finished_job(redis_server.url, 6000, words_each=25)

    async def scenario() -> tuple[int, int]:
        client = RedisClient(redis_server.url)
        await client.store.get(job_id)  # the connection first: it is not the results'
        count = 0
        tracemalloc.start()
        try:
            async for source, record in results_in_order(client, job_id, sources):
                assert record["text"] == f"item {count}" and source == sources[count]
                count += 1
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            await client.close()
        return count, peak

    count, peak = asyncio.run(scenario())
    assert count == 6000 and peak < 25 * 2**20, f"{peak / 2**20:.0f} MiB held for 6,000 results"


def test_submit_wait_resumes_a_jobs_results_after_an_outage_without_repeating_any(tmp_path, capsys):
    from service.job_clients import RedisClient, results_in_order
    from service.jobs import RESULTS_PAGE
    from tests.redis_server import RedisServer

    server = RedisServer(tmp_path, appendonly=True).start()  # the job outlives the restart
    try:
        job_id, sources = finished_job(server.url, RESULTS_PAGE + 500)

        async def scenario() -> list[str]:
            async def start_again_soon() -> None:
                await asyncio.sleep(0.5)
                await asyncio.to_thread(server.start)

            client, texts, restarting = RedisClient(server.url), [], []
            try:
                async for _, record in results_in_order(client, job_id, sources):
                    texts.append(record["text"])
                    if len(texts) == RESULTS_PAGE:  # the first page is in: Redis goes away for a moment
                        await asyncio.to_thread(server.stop)
                        restarting.append(asyncio.create_task(start_again_soon()))
                await restarting[0]
            finally:
                await client.close()
            return texts

        texts = asyncio.run(scenario())
    finally:
        server.stop()
    assert texts == [f"item {i}" for i in range(RESULTS_PAGE + 500)]  # each once, in order
    assert "trying again" in capsys.readouterr().err


def test_submit_wait_says_when_a_jobs_results_do_not_match_its_inputs(redis_server):
    from service.job_clients import RedisClient, results_in_order

    job_id, sources = finished_job(redis_server.url, 5)

    async def read_all(given: list[Path]) -> None:
        client = RedisClient(redis_server.url)
        try:
            async for _ in results_in_order(client, job_id, given):
                pass
        finally:
            await client.close()

    with pytest.raises(ValueError, match=r"more results than its 3 items"):
        asyncio.run(read_all(sources[:3]))
    with pytest.raises(ValueError, match=r"5 results for its 7 items"):
        asyncio.run(read_all([*sources, Path("a.wav"), Path("b.wav")]))


def test_a_job_retried_late_in_its_life_stays_listed_while_it_is_there(redis_server):
    """A retry keeps the job's records a new job's time from then, but its owner's list kept it no longer than from
    its submission: it expired with the list, or a later submission pruned it by its age, and the job, still read
    by its id, was no longer listed. (TTLs of seconds stand in for days.)"""
    from tests.servers import settle_items

    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url, input_ttl_s=1, result_ttl_s=3)  # a job kept 4 s
        try:
            job, _ = await store.submit([ItemInput(audio="a.wav", path="/x/a.wav")])
            await settle_items(store, 1, "failed")
            await asyncio.sleep(2.5)  # late in its life
            assert (await store.retry_failed(job.id)).retried == 1
            await asyncio.sleep(2.0)  # past its first 4 s: the list made at its submission is gone
            assert [j.id for j in (await store.list_jobs("anonymous"))[0]] == [job.id]
            later, _ = await store.submit([ItemInput(audio="b.wav", path="/x/b.wav")])  # prunes the list by age
            assert [j.id for j in (await store.list_jobs("anonymous"))[0]] == [later.id, job.id]
        finally:
            await store.close()

    asyncio.run(scenario())
