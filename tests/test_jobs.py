"""Bulk jobs against a real redis-server: exactly one correct result per item whatever fails."""

from __future__ import annotations

import asyncio
import functools
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
import torch
from redis.exceptions import OutOfMemoryError

from models import load_model
from service import submit_inputs, url_inputs
from service.batcher import POOL_FACTOR
from service.config import Settings
from service.job_keys import (
    DEAD_LETTER_STREAM,
    GROUP,
    ITEM_STREAM,
    OWNER_STREAMS_KEY,
    RESULTS_KEY,
    WEBHOOK_STREAM,
    item_stream,
)
from service.job_types import ItemInput, Job, JobInputError, JobOptions, JobPriority, item_record
from service.jobs import JSON_JOB_BYTES, MAX_JOB_ITEMS, JobStore
from service.jobs_cli import run_submit
from service.runtime import READING_SHARE, build_stack
from service.spool import NoRoomForInput
from service.submit_inputs import parse_size, split_into_jobs
from service.url_inputs import check_input_url
from tests.conftest import long_recording
from tests.ports import free_port
from tests.redis_server import RedisServer
from tests.servers import StreamedUpload, drain_jobs, metric, run_server, upload_items

MODEL_FILE = "tdt.nemo"  # the fastest fixture: one encoder layer


@pytest.fixture(scope="module")
def model(parity_dir):
    return load_model(parity_dir / MODEL_FILE, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def expected(model, parity_audio) -> dict[str, str]:
    return {Path(p).name: t.text for p, t in zip(parity_audio, model.transcribe(parity_audio), strict=True)}


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
    try:
        time.sleep(6)
        assert worker.poll() is None, "the worker must not exit (or crash-loop) while Redis is away"
        server.start()
        items = upload_items(parity_audio, 5)
        job, _ = asyncio.run(JobStore.from_url(server.url).submit(items))
        client = server.client()
        _wait_for(lambda: _job_status(client, job.id)["status"] == "completed", 120, "job did not complete")
    finally:
        worker.send_signal(signal.SIGTERM)
        output = worker.communicate(timeout=60)[0]
        server.stop()
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


async def _run_consumer(settings: Settings, model, items: list[ItemInput], setup=None, timeout_s: float = 60
                        ) -> tuple[Job, list[dict]]:
    """Submit ``items`` as one job, run a consumer (``setup(consumer, store)`` first; it may submit the job itself
    and return it) until the job finishes, stop it; the job and its results. The consumer must still be running
    when the job finishes."""
    stack = build_stack(settings, model)
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
        while not (job := await stack.jobs.get(job.id)).finished and time.monotonic() < deadline:
            assert not task.done(), f"the consumer stopped: {task.exception()!r}"
            await asyncio.sleep(0.1)
        stop.set()
        await task
        return job, await stack.jobs.results(job.id)
    finally:
        await stack.stop()


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


def test_an_item_slower_than_the_visibility_timeout_stays_with_its_live_worker(redis_server, model, parity_audio,
                                                                               expected):
    """Its delivery's idle time is reset while it is worked on: without that it was reclaimed every timeout, run
    again, and failed at its fourth start as "the worker died" (while the first run was still going)."""
    items = upload_items(parity_audio, 2)
    calls = []

    async def slow_transcriber(consumer, store):
        transcribe = consumer.transcriber.transcribe

        async def slow(*args):
            calls.append(args)
            await asyncio.sleep(3.5)  # three and a half visibility timeouts
            return await transcribe(*args)

        consumer.transcriber.transcribe = slow

    settings = Settings(redis_url=redis_server.url, job_visibility_timeout_s=1.0)
    job, records = asyncio.run(_run_consumer(settings, model, items, slow_transcriber))
    assert len(calls) == 2
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


def test_an_item_of_more_pieces_than_the_queue_holds_fails_at_once(redis_server, model, parity_audio, expected):
    recording, _ = long_recording(parity_audio, 30)
    buffer = io.BytesIO()
    sf.write(buffer, recording, 16000, format="WAV")
    items = [ItemInput(audio="long.wav", upload=buffer.getvalue()), *upload_items(parity_audio, 1)]
    settings = Settings(redis_url=redis_server.url, max_queue=4, max_segment_s=5, segment_overlap_s=1)
    job, records = asyncio.run(_run_consumer(settings, model, items, timeout_s=30))
    assert job.status.value == "completed_with_errors"
    assert records[0]["status"] == "failed" and "more than the queue ever holds (4)" in records[0]["error"]
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


def test_stalled_deliveries_behind_many_live_ones_are_reached(redis_server):
    """XAUTOCLAIM looks at ten pending entries per one asked for. Each look used to start over at the oldest, so a
    consumer with little room never got past the deliveries live workers were still renewing."""
    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url)
        await store.ensure_group()
        items = [ItemInput(audio=f"{i}.wav", url=f"https://media.example/{i}.wav") for i in range(30)]
        await store.submit(items)
        reply = await store.redis.xreadgroup(GROUP, "live", {ITEM_STREAM: ">"}, count=30)
        delivered = [message_id for message_id, _ in reply[0][1]]
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
        await store.ensure_group()
        await store.submit([ItemInput(audio=f"{i}.wav", url=f"https://media.example/{i}.wav") for i in range(4)])
        reply = await store.redis.xreadgroup(GROUP, "paused", {ITEM_STREAM: ">"}, count=4)
        held = [message_id for message_id, _ in reply[0][1]]
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


# --- HTTP routes -------------------------------------------------------------------------------------------------


def test_http_jobs_submit_idempotent_poll_results(redis_server, model, parity_audio, expected):
    settings = Settings(redis_url=redis_server.url, max_wait_ms=20)
    files = [("files", (Path(p).name, Path(p).read_bytes(), "audio/wav")) for p in parity_audio]
    with run_server(settings, model) as running:
        first = httpx.post(f"{running.url}/v1/jobs", files=files, headers={"Idempotency-Key": "batch-7"}, timeout=60)
        again = httpx.post(f"{running.url}/v1/jobs", files=files, headers={"Idempotency-Key": "batch-7"}, timeout=60)
        assert first.status_code == 202 and again.status_code == 200
        job_id = first.json()["id"]
        assert again.json()["id"] == job_id and len(job_id) > 20
        _wait_for(lambda: httpx.get(f"{running.url}/v1/jobs/{job_id}").json()["status"] == "completed", 60,
                  "job did not complete")
        job = httpx.get(f"{running.url}/v1/jobs/{job_id}").json()
        assert job["counts"]["completed"] == 10 and job["rtfx"] > 0 and job["finished_at"] >= job["created_at"]
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
        for bad in (roots / "fifo.wav", roots, f"{inside}\x00.txt", f"{roots}/{'a' * 5000}.wav"):
            response = submit(bad)
            assert response.status_code == 400, (bad, response.text)  # not a server error
        ok = submit(inside)
        assert ok.status_code == 202
        job_id = ok.json()["id"]
        _wait_for(lambda: httpx.get(f"{running.url}/v1/jobs/{job_id}").json()["status"] == "completed", 60,
                  "path job did not complete")
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
        assert httpx.get(f"{running.url}/healthz").status_code == 200
        server.start()
        assert httpx.get(f"{running.url}/readyz").status_code == 200
    server.stop()


@pytest.mark.parametrize("target, said", [("--redis-url", "Redis"), ("--server", "the server")])
def test_submit_cli_to_an_address_that_answers_nothing_says_so_at_once(parity_audio, target, said):
    """Not tried again for minutes as an outage is (a wrong address, most likely): nothing there was ever reached."""
    address = f"{'redis' if target == '--redis-url' else 'http'}://127.0.0.1:{free_port()}"
    result = subprocess.run([sys.executable, "-m", "service.cli", "submit", target, address, parity_audio[0]],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and f"cannot reach {said}" in result.stderr, result.stderr
    assert "trying again" not in result.stderr


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


# --- URL inputs ----------------------------------------------------------------------------------------------------


class AudioSite:
    """A real HTTP server with the parity clips under /clips/, and the ways a media host misbehaves: /clips/flaky/
    answers 503 twice per clip first, /clips/moved/ redirects back into /clips/, /clips/away redirects off the
    allowed prefix, /clips/huge streams more than the upload limit without saying its length, /clips/drip/ and
    /clips/drip-chunked/ send a clip a byte every 50 ms (with its length, and without), and /private/ holds a clip
    outside the prefix."""

    def __init__(self, parity_audio: list[str], huge_bytes: int):
        self.clips = {Path(p).name: Path(p).read_bytes() for p in parity_audio}
        self.requests: dict[str, int] = {}
        site = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                site.requests[self.path] = site.requests.get(self.path, 0) + 1
                name = self.path.rsplit("/", 1)[-1]
                if self.path.startswith("/clips/flaky/") and site.requests[self.path] <= 2:
                    self._send(503, b"busy")
                elif self.path.startswith("/clips/moved/"):
                    self._redirect(f"/clips/{name}")
                elif self.path == "/clips/away":
                    self._redirect(f"http://127.0.0.1:{site.port}/private/{next(iter(site.clips))}")
                elif self.path == "/clips/huge":
                    self.send_response(200)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    chunk = b"\0" * 65536
                    for _ in range(huge_bytes // len(chunk) + 1):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.write(b"0\r\n\r\n")
                elif self.path.startswith("/clips/drip") and name in site.clips:
                    self._drip(site.clips[name], chunked=self.path.startswith("/clips/drip-chunked/"))
                elif self.path.startswith(("/clips/", "/private/")) and name in site.clips:
                    self._send(200, site.clips[name])
                else:
                    self._send(404, b"no such clip")

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _drip(self, body: bytes, chunked: bool) -> None:
                self.send_response(200)
                self.send_header(*(("Transfer-Encoding", "chunked") if chunked else ("Content-Length", str(len(body)))))
                self.end_headers()
                try:
                    for byte in body:
                        self.wfile.write(b"1\r\n%c\r\n" % byte if chunked else bytes([byte]))
                        self.wfile.flush()
                        time.sleep(0.05)
                except OSError:  # the client gave up
                    pass

            def _redirect(self, location: str) -> None:
                self.send_response(302)
                self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_which_urls_a_server_takes():
    prefixes = ["https://bucket.example.com/audio/", "http://127.0.0.1:8900/clips"]
    taken = ["https://bucket.example.com/audio/a.wav", "https://BUCKET.example.com:443/audio/x/y.flac?sig=1",
             "http://127.0.0.1:8900/clips/a.wav", "http://127.0.0.1:8900/clips",
             "https://bucket.example.com/audio/%252e%252e/x"]  # the server reads a directory named "%2e%2e"
    refused = ["https://bucket.example.com/audio/../secret", "https://bucket.example.com/audio/%2e%2e/secret",
               "https://bucket.example.com.evil.com/audio/a.wav", "http://bucket.example.com/audio/a.wav",
               "https://bucket.example.com:8443/audio/a.wav", "http://127.0.0.1:8900/clipsX/a.wav",
               "file:///etc/passwd", "ftp://bucket.example.com/audio/a", "not a url"]
    for url in taken:
        check_input_url(url, prefixes)
    for url in refused:
        with pytest.raises(JobInputError):
            check_input_url(url, prefixes)
    with pytest.raises(JobInputError, match="BATCHASR_INPUT_URL_PREFIXES"):
        check_input_url(taken[0], [])


def test_url_items_are_fetched_and_each_failure_fails_only_its_item(redis_server, model, parity_audio, expected,
                                                                      monkeypatch):
    monkeypatch.setattr(url_inputs, "RETRY_DELAYS_S", (0.05, 0.1, 0.2))
    limit = 2 * 1024 * 1024
    site = AudioSite(parity_audio, limit)
    dead = f"http://127.0.0.1:{free_port()}/"  # nothing listens there
    names = sorted(site.clips)
    settings = Settings(redis_url=redis_server.url, input_url_prefixes=[f"{site.url}/clips/", dead],
                        max_upload_bytes=limit)
    items = {f"{site.url}/clips/{names[0]}": "completed", f"{site.url}/clips/moved/{names[1]}": "completed",
             f"{site.url}/clips/flaky/{names[2]}": "completed", f"{site.url}/clips/missing.wav": "HTTP 404",
             f"{site.url}/clips/huge": "upload limit", f"{site.url}/clips/away": "not under",
             f"{dead}a.wav": "ClientConnectorError"}
    try:
        with run_server(settings, model) as running:
            submitted = httpx.post(f"{running.url}/v1/jobs", json={"items": [{"url": u} for u in items]}, timeout=30)
            assert submitted.status_code == 202, submitted.text
            job_id = submitted.json()["id"]
            _wait_for(lambda: httpx.get(f"{running.url}/v1/jobs/{job_id}").json()["finished_at"] is not None, 60,
                      "the URL job did not finish")
            job = httpx.get(f"{running.url}/v1/jobs/{job_id}").json()
            results = httpx.get(f"{running.url}/v1/jobs/{job_id}/results").text
            lines = [json.loads(line) for line in results.splitlines()]
    finally:
        site.close()
    assert job["status"] == "completed_with_errors" and job["counts"]["failed"] == 4
    for (url, outcome), line in zip(items.items(), lines, strict=True):
        assert line["audio"] == url
        if outcome == "completed":
            assert line["status"] == "completed" and line["text"] == expected[url.rsplit("/", 1)[-1]]
        else:
            assert line["status"] == "failed" and outcome in line["error"], (url, line["error"])
    assert site.requests[f"/clips/flaky/{names[2]}"] == 3  # two 503s, then the clip
    assert "(4 tries)" in lines[-1]["error"]  # refused connections are tried again, then given up
    assert not any(path.startswith("/private/") for path in site.requests)  # the redirect off the prefix: not taken


def test_a_url_whose_body_drips_is_given_up_and_tried_again(parity_audio):
    site = AudioSite(parity_audio, 0)
    name = sorted(site.clips)[0]
    fetcher = url_inputs.UrlFetcher([f"{site.url}/clips/"], 1 << 20, timeout_s=0.5, retry_delays_s=(0.0,),
                                    min_bytes_per_s=100)

    async def fetch(url: str) -> bytes:
        with await fetcher.fetch(url) as body:
            return body.read()

    async def fetch_all() -> list[bytes | Exception]:
        try:
            return await asyncio.gather(*(fetch(f"{site.url}/clips/{path}{name}")
                                          for path in ("", "drip/", "drip-chunked/")), return_exceptions=True)
        finally:
            await fetcher.close()

    try:
        began = time.monotonic()
        whole, dripped, dripped_chunked = asyncio.run(fetch_all())
        took = time.monotonic() - began
    finally:
        site.close()
    assert whole == site.clips[name]  # a body that comes quickly is taken whatever its size
    for failure in (dripped, dripped_chunked):  # 20 bytes a second, below 100: each try stops within a second
        assert isinstance(failure, JobInputError) and "slower than" in str(failure) and "(2 tries)" in str(failure)
    assert took < 5


@pytest.fixture
def file_site(tmp_path):
    """A real HTTP server for the files of a folder; yields (folder, base URL)."""
    folder = tmp_path / "site"
    folder.mkdir()
    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield folder, f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def _fetch(url: str, prefix: str) -> bytes:
    fetcher = url_inputs.UrlFetcher([prefix], 1 << 30, retry_delays_s=())

    async def fetch() -> bytes:
        try:
            with await fetcher.fetch(url) as body:
                return body.read(64)  # a head: what it holds whole is measured, not what this test reads of it
        finally:
            await fetcher.close()

    return asyncio.run(fetch())


def test_a_fetched_body_waits_in_a_temporary_file_not_in_memory(file_site):
    """A URL's body grew in a bytearray, then was copied to bytes: three times its size in memory at once, for each
    of the consumer's 64 fetches."""
    folder, base = file_site
    recording = np.random.default_rng(5).bytes(24 << 20)
    (folder / "long.flac").write_bytes(recording)
    tracemalloc.start()
    try:
        head = _fetch(base + "long.flac", base)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert head == recording[:64]
    assert peak < 4 << 20, f"{peak / 2**20:.1f} MiB held fetching 24 MiB"


def test_a_fetch_with_no_disk_left_is_the_workers_failure_not_the_items(file_site, small_disk):
    """Failed as the item's (JobInputError, or an OSError: failed at once), a full disk would lose every item
    fetched meanwhile; NoRoomForInput is retried like any failure of the worker's."""
    folder, base = file_site
    (folder / "long.flac").write_bytes(bytes(2 << 20))  # past the 1.5 MiB disk
    with pytest.raises(NoRoomForInput, match="no disk space left"):
        _fetch(base + "long.flac", base)
    assert not isinstance(NoRoomForInput("x"), (OSError, ValueError, JobInputError))
    assert list(small_disk.iterdir()) == []  # the part received is gone


def test_url_items_are_checked_when_submitted(redis_server, model):
    with run_server(Settings(redis_url=redis_server.url, input_url_prefixes=["http://media.example/clips/"]),
                    model) as running:
        def submit(*items):
            return httpx.post(f"{running.url}/v1/jobs", json={"items": list(items)}, timeout=30)

        outside = submit({"url": "http://media.example/clips/a.wav"}, {"url": "http://media.example/private/b.wav"})
        assert outside.status_code == 400 and "not under" in outside.json()["error"]["message"]
        for bad in ({}, {"url": "http://media.example/clips/a.wav", "path": "/tmp/a.wav"}):
            refused = submit(bad)
            assert refused.status_code == 400 and "either a `path` or a `url`" in refused.json()["error"]["message"]
        assert submit({"url": "file:///etc/passwd"}).status_code == 400
    with run_server(Settings(redis_url=redis_server.url), model) as running:
        disabled = httpx.post(f"{running.url}/v1/jobs", json={"items": [{"url": "http://media.example/a.wav"}]})
        assert disabled.status_code == 400 and "BATCHASR_INPUT_URL_PREFIXES" in disabled.json()["error"]["message"]


def test_submit_cli_takes_a_list_of_urls(redis_server, model, parity_audio, expected, tmp_path):
    site = AudioSite(parity_audio, 1 << 20)
    urls = [f"{site.url}/clips/{name}" for name in sorted(site.clips)[:3]]
    listing = tmp_path / "urls.txt"
    listing.write_text("# three clips\n" + "\n".join(urls) + "\n\n")
    settings = Settings(redis_url=redis_server.url, input_url_prefixes=[f"{site.url}/clips/"])
    try:
        with run_server(settings, model) as running:
            def submit(*args):
                return subprocess.run([sys.executable, "-m", "service.cli", "submit", *args], capture_output=True,
                                      text=True, timeout=120)

            for target in (["--server", running.url], ["--redis-url", redis_server.url]):
                out = tmp_path / "results.jsonl"
                result = submit(*target, "--wait", "--output", str(out), "--url-list", str(listing))
                assert result.returncode == 0, result.stderr
                lines = [json.loads(line) for line in out.read_text().splitlines()]
                assert [r["audio"] for r in lines] == urls
                assert [r["text"] for r in lines] == [expected[u.rsplit("/", 1)[-1]] for u in urls]
            out = tmp_path / "mixed.jsonl"  # a URL and a file: two jobs, results in input order
            mixed = submit("--server", running.url, "--wait", "--output", str(out), urls[0], parity_audio[0])
            assert mixed.returncode == 0 and mixed.stderr.count(": 1 items") == 2, mixed.stderr
            lines = [json.loads(line) for line in out.read_text().splitlines()]
            assert [r["audio"] for r in lines] == [urls[0], parity_audio[0]]
            assert [r["text"] for r in lines] == [expected[urls[0].rsplit("/", 1)[-1]],
                                                  expected[Path(parity_audio[0]).name]]
            refused = submit("--server", running.url, f"{site.url}/private/a.wav")
            assert refused.returncode == 2 and "not under" in refused.stderr
    finally:
        site.close()
