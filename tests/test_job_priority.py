"""Job priorities against a real redis-server: workers take high jobs' items before normal ones', normal before
low, whatever order they were submitted in; every stream is reclaimed, trimmed and counted in the lag."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from service.config import Settings
from service.http import owner_of
from service.job_keys import GROUP, ITEM_STREAM, ITEM_STREAMS, item_stream
from service.job_types import ANONYMOUS, JobOptions, JobPriority
from service.jobs import JobStore
from service.runtime import build_stack
from tests.servers import drained_jobs, run_server, upload_items


def test_higher_priorities_are_taken_first_whatever_the_order_submitted(redis_server, model, parity_audio):
    """A backfill (low) and a normal job are queued before an urgent (high) one: with room for two items at a
    time, the urgent job finishes first, then the normal one, then the backfill."""
    async def submit(store: JobStore) -> dict:
        return {priority: (await store.submit(upload_items(parity_audio, 6), options=JobOptions(priority=priority)))[0]
                for priority in (JobPriority.LOW, JobPriority.NORMAL, JobPriority.HIGH)}

    settings = Settings(redis_url=redis_server.url, job_prefetch=2, max_batch_size=2, max_wait_ms=1)
    done = drained_jobs(settings, model, submit)
    assert all(job.status.value == "completed" and job.priority == priority for priority, job in done.items())
    high, normal, low = done[JobPriority.HIGH], done[JobPriority.NORMAL], done[JobPriority.LOW]
    assert high.finished_at < normal.finished_at < low.finished_at
    assert low.started_at >= normal.started_at >= high.started_at
    assert low.started_at > high.finished_at  # the backfill waited for the urgent job
    client = redis_server.client()
    for stream in ITEM_STREAMS.values():  # every delivery acknowledged, on every stream
        assert client.xpending(stream, GROUP)["pending"] == 0


def test_each_priority_has_its_stream_and_all_count_in_the_lag(redis_server, parity_audio):
    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url)
        for priority, n in ((JobPriority.HIGH, 2), (JobPriority.NORMAL, 3), (JobPriority.LOW, 4)):
            await store.submit(upload_items(parity_audio, n), options=JobOptions(priority=priority))
        assert [await store.redis.xlen(ITEM_STREAMS[p]) for p in JobPriority] == [2, 3, 4]
        assert ITEM_STREAMS[JobPriority.NORMAL] == ITEM_STREAM  # jobs queued before priorities existed
        assert await store.stream_lag() == 9
        taken = await store.read_items("c", 4, block_ms=0)  # the high stream's two, then two of normal's
        assert [stream for stream, _, _ in taken] == [ITEM_STREAMS[JobPriority.HIGH]] * 2 + [ITEM_STREAM] * 2
        for stream, message_id, _ in taken:
            await store.ack_item(stream, message_id)
        await store.trim_acknowledged()
        # each stream kept from its last delivered entry (XTRIM MINID keeps that one) and what was not delivered
        assert [await store.redis.xlen(ITEM_STREAMS[p]) for p in JobPriority] == [1, 2, 4]
        assert await store.stream_lag() == 5
        await store.close()

    asyncio.run(scenario())


def test_a_consumer_exports_the_lag_over_every_stream_until_it_is_nothing(redis_server, model, parity_audio):
    """batchasr_job_stream_lag, what KEDA scales the workers on: every item queued or in hand, over the priorities'
    and the keys' streams, as the consumer starts; nothing within a few seconds of the last item's end. It is read at
    most once a second (two round trips over every stream), not at every step of the consumer."""
    observed: list[int] = []

    async def scenario() -> None:
        stack = build_stack(Settings(redis_url=redis_server.url, max_wait_ms=1), model)
        assert await asyncio.to_thread(stack.engine.wait_ready, 30)
        consumer = stack.make_consumer()
        consumer.options = replace(consumer.options, block_ms=20)  # a step every 20 ms while idle
        export = consumer.metrics.observe_job_backlog
        consumer.metrics.observe_job_backlog = lambda waiting, delivered: (observed.append(waiting + delivered),
                                                                           export(waiting, delivered))
        stop = asyncio.Event()
        try:
            jobs = []
            for priority, owner, n in ((JobPriority.HIGH, ANONYMOUS, 2), (JobPriority.LOW, owner_of("k"), 3),
                                       (JobPriority.NORMAL, owner_of("k"), 4)):
                options = JobOptions(priority=priority, owner=owner)
                jobs.append((await stack.jobs.submit(upload_items(parity_audio, n), options=options))[0])
            task = asyncio.create_task(consumer.run(stop))
            for _ in range(200):
                if [(await stack.jobs.get(job.id)).status.value for job in jobs] == ["completed"] * 3:
                    break
                await asyncio.sleep(0.05)
            for _ in range(60):  # the next reading after the last item's acknowledgement
                if stack.metrics.job_stream_lag._value.get() == 0:
                    break
                await asyncio.sleep(0.05)
            idle_from = len(observed)
            await asyncio.sleep(1.5)  # 75 idle steps or so
            assert len(observed) - idle_from <= 3, observed
        finally:
            stop.set()
            await task
            await stack.stop()

    asyncio.run(scenario())
    assert observed[0] == 9 and observed[-1] == 0, observed


def test_an_item_finished_before_its_done_callback_ran_leaves_room_for_the_next(redis_server, model, parity_audio):
    """A consumer with room for one item, whose last item has finished (its audio released) but whose done callback,
    which takes it out of the items in flight, has not run yet when the next step begins: that step takes the next
    item. It counted the finished one as in flight, found no room, and waited for an item to finish, which none
    would: the consumer stopped for good, its stream lagging (two consumer processes of a worker did)."""
    async def scenario() -> None:
        stack = build_stack(Settings(redis_url=redis_server.url, job_prefetch=1), model)
        assert await asyncio.to_thread(stack.engine.wait_ready, 30)
        try:
            await stack.jobs.submit(upload_items(parity_audio, 1))
            consumer = stack.make_consumer()
            finished = asyncio.create_task(asyncio.sleep(0))
            await finished
            consumer._in_flight.add(finished)  # as a task that has finished, its callback still to come
            assert await asyncio.wait_for(consumer._step(block_ms=0), 10) == 1
            await consumer._finish_in_flight()
        finally:
            await stack.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize("priority, owner", [(JobPriority.HIGH, ANONYMOUS), (JobPriority.NORMAL, owner_of("key"))])
def test_a_stalled_delivery_is_reclaimed_on_its_own_stream(redis_server, model, parity_audio, priority, owner):
    """An item of a high job (or of an API key's job, on the key's stream) delivered to a worker that died is taken
    back by another after the visibility timeout, and acknowledged on the stream it came from."""
    state = {}
    stream = item_stream(priority, owner)

    async def scenario() -> None:
        settings = Settings(redis_url=redis_server.url, job_visibility_timeout_s=1)
        stack = build_stack(settings, model)
        assert await asyncio.to_thread(stack.engine.wait_ready, 30)
        try:
            state["job"], _ = await stack.jobs.submit(upload_items(parity_audio, 3),
                                                        options=JobOptions(priority=priority, owner=owner))
            assert len(await stack.jobs.read_items("dead-worker", 3, block_ms=0)) == 3  # never acknowledged
            assert await stack.jobs.streams_with_pending() == [stream]
            await asyncio.sleep(1.2)
            await stack.make_consumer().drain()
            state["done"] = await stack.jobs.get(state["job"].id)
            state["pending"] = await stack.jobs.streams_with_pending()
        finally:
            await stack.stop()

    asyncio.run(scenario())
    assert state["done"].status.value == "completed" and state["done"].counts["completed"] == 3
    assert redis_server.client().xpending(stream, GROUP)["pending"] == 0 and state["pending"] == []


def test_priority_over_http_and_from_the_command_line(redis_server, model, parity_audio, tmp_path):
    with run_server(Settings(redis_url=redis_server.url), model) as running:
        files = [("files", ("a.wav", Path(parity_audio[0]).read_bytes(), "audio/wav"))]
        job = httpx.post(f"{running.url}/v1/jobs", files=files, data={"priority": "high"}, timeout=60).json()
        assert job["priority"] == "high"
        assert httpx.get(f"{running.url}/v1/jobs/{job['id']}").json()["priority"] == "high"
        default = httpx.post(f"{running.url}/v1/jobs", files=files, timeout=60).json()
        assert default["priority"] == "normal"
        refused = httpx.post(f"{running.url}/v1/jobs", files=files, data={"priority": "urgent"}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_priority"
        as_json = httpx.post(f"{running.url}/v1/jobs", json={"items": [{"url": "https://example.com/a.wav"}],
                                                             "priority": "urgent"}, timeout=60)
        assert as_json.status_code == 400 and "priority" in as_json.json()["error"]["message"]
        result = subprocess.run([sys.executable, "-m", "service.cli", "submit", "--server", running.url,
                                 "--priority", "low", parity_audio[1]], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["priority"] == "low"
    assert redis_server.client().xlen(ITEM_STREAMS[JobPriority.LOW]) >= 1


def test_priority_latency_stops_with_the_workers_output_when_its_worker_exits(tmp_path):
    """loadtest/priority_latency.py waited for the backlog's first item for ever once its worker had died."""
    command = [sys.executable, "loadtest/priority_latency.py", "--model", str(tmp_path / "missing.nemo"),
               "--backlog", "2", "--urgent", "1", "--delay-s", "0"]
    result = subprocess.run(command, cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1
    assert "the worker exited with status 2" in result.stderr and "missing.nemo" in result.stderr
