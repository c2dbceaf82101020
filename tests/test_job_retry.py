"""Retrying a job's failed items (POST /v1/jobs/{id}/retry, `batchasr jobs --retry`, JobStore.retry_failed): those
of paths and URLs are queued again from a first attempt, and the job goes on to a second end; uploads, whose audio
went with their failure, are left as they were."""

from __future__ import annotations

import asyncio
import io
import json
import shutil

import httpx
import pytest
from redis.exceptions import OutOfMemoryError

from models import load_model
from service.config import Settings
from service.job_keys import ATTEMPTS_KEY, ITEM_STREAM, JOB_KEY, WEBHOOK_STREAM
from service.job_types import ItemInput, JobNotFound, JobOptions, item_record
from service.jobs import JobStore
from service.jobs_cli import run_action
from tests.servers import run_server, wait_job


def test_failed_path_and_url_items_are_queued_again_and_the_job_ends_again(redis_server, capsys):
    client = redis_server.client()
    items = [ItemInput(audio="a.wav", path="/audio/a.wav"), ItemInput(audio="b.wav", url="https://media.example/b"),
             ItemInput(audio="c.wav", upload=b"RIFF not audio"), ItemInput(audio="d.wav", path="/audio/d.wav")]

    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url, result_ttl_s=600, input_ttl_s=3600)
        try:
            job, _ = await store.submit(items, options=JobOptions(webhook_url="https://hooks.example/done"))
            for index in range(4):
                await store.start_item(job.id, index)
            await store.start_item(job.id, 0)  # a second attempt at the first
            for index in range(3):
                await store.finish_item(job.id, index, "failed", item_record(items[index].audio, "failed",
                                                                             error="unreadable"), error="unreadable")
            assert await store.finish_item(job.id, 3, "completed", item_record("d.wav", "completed", text="d")) == 2
            assert client.ttl(JOB_KEY.format(job_id=job.id)) <= 600
            entries_before = client.xlen(ITEM_STREAM)
            hooks_before = client.xlen(WEBHOOK_STREAM)
            await store.record_webhook(job.id, 1, b"0-1", True, 1, None)

            client.config_set("maxmemory", client.info("memory")["used_memory"] - 1024)  # full: refused, untouched
            with pytest.raises(OutOfMemoryError):
                await store.retry_failed(job.id)
            client.config_set("maxmemory", 0)
            assert (await store.get(job.id)).counts["failed"] == 3 and client.xlen(ITEM_STREAM) == entries_before

            retry = await store.retry_failed(job.id)
            assert (retry.retried, retry.unretried, retry.deferred) == (2, 1, 0)  # the upload's audio is gone
            again = retry.job
            assert again.status.value == "in_progress" and again.finished_at is None
            assert again.counts == {"queued": 2, "in_progress": 0, "completed": 1, "failed": 1, "cancelled": 0}
            assert again.webhook_status == "pending" and again.webhook_attempts == 0
            assert client.xlen(ITEM_STREAM) == entries_before + 2
            queued = [(f[b"job"].decode(), int(f[b"index"])) for _, f in client.xrange(ITEM_STREAM)[-2:]]
            assert queued == [(job.id, 0), (job.id, 1)]
            assert client.ttl(JOB_KEY.format(job_id=job.id)) > 3600  # kept as a new job is, until it ends again
            records = await store.results(job.id)
            assert [r["status"] for r in records] == ["queued", "queued", "failed", "completed"]
            assert records[0]["error"] is None and not client.hexists(ATTEMPTS_KEY.format(job_id=job.id), 0)
            assert (await store.retry_failed(job.id)).retried == 0  # nothing more to queue

            for index in range(2):
                start = await store.start_item(job.id, index)
                assert start.state == "in_progress" and start.attempts == 1  # a first attempt again
                await store.finish_item(job.id, index, "completed", item_record(items[index].audio, "completed"))
            ended = await store.get(job.id)
            assert ended.status.value == "completed_with_errors" and ended.counts["completed"] == 3
            assert client.xlen(WEBHOOK_STREAM) == hooks_before + 1  # owed again, for the second end
            with pytest.raises(JobNotFound):
                await store.retry_failed("job_doesnotexist")
            output = io.StringIO()  # `batchasr jobs --redis-url URL --retry ID`: straight in Redis
            assert await run_action(redis_server.url, None, None, [job.id], "retry", output) == 0
            assert json.loads(output.getvalue())["unretried_items"] == 1
            assert "1 failed items not retried: they were uploads" in capsys.readouterr().err  # and what to do
        finally:
            await store.close()

    asyncio.run(scenario())


def test_a_file_fixed_after_its_item_failed_transcribes_on_retry_over_http_and_the_cli(redis_server, parity_dir,
                                                                                         parity_audio, tmp_path):
    model = load_model(parity_dir / "tdt.nemo", device="cpu", dtype="float32")
    roots = tmp_path / "audio"
    roots.mkdir()
    good, broken = roots / "good.wav", roots / "late.wav"
    shutil.copy(parity_audio[0], good)
    broken.write_bytes(b"RIFF....still being copied")
    expected = model.transcribe([parity_audio[0], parity_audio[1]])
    settings = Settings(redis_url=redis_server.url, input_roots=[str(roots)], max_wait_ms=20)
    with run_server(settings, model) as running:
        submitted = httpx.post(f"{running.url}/v1/jobs", json={"items": [{"path": str(good)}, {"path": str(broken)}]},
                               timeout=30)
        assert submitted.status_code == 202, submitted.text
        job = wait_job(running.url, submitted.json()["id"])
        assert job["status"] == "completed_with_errors" and job["counts"]["failed"] == 1

        shutil.copy(parity_audio[1], broken)  # the copy finished: the item can be had now
        retried = httpx.post(f"{running.url}/v1/jobs/{job['id']}/retry", timeout=30)
        assert retried.status_code == 200, retried.text
        body = retried.json()
        assert body["retried_items"] == 1 and body["unretried_items"] == 0 and body["status"] == "in_progress"
        assert body["deferred_items"] == 0  # no queued-items limit set
        job = wait_job(running.url, job["id"])
        assert job["status"] == "completed" and job["counts"] == {"queued": 0, "in_progress": 0, "completed": 2,
                                                                   "failed": 0, "cancelled": 0}
        lines = httpx.get(f"{running.url}/v1/jobs/{job['id']}/results").text.splitlines()
        results = [json.loads(line) for line in lines]
        assert [r["text"] for r in results] == [t.text for t in expected]
        assert running.metric("batchasr_jobs_total", '{status="completed"}') == 1  # its second end, counted

        # the CLI, over the same route: nothing left to retry; and an unknown job is an error
        output = io.StringIO()
        assert asyncio.run(run_action(None, running.url, None, [job["id"]], "retry", output)) == 0
        assert json.loads(output.getvalue())["retried_items"] == 0
        assert asyncio.run(run_action(None, running.url, None, ["job_doesnotexist"], "retry", io.StringIO())) == 2
        missing = httpx.post(f"{running.url}/v1/jobs/job_doesnotexist/retry")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "job_not_found"
