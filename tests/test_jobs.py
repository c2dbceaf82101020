"""Bulk jobs against a real redis-server: exactly one correct result per item whatever fails."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
import torch
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError

import service.job_worker as job_worker
from service.audio import DecodeStopped
from service.batcher import POOL_FACTOR
from service.config import Settings
from service.job_keys import (
    DEAD_LETTER_STREAM,
    GROUP,
    ITEM_STREAM,
    JOB_KEY,
    OWNER_STREAMS_KEY,
    RESULTS_KEY,
    WEBHOOK_STREAM,
    item_stream,
)
from service.job_types import ItemInput, Job, JobOptions, JobPriority, Retried, item_record
from service.job_worker import NAME_LEASE_S, CancelWatch
from service.jobs import JobStore
from service.metrics import Metrics
from service.redis_outages import REDIS_ERRORS
from service.runtime import READING_SHARE, build_stack
from service.transcriber import NeverRan
from tests.conftest import long_recording
from tests.ports import free_port
from tests.redis_server import RedisServer, first_reply_lost
from tests.servers import drain_jobs, metric, run_server, serve_process, upload_items

MODEL_FILE = "tdt.nemo"  # the fastest fixture: one encoder layer


def _check_results(records: list[dict], items: list[ItemInput], expected: dict[str, str]) -> None:
    assert len(records) == len(items)
    for item, record in zip(items, records, strict=True):
        assert record["status"] == "completed", record
        assert record["text"] == expected[item.audio]


def _worker(url: str, name: str, parity_dir: Path, *options: str, **env: str) -> subprocess.Popen:
    environment = {**os.environ, "PYTHONUNBUFFERED": "1", **{f"BATCHASR_{k.upper()}": v for k, v in env.items()}}
    return subprocess.Popen([sys.executable, "-m", "service.cli", "worker", "--model", str(parity_dir / MODEL_FILE),
                             "--redis-url", url, "--name", name, *options], env=environment, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait_for(predicate, timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(message)


def _job_status(client, job_id: str) -> dict:
    raw = client.hgetall(f"batchasr:job:{job_id}")
    return {k.decode(): v.decode() for k, v in raw.items()}


# --- crash safety ----------------------------------------------------------------------------------------------


def test_200_items_over_3_workers_with_one_killed_mid_batch(redis_server, parity_dir, parity_audio, expected):
    items = upload_items(parity_audio, 200)
    store = JobStore.from_url(redis_server.url)
    job, _ = asyncio.run(store.submit(items))
    client = redis_server.client()
    env = {"job_visibility_timeout_s": "3", "max_wait_ms": "100", "max_batch_size": "8", "job_prefetch": "16"}
    workers = [_worker(redis_server.url, f"w{i}", parity_dir, **env) for i in range(3)]
    try:
        def victim_holds_items() -> bool:
            pending = client.xpending_range(ITEM_STREAM, GROUP, "-", "+", 100, consumername="w0")
            return len(pending) > 0 and int(_job_status(client, job.id)["n_completed"]) > 0
        _wait_for(victim_holds_items, 120, "worker w0 never held items")
        workers[0].send_signal(signal.SIGKILL)  # mid-batch: its deliveries stay unacknowledged
        _wait_for(lambda: _job_status(client, job.id)["status"] == "completed", 180, "job did not complete")
        # Deliveries the victim finished but never acknowledged outlive the job; the survivors reclaim them
        # (after the visibility timeout), see the result already written, and acknowledge.
        _wait_for(lambda: client.xpending(ITEM_STREAM, GROUP)["pending"] == 0, 30, "deliveries left pending")
    finally:
        for w in workers:
            w.kill()
            w.wait()
    assert client.hlen(RESULTS_KEY.format(job_id=job.id)) == 200  # one result per item, no more
    status = _job_status(client, job.id)
    assert (status["n_completed"], status["n_failed"], status["n_in_progress"]) == ("200", "0", "0")
    _check_results(asyncio.run(JobStore.from_url(redis_server.url).results(job.id)), items, expected)


def test_a_killed_worker_replaced_under_a_new_name_leaves_its_items_for_seconds_not_the_visibility_timeout(
        parity_dir):
    """loadtest/worker_loss.py: two worker processes as shipped (a visibility timeout of 300 s), one killed holding
    items and never started again, as a pod rescheduled under a new name is: the other takes its items once its
    name's lease has lapsed; the script fails should the job not be done within 120 s."""
    result = subprocess.run([sys.executable, "loadtest/worker_loss.py", "--items", "40", "--timeout-s", "120",
                             "--model", str(parity_dir / MODEL_FILE)],
                            cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "not started again: its items taken back" in result.stdout


def test_redis_restart_mid_job_loses_nothing(tmp_path, parity_dir, parity_audio, expected):
    server = RedisServer(tmp_path, appendonly=True).start()
    items = upload_items(parity_audio, 60)
    job, _ = asyncio.run(JobStore.from_url(server.url).submit(items))
    worker = _worker(server.url, "w-restart", parity_dir, max_wait_ms="50", max_batch_size="4", job_prefetch="4",
                     job_visibility_timeout_s="3")
    try:
        client = server.client()
        _wait_for(lambda: int(_job_status(client, job.id)["n_completed"]) >= 5, 120, "no progress before restart")
        server.stop()
        time.sleep(1.5)  # the worker sees Redis gone and backs off
        server.start()  # same port and directory: the append-only file brings everything back
        client = server.client()
        _wait_for(lambda: _job_status(client, job.id).get("status") == "completed", 180,
                  "job did not complete after the restart")
        assert worker.poll() is None  # the worker rode it out
    finally:
        worker.kill()
        output = worker.communicate()[0]
        server.stop()
    assert "redis unreachable" in output
    server.start()
    try:
        _check_results(asyncio.run(JobStore.from_url(server.url).results(job.id)), items, expected)
        assert server.client().hlen(RESULTS_KEY.format(job_id=job.id)) == 60
    finally:
        server.stop()


def test_a_transcription_done_while_redis_restarts_is_written_once_it_is_back(tmp_path, model, parity_audio,
                                                                              expected, caplog):
    """Results finished while Redis was away were thrown away: their items waited out the visibility timeout (5 min)
    to be transcribed again, an attempt more each (with JOB_MAX_ATTEMPTS=1, failed "the worker died" with no worker
    dead). Now their writes wait for Redis, and the outage's end is logged."""
    items = upload_items(parity_audio, 3)

    async def restart_redis_mid_transcription(consumer, store, server) -> None:
        transcribe, restarts = consumer.transcriber.transcribe, []

        async def transcribed(*args, **kwargs):
            if restarts:  # items transcribed side by side: only the first restarts Redis, once
                return await transcribe(*args, **kwargs)
            restarts.append("stopping")
            await asyncio.to_thread(server.stop)  # stopped now, back 2 s after the result is ready
            result = await transcribe(*args, **kwargs)
            restarts.append(asyncio.create_task(asyncio.sleep(2)))
            restarts[-1].add_done_callback(lambda _: server.start())
            return result

        consumer.transcriber.transcribe = transcribed

    with caplog.at_level(logging.INFO, logger="service.redis_outages"):  # the visibility timeout of 300 s
        job, records = _consume_with_redis_restarting(tmp_path, model, items, restart_redis_mid_transcription,
                                                      job_max_attempts=1)
    assert job.finished and job.counts["completed"] == len(items), job.counts  # within the minute, not after five
    _check_results(records, items, expected)
    assert "job consumer: redis reachable again" in caplog.text


def test_an_item_in_hand_whose_start_met_redis_away_starts_once_it_is_back(tmp_path, model, parity_audio, expected):
    """Items read ahead start as room comes; one whose start met Redis restarting (its reply lost) was left for the
    visibility timeout, 5 minutes, to be delivered again. Its start now waits for Redis, as its end does."""
    items = upload_items(parity_audio, 3)

    async def lose_the_first_start(consumer, store, server) -> None:
        consumer.store.start_item = first_reply_lost(consumer.store.start_item, server, [])

    job, records = _consume_with_redis_restarting(tmp_path, model, items, lose_the_first_start, timeout_s=30)
    assert job.finished and job.counts["completed"] == len(items), job.counts  # within seconds, not after five minutes
    _check_results(records, items, expected)


def test_deliveries_whose_reply_was_lost_as_redis_restarted_are_taken_back_once_it_is_back(tmp_path, model,
                                                                                          parity_audio, expected,
                                                                                          caplog):
    """A read's reply lost with its connection (Redis restarting as it answered) left its items delivered to the
    consumer, which never saw them: they waited out the visibility timeout, 5 minutes (a 306 s test in CI). Now a
    consumer that met an outage takes back at once the deliveries to its name that it does not hold."""
    items = upload_items(parity_audio, 3)

    async def lose_the_first_reply(consumer, store, server) -> None:
        consumer.store.read_items = first_reply_lost(consumer.store.read_items, server, [])

    with caplog.at_level(logging.INFO, logger="service.job_worker"):  # the visibility timeout of 300 s
        job, records = _consume_with_redis_restarting(tmp_path, model, items, lose_the_first_reply)
    assert job.finished, job.counts  # within the minute, not after five
    _check_results(records, items, expected)
    assert "took back 3 items delivered to this consumer while Redis was away" in caplog.text


def test_an_item_left_for_the_visibility_timeout_is_not_taken_back_after_an_outage(tmp_path, model, parity_audio):
    """What a consumer leaves unacknowledged on purpose (a timeout, a source down) comes back after the visibility
    timeout, an attempt later: an outage, after which the deliveries the consumer does not hold are taken back,
    does not bring it back sooner."""
    calls: list[float] = []

    async def time_out_then_restart_redis(consumer, store, server) -> None:
        def restart() -> None:
            server.stop()
            asyncio.get_running_loop().call_later(1.0, server.start)

        async def transcribe(*args, **kwargs):
            calls.append(time.monotonic())
            asyncio.get_running_loop().call_later(0.5, restart)  # once the item has been left
            raise TimeoutError("the transcription took too long")

        consumer.transcriber.transcribe = transcribe

    job, _ = _consume_with_redis_restarting(tmp_path, model, upload_items(parity_audio, 1),
                                            time_out_then_restart_redis, timeout_s=6)
    assert not job.finished and len(calls) == 1  # left to the visibility timeout (300 s)


def _consume_with_redis_restarting(tmp_path: Path, model, items: list[ItemInput], setup, timeout_s: float = 60,
                                   **settings) -> tuple[Job, list[dict]]:
    """``_run_consumer`` on a private Redis that keeps what it holds across restarts (append-only), which
    ``setup(consumer, store, server)`` arranges."""
    server = RedisServer(tmp_path, appendonly=True).start()
    try:
        return asyncio.run(_run_consumer(Settings(redis_url=server.url, **settings), model, items,
                                         lambda consumer, store: setup(consumer, store, server), timeout_s))
    finally:
        server.stop()


def test_the_job_store_uses_no_connection_a_redis_restart_closed(tmp_path):
    """redis-py's maintenance notifications (on by default over RESP3) stop its pool from checking that a connection
    it hands out is still open: after a restart each pooled connection failed its next command once, so a server
    answered 503 to a burst, or to light traffic for as long as it took to reach every connection."""
    server = RedisServer(tmp_path, appendonly=True).start()

    async def scenario() -> list[object]:
        store = JobStore.from_url(server.url)
        await asyncio.gather(*(store.redis.ping() for _ in range(32)))  # the pool holds 32 connections
        await asyncio.to_thread(server.stop)
        await asyncio.to_thread(server.start)  # same port and data
        await asyncio.sleep(0.1)  # the closed connections' ends arrive
        try:
            return await asyncio.gather(*(store.redis.hlen("x") for _ in range(40)), return_exceptions=True)
        finally:
            await store.close()

    try:
        replies = asyncio.run(scenario())
    finally:
        server.stop()
    assert replies == [0] * 40


def test_worker_waits_for_redis_that_is_not_there_yet(tmp_path, parity_dir, parity_audio, expected):
    server = RedisServer(tmp_path)  # not started yet
    worker = _worker(server.url, "w-early", parity_dir)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(worker.stdout), daemon=True)
    reader.start()
    try:
        # once it has found Redis away (its model loads first: a fixed wait was shorter than that on a busy machine)
        _wait_for(lambda: any("redis unreachable" in line for line in lines), 120, "the worker never looked")
        time.sleep(2)
        assert worker.poll() is None, "the worker must not exit (or crash-loop) while Redis is away"
        server.start()
        items = upload_items(parity_audio, 5)
        job, _ = asyncio.run(JobStore.from_url(server.url).submit(items))
        client = server.client()
        _wait_for(lambda: _job_status(client, job.id)["status"] == "completed", 120, "job did not complete")
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(60)
        reader.join(10)
        server.stop()
    output = "".join(lines)
    assert worker.returncode == 0, output
    assert "redis unreachable" in output and "worker stopped" in output


def test_a_workers_log_does_not_show_the_redis_password(tmp_path, parity_dir, parity_audio, expected):
    server = RedisServer(tmp_path, password="hunter2-redis").start()
    worker = _worker(server.url, "w-auth", parity_dir)
    try:
        job, _ = asyncio.run(JobStore.from_url(server.url).submit(upload_items(parity_audio, 2)))
        _wait_for(lambda: _job_status(server.client(), job.id)["status"] == "completed", 120, "job did not complete")
    finally:
        worker.send_signal(signal.SIGTERM)
        output = worker.communicate(timeout=60)[0]
        server.stop()
    assert f"worker consuming jobs from redis://:***@127.0.0.1:{server.port}/0" in output
    assert "hunter2" not in output


def test_a_workers_metrics_port_counts_the_cpu_of_its_event_loop(redis_server, parity_dir, parity_audio):
    """A worker takes job items in on its event loop, and its metrics port answers scrapes on a thread of its own:
    nothing counted that loop's CPU, and batchasr_event_loop_cpu_seconds_total read 0 whatever it took in."""
    job, _ = asyncio.run(JobStore.from_url(redis_server.url).submit(upload_items(parity_audio, 20)))
    metrics_port = free_port()
    started = time.monotonic()
    worker = _worker(redis_server.url, "w-loop", parity_dir, "--metrics-port", str(metrics_port))
    try:
        _wait_for(lambda: _job_status(redis_server.client(), job.id).get("status") == "completed", 120,
                  "job did not complete")
        time.sleep(1.5)  # the loop's CPU is counted every second
        loop_cpu_s = metric(f"http://127.0.0.1:{metrics_port}", "batchasr_event_loop_cpu_seconds_total")
    finally:
        worker.send_signal(signal.SIGTERM)
        output = worker.communicate(timeout=60)[0]
    assert worker.returncode == 0, output
    assert 0 < loop_cpu_s < time.monotonic() - started


def test_a_worker_with_consumer_processes_counts_in_one_place_and_stops_cleanly(redis_server, parity_dir,
                                                                                parity_audio, expected):
    """BATCHASR_JOB_CONSUMERS=2: two consumers in processes of their own feed the worker's engine; their counts
    (a poison item among them) reach the worker's metrics port; SIGTERM finishes and exits cleanly."""
    items = [*upload_items(parity_audio, 30), ItemInput(audio="broken.wav", upload=b"RIFF....not audio at all")]
    job, _ = asyncio.run(JobStore.from_url(redis_server.url).submit(items))
    client = redis_server.client()
    metrics_port = free_port()
    # 4 items in flight, 2 per consumer: both must take items
    worker = _worker(redis_server.url, "wc", parity_dir, "--metrics-port", str(metrics_port), job_consumers="2",
                     job_prefetch="4", max_wait_ms="50", max_batch_size="8")
    try:
        _wait_for(lambda: _job_status(client, job.id).get("status") == "completed_with_errors", 120,
                  "job did not finish")
        consumers = {c["name"].decode() for c in client.xinfo_consumers(ITEM_STREAM, GROUP)}
        assert consumers == {"wc-0", "wc-1"}, consumers  # a consumer joins the group with its first delivery
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        assert 'batchasr_job_items_total{status="completed"} 30.0' in text
        assert 'batchasr_job_items_total{status="failed"} 1.0' in text
        assert "batchasr_job_items_dead_lettered_total 1.0" in text
        assert 'batchasr_jobs_total{status="completed_with_errors"} 1.0' in text
        # the test's Redis keeps nothing on disk: the consumers said so, over their links
        assert 'batchasr_job_store_risk{risk="no_appendonly"} 1.0' in text
        assert 'batchasr_job_store_risk{risk="eviction"} 0.0' in text
    finally:
        worker.send_signal(signal.SIGTERM)
        output = worker.communicate(timeout=60)[0]
    assert worker.returncode == 0, output
    assert "2 job consumer processes" in output and "wc-1: 2 items in flight" in output and '"stopped"' in output
    records = asyncio.run(JobStore.from_url(redis_server.url).results(job.id))
    _check_results(records[:30], items[:30], expected)
    assert records[30]["status"] == "failed"


def _slow_upload(total_s: float):
    """A multipart upload that takes ``total_s`` to send: it holds a server's shutdown open that long."""
    boundary = "slow-upload"
    yield (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="x.wav"\r\n'
           "Content-Type: audio/wav\r\n\r\n").encode()
    for _ in range(int(total_s / 0.1)):
        time.sleep(0.1)
        yield bytes(1000)
    yield f"\r\n--{boundary}--\r\n".encode()


@pytest.mark.parametrize("frontends", [0, 1])
def test_serve_takes_no_job_items_after_sigterm_while_its_requests_finish(redis_server, parity_dir, parity_audio,
                                                                          frontends):
    """The consumer stopped only once uvicorn had finished every request (up to the request timeout): while one
    slow upload held that open, it took on the rest of the queue (66 items after the signal). The items in hand
    are finished; those queued stay queued, for another instance."""
    job, _ = asyncio.run(JobStore.from_url(redis_server.url).submit(upload_items(parity_audio, 200)))

    def counted(state: str) -> int:
        return asyncio.run(JobStore.from_url(redis_server.url).get(job.id)).counts.get(state, 0)

    with serve_process(parity_dir / MODEL_FILE, frontends=frontends, redis_url=redis_server.url, job_prefetch=2,
                       max_batch_size=2) as running:
        _wait_for(lambda: counted("completed") >= 4, 120, "no item completed")
        upload = threading.Thread(target=lambda: httpx.post(
            f"{running.url}/v1/transcribe", content=_slow_upload(10), timeout=60,
            headers={"content-type": "multipart/form-data; boundary=slow-upload"}), daemon=True)
        upload.start()
        time.sleep(0.5)
        running.process.send_signal(signal.SIGTERM)
        time.sleep(1.5)  # the items in hand at the signal are started and finished
        queued = counted("queued")
        time.sleep(4)
        assert running.process.poll() is None, "the upload holds the shutdown open"
        assert counted("queued") == queued > 0
        running.process.wait(60)
        upload.join(60)
    assert (counted("queued"), counted("failed")) == (queued, 0)
    assert running.process.returncode in (0, -signal.SIGTERM)  # uvicorn (frontends=0) raises the signal again


# --- item outcomes (in-process consumer) ---------------------------------------------------------------------------


def test_poison_item_fails_alone_and_is_dead_lettered(redis_server, model, parity_audio, expected):
    items = [*upload_items(parity_audio, 3), ItemInput(audio="broken.wav", upload=b"RIFF....not audio at all"),
             *upload_items(parity_audio, 2)]
    state = {}

    async def body(store):
        state["job"], _ = await store.submit(items)

    asyncio.run(drain_jobs(Settings(redis_url=redis_server.url), model, body))
    job_id = state["job"].id
    records = asyncio.run(JobStore.from_url(redis_server.url).results(job_id))
    assert [r["status"] for r in records] == ["completed"] * 3 + ["failed"] + ["completed"] * 2
    assert "cannot decode audio" in records[3]["error"]
    assert records[0]["text"] == expected[items[0].audio]
    assert _job_status(redis_server.client(), job_id)["status"] == "completed_with_errors"
    dead = redis_server.client().xrange(DEAD_LETTER_STREAM)
    assert len(dead) == 1 and dead[0][1][b"index"] == b"3"


def test_more_items_in_flight_than_redis_connections_wait_for_one(redis_server, model, parity_audio, expected):
    """Commands past the pool's size wait for a free connection: none fails as if Redis were gone, which would
    leave its item unacknowledged until the visibility timeout."""
    items = upload_items(parity_audio, 40)
    # a consumer reads a sixteenth of its items in flight at once: all 40 start together
    settings = Settings(redis_url=redis_server.url, job_prefetch=40 * READING_SHARE, job_visibility_timeout_s=600)

    async def run() -> str:
        stack = build_stack(settings, model)
        await stack.jobs.close()
        stack.jobs = JobStore.from_url(redis_server.url, max_connections=4)
        assert await asyncio.to_thread(stack.engine.wait_ready, 30)
        try:
            job, _ = await stack.jobs.submit(items)
            await asyncio.wait_for(stack.make_consumer().drain(), 120)
            return job.id
        finally:
            await stack.stop()

    job_id = asyncio.run(run())
    _check_results(asyncio.run(JobStore.from_url(redis_server.url).results(job_id)), items, expected)


def test_a_job_item_has_its_own_timeout_not_the_http_requests(redis_server, model, parity_audio):
    """A job item waits behind every HTTP request and may be hours long: it had REQUEST_TIMEOUT_S, a client's
    wait, so a recording longer than that took on a slow device timed out on every attempt and failed. Here a
    request timeout no 40 s recording meets, and the item's own (JOB_ITEM_TIMEOUT_S) that it does."""
    recording, _ = long_recording(parity_audio, 40)
    buffer = io.BytesIO()
    sf.write(buffer, recording, 16000, format="FLAC")
    items = [ItemInput(audio="long.flac", upload=buffer.getvalue())]
    settings = Settings(redis_url=redis_server.url, request_timeout_s=0.01, job_item_timeout_s=120)
    job, records = asyncio.run(_run_consumer(settings, model, items, timeout_s=60))
    assert job.counts["completed"] == 1, records
    assert records[0]["status"] == "completed" and records[0]["duration_s"] > 39


def test_a_worker_holds_the_audio_of_its_items_in_flight_within_its_budget(redis_server, model, parity_audio):
    """Long recordings: a worker keeping 8 items in flight of 5 s segments holds at most 40 s of audio, so one
    30 s recording at a time, and each is transcribed."""
    recording, _ = long_recording(parity_audio, 30)
    buffer = io.BytesIO()
    sf.write(buffer, recording, 16000, format="FLAC")
    items = [ItemInput(audio=f"long{i}.flac", upload=buffer.getvalue()) for i in range(5)]
    settings = Settings(redis_url=redis_server.url, job_prefetch=8, max_segment_s=5, max_wait_ms=300, max_batch_size=64)
    held: list[float] = []

    async def run() -> str:
        stack = build_stack(settings, model)
        assert await asyncio.to_thread(stack.engine.wait_ready, 30)
        consumer = stack.make_consumer()

        async def watch() -> None:
            while True:
                held.append(consumer.audio.held_s)
                await asyncio.sleep(0.002)

        watcher = asyncio.create_task(watch())
        stop = asyncio.Event()
        consuming = asyncio.create_task(consumer.run(stop))  # as a worker runs: items overlap (drain goes in rounds)
        try:
            job, _ = await stack.jobs.submit(items)
            while not (await stack.jobs.get(job.id)).finished:
                await asyncio.sleep(0.05)
            return job.id
        finally:
            stop.set()
            await asyncio.wait_for(consuming, 60)
            watcher.cancel()
            await stack.stop()

    job_id = asyncio.run(run())
    records = asyncio.run(JobStore.from_url(redis_server.url).results(job_id))
    assert [r["status"] for r in records] == ["completed"] * 5 and len({r["text"] for r in records}) == 1
    assert records[0]["duration_s"] == pytest.approx(len(recording) / 16000)
    assert max(held) == pytest.approx(len(recording) / 16000)  # one at a time: the budget holds one


def test_a_workers_item_holds_its_samples_not_its_uploads_bytes_while_transcribed(redis_server, model, parity_audio,
                                                                                   tmp_path):
    """The budget counts decoded seconds; an item's upload stayed in memory beside them until the item ended, three
    times its samples for a 48 kHz stereo WAV."""
    clip, _ = sf.read(parity_audio[0], dtype="float32")
    stereo_48k = np.repeat(np.interp(np.arange(len(clip) * 3) / 3, np.arange(len(clip)), clip)[:, None], 2, 1)
    path = tmp_path / "long.wav"  # submitted from the file: the test holds none of its bytes
    sf.write(path, np.tile(stereo_48k, (20, 1)), 48000, subtype="PCM_16")
    largest_held: list[int] = []

    async def setup(consumer, store):
        transcribe = consumer.transcriber.transcribe

        async def look_then_transcribe(*args, **kwargs):
            for _ in range(100):  # the decoding thread lets its arguments go a moment after its result is in
                largest = max(trace.size for trace in tracemalloc.take_snapshot().traces)
                if largest < path.stat().st_size / 2:
                    break
                await asyncio.sleep(0.01)
            largest_held.append(largest)
            return await transcribe(*args, **kwargs)

        consumer.transcriber.transcribe = look_then_transcribe
        return (await store.submit([ItemInput(audio="long.wav", upload=path)]))[0]

    tracemalloc.start()
    try:
        job, records = asyncio.run(_run_consumer(Settings(redis_url=redis_server.url), model, [], setup))
    finally:
        tracemalloc.stop()
    assert job.status.value == "completed" and records[0]["text"]
    size = path.stat().st_size
    assert len(largest_held) == 1 and largest_held[0] < size / 2, f"{largest_held[0]} bytes held of a {size} upload"


def test_a_worker_whose_gpu_broke_stops_taking_items_and_another_finishes_them(redis_server, model, parity_audio,
                                                                               expected):
    """A broken CUDA context fails every batch after it. A worker that went on taking items would fail each one
    at once, and the whole queue with them after their attempts ran out."""
    items = upload_items(parity_audio, 24)
    settings = Settings(redis_url=redis_server.url, job_prefetch=4, job_visibility_timeout_s=2, max_wait_ms=20)

    def illegal_address(*args, **kwargs):
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    async def run() -> str:
        broken = build_stack(settings, model)
        assert await asyncio.to_thread(broken.engine.wait_ready, 30)
        job, _ = await broken.jobs.submit(items)
        broken.engine._compute = illegal_address
        await asyncio.wait_for(broken.make_consumer().run(asyncio.Event()), 60)  # returns by itself
        assert broken.engine.failed and "illegal memory access" in broken.engine.error
        status = await broken.jobs.get(job.id)
        assert status.counts.get("failed", 0) == 0 and status.counts.get("queued", 0) >= len(items) - 4
        await broken.stop()
        healthy = build_stack(settings, model)
        assert await asyncio.to_thread(healthy.engine.wait_ready, 30)
        stop = asyncio.Event()
        consuming = asyncio.create_task(healthy.make_consumer().run(stop))
        try:
            while not (await healthy.jobs.get(job.id)).finished:
                await asyncio.sleep(0.1)
        finally:
            stop.set()
            await asyncio.wait_for(consuming, 60)
            await healthy.stop()
        return job.id

    job_id = asyncio.run(asyncio.wait_for(run(), 120))
    _check_results(asyncio.run(JobStore.from_url(redis_server.url).results(job_id)), items, expected)


def test_a_worker_keeps_the_batchers_pool_in_flight_within_half_the_queue():
    assert Settings().job_items_in_flight == POOL_FACTOR * Settings().max_batch_size
    assert Settings(max_batch_size=128, max_queue=512).job_items_in_flight == 256
    assert Settings(max_batch_size=128, max_queue=4096).job_items_in_flight == 2048
    assert Settings(max_batch_size=128, max_queue=4096).redis_max_connections == 256 + 32
    assert Settings(max_batch_size=128, max_queue=2048, job_prefetch=64).job_items_in_flight == 64
    with pytest.raises(ValueError):
        Settings(job_prefetch=0)


def test_an_upload_that_expired_before_a_worker_took_it_fails_with_the_reason(redis_server, model, parity_audio):
    items = upload_items(parity_audio, 2)
    state = {}

    async def body(store):
        state["job"], _ = await store.submit(items)
        await asyncio.sleep(1.5)  # past the input TTL: Redis drops the uploaded audio, the job stays

    asyncio.run(drain_jobs(Settings(redis_url=redis_server.url, job_input_ttl_s=1), model, body))
    records = asyncio.run(JobStore.from_url(redis_server.url).results(state["job"].id))
    assert [(r["audio"], r["status"]) for r in records] == [(i.audio, "failed") for i in items]
    assert all("expired before it was processed" in r["error"] for r in records)


def test_an_item_whose_input_record_cannot_be_read_fails_once(redis_server, model, parity_audio, expected):
    """A job written straight into Redis with an item's input missing or not JSON: each delivery raised on reading
    it, before the attempts were counted against the limit, so the item was delivered again for good and its job
    never ended."""
    items = upload_items(parity_audio, 3)
    state = {}

    async def body(store):
        state["job"], _ = await store.submit(items)
        inputs = f"batchasr:job:{state['job'].id}:inputs"
        await store.redis.hdel(inputs, 0)
        await store.redis.hset(inputs, 1, "{not json")

    asyncio.run(asyncio.wait_for(drain_jobs(Settings(redis_url=redis_server.url), model, body), 120))

    async def outcome(store: JobStore) -> tuple[Job, list[dict], Retried]:
        job_id = state["job"].id
        return await store.get(job_id), await store.results(job_id), await store.retry_failed(job_id)

    job, records, retried = asyncio.run(outcome(JobStore.from_url(redis_server.url)))
    assert (retried.retried, retried.unretried) == (0, 2)  # nothing to queue again (the script raised on them)
    assert job.status.value == "completed_with_errors" and job.counts["failed"] == 2
    assert [r["status"] for r in records] == ["failed", "failed", "completed"]
    assert "has no input record that can be read (none)" in records[0]["error"]
    assert "has no input record that can be read" in records[1]["error"]
    assert records[2]["text"] == expected[items[2].audio]
    attempts = redis_server.client().hgetall(f"batchasr:job:{job.id}:attempts")
    assert {int(v) for v in attempts.values()} == {1}
    assert redis_server.client().xpending(ITEM_STREAM, GROUP)["pending"] == 0


def test_a_stream_entry_that_names_no_item_is_dead_lettered_once(redis_server, model, parity_audio, expected):
    items = upload_items(parity_audio, 2)
    state = {}

    async def body(store):
        await store.ensure_group()
        await store.redis.xadd(ITEM_STREAM, {"something": "else"})  # another writer, or another version
        await store.redis.xadd(ITEM_STREAM, {"job": "job_x", "index": "not a number"})
        state["job"], _ = await store.submit(items)

    # before the fix such entries failed on every redelivery and the drain never ended
    asyncio.run(asyncio.wait_for(drain_jobs(Settings(redis_url=redis_server.url), model, body), 120))
    _check_results(asyncio.run(JobStore.from_url(redis_server.url).results(state["job"].id)), items, expected)
    client = redis_server.client()
    assert client.xpending(ITEM_STREAM, GROUP)["pending"] == 0  # acknowledged, so never redelivered
    dead = client.xrange(DEAD_LETTER_STREAM)
    assert len(dead) == 2 and all(b"not a job item" in fields[b"error"] for _, fields in dead)


def test_item_that_keeps_killing_workers_is_failed_after_max_attempts(redis_server, model, parity_audio):
    items = upload_items(parity_audio, 2)
    state = {}

    async def body(store):
        state["job"], _ = await store.submit(items)
        # as if two workers had died on item 1 already: it has been started max_attempts times
        await store.redis.hset(f"batchasr:job:{state['job'].id}:attempts", 1, 3)
        await store.record_error(state["job"].id, 1, "worker killed (out of memory)")

    asyncio.run(drain_jobs(Settings(redis_url=redis_server.url, job_max_attempts=3), model, body))
    records = asyncio.run(JobStore.from_url(redis_server.url).results(state["job"].id))
    assert records[0]["status"] == "completed"
    assert records[1]["status"] == "failed"
    assert records[1]["error"] == "gave up after 3 attempts: worker killed (out of memory)"


async def _run_consumer(settings: Settings, model, items: list[ItemInput], setup=None, timeout_s: float = 60,
                        metrics: Metrics | None = None) -> tuple[Job, list[dict]]:
    """Submit ``items`` as one job, run a consumer (``setup(consumer, store)`` first; it may submit the job itself
    and return it) until the job finishes, stop it; the job and its results. The consumer must still be running
    when the job finishes."""
    stack = build_stack(settings, model, metrics)
    assert await asyncio.to_thread(stack.engine.wait_ready, 30)
    try:
        consumer = stack.make_consumer()
        consumer.options = replace(consumer.options, reclaim_interval_s=0.2, block_ms=100)
        job = await setup(consumer, stack.jobs) if setup is not None else None
        if job is None:
            job, _ = await stack.jobs.submit(items)
        stop = asyncio.Event()
        task = asyncio.create_task(consumer.run(stop))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert not task.done(), f"the consumer stopped: {task.exception()!r}"
            with contextlib.suppress(*REDIS_ERRORS):  # a Redis the test restarts
                if (job := await stack.jobs.get(job.id)).finished:
                    break
            await asyncio.sleep(0.1)
        stop.set()
        await task
        return job, await stack.jobs.results(job.id)
    finally:
        await stack.stop()


def test_a_gone_workers_items_are_taken_once_no_one_holds_its_name(redis_server, model, parity_audio, expected,
                                                                   caplog):
    """A worker killed and replaced under a new name (a pod rescheduled) left its items to the visibility timeout,
    5 minutes. Once its name's lease has lapsed, and they have been idle as long, a running consumer takes them."""
    items = upload_items(parity_audio, 4)

    async def setup(consumer, store):
        consumer.options = replace(consumer.options, name_lease_s=1.0)
        job, _ = await store.submit(items)
        assert await store.hold_consumer_name("killed-pod", "its-instance", 1.0)
        assert len(await store.read_items("killed-pod", len(items), 0)) == len(items)  # taken, never finished
        return job

    with caplog.at_level(logging.INFO, logger="service.job_worker"):  # the visibility timeout as shipped: 300 s
        job, records = asyncio.run(_run_consumer(Settings(redis_url=redis_server.url), model, items, setup, 30))
    assert job.finished and job.counts["completed"] == len(items)
    _check_results(records, items, expected)
    assert "reclaimed 4 items from consumers gone (no running worker holds the name killed-pod)" in caplog.text


def test_a_running_workers_items_are_not_taken_however_long_it_holds_them(redis_server, model, parity_audio):
    items = upload_items(parity_audio, 2)

    async def setup(consumer, store):
        consumer.options = replace(consumer.options, name_lease_s=2.0)
        job, _ = await store.submit(items)
        assert await store.hold_consumer_name("busy-worker", "its-instance", 2.0)
        assert len(await store.read_items("busy-worker", len(items), 0)) == len(items)

        async def renew_its_lease() -> None:  # as a running consumer does, every third of a lease or more often
            while await store.hold_consumer_name("busy-worker", "its-instance", 2.0):
                await asyncio.sleep(0.3)

        asyncio.get_running_loop().create_task(renew_its_lease())  # ends with the scenario
        return job

    # the consumer judges from 2 s on: its items idle past the lease, but their worker holds its name
    job, _ = asyncio.run(_run_consumer(Settings(redis_url=redis_server.url), model, items, setup, timeout_s=7))
    assert job.counts["completed"] == 0 and not job.finished
    pending = redis_server.client().xinfo_consumers(ITEM_STREAM, GROUP)
    assert {entry["name"]: entry["pending"] for entry in pending}.get(b"busy-worker") == len(items)


def test_no_worker_is_taken_for_gone_until_this_one_has_been_connected_for_a_lease(redis_server, model,
                                                                                   parity_audio):
    """After an outage every lease may have lapsed: running consumers renew theirs within a third of a lease once
    Redis is back, so none is judged until this one has been connected for a lease."""
    stack = build_stack(Settings(redis_url=redis_server.url), model)

    async def scenario() -> list[int]:
        try:
            consumer, store = stack.make_consumer(), stack.jobs
            consumer.options = replace(consumer.options, name_lease_s=0.5)
            await store.submit(upload_items(parity_audio, 2))
            assert len(await store.read_items("gone-worker", 2, 0)) == 2
            await asyncio.sleep(0.6)  # idle past the lease, and no lease held
            await consumer._renew_name()
            claimed = []
            consumer._connected_since = time.monotonic()  # just connected (again)
            claimed.append(len(await consumer._claim_from_gone([ITEM_STREAM], 10)))
            consumer._failed(RedisConnectionError("Connection closed by server."))  # an outage
            claimed.append(len(await consumer._claim_from_gone([ITEM_STREAM], 10)))
            consumer._connected_since = time.monotonic() - 0.5  # connected for a lease
            claimed.append(len(await consumer._claim_from_gone([ITEM_STREAM], 10)))
            return claimed
        finally:
            await stack.stop()

    assert asyncio.run(scenario()) == [0, 0, 2]


def test_a_dead_workers_backlog_is_reclaimed_as_fast_as_there_is_room(redis_server, model, parity_audio, expected):
    """A worker that dies holding many items: a consumer with room for two at a time looked for stalled items once
    per reclaim interval, so taking back twelve took six intervals. Now a look that fills the room is followed
    by another as soon as there is room again."""
    items = upload_items(parity_audio, 12)

    async def setup(consumer, store):
        consumer.options = replace(consumer.options, prefetch=2, reclaim_interval_s=60.0)
        job, _ = await store.submit(items)
        assert len(await store.read_items("dead-worker", len(items), 0)) == len(items)  # taken, never finished
        await asyncio.sleep(0.5)  # past the visibility timeout
        return job

    settings = Settings(redis_url=redis_server.url, job_visibility_timeout_s=0.3)
    job, records = asyncio.run(_run_consumer(settings, model, items, setup, timeout_s=30))
    assert job.finished and job.counts["completed"] == len(items)
    _check_results(records, items, expected)


def test_items_reclaimed_in_a_step_whose_upkeep_then_fails_are_started_all_the_same(redis_server, model,
                                                                                    parity_audio, expected):
    """A dead worker's two items reclaimed, and then the same step's trimming met Redis gone away: the items went
    with the failed step, held by this consumer and started by none, until the visibility timeout passed again and
    they were reclaimed a second time."""
    items = upload_items(parity_audio, 2)

    async def setup(consumer, store):
        job, _ = await store.submit(items)
        assert len(await store.read_items("dead-worker", len(items), 0)) == len(items)  # taken, never finished
        await asyncio.sleep(0.5)  # past the visibility timeout
        trim = store.trim_acknowledged

        async def refused_once() -> int:
            store.trim_acknowledged = trim
            raise RedisConnectionError("Connection closed by server.")  # Redis restarting

        store.trim_acknowledged = refused_once
        return job

    settings = Settings(redis_url=redis_server.url, job_visibility_timeout_s=0.3)
    metrics = Metrics()
    _, records = asyncio.run(_run_consumer(settings, model, items, setup, timeout_s=30, metrics=metrics))
    _check_results(records, items, expected)
    assert metrics.registry.get_sample_value("batchasr_job_items_reclaimed_total") == len(items)  # once each


@pytest.mark.parametrize("prefetch", [64, 2])
def test_an_item_slower_than_the_visibility_timeout_stays_with_its_live_worker(redis_server, model, parity_audio,
                                                                               expected, prefetch):
    """Its delivery's idle time is reset while it is worked on: without that it was reclaimed every timeout, run
    again, and failed at its fourth start as "the worker died" (while the first run was still going). A window of
    two, both slow items in it, left the worker waiting for room without renewing them: another worker's look for
    stalled deliveries took them."""
    items = upload_items(parity_audio, 2)
    calls, taken_by_another = [], []

    async def slow_transcriber(consumer, store):
        transcribe = consumer.transcriber.transcribe

        async def slow(*args):
            calls.append(args)
            await asyncio.sleep(3.5)  # three and a half visibility timeouts
            return await transcribe(*args)

        async def another_worker():  # looks for stalled deliveries as often as it may; asyncio.run ends it
            while True:
                for stream in await store.streams_with_pending():
                    taken_by_another.extend((await store.claim_stalled(stream, "another", 1.0, 10))[1])
                await asyncio.sleep(0.2)

        consumer.transcriber.transcribe = slow
        asyncio.get_running_loop().create_task(another_worker())

    settings = Settings(redis_url=redis_server.url, job_visibility_timeout_s=1.0, job_prefetch=prefetch)
    job, records = asyncio.run(_run_consumer(settings, model, items, slow_transcriber))
    assert taken_by_another == [] and len(calls) == 2
    _check_results(records, items, expected)
    attempts = redis_server.client().hgetall(f"batchasr:job:{job.id}:attempts")
    assert {int(v) for v in attempts.values()} == {1}


def test_a_transcription_that_times_out_is_retried_with_its_reason(redis_server, model, parity_audio):
    async def always_times_out(consumer, store):
        async def timeout(*args):
            raise TimeoutError  # as asyncio.wait_for raises it: an OSError, which is not a Redis error

        consumer.transcriber.transcribe = timeout

    settings = Settings(redis_url=redis_server.url, job_visibility_timeout_s=0.3, job_max_attempts=2)
    _, records = asyncio.run(_run_consumer(settings, model, upload_items(parity_audio, 1), always_times_out))
    assert records[0]["error"] == "gave up after 2 attempts: timed out"


def test_an_item_held_behind_other_work_its_whole_timeout_is_queued_again_without_an_attempt(
        redis_server, model, parity_audio, expected):
    """Starved by HTTP requests (or more urgent jobs) for its whole timeout, none of it run, an item spent an attempt
    each time, and was failed for good after three ("gave up after 2 attempts: timed out: dropped before it ran")
    while the server answered 772 requests. Such a wait now queues it again; one dropped soon after it was queued (it
    could not be done in time at the engine's pace) still spends its attempt."""
    calls = []

    def starved_first(wait_s: float):
        async def setup(consumer, store):
            transcribe = consumer.transcriber.transcribe

            async def starved(*args):
                calls.append(1)
                if len(calls) <= 2:
                    await asyncio.sleep(wait_s)
                    raise NeverRan("dropped before it ran")
                return await transcribe(*args)

            consumer.transcriber.transcribe = starved
        return setup

    items = upload_items(parity_audio, 1)
    settings = Settings(redis_url=redis_server.url, job_item_timeout_s=1.0, job_max_attempts=1,
                        job_visibility_timeout_s=0.3)
    job, records = asyncio.run(_run_consumer(settings, model, items, starved_first(0.6)))
    _check_results(records, items, expected)
    assert len(calls) == 3 and redis_server.client().hgetall(f"batchasr:job:{job.id}:attempts") == {b"0": b"1"}
    calls.clear()
    _, records = asyncio.run(_run_consumer(settings, model, items, starved_first(0.0)))
    assert records[0]["status"] == "failed" and "dropped before it ran" in records[0]["error"]


def test_an_item_of_more_pieces_than_the_queue_holds_fails_at_once(redis_server, model, parity_audio, expected):
    recording, _ = long_recording(parity_audio, 30)
    buffer = io.BytesIO()
    sf.write(buffer, recording, 16000, format="WAV")
    items = [ItemInput(audio="long.wav", upload=buffer.getvalue()), *upload_items(parity_audio, 1)]
    settings = Settings(redis_url=redis_server.url, max_queue=4, max_segment_s=5, segment_overlap_s=1)
    job, records = asyncio.run(_run_consumer(settings, model, items, timeout_s=30))
    assert job.status.value == "completed_with_errors"
    # job items fill at most 3/4 of the queue (batcher.queue_limit)
    assert records[0]["status"] == "failed" and "more than the queue ever holds (3)" in records[0]["error"]
    assert records[1]["status"] == "completed" and records[1]["text"] == expected[items[1].audio]


def test_a_full_redis_lets_items_in_flight_finish_and_frees_their_audio(redis_server, model, parity_audio, expected):
    """Redis at its maxmemory (noeviction) refuses writes. The consumer used to die on the refusal, and had it
    lived, no item could start or finish, so no upload was freed: Redis stayed full until the jobs expired."""
    items = upload_items(parity_audio, 8)
    client = redis_server.client()

    async def fill_redis(consumer, store):
        await store.ensure_group()
        job, _ = await store.submit(items)  # a job queued before Redis filled up
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", client.info("memory")["used_memory"] - 1024)
        with pytest.raises(OutOfMemoryError):
            await store.submit(items[:1])
        return job

    _, records = asyncio.run(_run_consumer(Settings(redis_url=redis_server.url), model, items, fill_redis))
    _check_results(records, items, expected)
    assert not client.keys("batchasr:upload:*")
    assert client.info("memory")["used_memory"] < int(client.config_get("maxmemory")["maxmemory"])


def test_finishing_an_item_frees_its_upload_and_dead_letters_a_failure_with_it(redis_server, parity_audio):
    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url)
        job, _ = await store.submit(upload_items(parity_audio, 3))
        uploads = [f"batchasr:upload:{job.id}:{i}" for i in range(3)]
        for index in range(2):
            await store.start_item(job.id, index)
        await store.finish_item(job.id, 0, "completed", item_record("a.wav", "completed", text="hi"))
        await store.finish_item(job.id, 1, "failed", item_record("b.wav", "failed", error="bad"), error="bad")
        assert [await store.redis.exists(key) for key in uploads] == [0, 0, 1]  # the job goes on
        dead = await store.redis.xrange(DEAD_LETTER_STREAM)
        assert [(f[b"job"].decode(), f[b"index"], f[b"error"]) for _, f in dead] == [(job.id, b"1", b"bad")]
        assert await store.finish_item(job.id, 1, "failed", item_record("b.wav", "failed", error="x"), error="x") == 0
        assert await store.redis.xlen(DEAD_LETTER_STREAM) == 1  # a redelivery writes nothing twice
        await store.close()

    asyncio.run(scenario())


def test_a_worker_restarted_under_its_name_takes_back_at_once_what_it_held(redis_server, model, parity_audio,
                                                                          expected, caplog):
    """A worker killed and started again under the same name (a container restarted in place keeps its host-pid
    name) waited out the visibility timeout, five minutes by default, for the items its last life held."""
    items = upload_items(parity_audio, 6)

    async def setup(consumer, store):
        job, _ = await store.submit(items)
        assert len(await store.read_items(consumer.options.name, 4, 0)) == 4  # its last life's: never finished
        return job

    settings = Settings(redis_url=redis_server.url)  # the visibility timeout of 300 s
    metrics = Metrics()
    with caplog.at_level(logging.INFO, logger="service.job_worker"):
        job, records = asyncio.run(_run_consumer(settings, model, items, setup, timeout_s=30, metrics=metrics))
    assert job.finished and job.counts["completed"] == len(items)
    _check_results(records, items, expected)
    assert metrics.registry.get_sample_value("batchasr_job_items_reclaimed_total") == 4
    assert "took back 4 items that its name held when its last run ended" in caplog.text


def test_a_consumer_takes_back_its_names_items_only_while_no_other_running_instance_holds_the_name(
        redis_server, model, caplog):
    """Two instances under one name (two workers given one --name; host-pid alike under host networking): one
    starting took every item the other was working on. Now the name is held by a lease its holder renews; a killed
    instance's lapses, and its items are taken back then; another's running one is left alone, and said."""
    async def scenario() -> None:
        stack = build_stack(Settings(redis_url=redis_server.url), model)
        try:
            consumer, store = stack.make_consumer(), stack.jobs
            name = consumer.options.name
            await store.ensure_group()
            await store.submit([ItemInput(audio=f"{i}.wav", url=f"https://media.example/{i}.wav") for i in range(3)])
            assert len(await store.read_items(name, 3, 0)) == 3  # in the other instance's hands
            assert await store.hold_consumer_name(name, "the-other-instance", 60)
            await consumer._renew_name()
            assert await consumer._reclaim_stalled(10) == []
            consumer._name_refused_since -= NAME_LEASE_S  # refused for a whole lease: not a previous life's
            await consumer._renew_name()
            assert "another running consumer has the name" in caplog.text
            await store.release_consumer_name(name, "the-other-instance")  # it stopped (or its lease lapsed)
            await consumer._renew_name()
            assert len(await consumer._reclaim_stalled(10)) == 3
        finally:
            await stack.stop()

    asyncio.run(scenario())


async def _url_items_delivered(store: JobStore, n: int, consumer: str, count: int) -> list[bytes]:
    """``n`` URL items submitted as one job, ``count`` of them delivered to ``consumer``: their message ids."""
    await store.ensure_group()
    await store.submit([ItemInput(audio=f"{i}.wav", url=f"https://media.example/{i}.wav") for i in range(n)])
    reply = await store.redis.xreadgroup(GROUP, consumer, {ITEM_STREAM: ">"}, count=count)
    return [message_id for message_id, _ in reply[0][1]]


def test_a_consumer_takes_back_only_the_deliveries_to_its_name_it_does_not_hold(redis_server):
    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url)
        delivered = await _url_items_delivered(store, 5, "w", 4)
        await store.redis.xreadgroup(GROUP, "other", {ITEM_STREAM: ">"}, count=1)  # another's: not taken
        await store.redis.xdel(ITEM_STREAM, delivered[3])  # trimmed away while pending: acknowledged, not taken
        found, taken = await store.claim_own_left(ITEM_STREAM, "w", 10, {delivered[0]})  # one in hand
        assert found == 3 and [message_id for message_id, _ in taken] == delivered[1:3]
        assert all(fields[b"job"] for _, fields in taken)
        assert await store.claim_own_left(ITEM_STREAM, "w", 10, set(delivered[:3])) == (0, [])
        owners = [entry["consumer"] for entry in await store.redis.xpending_range(ITEM_STREAM, GROUP, "-", "+", 10)]
        assert owners == [b"w", b"w", b"w", b"other"]
        await store.close()

    asyncio.run(scenario())


def test_stalled_deliveries_behind_many_live_ones_are_reached(redis_server):
    """XAUTOCLAIM looks at ten pending entries per one asked for. Each look used to start over at the oldest, so a
    consumer with little room never got past the deliveries live workers were still renewing."""
    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url)
        delivered = await _url_items_delivered(store, 30, "live", 30)
        await asyncio.sleep(0.3)
        await store.keep_claimed(ITEM_STREAM, "live", delivered[:25])  # a live worker renews these; 5 stall
        start, claimed = "0-0", []
        for _ in range(5):
            start, stalled = await store.claim_stalled(ITEM_STREAM, "new", 0.2, 1, start)
            claimed += [message_id for message_id, _ in stalled]
        assert claimed and set(claimed) <= set(delivered[25:])
        await store.close()

    asyncio.run(scenario())


def test_a_worker_renews_only_the_deliveries_still_its_own(redis_server):
    """A worker stopped past the visibility timeout (SIGSTOP, a long pause) and then continued renewed every item it
    held, taking back those another worker had reclaimed: both transcribed them, and their audio counted twice."""
    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url)
        held = await _url_items_delivered(store, 4, "paused", 4)
        await asyncio.sleep(0.3)
        _, taken = await store.claim_stalled(ITEM_STREAM, "other", 0.2, 2)  # the visibility timeout passed
        assert [message_id for message_id, _ in taken] == held[:2]
        assert await store.keep_claimed(ITEM_STREAM, "paused", held) == 2  # it continues, and renews
        owners = {entry["message_id"]: entry["consumer"]
                  for entry in await store.redis.xpending_range(ITEM_STREAM, GROUP, "-", "+", 10)}
        assert [owners[message_id] for message_id in held] == [b"other", b"other", b"paused", b"paused"]
        await store.close()

    asyncio.run(scenario())


def test_the_names_of_consumers_gone_are_forgotten_but_not_those_holding_items(redis_server):
    """Every restarted worker joins the group under a new host-pid name; the old names stayed in it for good. On
    every stream: the priorities', the API keys' and the webhooks'."""
    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url)
        await store.ensure_group()
        await store.submit([ItemInput(audio="a.wav", url="https://media.example/a.wav")])
        await store.submit([ItemInput(audio="b.wav", url="https://media.example/b.wav")],
                           options=JobOptions(owner="someone"))
        owned = item_stream(JobPriority.NORMAL, "someone")
        await store.redis.xreadgroup(GROUP, "holding", {ITEM_STREAM: ">"}, count=1)
        for stream in (ITEM_STREAM, owned, WEBHOOK_STREAM):
            for name in ("gone-1", "gone-2"):  # workers that took items, acknowledged them, and went
                await store.redis.xgroup_createconsumer(stream, GROUP, name)
        await asyncio.sleep(0.3)
        await store.redis.xgroup_createconsumer(ITEM_STREAM, GROUP, "live")
        assert await store.forget_gone_consumers(0.2) == 6
        names = {c["name"] for c in await store.redis.xinfo_consumers(ITEM_STREAM, GROUP)}
        assert names == {b"holding", b"live"}
        assert await store.redis.xinfo_consumers(owned, GROUP) == []
        assert await store.redis.xinfo_consumers(WEBHOOK_STREAM, GROUP) == []
        assert await store.forget_gone_consumers(0.2) == 0
        await store.close()

    asyncio.run(scenario())


def test_trimming_counts_what_it_dropped_leaves_streams_without_the_group_and_works_with_redis_full(
        redis_server, parity_audio):
    """One script over every stream: an owner's stream listed before its group was made is left whole, and a Redis
    at its maxmemory still trims (XTRIM frees memory, and the script may run when writes are refused)."""
    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url)
        await store.ensure_group()
        await store.submit(upload_items(parity_audio, 6))
        no_group = item_stream(JobPriority.NORMAL, "someone")
        await store.redis.xadd(no_group, {"job": "x", "index": 0})
        await store.redis.hset(OWNER_STREAMS_KEY, no_group, JobPriority.NORMAL.value)
        reply = await store.redis.xreadgroup(GROUP, "c", {ITEM_STREAM: ">"}, count=6)
        await store.redis.xack(ITEM_STREAM, GROUP, *[message_id for message_id, _ in reply[0][1]])
        client = redis_server.client()
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", client.info("memory")["used_memory"] - 1024)
        with pytest.raises(OutOfMemoryError):
            await store.redis.set("anything", 1)
        assert await store.trim_acknowledged() == 5  # kept from the last one delivered
        assert await store.redis.xlen(ITEM_STREAM) == 1 and await store.redis.xlen(no_group) == 1
        assert await store.trim_acknowledged() == 0
        await store.close()

    asyncio.run(scenario())


def test_cancelled_results_expire_with_their_job_before_it_ends(redis_server):
    """Cancelling around an item in progress does not end the job, so nothing else gave the results hash the
    cancel created a TTL: had the job never ended, it would have stayed for ever."""
    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url)
        items = [ItemInput(audio=f"{i}.wav", url=f"https://media.example/{i}.wav") for i in range(3)]
        job, _ = await store.submit(items)
        await store.start_item(job.id, 1)
        assert (await store.cancel(job.id))[0].status.value == "in_progress"
        assert 0 < await store.redis.ttl(RESULTS_KEY.format(job_id=job.id)) <= await store.redis.ttl(
            f"batchasr:job:{job.id}")
        await store.close()

    asyncio.run(scenario())


def test_the_stream_keeps_only_entries_not_yet_acknowledged(redis_server, parity_audio):
    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url)
        await store.ensure_group()
        await store.submit(upload_items(parity_audio, 10))
        everything = [message_id for message_id, _ in await store.redis.xrange(ITEM_STREAM)]
        reply = await store.redis.xreadgroup(GROUP, "c", {ITEM_STREAM: ">"}, count=6)
        delivered = [message_id for message_id, _ in reply[0][1]]
        await store.redis.xack(ITEM_STREAM, GROUP, *delivered[:3], delivered[4])  # 3 and 5 still pending
        await store.trim_acknowledged()
        assert [m for m, _ in await store.redis.xrange(ITEM_STREAM)] == everything[3:]  # from the oldest pending
        await store.redis.xack(ITEM_STREAM, GROUP, delivered[3], delivered[5])
        await store.trim_acknowledged()
        # all delivered ones acknowledged: kept from the last delivered on, and the four never delivered
        assert [m for m, _ in await store.redis.xrange(ITEM_STREAM)] == everything[5:]
        assert await store.stream_lag() == 4  # the group's lag still counts right after trimming
        await store.close()

    asyncio.run(scenario())


def test_cancel_stops_unstarted_items(redis_server, model, parity_audio):
    items = upload_items(parity_audio, 20)
    state = {}

    async def body(store):
        state["job"], _ = await store.submit(items)
        state["cancelled"], _ = await store.cancel(state["job"].id)

    asyncio.run(drain_jobs(Settings(redis_url=redis_server.url), model, body))
    cancelled = state["cancelled"]
    assert cancelled.status.value == "cancelled" and cancelled.counts["cancelled"] == 20
    records = asyncio.run(JobStore.from_url(redis_server.url).results(state["job"].id))
    assert {r["status"] for r in records} == {"cancelled"}
    client = redis_server.client()
    assert client.xpending(ITEM_STREAM, GROUP)["pending"] == 0  # the consumer acknowledged without working
    assert not client.keys("batchasr:upload:*")  # inputs of a finished job are dropped


def test_cancel_stops_the_items_a_worker_holds(redis_server, model, parity_audio):
    """A worker reads items ahead (up to its prefetch) and starts them: a cancel reached none of those, so a job
    smaller than the prefetch could not be stopped (24 of 24 transcribed, and the job ended "completed"). Here
    every item waits in the batcher (a batch is held for MAX_WAIT_MS to fill) when the job is cancelled: the
    worker lets them go, and the job ends cancelled without waiting for them."""
    n = 8
    items = upload_items(parity_audio, n)
    settings = Settings(redis_url=redis_server.url, max_batch_size=64, max_wait_ms=120_000, job_prefetch=n)

    async def submit() -> str:
        store = JobStore.from_url(redis_server.url)
        job, _ = await store.submit(items)
        await store.close()
        return job.id

    with run_server(settings, model) as running:
        job_id = asyncio.run(submit())

        def job() -> dict:
            return httpx.get(f"{running.url}/v1/jobs/{job_id}", timeout=30).json()

        _wait_for(lambda: running.metric("batchasr_queue_depth") == n, 60, "the items to wait in the batcher")
        assert job()["counts"]["in_progress"] == n
        dropped = running.metric("batchasr_dropped_items_total", '{reason="cancelled"}')
        cancelled_at = time.monotonic()
        assert httpx.delete(f"{running.url}/v1/jobs/{job_id}", timeout=30).status_code == 200
        _wait_for(lambda: job()["status"] == "cancelled", 30, "the job to end cancelled")
        assert time.monotonic() - cancelled_at < 30  # long before the batch would have been released
        assert job()["counts"] == {"queued": 0, "in_progress": 0, "completed": 0, "failed": 0, "cancelled": n}
        _wait_for(lambda: running.metric("batchasr_queue_depth") == 0, 10, "the batcher to let them go")
        assert running.metric("batchasr_dropped_items_total", '{reason="cancelled"}') - dropped == n
        assert running.metric("batchasr_jobs_total", '{status="cancelled"}') == 1
    records = asyncio.run(JobStore.from_url(redis_server.url).results(job_id))
    assert records == [item_record(item.audio, "cancelled") for item in items]
    client = redis_server.client()
    assert client.xpending(ITEM_STREAM, GROUP)["pending"] == 0
    assert not client.keys("batchasr:upload:*")


def test_a_cancel_stops_the_decoding_of_an_item_under_way(redis_server, model, parity_audio, monkeypatch):
    """A cancelled item's decode ran on in its thread to the end (a recording of hours, decoded for no one, its
    memory held meanwhile): now the cancel reaches the thread, which gives up at its next block."""
    entered, outcomes = threading.Event(), []
    decode = job_worker.decode_audio

    def decode_waiting_for_the_cancel(body, limits, multichannel, stretch, stop=None):
        entered.set()
        outcomes.append(stop is not None and stop.wait(30))  # the cancel reaches this thread
        try:
            return decode(body, limits, multichannel, stretch, stop)
        except DecodeStopped:
            outcomes.append("stopped")
            raise

    monkeypatch.setattr(job_worker, "decode_audio", decode_waiting_for_the_cancel)
    with run_server(Settings(redis_url=redis_server.url), model) as running:
        job = httpx.post(f"{running.url}/v1/jobs", files=[("files", ("a.wav", Path(parity_audio[0]).read_bytes(),
                                                                      "audio/wav"))], timeout=30).json()
        _wait_for(entered.is_set, 30, "the item's decode never began")
        assert httpx.delete(f"{running.url}/v1/jobs/{job['id']}", timeout=30).status_code == 200
        _wait_for(lambda: httpx.get(f"{running.url}/v1/jobs/{job['id']}", timeout=30).json()["status"] == "cancelled",
                  30, "the job to end cancelled")
        _wait_for(lambda: len(outcomes) == 2, 30, "the decode did not end")
    assert outcomes == [True, "stopped"]


def test_a_retry_of_a_cancelled_jobs_failed_items_runs_them(redis_server):
    """The cancel is remembered on the job, so that items started later are cancelled; a retry of its failed
    items sets it aside for them, or they would be cancelled as they start."""
    items = [ItemInput(audio=f"{i}.wav", url=f"https://media.example/{i}.wav") for i in range(3)]

    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url)
        job, _ = await store.submit(items)
        await store.start_item(job.id, 0)
        await store.start_item(job.id, 1)
        await store.cancel(job.id)
        assert (await store.start_item(job.id, 1)).state == "cancelling"  # a worker's next look at it
        assert (await store.start_item(job.id, 1)).record == {"audio": items[1].audio}
        await store.finish_item(job.id, 0, "failed", item_record(items[0].audio, "failed", error="x"), error="x")
        assert await store.finish_item(job.id, 1, "cancelled", item_record(items[1].audio, "cancelled")) == 2
        assert (await store.get(job.id)).status.value == "cancelled"
        assert await store.cancel_requested([job.id, "no-such-job"]) == {job.id: 1, "no-such-job": math.inf}
        assert (await store.retry_failed(job.id)).retried == 1
        assert await store.cancel_requested([job.id]) == {job.id: 1}  # for items held since before the cancel
        retried = await store.start_item(job.id, 0)
        assert retried.state == "in_progress" and retried.cancels == 1
        # a look at the cancels that began before the retry and answers after it stops nothing begun since
        watch = CancelWatch()
        with watch.holding(job.id, retried.cancels) as cancelled:
            watch.cancelled({job.id: 1})
            assert not cancelled.is_set()
            await store.cancel(job.id)  # a second cancel does
            watch.cancelled(await store.cancel_requested([job.id]))
            assert cancelled.is_set()
        assert watch.jobs() == []
        await store.close()

    asyncio.run(scenario())


def test_an_item_held_when_its_job_was_cancelled_stops_though_a_retry_came_before_its_consumer_looked(
        redis_server):
    """A cancel, then a retry of the failed items within the second before the consumers look for cancels: the item
    a consumer held since before the cancel is still stopped at its look. (The retry deleted the cancel, and the
    item ran to the end.)"""
    items = [ItemInput(audio=f"{i}.wav", url=f"https://media.example/{i}.wav") for i in range(2)]

    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url)
        job, _ = await store.submit(items)
        held = await store.start_item(job.id, 0)
        await store.start_item(job.id, 1)
        await store.finish_item(job.id, 1, "failed", item_record(items[1].audio, "failed", error="x"), error="x")
        watch = CancelWatch()
        with watch.holding(job.id, held.cancels) as cancelled:
            await store.cancel(job.id)
            assert (await store.retry_failed(job.id)).retried == 1
            watch.cancelled(await store.cancel_requested([job.id]))  # the consumer's look, after the retry
            assert cancelled.is_set()
        assert (await store.start_item(job.id, 1)).state == "in_progress"  # the retried item runs
        await store.close()

    asyncio.run(scenario())


def test_a_retry_between_a_jobs_end_and_its_expiry_keeps_a_new_jobs_time(redis_server):
    """The end's step, then its records given the results' time: a retry of the failed items between the two kept
    a new job's time, and the expiry after it cut that to the results' (here 10 s, not 110 s)."""
    item = ItemInput(audio="a.wav", url="https://media.example/a.wav")

    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url, input_ttl_s=100, result_ttl_s=10)
        expire_finished = store._expire_finished

        async def retried_first(job_id: str) -> None:
            assert (await store.retry_failed(job_id)).retried == 1
            await expire_finished(job_id)

        try:
            job, _ = await store.submit([item])
            await store.start_item(job.id, 0)
            store._expire_finished = retried_first
            assert await store.finish_item(job.id, 0, "failed", item_record("a.wav", "failed", error="x"),
                                           error="x") == 2
            assert (await store.get(job.id)).status.value == "in_progress"
            assert await store.redis.ttl(JOB_KEY.format(job_id=job.id)) > 100
        finally:
            await store.close()

    asyncio.run(scenario())


def test_a_cancel_goes_through_a_full_redis_and_writes_nothing_for_a_job_gone(redis_server, parity_audio):
    """A full Redis (noeviction) is when an operator cancels: the cancel's first write was a plain HSET, which
    Redis refused there. And a job purged (or expired) between the cancel's read and its write was recreated as a
    record of that one field, with no TTL, that every read of it then failed on."""
    client = redis_server.client()

    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url)
        job, _ = await store.submit(upload_items(parity_audio, 5))
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", client.info("memory")["used_memory"] - 1024)
        try:
            with pytest.raises(OutOfMemoryError):
                await store.submit(upload_items(parity_audio, 1))
            cancelled, ended = await store.cancel(job.id)
            assert ended and cancelled.status.value == "cancelled" and cancelled.counts["cancelled"] == 5
        finally:
            client.config_set("maxmemory", 0)
        gone, _ = await store.submit(upload_items(parity_audio, 1))
        await store.delete(gone.id)
        assert await store._request_cancel(keys=[JOB_KEY.format(job_id=gone.id)]) == 0  # what cancel does next
        assert not client.exists(JOB_KEY.format(job_id=gone.id))
        await store.close()

    asyncio.run(scenario())


def test_a_job_that_cancelling_ends_is_counted_once(redis_server, model, parity_audio):
    """With no item in progress, the cancel ends the job: no consumer finishes it, so the route counts it (it was
    never counted: Grafana's jobs by final status missed every job cancelled before it started)."""
    store = JobStore.from_url(redis_server.url)

    async def unseen_job() -> Job:  # queued before the server starts, its stream entries gone: no consumer takes one
        job, _ = await store.submit(upload_items(parity_audio, 3))
        await store.redis.xtrim(ITEM_STREAM, maxlen=0)
        return job

    job = asyncio.run(unseen_job())
    with run_server(Settings(redis_url=redis_server.url), model) as running:
        for _ in range(2):  # the second cancel finds nothing left to end
            cancelled = httpx.delete(f"{running.url}/v1/jobs/{job.id}")
            assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
        assert running.metric("batchasr_jobs_total", '{status="cancelled"}') == 1


def test_cancelling_a_large_job_spares_the_item_in_progress(redis_server):
    items = [ItemInput(audio=f"https://media.example/{i}.wav", url=f"https://media.example/{i}.wav")
             for i in range(2500)]

    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url)
        job, _ = await store.submit(items, options=JobOptions(webhook_url="https://hooks.example.com/x"))
        await store.start_item(job.id, 1234)
        cancelled, ended = await store.cancel(job.id)  # across three pages of items
        assert not ended  # an item is in progress: its consumer ends the job
        assert cancelled.status.value == "in_progress"
        assert cancelled.counts == {"queued": 0, "in_progress": 1, "completed": 0, "failed": 0, "cancelled": 2499}
        records = await store.results(job.id)
        assert records[0] == item_record(items[0].audio, "cancelled") and records[1234]["status"] == "in_progress"
        assert (await store.cancel(job.id))[0].counts["cancelled"] == 2499  # again: nothing more to cancel
        assert await store.finish_item(job.id, 1234, "completed", item_record(items[1234].audio, "completed")) == 2
        assert (await store.get(job.id)).status.value == "cancelled"
        assert await store.redis.xlen(WEBHOOK_STREAM) == 1  # its webhook, queued as the job ended
        await store.close()

    asyncio.run(scenario())


def test_a_submission_answers_with_its_job_as_written_even_if_it_is_purged_at_once(redis_server):
    """The job was read back from Redis to answer the submission: one purged (or lost) in that moment made the
    submission a 500, though it had been queued."""
    items = [ItemInput(audio="https://media.example/a.wav", url="https://media.example/a.wav")]
    options = JobOptions(webhook_url="https://hooks.example.com/x", priority=JobPriority.HIGH, multichannel=True,
                         skip_silence=True, owner="owner-1", channel_names=("agent", "caller"), hotwords=("acme",))

    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url)
        job, created = await store.submit(items, "key-1", options)
        assert created and job.to_dict() == (await store.get(job.id)).to_dict()  # what a reader sees
        real_hgetall, purges = store.redis.hgetall, []

        async def purged_first(name, *args):  # the job is purged the moment before any read of it
            if not purges:
                purges.append(name)
                await store.delete(str(name).split(":")[2])
            return await real_hgetall(name, *args)

        store.redis.hgetall = purged_first
        second, created = await store.submit(items, options=options)
        assert created and second.status.value == "queued" and second.counts["queued"] == 1
        await store.close()

    asyncio.run(scenario())


def test_results_expire_after_the_job(redis_server, model, parity_audio):
    state = {}

    async def body(store):
        state["job"], _ = await store.submit(upload_items(parity_audio, 2))

    asyncio.run(drain_jobs(Settings(redis_url=redis_server.url, job_result_ttl_s=120), model, body))
    ttl = redis_server.client().ttl(RESULTS_KEY.format(job_id=state["job"].id))
    assert 0 < ttl <= 120


def test_a_finish_written_again_after_an_outage_still_sets_the_finished_jobs_expiry(redis_server):
    """The result script ended the job, then the outage met the expiry that follows it; the write tried again found
    the result there (0) and set none: the job's keys kept the submission's TTL, days past JOB_RESULT_TTL_S."""
    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url)
        store.result_ttl_s = 120
        await store.ensure_group()
        job, _ = await store.submit([ItemInput(audio="a.wav", url="https://media.example/a.wav")])
        await store.start_item(job.id, 0)
        record = item_record("a.wav", "completed", text="a")
        assert await store.finish_item(job.id, 0, "completed", record) == 2
        results = RESULTS_KEY.format(job_id=job.id)
        await store.redis.persist(results)  # as if the expiry had not been reached
        assert await store.finish_item(job.id, 0, "completed", record) == 0
        assert 0 < await store.redis.ttl(results) <= 120
        await store.close()

    asyncio.run(scenario())
