"""Fair shares between owners (API keys) within a priority, against a real redis-server: each owner's items go on a
stream of their own, workers read each owner's stream with items waiting an equal share, so one key's backfill
does not hold up another key's job; the owners' streams are trimmed, retried onto and counted in the lag like the
priorities' own (and reclaimed: tests/test_job_priority.py)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from models import load_model
from service.config import Settings
from service.http import owner_of
from service.job_keys import GROUP, ITEM_STREAM, ITEM_STREAMS, OWNER_STREAMS_KEY, item_stream, stream_priority
from service.job_types import ANONYMOUS, ItemInput, JobOptions, JobPriority
from service.jobs import JobStore, fair_shares
from tests.servers import drained_jobs, run_server, upload_items

ALICE, BOB = owner_of("alice-key"), owner_of("bob-key")


@pytest.fixture(scope="module")
def model(parity_dir):
    return load_model(parity_dir / "tdt.nemo", device="cpu", dtype="float32")


def _urls(n: int) -> list[ItemInput]:
    return [ItemInput(audio=f"{i}.wav", url=f"https://media.example/{i}.wav") for i in range(n)]


# --- the shares, as arithmetic ------------------------------------------------------------------------------------

waiting_counts = st.dictionaries(st.sampled_from("abcdefgh"), st.one_of(st.none(), st.integers(0, 50)), max_size=8)


@given(waiting_counts, st.integers(0, 100), st.integers(0, 20))
def test_shares_are_max_min_fair(waiting, count, turn):
    shares = fair_shares(waiting, count, turn)
    assert shares.keys() == waiting.keys()
    known = {stream: count if n is None else n for stream, n in waiting.items()}
    assert all(0 <= shares[s] <= known[s] for s in waiting)
    assert sum(shares.values()) == min(count, sum(known.values()))  # as many as asked for, if there are as many
    for a in waiting:  # a stream given less than another by two or more was given all it holds
        for b in waiting:
            assert shares[a] >= shares[b] - 1 or shares[a] == known[a]


@given(st.integers(1, 8), st.integers(0, 20))
def test_shares_of_less_than_one_each_go_round_in_turn(n_streams, turn):
    waiting = {f"s{i}": 100 for i in range(n_streams)}
    given_out = Counter()
    for offset in range(n_streams):  # one item a read: each stream once in as many reads as there are streams
        given_out.update({s: n for s, n in fair_shares(waiting, 1, turn + offset).items() if n})
    assert given_out == dict.fromkeys(waiting, 1)


def test_an_owners_stream_is_its_priority_stream_and_the_owner():
    assert item_stream(JobPriority.NORMAL, ANONYMOUS) == ITEM_STREAM  # as before owners had streams
    assert item_stream(JobPriority.HIGH, ALICE) == f"batchasr:items:high:owner:{ALICE}"
    for priority in JobPriority:
        assert stream_priority(item_stream(priority, ALICE)) == priority == stream_priority(ITEM_STREAMS[priority])
    with pytest.raises(KeyError):
        stream_priority("batchasr:items:dead")


# --- the streams, in Redis ------------------------------------------------------------------------------------------

def test_each_owner_waiting_gets_an_equal_share_of_a_read(redis_server):
    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url)
        await store.submit(_urls(30), options=JobOptions(owner=ALICE))  # a backfill
        await store.submit(_urls(3), options=JobOptions(owner=BOB))
        await store.submit(_urls(5))  # no key
        await store.submit(_urls(4), options=JobOptions(owner=BOB, priority=JobPriority.HIGH))
        streams = await store.item_streams()
        assert streams[JobPriority.NORMAL] == [ITEM_STREAM, *sorted([item_stream(JobPriority.NORMAL, ALICE),
                                                                      item_stream(JobPriority.NORMAL, BOB)])]
        assert streams[JobPriority.HIGH] == [ITEM_STREAMS[JobPriority.HIGH], item_stream(JobPriority.HIGH, BOB)]
        assert await store.redis.xlen(item_stream(JobPriority.NORMAL, ALICE)) == 30
        assert await store.stream_lag() == 42

        def by_stream(taken):
            return Counter(stream for stream, _, _ in taken)

        # high first (Bob's four), then normal shared out: three each, the remainder to one of them in turn
        first = by_stream(await store.read_items("c", 14, block_ms=0))
        assert first[item_stream(JobPriority.HIGH, BOB)] == 4
        normal = [first[item_stream(JobPriority.NORMAL, o)] for o in (ANONYMOUS, ALICE, BOB)]
        assert sum(normal) == 10 and sorted(normal) == [3, 3, 4]
        # Bob has nothing left: what his share would have been goes to the others
        second = by_stream(await store.read_items("c", 6, block_ms=0))
        assert second == {ITEM_STREAM: 5 - first[ITEM_STREAM], item_stream(JobPriority.NORMAL, ALICE):
                          6 - (5 - first[ITEM_STREAM])}
        rest = by_stream(await store.read_items("c", 100, block_ms=0))
        assert rest == {item_stream(JobPriority.NORMAL, ALICE): 30 - first[item_stream(JobPriority.NORMAL, ALICE)]
                        - second[item_stream(JobPriority.NORMAL, ALICE)]}
        assert await store.read_items("c", 5, block_ms=0) == []
        assert await store.stream_lag() == 42  # delivered, not acknowledged
        await store.close()

    asyncio.run(scenario())


def test_the_counts_redis_gives_of_each_stream(redis_server):
    """GROUP_COUNTS: lag and pending in the workers' group; a stream without the group is read anyway (its lag not
    known), so that the read says NOGROUP and the consumer makes the group; a stream not there is left out."""
    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url)
        await store.submit(_urls(5), options=JobOptions(owner=ALICE))
        await store.read_items("c", 2, block_ms=0)
        await store.redis.xadd("batchasr:items:owner:nogroup", {"job": "job_x", "index": 0})
        streams = [item_stream(JobPriority.NORMAL, ALICE), "batchasr:items:owner:nogroup", "batchasr:items:gone"]
        assert await store._counts(streams) == {streams[0]: (3, 2), streams[1]: (-1, 0)}
        assert await store._waiting(streams) == {streams[0]: 3, streams[1]: None}
        assert await store.stream_lag() == 5  # the listed streams only
        await store.close()

    asyncio.run(scenario())


def test_a_read_that_waits_wakes_for_an_owners_item(redis_server):
    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url)
        await store.submit(_urls(1), options=JobOptions(owner=ALICE))
        assert len(await store.read_items("c", 4, block_ms=0)) == 1
        reading = asyncio.create_task(store.read_items("c", 4, block_ms=5000))
        await asyncio.sleep(0.2)
        other = JobStore.from_url(redis_server.url)
        await other.submit(_urls(2), options=JobOptions(owner=ALICE))
        taken = await asyncio.wait_for(reading, 4)  # count // streams from each stream: one
        taken += await store.read_items("c", 4, block_ms=0)
        assert [stream for stream, _, _ in taken] == [item_stream(JobPriority.NORMAL, ALICE)] * 2
        await other.close()
        await store.close()

    asyncio.run(scenario())


def test_an_owners_stream_is_trimmed_and_retried_onto(redis_server):
    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url)
        job, _ = await store.submit(_urls(3), options=JobOptions(owner=ALICE, priority=JobPriority.LOW))
        stream = item_stream(JobPriority.LOW, ALICE)
        taken = await store.read_items("c", 3, block_ms=0)
        assert {s for s, _, _ in taken} == {stream}
        for index, (_, message_id, _) in enumerate(taken):
            await store.start_item(job.id, index)
            state = "failed" if index == 2 else "completed"
            await store.finish_item(job.id, index, state, {"status": state}, error="bad" if index == 2 else "")
            await store.ack_item(stream, message_id)
        await store.trim_acknowledged()
        assert await store.redis.xlen(stream) == 1  # from the last one delivered
        _, queued, _ = await store.retry_failed(job.id, ALICE)
        assert queued == 1 and await store.redis.xlen(stream) == 2
        (again,) = await store.read_items("c", 5, block_ms=0)
        assert again[0] == stream and again[2][b"index"] == b"2"
        await store.close()

    asyncio.run(scenario())


def test_a_job_queued_on_its_priority_stream_before_owners_had_streams_is_retried_onto_its_owners(redis_server):
    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url)
        job, _ = await store.submit(_urls(1), options=JobOptions(owner=ALICE))
        stream = item_stream(JobPriority.NORMAL, ALICE)
        # as an older version left it: the item on the priority's stream, no stream of the owner's
        await store.redis.delete(stream, OWNER_STREAMS_KEY)
        await store.redis.xadd(ITEM_STREAM, {"job": job.id, "index": 0})
        (delivery,) = await store.read_items("c", 5, block_ms=0)
        assert delivery[0] == ITEM_STREAM
        await store.start_item(job.id, 0)
        await store.finish_item(job.id, 0, "failed", {"status": "failed"}, error="bad")
        await store.retry_failed(job.id, ALICE)
        (retried,) = await store.read_items("c", 5, block_ms=0)
        assert retried[0] == stream  # listed and given its group when the retry queued onto it
        await store.close()

    asyncio.run(scenario())


def test_a_redis_that_lost_an_owners_group_has_it_made_again_by_the_worker(redis_server, model, parity_audio):
    """An owner's stream listed but without the workers' group: the read says NOGROUP, the consumer makes the
    group again on every listed stream, and the items are done."""
    async def submit(store: JobStore) -> dict:
        job, _ = await store.submit(upload_items(parity_audio, 2), options=JobOptions(owner=BOB))
        await store.redis.xgroup_destroy(item_stream(JobPriority.NORMAL, BOB), GROUP)
        return {"job": job}

    assert drained_jobs(Settings(redis_url=redis_server.url), model, submit)["job"].status.value == "completed"


# --- workers ------------------------------------------------------------------------------------------------------

def test_another_keys_job_is_not_held_up_by_a_backfill_at_the_same_priority(redis_server, model, parity_audio):
    """Alice's backfill of 24 items is queued before Bob's job of 3, both at normal priority; with room for two
    items at a time, Bob's job is done before the backfill (on one stream, it would wait for all 24)."""
    async def submit(store: JobStore) -> dict:
        return {"backfill": (await store.submit(upload_items(parity_audio, 24), options=JobOptions(owner=ALICE)))[0],
                "small": (await store.submit(upload_items(parity_audio, 3), options=JobOptions(owner=BOB)))[0]}

    settings = Settings(redis_url=redis_server.url, job_prefetch=2, max_batch_size=2, max_wait_ms=1)
    done = drained_jobs(settings, model, submit)
    assert all(job.status.value == "completed" for job in done.values())
    assert done["small"].finished_at < done["backfill"].finished_at
    client = redis_server.client()
    for stream in (item_stream(JobPriority.NORMAL, ALICE), item_stream(JobPriority.NORMAL, BOB)):
        assert client.xpending(stream, GROUP)["pending"] == 0


def test_jobs_submitted_with_api_keys_go_on_their_keys_streams_and_are_done(redis_server, model, parity_audio):
    settings = Settings(redis_url=redis_server.url, api_keys=["alice-key", "bob-key"])
    files = [("files", ("a.wav", Path(parity_audio[0]).read_bytes(), "audio/wav"))]
    with run_server(settings, model) as running:
        ids = {}
        for key in ("alice-key", "bob-key"):
            reply = httpx.post(f"{running.url}/v1/jobs", files=files, data={"priority": "high"},
                               headers={"Authorization": f"Bearer {key}"}, timeout=60)
            assert reply.status_code in (200, 201, 202), reply.text
            ids[key] = reply.json()["id"]
        for key, job_id in ids.items():  # the server's own consumer reads the keys' streams
            headers = {"Authorization": f"Bearer {key}"}
            for _ in range(600):
                job = httpx.get(f"{running.url}/v1/jobs/{job_id}", headers=headers, timeout=30).json()
                if job["status"] not in ("queued", "in_progress"):
                    break
                time.sleep(0.05)
            assert job["status"] == "completed", job
    client = redis_server.client()
    for key, owner in (("alice-key", ALICE), ("bob-key", BOB)):
        entries = client.xrange(item_stream(JobPriority.HIGH, owner))
        assert [fields[b"job"].decode() for _, fields in entries] == [ids[key]]
    assert client.hgetall(OWNER_STREAMS_KEY) == {item_stream(JobPriority.HIGH, o).encode(): b"high"
                                                  for o in (ALICE, BOB)}
    assert client.xlen(ITEM_STREAMS[JobPriority.HIGH]) == 0
