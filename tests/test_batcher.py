"""The dynamic batcher: who goes into a batch, when it is released, and what is dropped."""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest
import torch

from service.batcher import Batch, Batcher, Priority, QueueFull, WorkItem, queue_limit
from service.config import Settings
from service.engine import WARMUP_S, warmup_shapes


def _item(seconds: float, priority: Priority = Priority.INTERACTIVE, timeout_s: float = 60.0) -> WorkItem:
    return WorkItem(np.zeros(int(seconds * 16000), dtype=np.float32), priority, timeout_s)


def _batcher(**kw) -> Batcher:
    args = {"max_batch_size": 4, "max_batch_audio_s": 1000.0, "max_wait_ms": 0.0, "max_queue": 100} | kw
    return Batcher(**args)


def test_oldest_item_is_always_in_the_batch_with_similar_lengths():
    b = _batcher()
    items = [_item(s) for s in (10, 1, 30, 11, 2, 9, 29, 12)]
    b.submit(items)
    first = b.next_batch().items
    assert items[0] in first and len(first) == 4
    assert sorted(i.n_samples // 16000 for i in first) == [9, 10, 11, 12]


def test_length_buckets_keep_a_batch_to_one_bucket_padded_to_its_end_and_full_rows():
    b = _batcher(length_bucket_s=2.0)
    items = [_item(s) for s in (2.5, 1.0, 3.9, 2.0, 0.4, 4.1, 3.0)]
    b.submit(items)
    batches = [b.next_batch() for _ in range(3)]
    assert [sorted(i.n_samples / 16000 for i in batch.items) for batch in batches] == [
        [2.5, 3.0, 3.9], [0.4, 1.0, 2.0], [4.1]]  # (2, 4], (0, 2], (4, 6]: each anchored on its oldest
    assert [batch.width / 16000 for batch in batches] == [4.0, 2.0, 6.0]
    assert [batch.rows for batch in batches] == [4, 4, 4]  # max_batch_size, padded with silence
    assert batches[0].padded_samples == 4 * 4 * 16000
    assert _batcher().padded_length(12345) == 12345 and b.padded_length(0) == 32000


def test_the_last_bucket_ends_at_the_longest_piece():
    """7 s buckets padded 30 s pieces (the longest a recording is cut into) to 35 s: every batch of that bucket
    computed 5 s a row no piece could fill, and fit fewer rows in the padded-audio limit (27 of 32)."""
    b = _batcher(max_batch_size=32, max_batch_audio_s=32 * 30.0, length_bucket_s=7.0, longest_samples=30 * 16000)
    b.submit([_item(30.0) for _ in range(32)] + [_item(29.0)])
    batch = b.next_batch()
    assert (batch.width, batch.rows, len(batch.items)) == (30 * 16000, 32, 32)
    assert b.padded_length(29 * 16000) == 30 * 16000  # (28, 35] ends at 30
    assert b.padded_length(27 * 16000) == 28 * 16000 and b.padded_length(20 * 16000) == 21 * 16000
    assert b.padded_length(31 * 16000) == 35 * 16000  # past the longest (none is): its own bucket, as before


def test_a_batch_is_released_once_any_item_has_waited_not_only_the_first_in_line():
    """The release was timed from the first item in line, and an owner whose requests are cancelled as they wait
    keeps its turns ahead of another's item: the other's item then waited, beside an idle engine, until it timed
    out. It is timed from the item waiting longest."""
    b = _batcher(max_batch_size=32, max_wait_ms=10_000.0)
    waited = WorkItem(np.zeros(5 * 16000, dtype=np.float32), owner="patient", enqueued_at=time.monotonic() - 20)
    b.submit([waited])
    b.submit([WorkItem(np.zeros(1600, dtype=np.float32), owner="churning")])  # a shorter turn: first in line
    released: list[Batch | None] = []
    engine = threading.Thread(target=lambda: released.append(b.next_batch()), daemon=True)
    engine.start()
    engine.join(5.0)
    b.close()
    assert released and waited in released[0].items


def test_without_buckets_a_batch_is_its_items_padded_to_the_longest():
    b = _batcher()
    b.submit([_item(s) for s in (2.5, 1.0)])
    batch = b.next_batch()
    assert (batch.rows, batch.width, batch.padded_samples) == (2, 40000, 80000)


def test_the_padded_audio_limit_counts_the_bucket_end():
    b = _batcher(length_bucket_s=10.0, max_batch_audio_s=25.0)
    b.submit([_item(s) for s in (1.0, 1.5, 2.0)])
    batch = b.next_batch()
    assert len(batch.items) == 2  # 2 pieces padded to 10 s fit 25 s, 3 do not
    # and the rows of silence too: a bucket's shape is as many rows as fit the limit, not max_batch_size (4 x 10 s)
    assert batch.rows == 2 and batch.padded_samples <= 25 * 16000


def test_padded_audio_limit_bounds_the_batch():
    b = _batcher(max_batch_audio_s=45.0)
    b.submit([_item(10), _item(20), _item(5)])
    batch = b.next_batch()
    assert batch.padded_samples <= 45 * 16000
    assert [i.n_samples // 16000 for i in batch.items] == [10, 5]


def test_interactive_first_then_bulk_fills_the_room():
    b = _batcher()
    bulk = [_item(5, Priority.BULK) for _ in range(3)]
    b.submit(bulk)
    interactive = [_item(5) for _ in range(2)]
    b.submit(interactive)
    batch = b.next_batch().items
    assert batch[:2] == interactive and len(batch) == 4 and batch[2] in bulk


def test_job_items_go_by_their_jobs_priority_whatever_was_queued_first():
    b = _batcher()
    low = [_item(5, Priority.BULK_LOW) for _ in range(4)]
    normal = [_item(5, Priority.BULK) for _ in range(3)]
    high = [_item(5, Priority.BULK_HIGH) for _ in range(2)]
    for items in (low, normal, high):  # a backfill held first, an urgent job's items last
        b.submit(items)
    first = b.next_batch().items
    assert first[:2] == high and set(map(id, first[2:])) <= set(map(id, normal))
    second = b.next_batch().items
    assert normal[2] in second and set(map(id, second)) - {id(normal[2])} <= set(map(id, low))


def _owned(owner: str, n: int, seconds: float = 1.0) -> list[WorkItem]:
    return [WorkItem(np.zeros(int(seconds * 16000), dtype=np.float32), Priority.BULK, 60.0, owner=owner)
            for _ in range(n)]


def _owners(batch) -> str:
    return "".join(item.owner for item in batch.items)


def test_another_owners_items_take_turns_with_a_backfill_held_before_them():
    """A worker holds 40 of a's items when b's 4 come: b's are in the next two batches, not after a's 40."""
    b = _batcher()
    b.submit(_owned("a", 40))
    b.submit(_owned("b", 4))
    assert [_owners(b.next_batch()) for _ in range(3)] == ["abab", "abab", "aaaa"]


def test_an_owner_back_after_a_while_takes_its_turn_at_the_head_of_the_line():
    """Turns given to the items still held are not held against an owner that had none waiting."""
    b = _batcher()
    b.submit(_owned("a", 40))
    b.submit(_owned("b", 2))
    assert [_owners(b.next_batch()) for _ in range(4)] == ["abab", "aaaa", "aaaa", "aaaa"]
    b.submit(_owned("b", 2))  # after 14 of a's: in the next batch, not behind all of a's 26 left
    assert sorted(_owners(b.next_batch())) == ["a", "a", "b", "b"]


@pytest.mark.parametrize("gone", ["cancelled", "expired"])
def test_items_dropped_unserved_are_not_held_against_their_owner(gone):
    """a queued 100 items of 30 s and they were dropped unserved (its clients went away, or their time ran out):
    a's next item was still given its turn after all of them, behind everything b queued meanwhile, 50 items."""
    b = _batcher(max_batch_size=1, max_queue=1000)
    given_up = [WorkItem(np.zeros(30 * 16000, dtype=np.float32), Priority.BULK, 0.05 if gone == "expired" else 60.0,
                         owner="a") for _ in range(100)]
    b.submit(given_up)
    if gone == "cancelled":
        for item in given_up:
            item.future.cancel()
    else:
        time.sleep(0.1)  # past their deadline
    b.submit(_owned("b", 25))
    b.submit(_owned("a", 1))
    b.submit(_owned("b", 25))
    order = "".join(_owners(b.next_batch()) for _ in range(51))
    assert order.count("a") == 1 and order.index("a") <= 1, order


def test_turns_are_shared_by_audio_not_by_items():
    """b's items are twice as long as a's: b gets one turn for two of a's, the same audio each. (A batch is its
    first item, in turn, and items of similar length from the next: one item a batch shows the turns.)"""
    b = _batcher(max_batch_size=1)
    b.submit(_owned("a", 12))
    b.submit(_owned("b", 4, seconds=2.0))
    assert "".join(_owners(b.next_batch()) for _ in range(9)) == "aabaabaab"


def test_one_owners_items_keep_the_order_they_came_in():
    b = _batcher()
    items = _owned("a", 6) + _owned("", 2)  # "" too is one owner: HTTP requests'
    b.submit(items[:3])
    b.submit(items[3:6])
    assert b.next_batch().items == items[:4]
    assert b.next_batch().items == items[4:6]


def test_batch_waits_for_max_wait_unless_full():
    b = _batcher(max_wait_ms=200)
    b.submit([_item(1)])
    started = time.monotonic()
    assert len(b.next_batch().items) == 1
    assert time.monotonic() - started >= 0.19
    b.submit([_item(1) for _ in range(4)])
    started = time.monotonic()
    assert len(b.next_batch().items) == 4
    assert time.monotonic() - started < 0.1  # full: no waiting


def test_bulk_work_leaves_a_quarter_of_the_queue_to_interactive_requests():
    """Job items could fill the whole queue, the consumer refilling it within 0.2 s of each batch: every HTTP request
    was refused 429 until the backfill ended."""
    b = _batcher(max_queue=16)
    assert (b.room(Priority.BULK), b.room(Priority.INTERACTIVE)) == (12, 16)
    b.submit([_item(1, Priority.BULK) for _ in range(12)])
    with pytest.raises(QueueFull):
        b.submit([_item(1, Priority.BULK_HIGH)])
    b.submit([_item(1) for _ in range(4)])  # interactive: the room kept for it
    assert (b.depth, b.room(Priority.BULK), b.room(Priority.INTERACTIVE)) == (16, 0, 0)
    assert [queue_limit(n, Priority.BULK_LOW) for n in (1, 2, 4, 2048)] == [1, 1, 3, 1536]


def test_queue_full_is_all_or_nothing():
    b = _batcher(max_queue=3)
    b.submit([_item(1), _item(1)])
    with pytest.raises(QueueFull) as info:
        b.submit([_item(1), _item(1)])
    assert info.value.retry_after_s >= 1 and b.depth == 2


def test_cancelled_and_expired_items_never_reach_the_engine():
    drops = []
    b = _batcher(on_drop=drops.append)
    cancelled, expired, alive = _item(1), _item(1, timeout_s=0.0), _item(1)
    b.submit([cancelled, expired, alive])
    cancelled.future.cancel()
    assert b.next_batch().items == [alive]
    assert sorted(drops) == ["cancelled", "expired"]
    assert isinstance(expired.future.exception(), TimeoutError)


def test_items_that_die_while_others_wait_are_dropped_where_they_stand():
    """The queue is looked through only after a cancel or a passed deadline; both still drop the item, from
    the middle of the queue, between items of the same length."""
    drops = []
    b = _batcher(on_drop=drops.append, max_batch_size=2)
    first, later, short_lived, fourth, fifth = _item(5), _item(5), _item(5, timeout_s=0.3), _item(5), _item(5)
    b.submit([first, later, short_lived, fourth, fifth])
    assert b.next_batch().items == [first, later]
    time.sleep(0.35)
    assert b.next_batch().items == [fourth, fifth]
    assert drops == ["expired"] and isinstance(short_lived.future.exception(), TimeoutError)
    cancelled, alive = _item(5), _item(5)
    b.submit([cancelled, alive])
    cancelled.future.cancel()
    assert b.next_batch().items == [alive]
    assert drops == ["expired", "cancelled"]


def test_items_that_could_not_be_done_before_their_deadline_are_failed_instead_of_started():
    """Under overload items were started with less time left than a batch takes: the engine transcribed for
    clients already answered 504, and a tenth of its work reached anyone (loadtest/overload.py)."""
    drops = []
    b = _batcher(on_drop=drops.append, max_batch_size=2)
    unknown_pace = _item(1, timeout_s=1.0)
    b.submit([unknown_pace])
    assert b.next_batch().items == [unknown_pace]  # no batch timed yet: nothing is judged too late
    b.record_throughput(audio_s=2.0, compute_s=0.5)  # batches take 0.5 s: an item needs 1 s (its own, one ahead)
    too_late, in_time = _item(1, timeout_s=0.8), _item(1, timeout_s=30.0)
    b.submit([too_late, in_time])
    assert b.next_batch().items == [in_time]
    assert drops == ["expired"] and isinstance(too_late.future.exception(), TimeoutError)
    # said as it is: not a hang, a refusal with time left that two batches would not fit in
    assert re.fullmatch(r"dropped before it ran: 0\.\d s of its 0\.8 s were left, and 2 batches take 1\.0 s at the "
                        r"engine's recent pace", str(too_late.future.exception()))
    assert str(expired_late(b)) == "not processed within 0 s"


def test_a_short_request_after_long_ones_is_judged_by_its_own_audio_not_their_batches():
    """A burst of long uploads made batches of 4 s; judged by them (two take 8 s), a 10 ms request with a 4 s timeout
    was dropped unrun, and so was every request after it, the pace never measured again: a server answering 504 to
    all until restarted. The next batch is judged by the audio waiting, up to a recent batch's time."""
    drops = []
    b = _batcher(on_drop=drops.append, max_batch_size=4)
    b.record_throughput(audio_s=240.0, compute_s=4.2)  # the burst's batch
    short = _item(0.01, timeout_s=4.0)
    b.submit([short])
    assert b.next_batch().items == [short] and drops == []
    # with a batch's worth of audio waiting, its batches' time is what an item needs, as before
    backlog = [_item(30.0, timeout_s=30.0) for _ in range(8)]
    doomed = _item(30.0, timeout_s=4.0)
    b.submit([*backlog, doomed])
    assert doomed not in b.next_batch().items
    assert drops == ["expired"] and "2 batches take 8.4 s" in str(doomed.future.exception())


def test_a_request_after_a_burst_of_abandoned_ones_is_judged_without_their_audio():
    """The pace was judged before the cancelled items were dropped: their 42 minutes of audio said two batches take
    24 s, and a 6 s request with 10 s left was dropped beside an idle engine."""
    drops = []
    b = _batcher(on_drop=drops.append, max_queue=200)
    b.record_throughput(audio_s=960.0, compute_s=12.0)
    abandoned = [_item(28.0, timeout_s=60.0) for _ in range(90)]
    b.submit(abandoned)
    for item in abandoned:
        item.future.cancel()
    fresh, patient = _item(6.0, timeout_s=10.0), _item(6.0, timeout_s=60.0)  # patient: a batch comes either way
    b.submit([fresh, patient])
    assert b.next_batch().items == [fresh, patient]
    assert drops == ["cancelled"] * 90


def expired_late(b) -> BaseException | None:
    """The error of an item whose time ran out before anyone looked."""
    late = _item(1, timeout_s=0.0)
    b.submit([late, _item(1, timeout_s=30.0)])
    b.next_batch()
    return late.future.exception()


def test_close_drains_then_stops():
    b = _batcher(max_wait_ms=10_000)
    b.submit([_item(1)])
    threading.Timer(0.1, b.close).start()
    assert len(b.next_batch().items) == 1  # released by close, not by the 10 s wait
    assert b.next_batch() is None
    with pytest.raises(RuntimeError):
        b.submit([_item(1)])


def test_the_padded_audio_limit_follows_the_batch_size_unless_set():
    assert Settings().batch_audio_limit_s == Settings().max_batch_size * Settings().max_segment_s
    assert Settings(max_batch_size=128).batch_audio_limit_s == 128 * 30.0  # not capped at 32 batches' worth
    assert Settings(max_batch_size=128, max_batch_audio_s=600).batch_audio_limit_s == 600


def test_warm_up_covers_the_widest_and_the_longest_batch_on_a_gpu_only():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert warmup_shapes(cpu, 128, 30.0, 3840.0) == [(1, WARMUP_S)]
    assert warmup_shapes(cuda, 128, 30.0, 3840.0) == [(1, WARMUP_S), (128, 30.0)]
    # a tighter padded-audio limit: full rows of shorter pieces, and fewer rows of the longest
    assert warmup_shapes(cuda, 128, 30.0, 960.0) == [(1, WARMUP_S), (128, 7.5), (32, 30.0)]
    assert warmup_shapes(cuda, 16, 30.0, 10.0) == [(1, WARMUP_S), (16, 0.625), (1, 30.0)]  # one piece may pass it


def test_a_waiting_engine_wakes_for_a_cancel():
    """A cancelled item kept its place in the queue (and in the 429 count) until the batch wait ended."""
    b = _batcher(max_wait_ms=3000.0, max_batch_size=64)
    threading.Thread(target=b.next_batch, daemon=True).start()
    cancelled = _item(1.0)
    started = time.monotonic()
    b.submit([cancelled])
    time.sleep(0.2)
    cancelled.future.cancel()
    deadline = time.monotonic() + 1.0
    while b.depth and time.monotonic() < deadline:
        time.sleep(0.01)
    assert b.depth == 0 and time.monotonic() - started < 1.5
    b.close()


def test_a_batch_counts_each_owners_audio_by_source_with_overlaps_once():
    """What batchasr_owner_audio_seconds adds up: a long recording's piece counts its own samples (not the overlap
    the next piece transcribes too), requests someone waits on as "http", job items as "job"."""
    samples = np.zeros(16000, dtype=np.float32)
    items = [WorkItem(samples, Priority.INTERACTIVE, owner="a", counted_samples=12000),
             WorkItem(samples, Priority.INTERACTIVE, owner="a"),
             WorkItem(samples, Priority.BULK_HIGH, owner="a"),
             WorkItem(samples, Priority.BULK_LOW, owner="b")]
    assert Batch(items).counted_by_owner() == {("a", "http"): 28000, ("a", "job"): 16000, ("b", "job"): 16000}
