"""API keys' streams pruned once idle, against a real redis-server: a key's stream given no items for an hour, all
of them acknowledged, is unlisted (workers stop reading it) and deleted a grace later; the key's next job, or a
retry, makes it again in the transaction that queues its items, so no item is ever queued on a stream that is
going, or on one the workers do not read. Streams with items waiting or in hand, streams listed again within the
grace, and streams listed by a version before pruning are kept."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from service.config import Settings
from service.http import owner_of
from service.job_keys import GROUP, OWNER_STREAMS_KEY, RETIRED_STREAMS_KEY, STREAMS_USED_KEY, item_stream
from service.job_types import ItemInput, JobOptions, JobPriority
from service.jobs import JobStore
from service.runtime import build_stack
from tests.servers import drained_jobs, settle_items, upload_items

ALICE, BOB = owner_of("alice-key"), owner_of("bob-key")
ALICE_LOW = item_stream(JobPriority.LOW, ALICE)
NOW = {"idle_s": 0, "grace_s": 0}  # idle and past its grace at once
HOUR = 3600


def _urls(n: int) -> list[ItemInput]:
    return [ItemInput(audio=f"{i}.wav", url=f"https://media.example/{i}.wav") for i in range(n)]


async def _listed(store: JobStore) -> list[str]:
    return [stream for streams in (await store.item_streams()).values() for stream in streams
            if ":owner:" in stream]


def _run(url: str, scenario) -> None:
    async def with_store() -> None:
        store = JobStore.from_url(url)
        try:
            await scenario(store)
        finally:
            await store.close()

    asyncio.run(with_store())


def test_an_idle_keys_stream_is_unlisted_then_deleted_and_made_again_by_its_next_job(redis_server):
    async def scenario(store: JobStore) -> None:
        await store.submit(_urls(2), options=JobOptions(owner=ALICE, priority=JobPriority.LOW))
        assert await store.prune_idle_streams(**NOW) == (0, 0)  # items waiting
        await settle_items(store, 2)
        assert await store.prune_idle_streams(HOUR, 0) == (0, 0)  # given items a moment ago
        assert await store.prune_idle_streams(0, HOUR) == (1, 0)  # unlisted: read no more, kept for the grace
        assert await _listed(store) == [] and await store.redis.exists(ALICE_LOW)
        assert await store.stream_lag() == 0
        assert await store.prune_idle_streams(0, HOUR) == (0, 0)  # still within its grace
        assert await store.prune_idle_streams(**NOW) == (0, 1)
        assert not await store.redis.exists(ALICE_LOW, STREAMS_USED_KEY, RETIRED_STREAMS_KEY)

        again, _ = await store.submit(_urls(1), options=JobOptions(owner=ALICE, priority=JobPriority.LOW))
        assert await _listed(store) == [ALICE_LOW]
        assert [group["name"] for group in await store.redis.xinfo_groups(ALICE_LOW)] == [GROUP.encode()]
        (delivery,) = await store.read_items("c", 5, block_ms=0)
        assert delivery[0] == ALICE_LOW and delivery[2][b"job"].decode() == again.id

    _run(redis_server.url, scenario)


def test_a_stream_given_a_job_within_its_grace_is_kept_and_read(redis_server):
    async def scenario(store: JobStore) -> None:
        await store.submit(_urls(1), options=JobOptions(owner=ALICE, priority=JobPriority.LOW))
        await settle_items(store, 1)
        assert await store.prune_idle_streams(0, HOUR) == (1, 0)
        second, _ = await store.submit(_urls(2), options=JobOptions(owner=ALICE, priority=JobPriority.LOW))
        assert await _listed(store) == [ALICE_LOW]  # listed again by the job's own transaction
        assert await store.prune_idle_streams(**NOW) == (0, 0)  # its items waiting: neither deleted nor unlisted
        assert not await store.redis.exists(RETIRED_STREAMS_KEY)
        assert await store.stream_lag() == 2
        assert {fields[b"job"].decode() for _, _, fields in await store.read_items("c", 5, block_ms=0)} == {second.id}

    _run(redis_server.url, scenario)


def test_streams_with_items_waiting_or_in_hand_are_kept(redis_server):
    async def scenario(store: JobStore) -> None:
        await store.submit(_urls(3), options=JobOptions(owner=ALICE))
        await store.submit(_urls(2), options=JobOptions(owner=BOB))
        await store.read_items("c", 5, block_ms=0)  # delivered, not acknowledged
        await store.submit(_urls(1), options=JobOptions(owner=BOB, priority=JobPriority.HIGH))  # waiting
        assert await store.prune_idle_streams(**NOW) == (0, 0)
        assert len(await _listed(store)) == 3 and await store.stream_lag() == 6

    _run(redis_server.url, scenario)


def test_a_stream_listed_by_a_version_before_pruning_is_kept(redis_server):
    """Such a version lists a stream before it writes the job that queues items there, not in the same step: pruned,
    the stream could go between the two. So only streams a job of this version used are pruned."""
    async def scenario(store: JobStore) -> None:
        await store.submit(_urls(1), options=JobOptions(owner=ALICE, priority=JobPriority.LOW))
        await settle_items(store, 1)
        await store.redis.delete(STREAMS_USED_KEY)  # as that version left it
        assert await store.prune_idle_streams(**NOW) == (0, 0)
        assert await _listed(store) == [ALICE_LOW]

    _run(redis_server.url, scenario)


def test_a_retry_makes_a_deleted_stream_again(redis_server):
    async def scenario(store: JobStore) -> None:
        job, _ = await store.submit(_urls(2), options=JobOptions(owner=ALICE, priority=JobPriority.LOW))
        (first, second) = await store.read_items("c", 2, block_ms=0)
        for index, (stream, message_id, _) in enumerate((first, second)):
            state = "failed" if index else "completed"
            await store.start_item(job.id, index)
            await store.finish_item(job.id, index, state, {"status": state}, error="bad" if index else "")
            await store.ack_item(stream, message_id)
        await store.prune_idle_streams(0, HOUR)
        assert await store.prune_idle_streams(**NOW) == (0, 1)
        queued = (await store.retry_failed(job.id, ALICE)).retried
        assert queued == 1 and await _listed(store) == [ALICE_LOW]
        (again,) = await store.read_items("c", 5, block_ms=0)
        assert again[0] == ALICE_LOW and again[2][b"index"] == b"1"

    _run(redis_server.url, scenario)


def test_a_stream_given_items_while_unlisted_is_listed_again_not_deleted(redis_server):
    """What OPEN_STREAM prevents, should anything do it (a client of an older version writing by hand): the items
    on a retired stream are read, not deleted with it."""
    async def scenario(store: JobStore) -> None:
        job, _ = await store.submit(_urls(1), options=JobOptions(owner=ALICE, priority=JobPriority.LOW))
        await settle_items(store, 1)
        assert await store.prune_idle_streams(0, HOUR) == (1, 0)
        await store.redis.xadd(ALICE_LOW, {"job": job.id, "index": 0})
        assert await store.prune_idle_streams(**NOW) == (0, 0)
        assert await store.redis.hgetall(OWNER_STREAMS_KEY) == {ALICE_LOW.encode(): b"low"}
        assert len(await store.read_items("c", 5, block_ms=0)) == 1

    _run(redis_server.url, scenario)


def test_a_consumer_prunes_the_streams_of_keys_gone_idle(redis_server, model, parity_audio):
    """Alice's job done, a consumer (idle time set to nothing) stops reading her stream at its first look; Bob's
    stream, with his job queued, is kept and read."""
    async def submit(store: JobStore) -> dict:
        return {"alice": (await store.submit(upload_items(parity_audio, 2), options=JobOptions(owner=ALICE)))[0]}

    settings = Settings(redis_url=redis_server.url)
    assert drained_jobs(settings, model, submit)["alice"].status.value == "completed"
    state = {}

    async def scenario() -> None:
        stack = build_stack(settings, model)
        assert await asyncio.to_thread(stack.engine.wait_ready, 30)
        try:
            state["bob"], _ = await stack.jobs.submit(upload_items(parity_audio, 2), options=JobOptions(owner=BOB))
            consumer = stack.make_consumer()
            consumer.options = replace(consumer.options, stream_idle_s=0)
            await consumer.drain()
            state["listed"] = await _listed(stack.jobs)
            state["done"] = await stack.jobs.get(state["bob"].id)
        finally:
            await stack.stop()

    asyncio.run(scenario())
    assert state["listed"] == [item_stream(JobPriority.NORMAL, BOB)]  # its job was queued at the look
    assert state["done"].status.value == "completed"
    assert redis_server.client().hkeys(RETIRED_STREAMS_KEY) == [item_stream(JobPriority.NORMAL, ALICE).encode()]
