"""Fair shares between owners (API keys), against a real redis-server and real servers: each owner's items go on a
stream of their own, workers read each owner's stream with items waiting an equal share within a priority, so one
key's backfill does not hold up another key's job; the owners' streams are trimmed, retried onto and counted in
the lag like the priorities' own (and reclaimed: tests/test_job_priority.py). And the items one key may have queued
at once (BATCHASR_JOB_MAX_QUEUED_ITEMS): a submission past it is refused (429, 413 for a job that could never fit)
with nothing of it written, other keys go on, and `batchasr submit` waits for room and submits the rest as the
workers take the first jobs."""

from __future__ import annotations

import asyncio
import io
import json
import re
import socket
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import soundfile as sf
from hypothesis import given
from hypothesis import strategies as st

from service import job_routes, jobs, url_inputs
from service.config import Settings
from service.http import owner_of
from service.item_streams import Backlog, fair_shares
from service.job_keys import (
    GROUP,
    ITEM_STREAM,
    ITEM_STREAMS,
    OWNER_STREAMS_KEY,
    RESERVED_KEY,
    item_stream,
    stream_priority,
)
from service.job_types import ANONYMOUS, ItemInput, JobOptions, JobPriority, NoRoomToRetry, TooManyQueued
from service.jobs import JobStore
from service.jobs_cli import run_action, run_list, run_submit
from tests.ports import free_port
from tests.servers import drained_jobs, run_server, settle_items, upload_items, wait_job

ALICE, BOB = owner_of("alice-key"), owner_of("bob-key")


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
        assert await store.backlog() == Backlog(waiting=42, delivered=0)

        def by_stream(taken):
            return Counter(stream for stream, _, _ in taken)

        # high first (Bob's four), then normal shared out: three each, the remainder to one of them in turn
        first = by_stream(await store.read_items("c", 14, block_ms=0))
        assert await store.backlog() == Backlog(waiting=28, delivered=14)
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
        # nothing waits: a worker added now would find nothing to read (the workers scale on waiting alone)
        assert await store.backlog() == Backlog(waiting=0, delivered=42)
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
        queued = (await store.retry_failed(job.id, ALICE)).retried
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


def test_each_keys_audio_is_counted_by_source_for_charging_back(redis_server, model, parity_audio):
    """batchasr_owner_audio_seconds: Alice's HTTP request and Bob's job of two items, each key's seconds (the
    recordings' own) under its owner id, the hash Redis keeps its jobs under; nothing under anyone else."""
    settings = Settings(redis_url=redis_server.url, api_keys=["alice-key", "bob-key"])
    audio = Path(parity_audio[0]).read_bytes()
    seconds = sf.info(parity_audio[0]).duration
    with run_server(settings, model) as running:
        reply = httpx.post(f"{running.url}/v1/audio/transcriptions", files={"file": ("a.wav", audio, "audio/wav")},
                           headers={"Authorization": "Bearer alice-key"}, timeout=60)
        assert reply.status_code == 200, reply.text
        bob = {"Authorization": "Bearer bob-key"}
        job = httpx.post(f"{running.url}/v1/jobs", files=[("files", (f"{i}.wav", audio, "audio/wav")) for i in (0, 1)],
                         headers=bob, timeout=60).json()
        for _ in range(600):
            if httpx.get(f"{running.url}/v1/jobs/{job['id']}", headers=bob, timeout=30).json()["status"] == "completed":
                break
            time.sleep(0.05)
        text = httpx.get(f"{running.url}/metrics", timeout=30).text
    used = {tuple(re.findall(r'"([^"]*)"', line)): float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("batchasr_owner_audio_seconds_total{")}
    # every key's series there from the start (at 0: increase() then counts a key's first use)
    assert used == pytest.approx({(ALICE, "http"): seconds, (ALICE, "job"): 0, (BOB, "http"): 0,
                                  (BOB, "job"): 2 * seconds}, abs=1e-3), used


# --- the items a key may have queued at once (BATCHASR_JOB_MAX_QUEUED_ITEMS) -----------------------------------

def test_the_limit_counts_a_keys_items_queued_and_in_hand_over_its_streams(redis_server):
    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url, max_queued_items=5)
        first, _ = await store.submit(_urls(2), "first", options=JobOptions(owner=ALICE))
        await store.submit(_urls(1), options=JobOptions(owner=ALICE, priority=JobPriority.HIGH))  # every priority
        with pytest.raises(TooManyQueued) as refused:
            await store.submit(_urls(3), options=JobOptions(owner=ALICE))
        assert (refused.value.queued, refused.value.limit, refused.value.items) == (3, 5, 3)
        assert not refused.value.never_fits and "3 of this key's items are queued" in str(refused.value)
        assert await store.redis.xlen(item_stream(JobPriority.NORMAL, ALICE)) == 2  # nothing of it written
        assert (await store.list_jobs(ALICE))[0].__len__() == 2
        await store.submit(_urls(5), options=JobOptions(owner=BOB))  # another key's own limit
        with pytest.raises(TooManyQueued) as never:
            await store.submit(_urls(6), options=JobOptions(owner=ALICE))
        assert never.value.never_fits and "submit it as smaller jobs" in str(never.value)
        again, created = await store.submit(_urls(2), "first", options=JobOptions(owner=ALICE))  # a retry of it
        assert again.id == first.id and not created
        taken = await store.read_items("c", 3, block_ms=0)  # high first: Alice's one, then normal's shared out
        assert await store.queued_items(ALICE) == 3  # delivered, not done: still in hand
        for stream, message_id, _ in taken:
            await store.ack_item(stream, message_id)
        assert await store.queued_items(ALICE) + await store.queued_items(BOB) == 8 - 3
        await store.submit(_urls(5 - await store.queued_items(ALICE)), options=JobOptions(owner=ALICE))
        await store.close()

    asyncio.run(scenario())


def test_submissions_at_the_same_moment_do_not_pass_the_limit_together(redis_server, parity_audio):
    """Each submission reserves its items against the key's limit, counted with those queued in one step (a Lua
    script), before its uploads are written: ten at once, each of two uploads, against a limit of 9 queue four jobs
    (eight items); the other six are refused with nothing written. Counted apart from the queueing, all ten passed
    (each saw none queued)."""
    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url, max_queued_items=9)
        outcomes = await asyncio.gather(
            *[store.submit(upload_items(parity_audio, 2), options=JobOptions(owner=ALICE)) for _ in range(10)],
            return_exceptions=True)
        assert sorted(type(outcome).__name__ for outcome in outcomes) == ["TooManyQueued"] * 6 + ["tuple"] * 4
        assert await store.queued_items(ALICE) == 8
        assert len(await store.redis.keys("batchasr:upload:*")) == 8  # the refused jobs wrote none
        assert not await store.redis.exists(RESERVED_KEY.format(owner=ALICE))  # each queued job dropped its own
        await store.close()

    asyncio.run(scenario())


def test_a_reservation_counts_until_its_job_is_queued_and_lapses_if_its_submitter_died(redis_server, monkeypatch):
    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url, max_queued_items=5)
        await store._reserve("job_of_a_submitter_that_died", ALICE, 4)  # between its reservation and its job
        await store.submit(_urls(1), options=JobOptions(owner=ALICE))
        with pytest.raises(TooManyQueued) as refused:
            await store.submit(_urls(1), options=JobOptions(owner=ALICE))
        assert refused.value.queued == 5 == await store.queued_items(ALICE)  # one queued, four reserved
        await store.submit(_urls(2), options=JobOptions(owner=BOB))  # another key's reservations are its own
        monkeypatch.setattr(jobs, "RESERVATION_HOLD_MS", 200)
        await asyncio.sleep(0.3)
        await store.submit(_urls(4), options=JobOptions(owner=ALICE))  # the dead one's reservation lapsed
        assert await store.queued_items(ALICE) == 5
        assert not await store.redis.exists(RESERVED_KEY.format(owner=ALICE))
        await store.close()

    asyncio.run(scenario())


def test_a_retry_queues_as_many_failed_items_as_the_limit_has_room_for(redis_server, monkeypatch):
    """Retried items count against the key's limit as a submission's do, in the step that queues them: a page at a
    time (two items here), each page counting those the one before queued. Those left failed go at a later retry."""
    monkeypatch.setattr(jobs, "RESULTS_PAGE", 2)

    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url, max_queued_items=5)
        failed, _ = await store.submit(_urls(5), options=JobOptions(owner=ALICE))
        await settle_items(store, 5, "failed")
        await store.submit(_urls(2), options=JobOptions(owner=ALICE))
        stream = item_stream(JobPriority.NORMAL, ALICE)
        entries = await store.redis.xlen(stream)

        retry = await store.retry_failed(failed.id, ALICE)
        assert (retry.retried, retry.unretried, retry.deferred) == (3, 0, 2)  # 2 queued already: room for 3
        assert retry.job.counts["queued"] == 3 and retry.job.counts["failed"] == 2
        assert retry.job.status.value == "in_progress" and retry.to_dict()["deferred_items"] == 2
        assert await store.queued_items(ALICE) == 5 and await store.redis.xlen(stream) == entries + 3

        with pytest.raises(NoRoomToRetry) as refused:  # none queued: refused, and nothing written
            await store.retry_failed(failed.id, ALICE)
        assert (refused.value.queued, refused.value.limit, refused.value.items) == (5, 5, 2)
        assert "none of the job's 2 failed items were queued again" in str(refused.value)
        assert not refused.value.never_fits and await store.redis.xlen(stream) == entries + 3
        assert (await store.get(failed.id)).counts["failed"] == 2

        await settle_items(store, 2)  # the second job's two: room for two
        await store._reserve("job_being_queued", ALICE, 1)  # of which a submission under way holds one
        retry = await store.retry_failed(failed.id, ALICE)
        assert (retry.retried, retry.deferred) == (1, 1)
        await store.redis.hdel(RESERVED_KEY.format(owner=ALICE), "job_being_queued")
        retry = await store.retry_failed(failed.id, ALICE)
        assert (retry.retried, retry.deferred) == (1, 0) and retry.job.counts["queued"] == 5
        await store.close()

    asyncio.run(scenario())


@pytest.fixture
def silent_site():
    """An address that takes connections and never answers: a job's URL items stay in a worker's hand until their
    fetches time out."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    yield f"http://127.0.0.1:{listener.getsockname()[1]}/clips/"
    listener.close()


def test_a_key_at_its_limit_is_refused_over_http_while_other_keys_go_on(redis_server, model, silent_site):
    settings = Settings(redis_url=redis_server.url, api_keys=["alice-key", "bob-key"], job_max_queued_items=2,
                        input_url_prefixes=[silent_site], job_url_timeout_s=3)
    with run_server(settings, model) as running:
        def submit(key: str, n: int, **headers: str) -> httpx.Response:
            items = [{"url": f"{silent_site}{i}.wav"} for i in range(n)]
            return httpx.post(f"{running.url}/v1/jobs", json={"items": items}, timeout=30,
                              headers={"Authorization": f"Bearer {key}", **headers})

        first = submit("alice-key", 2, **{"Idempotency-Key": "backfill-1"})
        assert first.status_code == 202
        refused = submit("alice-key", 1)
        error = refused.json()["error"]
        assert refused.status_code == 429 and error["code"] == "too_many_queued_items", refused.text
        assert refused.headers["Retry-After"] == str(job_routes.QUEUED_RETRY_AFTER_S)
        assert "BATCHASR_JOB_MAX_QUEUED_ITEMS" in error["message"]
        again = submit("alice-key", 2, **{"Idempotency-Key": "backfill-1"})  # a retry is answered, not refused
        assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
        assert submit("bob-key", 2).status_code == 202
        too_big = submit("bob-key", 3)
        assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "too_many_items"
        assert too_big.headers["X-Max-Queued-Items"] == "2"  # what to split it by
        client = redis_server.client()  # none of the refused ones written (their fetches keep the rest in hand)
        assert [client.xlen(item_stream(JobPriority.NORMAL, owner)) for owner in (ALICE, BOB)] == [2, 2]


def test_retries_over_http_queue_what_fits_and_the_cli_retries_until_all_are_queued(redis_server, model,
                                                                                    silent_site, monkeypatch, capsys):
    """Items whose fetches fail after 2 s (one try, one attempt) against a limit of 3: a job's three failed, two
    others in hand, a retry queues one and defers two, the next is refused (429) with the job as it was, and
    `batchasr jobs --retry` waits for room and queues the rest."""
    monkeypatch.setattr(url_inputs, "RETRY_DELAYS_S", ())
    monkeypatch.setattr(job_routes, "QUEUED_RETRY_AFTER_S", 1)
    settings = Settings(redis_url=redis_server.url, api_keys=["alice-key"], job_max_queued_items=3,
                        input_url_prefixes=[silent_site], job_url_timeout_s=2, job_max_attempts=1)
    alice = {"Authorization": "Bearer alice-key"}
    with run_server(settings, model) as running:
        def submit(n: int) -> str:
            items = [{"url": f"{silent_site}{i}.wav"} for i in range(n)]
            reply = httpx.post(f"{running.url}/v1/jobs", json={"items": items}, headers=alice, timeout=30)
            assert reply.status_code == 202, reply.text
            return reply.json()["id"]

        def retry(job_id: str) -> httpx.Response:
            return httpx.post(f"{running.url}/v1/jobs/{job_id}/retry", headers=alice, timeout=30)

        failed = wait_job(running.url, submit(3), headers=alice)
        assert failed["status"] == "failed"
        client, deadline = redis_server.client(), time.monotonic() + 10
        while client.xpending(item_stream(JobPriority.NORMAL, ALICE), GROUP)["pending"]:  # acknowledged after
            assert time.monotonic() < deadline
            time.sleep(0.02)
        submit(2)  # in hand until their fetches time out
        partly = retry(failed["id"])
        assert partly.status_code == 200, partly.text
        assert [partly.json()[f"{n}_items"] for n in ("retried", "unretried", "deferred")] == [1, 0, 2]

        refused = retry(failed["id"])
        error = refused.json()["error"]
        assert refused.status_code == 429 and error["code"] == "too_many_queued_items", refused.text
        assert refused.headers["Retry-After"] == "1"
        assert "none of the job's 2 failed items were queued again" in error["message"]
        after = httpx.get(f"{running.url}/v1/jobs/{failed['id']}", headers=alice).json()
        assert after["status"] == "in_progress" and after["counts"]["failed"] == 2
        listed = httpx.get(f"{running.url}/v1/jobs", headers=alice).json()  # the room a key has, for pacing
        assert (listed["queued_items"], listed["max_queued_items"]) == (3, 3)
        table = io.StringIO()  # `batchasr jobs` says it under its table
        assert asyncio.run(run_list(None, running.url, "alice-key", 20, None, False, table)) == 0
        assert [row.split()[0] for row in table.getvalue().splitlines()[1:]] == [job["id"] for job in listed["data"]]
        assert "items queued or in progress: 3 (limit: 3)" in capsys.readouterr().err.splitlines()

        output = io.StringIO()
        assert asyncio.run(run_action(None, running.url, "alice-key", [failed["id"]], "retry", output)) == 0
        answer = json.loads(output.getvalue())
        assert answer["deferred_items"] == 0 and answer["retried_items"] in (2, 3)  # 3: the one retried failed too
        assert "waiting for room:" in capsys.readouterr().err
        ended = wait_job(running.url, failed["id"], headers=alice)
        assert ended["status"] == "failed" and ended["counts"]["failed"] == 3


def test_submit_waits_for_room_and_goes_on_as_the_first_jobs_are_done(redis_server, model, parity_audio,
                                                                      monkeypatch, tmp_path):
    """Three files as three jobs (`--job-bytes 1`) under a limit of one item: each job after the first is refused
    until the one before it is done, and submit waits and submits it then; every result comes back."""
    monkeypatch.setattr(job_routes, "QUEUED_RETRY_AFTER_S", 1)
    settings = Settings(redis_url=redis_server.url, api_keys=["alice-key"], job_max_queued_items=1)
    files = parity_audio[:3]
    with run_server(settings, model) as running:
        done = subprocess.run([sys.executable, "-m", "service.cli", "submit", "--server", running.url, "--api-key",
                               "alice-key", "--job-bytes", "1", "--wait", *files], capture_output=True, text=True,
                              timeout=300)
    assert done.returncode == 0, done.stderr
    assert "waiting for room:" in done.stderr and "trying again in 1 s" in done.stderr
    assert done.stderr.count(": 1 items\n") == 3
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["audio"] for r in records] == files and all(r["status"] == "completed" for r in records)
    assert all(Path(f).exists() for f in files)


def test_submit_sends_a_job_past_the_keys_limit_as_jobs_within_it(redis_server, model, parity_audio, monkeypatch):
    """A backfill of more items than the key may have queued at once was refused whole (413, "submit it as smaller
    jobs"), where docs/settings.md promised a backfill of any size goes in at the workers' pace: now it is sent as
    jobs of at most the limit the refusal names, each when there is room; run again under its key, it takes them up."""
    monkeypatch.setattr(job_routes, "QUEUED_RETRY_AFTER_S", 1)
    settings = Settings(redis_url=redis_server.url, api_keys=["alice-key"], job_max_queued_items=2)
    files = parity_audio[:3] + parity_audio[:2]
    with run_server(settings, model) as running:
        command = [sys.executable, "-m", "service.cli", "submit", "--server", running.url, "--api-key", "alice-key",
                   "--idempotency-key", "backfill", *files]
        done = subprocess.run([*command, "--wait"], capture_output=True, text=True, timeout=300)
        again = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "sent as 3 jobs of at most 2 items" in done.stderr and "waiting for room:" in done.stderr
    sent = [line for line in done.stderr.splitlines() if line.startswith("job ") and line.endswith(" items")]
    assert [line.split(": ")[1] for line in sent] == ["2 items", "2 items", "1 items"]
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["audio"] for r in records] == files and all(r["status"] == "completed" for r in records)
    assert again.returncode == 0, again.stderr
    assert [json.loads(line)["id"] for line in again.stdout.splitlines()] == [line.split()[1].rstrip(":")
                                                                             for line in sent]


def test_a_submit_waiting_for_room_rides_out_the_server_going_away(redis_server, model, parity_audio, silent_site,
                                                                    monkeypatch, capsys):
    """The key's one item in hand (a fetch that times out in 4 s), submit's first job is refused (429) and waits;
    the server stops meanwhile and comes back on its address. Submit's next try meets nothing there: once a try has
    reached the server, that is an outage to ride out, not a wrong address to stop at (it ended the command, and a
    backfill with it, at a rolling restart)."""
    monkeypatch.setattr(url_inputs, "RETRY_DELAYS_S", ())
    monkeypatch.setattr(job_routes, "QUEUED_RETRY_AFTER_S", 1)
    settings = Settings(redis_url=redis_server.url, api_keys=["alice-key"], job_max_queued_items=1,
                        input_url_prefixes=[silent_site], job_url_timeout_s=4, job_max_attempts=1)
    port, out = free_port(), io.StringIO()
    refusals = '{code="429",route="/v1/jobs"}'

    async def submitting() -> int:
        return await run_submit([Path(parity_audio[0])], None, f"http://127.0.0.1:{port}", "alice-key", True, out,
                                poll_s=0.05)

    with ThreadPoolExecutor(1) as pool:
        with run_server(settings, model, port=port) as first:
            in_hand = httpx.post(f"{first.url}/v1/jobs", json={"items": [{"url": f"{silent_site}0.wav"}]},
                                 headers={"Authorization": "Bearer alice-key"}, timeout=30)
            assert in_hand.status_code == 202, in_hand.text
            submitted = pool.submit(asyncio.run, submitting())
            deadline = time.monotonic() + 10
            while first.metric("batchasr_requests_total", refusals) < 1:  # refused: waiting 1 s for room
                assert time.monotonic() < deadline and not submitted.done()
                time.sleep(0.02)
        time.sleep(1.5)  # stopped: submit's next try finds nothing listening
        with run_server(settings, model, port=port):
            assert submitted.result(timeout=120) == 0, capsys.readouterr().err
    record = json.loads(out.getvalue())
    assert record["status"] == "completed" and record["audio"] == parity_audio[0]
    said = capsys.readouterr().err
    assert "waiting for room:" in said and "submitting: " in said and "trying again" in said
    assert f"(http://127.0.0.1:{port}/v1/jobs); trying again" in said  # where it could not reach
