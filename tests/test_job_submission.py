"""Submitting bulk jobs against a real redis-server and a real server: over HTTP (idempotency, the size and item
limits, path inputs, Redis away) and with batchasr submit (splitting, waiting, results written)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from service import submit_inputs
from service.config import Settings
from service.job_keys import ITEM_STREAM
from service.job_types import IdempotencyKeyReused, ItemInput, Job, JobNotFound
from service.jobs import JSON_JOB_BYTES, MAX_JOB_ITEMS, JobStore
from service.jobs_cli import run_submit
from service.submit_inputs import parse_size, split_into_jobs
from tests.ports import free_port
from tests.redis_server import RedisServer
from tests.servers import StreamedUpload, run_server, upload_items, wait_job


def test_http_jobs_submit_idempotent_poll_results(redis_server, model, parity_audio, expected):
    settings = Settings(redis_url=redis_server.url, max_wait_ms=20)
    files = [("files", (Path(p).name, Path(p).read_bytes(), "audio/wav")) for p in parity_audio]
    with run_server(settings, model) as running:
        first = httpx.post(f"{running.url}/v1/jobs", files=files, headers={"Idempotency-Key": "batch-7"}, timeout=60)
        again = httpx.post(f"{running.url}/v1/jobs", files=files, headers={"Idempotency-Key": "batch-7"}, timeout=60)
        assert first.status_code == 202 and again.status_code == 200
        job_id = first.json()["id"]
        assert again.json()["id"] == job_id and len(job_id) > 20
        job = wait_job(running.url, job_id, 60)
        assert job["status"] == "completed" and job["counts"]["completed"] == 10
        assert job["rtfx"] > 0 and job["finished_at"] >= job["created_at"]
        results = httpx.get(f"{running.url}/v1/jobs/{job_id}/results")
        assert results.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in results.text.splitlines()]
        assert [r["text"] for r in lines] == [expected[Path(p).name] for p in parity_audio]
        assert all(set(r) == {"audio", "status", "text", "tokens", "token_logprobs", "avg_logprob", "words",
                              "duration_s", "error"} for r in lines)
        assert all(len(r["token_logprobs"]) == len(r["tokens"]) and all(x <= 0 for x in r["token_logprobs"])
                   and all(0 <= w["confidence"] <= 1 for w in r["words"]) for r in lines)
        scores = [x for r in lines for x in r["token_logprobs"]]  # the job's own: over every item's tokens
        assert job["avg_logprob"] == pytest.approx(sum(scores) / len(scores), abs=1e-4)
        assert httpx.get(f"{running.url}/v1/jobs/job_doesnotexist").status_code == 404
        assert running.metric("batchasr_job_items_total", '{status="completed"}') == 10


def test_a_submission_redis_refused_for_memory_leaves_its_idempotency_key_free(redis_server, model, parity_audio):
    """Nothing of a job is written unless all of it is: the key too. (It used to be set first, so a retry of a
    submission Redis refused answered 404 for the job the key named, for as long as the key lived.)"""
    client = redis_server.client()
    files = [("files", (Path(p).name, Path(p).read_bytes(), "audio/wav")) for p in parity_audio]
    headers = {"Idempotency-Key": "nightly-42"}
    with run_server(Settings(redis_url=redis_server.url), model) as running:
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", client.info("memory")["used_memory"] + 100_000)  # less than the clips
        full = httpx.post(f"{running.url}/v1/jobs", files=files, headers=headers)
        assert full.status_code == 503 and full.json()["error"]["code"] == "job_store_full", full.text
        assert full.headers["retry-after"] == "30"
        assert client.xlen(ITEM_STREAM) == 0 and client.keys("batchasr:idempotency:*") == []
        assert client.keys("batchasr:upload:*") == []  # those written before Redis was full are deleted
        client.config_set("maxmemory", 0)
        retried = httpx.post(f"{running.url}/v1/jobs", files=files, headers=headers)
        assert retried.status_code == 202, retried.text
        again = httpx.post(f"{running.url}/v1/jobs", files=files, headers=headers)
        assert again.status_code == 200 and again.json()["id"] == retried.json()["id"]


def test_concurrent_submissions_with_one_idempotency_key_make_one_job(redis_server, parity_audio):
    async def scenario() -> list[tuple[Job, bool]]:
        stores = [JobStore.from_url(redis_server.url) for _ in range(8)]
        try:
            return await asyncio.gather(*(store.submit(upload_items(parity_audio, 3), "same-key") for store in stores))
        finally:
            for store in stores:
                await store.close()

    outcomes = asyncio.run(scenario())
    assert len({job.id for job, _ in outcomes}) == 1
    assert sum(created for _, created in outcomes) == 1
    assert redis_server.client().xlen(ITEM_STREAM) == 3  # one job's items, once


def test_an_idempotency_key_sent_with_another_request_is_refused(redis_server, model, parity_audio, tmp_path):
    """A key reused for a new job (other files, other options) was answered with the old job, whose results the
    client then took for the new one's. It is refused now, by name, and nothing of it is written; the same request
    again is still answered with its job, and so is one of the same files sent again (same names and sizes)."""
    clips = [Path(p) for p in parity_audio[:3]]
    files = [("files", (clip.name, clip.read_bytes(), "audio/wav")) for clip in clips]
    key = {"Idempotency-Key": "nightly-7"}
    with run_server(Settings(redis_url=redis_server.url, max_wait_ms=20), model) as running:
        first = httpx.post(f"{running.url}/v1/jobs", files=files, headers=key, timeout=60)
        assert first.status_code == 202, first.text
        job_id = first.json()["id"]
        others = {"fewer files": {"files": files[:2]}, "another file": {"files": [*files[:2], files[0]]},
                  "another option": {"files": files, "data": {"priority": "high"}}}
        for what, request in others.items():
            refused = httpx.post(f"{running.url}/v1/jobs", headers=key, timeout=60, **request)
            error = refused.json()["error"]
            assert refused.status_code == 400, (what, refused.text)
            assert (error["code"], error["param"]) == ("idempotency_key_reused", "Idempotency-Key"), what
            assert job_id in error["message"], what
        again = httpx.post(f"{running.url}/v1/jobs", files=files, headers=key, timeout=60)
        assert again.status_code == 200 and again.json()["id"] == job_id
        assert wait_job(running.url, job_id, 60)["counts"]["completed"] == 3
    assert redis_server.client().xlen(ITEM_STREAM) == 3  # the first job's items alone

    async def race() -> list[tuple[Job, bool] | BaseException]:
        """Two requests with one key and different items at once: one makes the job, the other is refused (its
        uploads discarded), whichever wins."""
        stores = [JobStore.from_url(redis_server.url) for _ in range(2)]
        try:
            return await asyncio.gather(stores[0].submit(upload_items(parity_audio, 2), "raced"),
                                        stores[1].submit(upload_items(parity_audio, 3), "raced"),
                                        return_exceptions=True)
        finally:
            for store in stores:
                await store.close()

    outcomes = asyncio.run(race())
    assert sum(isinstance(outcome, IdempotencyKeyReused) for outcome in outcomes) == 1, outcomes
    made = next(outcome for outcome in outcomes if isinstance(outcome, tuple))
    client = redis_server.client()
    uploaded_for = {key.decode().split(":")[2] for key in client.keys("batchasr:upload:*")}
    assert made[1] and uploaded_for <= {job_id, made[0].id}  # none left of the refused one


def test_a_job_submission_past_its_size_limit_is_refused_as_it_arrives(redis_server, model, parity_audio):
    clip = Path(parity_audio[0]).read_bytes()
    settings = Settings(redis_url=redis_server.url, max_job_upload_bytes=3 * len(clip))
    with run_server(settings, model) as running:
        files = [("files", (f"{i}.wav", clip, "audio/wav")) for i in range(4)]
        declared = httpx.post(f"{running.url}/v1/jobs", files=files)
        assert declared.status_code == 413, declared.text
        assert (declared.json()["error"]["code"], declared.json()["error"]["param"]) == ("job_too_large", "files")
        assert "paths or URLs" in declared.json()["error"]["message"]
        upload = StreamedUpload("files", total=200_000_000)
        streamed = httpx.post(f"{running.url}/v1/jobs", content=upload, headers={"content-type": upload.content_type})
        assert streamed.status_code == 413 and streamed.json()["error"]["code"] == "job_too_large"
        assert upload.sent < 20_000_000
        taken = httpx.post(f"{running.url}/v1/jobs", files=files[:3])  # within the limit with the form around it
        assert taken.status_code == 202, taken.text
    assert redis_server.client().xlen(ITEM_STREAM) == 3  # only the job that was taken


def test_a_job_form_is_parsed_within_the_intake_budget(redis_server, model, parity_audio, monkeypatch):
    """A form's fields and its files of up to 1 MiB each are held in memory as it is parsed: three submissions of a
    thousand such files at once took 1.9 GB beside a budget that had counted none of it. The budget now holds the
    body's room from before it is parsed until Redis has the job."""
    from starlette import formparsers

    held_while_parsed = []
    parse = formparsers.MultiPartParser.parse

    async def parse_and_look(parser):
        held_while_parsed.append(running.service.intake.held)
        return await parse(parser)

    monkeypatch.setattr(formparsers.MultiPartParser, "parse", parse_and_look)
    clip = Path(parity_audio[0]).read_bytes()
    with run_server(Settings(redis_url=redis_server.url), model) as running:
        files = [("files", (f"{i}.wav", clip, "audio/wav")) for i in range(3)]
        taken = httpx.post(f"{running.url}/v1/jobs", files=files, data={"priority": "low"})
        assert taken.status_code == 202, taken.text
        assert running.service.intake.held == 0
    assert len(held_while_parsed) == 1 and held_while_parsed[0] > 3 * len(clip)  # the whole body's room


def test_a_job_is_bounded_in_items_and_bytes(redis_server, model, parity_audio, tmp_path):
    """A JSON job's items are validated and checked one by one: a body of the upload limit (1 GiB) made twenty
    million of them, gigabytes of memory and minutes of an event loop that every other request waits on (100,000
    took 5 s of /healthz). A JSON body is at most JSON_JOB_BYTES, refused as it arrives, and its items at most
    MAX_JOB_ITEMS."""
    roots = tmp_path / "inputs"
    roots.mkdir()
    (roots / "a.wav").write_bytes(Path(parity_audio[0]).read_bytes())
    item = {"path": str(roots / "a.wav")}
    settings = Settings(redis_url=redis_server.url, input_roots=[str(roots)], max_job_items=5)
    with run_server(settings, model) as running:
        many = httpx.post(f"{running.url}/v1/jobs", json={"items": [item] * 6}, timeout=30)
        assert many.status_code == 413 and many.json()["error"]["code"] == "too_many_items", many.text
        clip = (roots / "a.wav").read_bytes()
        many_files = httpx.post(f"{running.url}/v1/jobs", files=[("files", (f"{i}.wav", clip)) for i in range(6)],
                                timeout=30)  # the same limit for uploads, and the same answer
        assert many_files.status_code == 413 and many_files.json()["error"]["code"] == "too_many_items", many_files.text
        assert "at most 5 items" in many_files.json()["error"]["message"]
        body = json.dumps({"items": [item]}).encode()
        padded = body[:-1] + b" " * (JSON_JOB_BYTES + 1 - len(body)) + b"}"  # valid JSON, one byte too many
        large = httpx.post(f"{running.url}/v1/jobs", content=padded, headers={"content-type": "application/json"},
                           timeout=60)
        assert large.status_code == 413 and large.json()["error"]["code"] == "job_too_large", large.text
        assert "several jobs" in large.json()["error"]["message"]
        # a second, multipart Content-Type gave the body the upload limit (1 GiB) while the route read it as JSON
        twice = httpx.post(f"{running.url}/v1/jobs", content=padded, timeout=60, headers=[
            ("content-type", "application/json"), ("content-type", "multipart/form-data; boundary=x")])
        assert twice.status_code == 413 and twice.json()["error"]["code"] == "job_too_large", twice.text
        taken = httpx.post(f"{running.url}/v1/jobs", json={"items": [item] * 5}, timeout=30)
        assert taken.status_code == 202, taken.text
    assert redis_server.client().xlen(ITEM_STREAM) == 5
    assert Settings().max_job_items == MAX_JOB_ITEMS


def test_results_are_listed_a_page_at_a_time_in_order(redis_server, model):
    items = [ItemInput(audio=f"item{i:04d}.wav", upload=b"not audio") for i in range(2100)]

    async def submit_and_finish_some() -> str:
        store = JobStore.from_url(redis_server.url)
        job, _ = await store.submit(items)
        await store.finish_item(job.id, 1, "completed", {"audio": "item0001.wav", "status": "completed",
                                                        "text": "done"})
        await store.finish_item(job.id, 1500, "failed", {"audio": "item1500.wav", "status": "failed"},
                                error="bad")
        small = [r async for r in store.iter_results(job.id, page=7)][:12]
        assert [r["audio"] for r in small] == [f"item{i:04d}.wav" for i in range(12)]
        # a job purged while its results are read page by page: its later items were made up as queued, and the
        # results ended as if whole
        other, _ = await store.submit(items[:20])
        reading, read = store.iter_results(other.id, page=7), []
        with pytest.raises(JobNotFound):
            async for record in reading:
                read.append(record)
                if len(read) == 3:
                    await store.delete(other.id)
        assert len(read) == 7  # the page read before the purge
        await store.close()
        return job.id

    job_id = asyncio.run(submit_and_finish_some())
    with run_server(Settings(redis_url=redis_server.url), model) as running:  # (its worker fails the rest)
        response = httpx.get(f"{running.url}/v1/jobs/{job_id}/results")
        missing = httpx.get(f"{running.url}/v1/jobs/job_nope/results")
    assert response.headers["content-type"].startswith("application/x-ndjson")
    records = [json.loads(line) for line in response.text.splitlines()]
    assert [r["audio"] for r in records] == [item.audio for item in items]  # across pages of 1000
    assert records[1]["text"] == "done" and records[1500]["status"] == "failed"
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "job_not_found"


def test_path_inputs_only_under_the_input_roots(redis_server, model, parity_audio, expected, tmp_path):
    roots = tmp_path / "inputs"
    roots.mkdir()
    inside = roots / "ok.wav"
    inside.write_bytes(Path(parity_audio[0]).read_bytes())
    outside = tmp_path / "secret.wav"
    outside.write_bytes(Path(parity_audio[1]).read_bytes())
    (roots / "link.wav").symlink_to(outside)
    # files are decoded from disk, whatever their size: an upload limit smaller than the clip does not apply
    settings = Settings(redis_url=redis_server.url, input_roots=[str(roots)],
                        max_upload_bytes=inside.stat().st_size // 2)
    with run_server(settings, model) as running:
        def submit(path):
            return httpx.post(f"{running.url}/v1/jobs", json={"items": [{"path": str(path)}]}, timeout=30)
        beside = tmp_path / "inputs2"  # a root is no prefix of its siblings' names
        beside.mkdir()
        (beside / "ok.wav").write_bytes(inside.read_bytes())
        for bad in (outside, roots / ".." / "secret.wav", roots / "link.wav", Path("/etc/passwd"), beside / "ok.wav"):
            response = submit(bad)
            assert response.status_code == 400, bad
            assert "outside the input roots" in response.json()["error"]["message"]
        os.mkfifo(roots / "fifo.wav")  # would block the worker that opened it
        (roots / "loop.wav").symlink_to(roots / "loop.wav")  # a 500 (RuntimeError) before
        for bad in (roots / "fifo.wav", roots, f"{inside}\x00.txt", f"{roots}/{'a' * 5000}.wav", roots / "loop.wav"):
            response = submit(bad)
            assert response.status_code == 400, (bad, response.text)  # not a server error
        ok = submit(inside)
        assert ok.status_code == 202
        job_id = ok.json()["id"]
        assert wait_job(running.url, job_id, 60)["status"] == "completed"
        line = json.loads(httpx.get(f"{running.url}/v1/jobs/{job_id}/results").text)
        assert line["text"] == expected[Path(parity_audio[0]).name]
        # an id names Redis keys: one that reaches another of the job's keys is no job, not a server error
        for other in (f"{job_id}:inputs", f"{job_id}:results", "job_*", "x"):
            for method, route in (("GET", ""), ("GET", "/results"), ("DELETE", ""), ("DELETE", "?purge=true")):
                response = httpx.request(method, f"{running.url}/v1/jobs/{other}{route}")
                assert response.status_code == 404, (other, method, route, response.text)
        assert httpx.get(f"{running.url}/v1/jobs/{job_id}").status_code == 200


def test_http_without_redis_and_with_redis_down(model, parity_audio, tmp_path):
    files = [("files", ("a.wav", Path(parity_audio[0]).read_bytes(), "audio/wav"))]
    with run_server(Settings(), model) as running:
        disabled = httpx.post(f"{running.url}/v1/jobs", files=files)
        assert disabled.status_code == 503 and disabled.json()["error"]["code"] == "jobs_disabled"
    server = RedisServer(tmp_path).start()
    with run_server(Settings(redis_url=server.url), model) as running:
        server.stop()
        down = httpx.post(f"{running.url}/v1/jobs", files=files, timeout=30)
        assert down.status_code == 503 and down.json()["error"]["code"] == "redis_unavailable"
        assert str(server.port) not in down.text  # where Redis is stays in the server's log
        listed = httpx.get(f"{running.url}/v1/jobs", timeout=30)
        assert listed.status_code == 503 and str(server.port) not in listed.text
        ready = httpx.get(f"{running.url}/readyz")
        assert ready.status_code == 503 and "redis unreachable" in ready.json()["problems"]
        # a load balancer's probe: transcription goes on without Redis, and the pod stays in service
        probed = httpx.get(f"{running.url}/readyz", params={"redis": "optional"})
        assert probed.status_code == 200, probed.text
        assert probed.json() == {"status": "ready", "problems": [], "warnings": ["redis unreachable"]}
        transcribed = httpx.post(f"{running.url}/v1/audio/transcriptions", files=[("file", files[0][1])], timeout=30)
        assert transcribed.status_code == 200, transcribed.text
        assert httpx.get(f"{running.url}/readyz", params={"redis": "sometimes"}).status_code == 400
        assert httpx.get(f"{running.url}/healthz").status_code == 200
        server.start()
        assert httpx.get(f"{running.url}/readyz").status_code == 200
    server.stop()


@pytest.mark.parametrize("target, said", [("--redis-url", "Redis at"), ("--server", "the server at")])
def test_submit_cli_to_an_address_that_answers_nothing_says_so_at_once(parity_audio, target, said):
    """Not tried again for minutes as an outage is (a wrong address, most likely): nothing there was ever reached;
    the address is named (a mistyped port is seen at once)."""
    address = f"{'redis' if target == '--redis-url' else 'http'}://127.0.0.1:{free_port()}"
    result = subprocess.run([sys.executable, "-m", "service.cli", "submit", target, address, parity_audio[0]],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and f"cannot reach {said} {address}:" in result.stderr, result.stderr
    assert "trying again" not in result.stderr


def test_a_first_submit_cut_off_mid_way_by_redis_is_tried_again_not_taken_for_a_wrong_address(redis_server,
                                                                                                parity_audio, capsys):
    """A first try that reached Redis and lost its connection half-way (a restart, a failover, a killed client) is an
    outage: it ended the command with "cannot reach Redis" as a wrong address does, though the job may have been
    written, and a second run made a second one."""
    admin = redis_server.client()

    async def scenario() -> tuple[int, str]:
        out = io.StringIO()
        admin.execute_command("CLIENT", "PAUSE", 3000, "WRITE")  # the submission's first write waits here
        submitting = asyncio.create_task(run_submit([Path(parity_audio[0])], redis_server.url, None, None, False,
                                                    out, idempotency_key="cut-off"))
        while not any("b" in client["flags"] for client in await asyncio.to_thread(admin.client_list)):  # blocked
            await asyncio.sleep(0.02)
        admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        admin.execute_command("CLIENT", "UNPAUSE")
        return await submitting, out.getvalue()

    code, out = asyncio.run(scenario())
    err = capsys.readouterr().err
    assert code == 0, err
    assert "trying again" in err and "cannot reach" not in err
    assert [json.loads(line)["total_items"] for line in out.splitlines()] == [1]
    jobs = [key for key in admin.keys("batchasr:job:job_*") if key.count(b":") == 2]  # the hashes
    assert len(jobs) == 1  # one job: the try again found the first one's, or made it


def test_submit_and_jobs_cli_take_redis_from_the_environment_and_say_when_there_is_none(redis_server, parity_audio):
    """As the worker does, `submit` and `jobs` read BATCHASR_REDIS_URL when no --redis-url (or --server) is given;
    with neither they exit 2 saying what they need (argparse's "one of the arguments is required" did not name the
    variable, and a set variable was ignored)."""
    def run(*args: str, **env: str) -> subprocess.CompletedProcess:
        environment = {k: v for k, v in os.environ.items() if k != "BATCHASR_REDIS_URL"} | env
        return subprocess.run([sys.executable, "-m", "service.cli", *args], capture_output=True, text=True,
                              timeout=60, env=environment)

    submitted = run("submit", parity_audio[0], BATCHASR_REDIS_URL=redis_server.url)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stderr.split()[1].rstrip(":")
    listed = run("jobs", "--json", BATCHASR_REDIS_URL=redis_server.url)
    assert listed.returncode == 0 and [json.loads(line)["id"] for line in listed.stdout.splitlines()] == [job_id]
    elsewhere = f"redis://127.0.0.1:{free_port()}/0"  # an option given wins over the variable
    assert "cannot reach Redis" in run("jobs", "--redis-url", elsewhere, BATCHASR_REDIS_URL=redis_server.url).stderr
    for command in (["submit", parity_audio[0]], ["jobs"], ["jobs", "--cancel", job_id]):
        refused = run(*command, BATCHASR_REDIS_URL=" ")  # blank: unset, as the server reads it
        assert refused.returncode == 2
        assert f"error: {command[0]} needs --server or --redis-url (or BATCHASR_REDIS_URL)" in refused.stderr
    assert redis_server.client().hget(f"batchasr:job:{job_id}", "status") == b"queued"  # nothing cancelled


def test_submit_cli_splits_more_audio_than_a_job_takes_into_several(redis_server, model, parity_audio, expected,
                                                                     tmp_path):
    sizes = [Path(p).stat().st_size for p in sorted(parity_audio)]
    settings = Settings(redis_url=redis_server.url, max_job_upload_bytes=350_000)
    with run_server(settings, model) as running:
        out = tmp_path / "results.jsonl"
        audio_dir = Path(parity_audio[0]).parent
        whole = subprocess.run([sys.executable, "-m", "service.cli", "submit", "--server", running.url,
                                "--job-bytes", "1M", str(audio_dir)], capture_output=True, text=True, timeout=120)
        assert whole.returncode == 2 and "BATCHASR_MAX_JOB_UPLOAD_BYTES" in whole.stderr  # one job: too large
        result = subprocess.run([sys.executable, "-m", "service.cli", "submit", "--server", running.url, "--wait",
                                 "--job-bytes", "300K", "--idempotency-key", "set-1", "--output", str(out),
                                 str(audio_dir)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    jobs = [line for line in result.stderr.splitlines() if line.endswith(" items")]
    assert len(jobs) == len(split_into_jobs([Path(p) for p in sorted(parity_audio)], 300 * 1024)) > 2
    assert sum(sizes) > 350_000
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [Path(r["audio"]).name for r in lines] == sorted(Path(p).name for p in parity_audio)  # input order
    assert all(r["text"] == expected[Path(r["audio"]).name] for r in lines)
    keys = {key.decode() for key in redis_server.client().keys("batchasr:idempotency:*")}
    assert keys == {f"batchasr:idempotency:set-1.{n}" for n in range(1, len(jobs) + 1)}  # one key per job


def test_submit_cli_refuses_a_link_to_nothing_by_name_before_sending_a_job(redis_server, parity_audio, tmp_path):
    """A directory's dead link is listed (for reading to report it): uploaded from here, it is refused by name, with
    no job sent, not a traceback from measuring the job's bytes."""
    folder = tmp_path / "calls"
    folder.mkdir()
    (folder / "a.wav").write_bytes(Path(parity_audio[0]).read_bytes())
    (folder / "gone.wav").symlink_to(tmp_path / "deleted.wav")
    result = subprocess.run([sys.executable, "-m", "service.cli", "submit", "--redis-url", redis_server.url,
                             str(folder)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == f"error: {folder / 'gone.wav'}: no such audio file\n"
    assert not redis_server.client().keys("batchasr:job:*")


def test_submit_cli_refuses_outputs_it_cannot_write_before_sending_a_job(redis_server, parity_audio, tmp_path):
    (tmp_path / "taken").write_text("a file where the output folder would go")
    for option in (["--output", str(tmp_path / "no-such-folder" / "results.jsonl")],
                   ["--output-dir", str(tmp_path / "taken")]):
        result = subprocess.run([sys.executable, "-m", "service.cli", "submit", "--redis-url", redis_server.url,
                                 "--wait", *option, parity_audio[0]], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2
        assert result.stderr.startswith("error: cannot write the results: ") and "Traceback" not in result.stderr
    assert not redis_server.client().keys("batchasr:job:*")


def test_submit_cli_that_cannot_write_the_results_says_so_and_where_they_are_kept(redis_server, model, parity_audio):
    """Results written once the jobs end, to a full disk: a traceback at exit (after "completed"), and nothing
    said of where the results still are."""
    with run_server(Settings(redis_url=redis_server.url), model) as running:
        result = subprocess.run([sys.executable, "-m", "service.cli", "submit", "--server", running.url, "--wait",
                                 "--output", "/dev/full", parity_audio[0]], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    job_id = redis_server.client().keys("batchasr:job:*:results")[0].decode().split(":")[2]
    assert "error: cannot write the results: [Errno 28] No space left on device (the jobs are kept" in result.stderr
    assert job_id in result.stderr


def test_jobs_are_split_by_upload_bytes_in_order(tmp_path, monkeypatch):
    files = []
    for name, size in (("a", 100), ("b", 150), ("c", 400), ("d", 50), ("e", 60)):
        files.append(tmp_path / f"{name}.wav")
        files[-1].write_bytes(bytes(size))
    url = "https://media.example/x.wav"
    jobs = split_into_jobs([*files[:2], url, *files[2:]], 300)
    assert jobs == [files[:2], [url], [files[2]], files[3:]]  # c is larger than a job alone: it goes alone
    assert split_into_jobs(files, 10_000) == [files]
    assert split_into_jobs(files, 10_000, max_items=2) == [files[:2], files[2:4], files[4:]]
    # URLs and workers' paths go as JSON: their jobs' bodies stay within what the server takes
    urls = [f"https://media.example/{i:04d}.wav" for i in range(10)]
    item_bytes = len(json.dumps({"url": urls[0]})) + 2
    monkeypatch.setattr(submit_inputs, "JSON_JOB_BYTES", submit_inputs.JSON_FIELDS_ROOM + 3 * item_bytes)
    assert split_into_jobs(urls, 10_000) == [urls[:3], urls[3:6], urls[6:9], urls[9:]]
    assert parse_size("256M") == 256 * 1024**2 and parse_size("300k") == 300 * 1024 and parse_size("12") == 12
    for bad in ("", "M", "-1", "1.5G", "0", "12T"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_submit_cli_waits_and_writes_results(redis_server, model, parity_audio, expected, tmp_path):
    with run_server(Settings(redis_url=redis_server.url), model) as running:
        out = tmp_path / "results.jsonl"
        audio_dir = Path(parity_audio[0]).parent
        result = subprocess.run([sys.executable, "-m", "service.cli", "submit", "--server", running.url, "--wait",
                                 "--output", str(out), str(audio_dir)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "10/10 items" in result.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [Path(r["audio"]).name for r in lines] == sorted(Path(p).name for p in parity_audio)
    assert all(r["text"] == expected[Path(r["audio"]).name] for r in lines)


@pytest.mark.parametrize("through", ["redis", "server"])
def test_submit_waiting_on_a_job_that_is_purged_says_so(redis_server, model, parity_audio, capsys, through):
    """It used to end in a traceback (Redis) or in "cannot reach the server" (HTTP 404)."""
    async def scenario(server_url: str | None) -> int:
        store = JobStore.from_url(redis_server.url)
        waiting = asyncio.create_task(run_submit([Path(parity_audio[0])], redis_server.url if server_url is None
                                                 else None, server_url, None, True, io.StringIO(), poll_s=0.05))
        while not (jobs := await store.redis.keys("batchasr:job:job_*[!s]")):  # its hash (its other keys end in s)
            await asyncio.sleep(0.05)
        await store.delete(jobs[0].decode().split(":")[2])
        code = await waiting
        await store.close()
        return code

    if through == "redis":
        code = asyncio.run(scenario(None))
    else:
        # its one item waits for a batch to fill, so the job is still in progress when it is purged
        with run_server(Settings(redis_url=redis_server.url, max_wait_ms=5000, max_batch_size=64), model) as running:
            code = asyncio.run(scenario(running.url))
    assert code == 2
    assert "no such job (it expired or was purged)" in capsys.readouterr().err


@pytest.mark.parametrize("through", ["redis", "server"])
def test_submit_waiting_rides_out_a_redis_restart(tmp_path, model, parity_audio, expected, capsys, through):
    """A poll that met Redis restarting (a 503 from the server, a connection refused from Redis) ended the wait with
    "cannot reach" and no results, while the job went on."""
    redis = RedisServer(tmp_path, appendonly=True).start()  # the job outlives the restart

    async def scenario(server_url: str | None) -> tuple[int, str]:
        out = io.StringIO()
        waiting = asyncio.create_task(run_submit([Path(parity_audio[0])], None if server_url else redis.url,
                                                 server_url, None, True, out, poll_s=0.05))
        while not redis.client().keys("batchasr:job:job_*[!s]"):  # submitted: its item waits for a batch
            await asyncio.sleep(0.05)
        await asyncio.to_thread(redis.stop)
        await asyncio.sleep(1.0)  # polls fail meanwhile
        await asyncio.to_thread(redis.start)
        return await waiting, out.getvalue()

    try:
        # the item waits 3 s for its batch to fill: the job is in progress across the restart
        with run_server(Settings(redis_url=redis.url, max_wait_ms=3000, max_batch_size=64), model) as running:
            code, out = asyncio.run(scenario(running.url if through == "server" else None))
    finally:
        redis.stop()
    assert code == 0, capsys.readouterr().err
    assert [json.loads(line)["text"] for line in out.splitlines()] == [expected[Path(parity_audio[0]).name]]
    assert "trying again" in capsys.readouterr().err


def test_submit_cli_writes_a_subtitle_file_per_input_mirroring_directories(redis_server, model, parity_audio,
                                                                          expected, tmp_path):
    """`submit --wait --output-dir DIR --format srt`: one file per input, named as `transcribe --output-dir` names
    them; an item that fails is reported on stderr and gets no file."""
    source = tmp_path / "calls"
    for day, clips in (("day1", parity_audio[:2]), ("day2", parity_audio[2:4])):
        (source / day).mkdir(parents=True)
        for clip in clips:
            (source / day / Path(clip).name).write_bytes(Path(clip).read_bytes())
    (source / "day2" / "broken.wav").write_bytes(b"RIFF....not audio at all")
    out = tmp_path / "subtitles"
    command = [sys.executable, "-m", "service.cli", "submit", "--redis-url", redis_server.url, "--wait"]
    with run_server(Settings(redis_url=redis_server.url), model):  # its job consumer works the job
        result = subprocess.run([*command, "--output-dir", str(out), "--format", "srt", str(source)],
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "broken.wav: failed: cannot decode audio" in result.stderr
    written = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert written == ["day1", *sorted(f"day1/{Path(c).stem}.srt" for c in parity_audio[:2]),
                       "day2", *sorted(f"day2/{Path(c).stem}.srt" for c in parity_audio[2:4])]
    for clip in parity_audio[:4]:
        day = "day1" if clip in parity_audio[:2] else "day2"
        cues = (out / day / f"{Path(clip).stem}.srt").read_text().split("\n\n")
        assert " ".join(cue.split("\n", 2)[2].strip() for cue in cues if cue.strip()) == expected[Path(clip).name]
    for extra, message in ((["--output-dir", str(out)], "needs --wait"),):
        refused = subprocess.run([*command[:-1], *extra, str(source)], capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2 and message in refused.stderr
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / Path(parity_audio[0]).name).write_bytes(Path(parity_audio[0]).read_bytes())
    clash = subprocess.run([*command, "--output-dir", str(out), str(source / "day1" / Path(parity_audio[0]).name),
                            str(tmp_path / "other")], capture_output=True, text=True, timeout=60)
    assert clash.returncode == 2 and "would both be written as" in clash.stderr


def test_submit_and_jobs_that_cannot_write_their_output_say_so_not_that_redis_is_away(redis_server, parity_audio):
    """`submit` without --wait to a full disk said nothing and exited 0 (the job submitted, its id lost: the error
    came at close, swallowed); `jobs` said "cannot reach Redis: [Errno 28] No space left on device"."""
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "service.cli", *args, "--redis-url", redis_server.url],
                              capture_output=True, text=True, timeout=60,
                              env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"})

    submitted = run("submit", "--output", "/dev/full", parity_audio[0])
    job_id = redis_server.client().keys("batchasr:job:job_*:inputs")[0].decode().split(":")[2]
    assert submitted.returncode == 2, submitted.stderr
    assert (f"error: cannot write the results: [Errno 28] No space left on device (the jobs were submitted: {job_id})"
            in submitted.stderr)
    for command in (["jobs"], ["jobs", "--json"], ["jobs", "--cancel", job_id]):
        with open("/dev/full", "w") as full:
            result = subprocess.run([sys.executable, "-m", "service.cli", *command, "--redis-url", redis_server.url],
                                    stdout=full, stderr=subprocess.PIPE, text=True, timeout=60)
        assert result.returncode == 2 and "error: cannot write the results: [Errno 28]" in result.stderr, command
        assert "cannot reach" not in result.stderr and "Traceback" not in result.stderr


def test_an_idempotency_key_names_its_job_as_long_as_the_job_is_there(redis_server, model, parity_audio, tmp_path):
    """The key lapsed at the result TTL from submission, so a retry of a job still in progress (or whose results were
    still kept) made a second job; and a retry was checked again before its key was looked up, so one whose file had
    been moved since (a pipeline cleaning up) was refused 400 instead of answered with its job."""
    async def key_ttls() -> tuple[int, int, int]:
        store = JobStore.from_url(redis_server.url, input_ttl_s=600, result_ttl_s=2)
        job, _ = await store.submit([ItemInput(audio="a.wav", upload=b"x")], "nightly-1")
        submitted = await store.redis.ttl("batchasr:idempotency:nightly-1")
        await store.cancel(job.id)  # it ends: the key, as the job's records, expires the result TTL from now
        ended = await store.redis.ttl("batchasr:idempotency:nightly-1")
        job_left = await store.redis.ttl(f"batchasr:job:{job.id}")
        await store.close()
        return submitted, ended, job_left

    submitted, ended, job_left = asyncio.run(key_ttls())
    assert submitted > 500 and 0 < ended <= 2 and abs(ended - job_left) <= 1

    roots = tmp_path / "inputs"
    roots.mkdir()
    clip = roots / "a.wav"
    clip.write_bytes(Path(parity_audio[0]).read_bytes())
    body, key = {"items": [{"path": str(clip)}]}, {"Idempotency-Key": "moved-after"}
    with run_server(Settings(redis_url=redis_server.url, input_roots=[str(roots)], max_wait_ms=3000,
                             max_batch_size=64), model) as running:
        first = httpx.post(f"{running.url}/v1/jobs", json=body, headers=key, timeout=30)
        clip.unlink()
        again = httpx.post(f"{running.url}/v1/jobs", json=body, headers=key, timeout=30)
    assert first.status_code == 202 and again.status_code == 200, again.text
    assert again.json()["id"] == first.json()["id"]


def _uploads(n: int) -> list[ItemInput]:
    return [ItemInput(audio=f"{i}.wav", upload=io.BytesIO(f"RIFF {i}".encode() + bytes(2000))) for i in range(n)]


async def _stream_length(url: str) -> int:
    store = JobStore.from_url(url)
    try:
        return await store.redis.xlen(ITEM_STREAM)
    finally:
        await store.close()


@pytest.mark.parametrize("idempotency_key", [None, "nightly-7"])
def test_a_submission_whose_reply_was_lost_is_the_job_redis_wrote_with_its_audio(redis_server, idempotency_key):
    """Redis ran the job's transaction and the connection closed before its reply came: the job is there. (With a
    key, the lost reply came back as a WatchError, the key named the job, taken for another request's, and its
    uploads were deleted; without one, a 503 and the uploads deleted: both left a queued job whose every item failed
    for audio expired.)"""
    from tests.redis_server import RepliesCut

    async def scenario() -> None:
        relay = await RepliesCut(redis_server).start()
        store = JobStore.from_url(relay.url)
        try:
            relay.armed = 1
            job, created = await store.submit(_uploads(3), idempotency_key)
            assert relay.cut == 1 and created
            for index in range(3):
                start = await store.start_item(job.id, index)
                assert start.state == "in_progress" and start.upload.startswith(f"RIFF {index}".encode())
            assert await _stream_length(redis_server.url) == 3  # written once
            again, created_again = await store.submit(_uploads(3), idempotency_key)
            assert (again.id == job.id) == (not created_again) == (idempotency_key is not None)
        finally:
            await store.close()
            await relay.close()

    asyncio.run(scenario())


def test_a_submission_redis_went_away_while_writing_keeps_its_audio_for_the_job_it_may_have_queued(tmp_path):
    """Redis ran the transaction and went away before anyone could ask: the submitter hears that the job may have
    been queued (a 503 over HTTP), the uploads are left (they may be the job's audio), and a retry with the key,
    once Redis is back, answers with the job."""
    from service.redis_outages import SubmissionUnconfirmed
    from tests.redis_server import RepliesCut

    server = RedisServer(tmp_path, appendonly=True).start()

    async def scenario() -> None:
        relay = await RepliesCut(server, close_after=True).start()
        store = JobStore.from_url(relay.url)
        try:
            relay.armed = 1
            with pytest.raises(SubmissionUnconfirmed, match="may have been queued"):
                await store.submit(_uploads(2), "tape-9")
            await asyncio.to_thread(server.start)
            again, created = await store.submit(_uploads(2), "tape-9")
            assert not created
            for index in range(2):
                start = await store.start_item(again.id, index)
                assert start.upload.startswith(f"RIFF {index}".encode())
        finally:
            await store.close()
            await relay.close()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


def test_a_path_or_url_too_long_to_keep_is_refused(redis_server, model, parity_audio, tmp_path):
    """A job's paths and URLs are kept in its records, and a failed item's in its error and dead letter, for days,
    uncounted by the queued-items limit: one 30 MiB URL that failed at once made 200 MB of Redis."""
    from service.job_routes import MAX_INPUT_CHARS

    long_tail = "a" * MAX_INPUT_CHARS
    settings = Settings(redis_url=redis_server.url, input_roots=[str(tmp_path)], webhook_secret="whsec_" + "A" * 44,
                        input_url_prefixes=["https://media.example/"])
    with run_server(settings, model) as running:
        for item in ({"url": f"https://media.example/a.wav?x={long_tail}"}, {"path": f"{tmp_path}/{long_tail}"}):
            refused = httpx.post(f"{running.url}/v1/jobs", json={"items": [item]}, timeout=30)
            assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_job", refused.text
            assert f"at most {MAX_INPUT_CHARS} characters" in refused.json()["error"]["message"]
        hook = f"https://hooks.example/{long_tail}"
        refused = httpx.post(f"{running.url}/v1/jobs", files=[("files", ("a.wav", Path(parity_audio[0]).read_bytes()))],
                             data={"webhook_url": hook}, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "webhook_url", refused.text
        assert not redis_server.client().keys("batchasr:job:*")


def test_submit_refused_part_way_names_the_jobs_it_had_sent(redis_server, model, parity_audio, capsys):
    """Files and URLs go as separate jobs: the second refused (URL inputs off), the command said only why, and the
    first job went on, named nowhere (run again under a new key, its audio was transcribed twice)."""
    from service.cli import main

    settings = Settings(redis_url=redis_server.url)
    with run_server(settings, model) as running:
        assert main(["submit", "--server", running.url, parity_audio[0], "https://media.example/a.wav"]) == 2
        out, said = capsys.readouterr()
        (job_id,) = [key.decode().removeprefix("batchasr:job:") for key in redis_server.client().keys("batchasr:job:*")
                     if key.count(b":") == 2]  # the job's own record, not its inputs', states'...
        assert [json.loads(line)["id"] for line in out.splitlines()] == [job_id]  # its line as it was accepted
        assert "URL inputs are disabled" in said
        assert f"1 of 2 jobs were sent before that and go on: {job_id}" in said
        assert f"batchasr jobs --cancel {job_id}" in said


def test_submit_waiting_on_jobs_of_which_one_is_purged_writes_the_others_results(redis_server, model, parity_audio,
                                                                                expected, capsys):
    """Several jobs followed, one purged meanwhile: the command ended at once, and the other jobs' results, done or
    still coming, were never written."""
    inputs = [Path(p) for p in parity_audio[:2]]

    async def scenario(server_url: str) -> tuple[int, str]:
        store = JobStore.from_url(redis_server.url)
        out = io.StringIO()
        waiting = asyncio.create_task(run_submit(inputs, None, server_url, None, True, out, poll_s=0.05,
                                                 job_bytes=1))  # a job a file
        while len(keys := await store.redis.keys("batchasr:job:job_*[!s]")) < 2:  # the jobs' hashes
            await asyncio.sleep(0.05)
        jobs = [await store.get(key.decode().split(":")[2]) for key in keys]
        await store.delete(min(jobs, key=lambda job: job.created_at).id)
        code = await waiting
        await store.close()
        return code, out.getvalue()

    # an item waits for a batch to fill (5 s): both jobs are in progress when the first is purged
    with run_server(Settings(redis_url=redis_server.url, max_wait_ms=5000, max_batch_size=64), model) as running:
        code, out = asyncio.run(scenario(running.url))
    assert code == 2
    lines = [json.loads(line) for line in out.splitlines()]
    assert [(r["audio"], r["text"]) for r in lines] == [(str(inputs[1]), expected[inputs[1].name])]
    assert "no such job (it expired or was purged): its results are not there" in capsys.readouterr().err
