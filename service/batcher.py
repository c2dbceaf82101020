"""Dynamic batching: one queue per engine; CPU bookkeeping only, never touches the model.

Invariant: the first waiting item of the most urgent priority is in the next batch, so nothing starves;
the rest of the batch is chosen among waiting items of similar length, so little compute goes to padding.
A batch is released when ``max_batch_size`` items wait (of any priority and length) or when any item has waited
``max_wait_ms``.

Within a priority, items wait in the order of their turn: each owner's items (a job's owner, its API key) take
turns in proportion to their audio, so one owner's backfill already held here does not keep another owner's items
waiting until it is done (fair queueing by virtual time; items without an owner, one owner, keep their order).

With ``length_bucket_s`` every batch has one shape per bucket: it takes pieces of one length bucket only, is
padded to the bucket's end (the last bucket's is the longest piece, ``longest_samples``), and to as many rows (at
most ``max_batch_size``) as fit ``max_batch_audio_s`` there.
In bf16 a piece's result then no longer moves with its neighbours (the padded length and, for small batches, the
row count change how kernels round: docs/benchmarks.md), at the cost of computing the padding.
"""

from __future__ import annotations

import bisect
import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from decoding.types import Hotwords, Hypothesis
from models.segmenter import length_bucket_end

# Batches are chosen among this many times max_batch_size waiting items. With lengths spread as speech's, a pool
# of 4 batches left a quarter of each batch's samples padding, 16 leaves 7% (docs/benchmarks.md).
POOL_FACTOR = 16
# An item is worth starting only if this many batches' time is left before its deadline: its own batch, and on a GPU
# the one staged ahead of it (service/staging.py). Past that it would finish after its client gave up: under
# overload the engine spent most of its time so (loadtest/overload.py: a tenth of what it transcribed was answered).
FINISH_BATCHES = 2
# Bulk work (job items) fills at most this share of the queue; the rest is kept for interactive requests. Job items
# could fill it all, the consumer refilling it as each batch left: every HTTP request was refused 429 until the
# backfill ended.
BULK_QUEUE_SHARE = 0.75


class Priority(IntEnum):
    INTERACTIVE = 0  # HTTP requests: someone is waiting
    BULK_HIGH = 1  # job items (high-priority jobs'): fill whatever room interactive work leaves
    BULK = 2  # normal jobs' items
    BULK_LOW = 3  # low-priority jobs' items (backfills): what room is left

    @property
    def source(self) -> str:
        """Where such work comes from, as the metrics label it: "http" (someone waits on it) or "job"."""
        return "http" if self is Priority.INTERACTIVE else "job"


def queue_limit(max_queue: int, priority: Priority) -> int:
    """How many pieces may be queued, all priorities together, when work of ``priority`` is queued."""
    if priority is Priority.INTERACTIVE:
        return max_queue
    return max(1, math.floor(max_queue * BULK_QUEUE_SHARE))


class QueueFull(Exception):
    def __init__(self, retry_after_s: int):
        super().__init__(f"the queue is full; retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class ItemResult:
    """What a work item's future resolves to."""

    hypothesis: Hypothesis
    queue_s: float  # enqueue -> its batch started
    compute_s: float  # its share of the batch's compute time, by audio length
    batch_size: int


class BatcherClosed(RuntimeError):
    """The engine is stopping: nothing new is queued."""


@dataclass(eq=False)
class WorkItem:
    """One waveform (a request, or one segment of a long one) waiting for the engine."""

    waveform: np.ndarray  # mono float32 at the model's rate
    priority: Priority = Priority.INTERACTIVE
    timeout_s: float = 600.0
    hotwords: Hotwords = ()  # phrases its request boosts, as tokens (decoding.boosting)
    future: Future = field(default_factory=Future)  # resolves to the engine's result for this item
    enqueued_at: float = field(default_factory=time.monotonic)
    # the samples of its recording it accounts for (RTFx): a piece's own, without the overlap the next piece
    # transcribes too; None: all of its own
    counted_samples: int | None = None
    owner: str = ""  # whose turn it takes among its priority's items (Batcher: a job's owner; "": everyone else)
    n_samples: int = field(init=False)  # an attribute, not a property: batch forming reads it thousands of times
    turn: int = field(init=False, default=0)  # its place in its priority's queue, set when queued (Batcher.submit)

    def __post_init__(self) -> None:
        self.n_samples = len(self.waveform)
        if self.counted_samples is None:
            self.counted_samples = self.n_samples

    @property
    def deadline(self) -> float:
        return self.enqueued_at + self.timeout_s


@dataclass
class Batch:
    items: list[WorkItem]
    formed_at: float = field(default_factory=time.monotonic)
    pad_to: int = 0  # samples every row is padded to at least (length buckets: the bucket's end)
    pad_rows: int = 0  # rows the batch is padded to at least, with silence (length buckets: as many as fit)

    @property
    def n_samples(self) -> int:
        return sum(item.n_samples for item in self.items)

    @property
    def counted_samples(self) -> int:
        """The recordings' samples the batch accounts for: overlaps between pieces once."""
        return sum(item.counted_samples or 0 for item in self.items)

    def counted_by_owner(self) -> dict[tuple[str, str], int]:
        """The samples each (owner, source) accounts for, as ``counted_samples`` counts them (``Priority.source``)."""
        counted: dict[tuple[str, str], int] = {}
        for item in self.items:
            key = (item.owner, item.priority.source)
            counted[key] = counted.get(key, 0) + (item.counted_samples or 0)
        return counted

    @property
    def width(self) -> int:
        """Samples per row once padded."""
        return max([self.pad_to, *(item.n_samples for item in self.items)])

    @property
    def rows(self) -> int:
        """Rows once padded: the items, then rows of silence."""
        return max(self.pad_rows, len(self.items))

    @property
    def row_samples(self) -> list[int]:
        """Each row's valid samples: the items', then the silence rows' (the whole width)."""
        return [item.n_samples for item in self.items] + [self.width] * (self.rows - len(self.items))

    @property
    def padded_samples(self) -> int:
        return self.rows * self.width


class Batcher:
    def __init__(self, max_batch_size: int, max_batch_audio_s: float, max_wait_ms: float, max_queue: int,
                 sample_rate: int = 16000, on_drop: Callable[[str], None] | None = None,
                 length_bucket_s: float | None = None, longest_samples: int | None = None):
        self.max_batch_size = max_batch_size
        self.bucket_samples = round(length_bucket_s * sample_rate) if length_bucket_s else 0
        self.longest_samples = longest_samples  # the longest piece it is given (None: unknown), the last bucket's end
        self.max_padded_samples = int(max_batch_audio_s * sample_rate)
        self.max_wait_s = max_wait_ms / 1000
        self.max_queue = max_queue
        self.sample_rate = sample_rate
        self._queues: dict[Priority, deque[WorkItem]] = {p: deque() for p in Priority}  # each in order of turn
        # fair queueing, per priority: the turn the last item taken into a batch began at (virtual time), and each
        # owner's last item's turn; an owner's next item's turn is its audio after the later of the two
        self._served: dict[Priority, int] = dict.fromkeys(Priority, 0)
        self._owner_turns: dict[Priority, dict[str, int]] = {p: {} for p in Priority}
        self._cond = threading.Condition()
        self._closed = False
        self._throughput_audio_s_per_s = 0.0  # recent engine speed, for Retry-After
        self._batch_s = 0.0  # recent time per batch: an item due sooner than FINISH_BATCHES of it is dropped
        self._queued_samples = 0  # of the items queued, all priorities
        self._on_drop = on_drop or (lambda reason: None)  # told "expired" or "cancelled" per dropped item
        # Dead items are looked for only when one may exist: a queued future was cancelled, or a deadline passed.
        self._maybe_cancelled = False
        self._next_deadline = math.inf

    # --- producers --------------------------------------------------------------------------------------

    def submit(self, items: list[WorkItem]) -> None:
        """Queue all items or none; raises ``QueueFull`` (with a retry hint) past ``max_queue`` (bulk work: past
        its share of it, ``queue_limit``)."""
        with self._cond:
            if self._closed:
                raise BatcherClosed("the engine is shutting down")
            if len(items) > min((self.room(p) for p in {item.priority for item in items}), default=0):
                raise QueueFull(self._retry_after_s())
            for item in items:
                self._enqueue(item)
                item.future.add_done_callback(self._note_cancelled)
                self._next_deadline = min(self._next_deadline, item.deadline)
            self._cond.notify_all()

    def _enqueue(self, item: WorkItem) -> None:
        """Into its priority's queue at its turn: after its owner's items before it, and after the others' items
        whose turns come before its own (one owner's turns only ever grow, so those stay in the order they came)."""
        turns = self._owner_turns[item.priority]
        item.turn = max(turns.get(item.owner, 0), self._served[item.priority]) + _cost(item)
        turns[item.owner] = item.turn
        queue = self._queues[item.priority]
        self._queued_samples += item.n_samples
        if not queue or queue[-1].turn <= item.turn:
            queue.append(item)
        else:
            queue.insert(bisect.bisect_right(queue, item.turn, key=_turn), item)

    def _note_cancelled(self, future: Future) -> None:
        if future.cancelled():
            with self._cond:  # the waiting engine thread drops it now: it no longer counts toward max_queue
                self._maybe_cancelled = True
                self._cond.notify_all()

    def room(self, priority: Priority) -> int:
        """How many pieces of ``priority`` the queue takes now."""
        return max(0, queue_limit(self.max_queue, priority) - self.depth)

    @property
    def depth(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def _retry_after_s(self) -> int:
        queued_s = self._queued_samples / self.sample_rate
        if self._throughput_audio_s_per_s <= 0:
            return 1
        return int(min(60, max(1, queued_s / self._throughput_audio_s_per_s)))

    def record_throughput(self, audio_s: float, compute_s: float) -> None:
        """The engine reports each batch, so Retry-After reflects how fast the queue really drains."""
        if compute_s > 0:
            self._throughput_audio_s_per_s = _recent(self._throughput_audio_s_per_s, audio_s / compute_s)
            self._batch_s = _recent(self._batch_s, compute_s)

    def close(self) -> None:
        """Stop accepting; ``next_batch`` drains what is queued, then returns None."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def fail_all(self, exc: BaseException) -> None:
        """Stop accepting, and fail every queued item with ``exc`` (an engine that can no longer run them)."""
        with self._cond:
            self._closed = True
            for queue in self._queues.values():
                for item in queue:
                    if not item.future.done():
                        item.future.set_exception(exc)
                queue.clear()
            self._queued_samples = 0
            self._cond.notify_all()

    # --- the consumer (the engine thread) ---------------------------------------------------------------

    def next_batch(self) -> Batch | None:
        """Block until a batch is ready; None once closed and drained."""
        with self._cond:
            while True:
                self._drop_dead_items()
                head = self._head()
                if head is None:
                    if self._closed:
                        return None
                    self._cond.wait()
                    continue
                full = self.depth >= self.max_batch_size
                # timed from the item waiting longest, which need not be the head: an owner whose requests are
                # cancelled as they wait keeps its turns at the head, and timed from there another owner's item
                # waited out its timeout beside an idle engine
                release_at = math.inf if full else self._longest_waiting() + self.max_wait_s
                now = time.monotonic()
                if full or self._closed or now >= release_at:
                    batch = self._form_batch(head)
                    if batch.items:
                        return batch
                    continue
                self._cond.wait(release_at - now)

    def _longest_waiting(self) -> float:
        """When the item queued longest ago was queued (fewer than ``max_batch_size`` wait: a short look)."""
        return min(item.enqueued_at for queue in self._queues.values() for item in queue)

    def _head(self) -> WorkItem | None:
        for priority in Priority:
            if self._queues[priority]:
                return self._queues[priority][0]
        return None

    def _why_late(self, item: WorkItem, now: float, batch_s: float) -> str:
        """Why ``item`` is dropped: its time ran out, or what is left of it is less than FINISH_BATCHES batches
        take at the engine's recent pace (said, or a refusal 0.1 s into a 5 s timeout reads as a hang)."""
        left_s = item.deadline - now
        if left_s <= 0:
            return f"not processed within {item.timeout_s:g} s"
        return (f"dropped before it ran: {left_s:.1f} s of its {item.timeout_s:g} s were left, and "
                f"{FINISH_BATCHES} batches take {FINISH_BATCHES * batch_s:.1f} s at the engine's recent pace")

    def _next_batch_s(self) -> float:
        """How long the next batch takes at the engine's recent pace: a recent batch's time, or, while less audio
        waits than that time transcribes, that audio's. (Judged by a burst of long uploads' batches, a short request
        that came after them was dropped, and every one after it: no batch ran again to say the pace had changed.)"""
        if self._throughput_audio_s_per_s <= 0:
            return self._batch_s
        return min(self._batch_s, self._queued_samples / self.sample_rate / self._throughput_audio_s_per_s)

    def _drop_dead_items(self) -> None:
        """Drops cancelled items, then fails with TimeoutError those that could not be done before their deadline,
        at the pace of the audio left (with the cancelled items' audio counted, a request that came after a burst of
        abandoned ones was dropped beside an idle engine)."""
        now = time.monotonic()
        if self._maybe_cancelled:  # each look is a lock per queued item: thousands, between two batches
            self._maybe_cancelled = False  # before the look: a cancel during it asks for another
            self._drop_items(lambda item: not item.future.cancelled(), now, 0.0)
        batch_s = self._next_batch_s()
        due_by = now + FINISH_BATCHES * batch_s  # an item due before this would be done too late
        if due_by >= self._next_deadline:
            self._drop_items(lambda item: due_by < item.deadline and not item.future.cancelled(), now, batch_s)

    def _drop_items(self, keep: Callable[[WorkItem], bool], now: float, batch_s: float) -> None:
        """Drops the items not to ``keep``: those cancelled as such, the others failed with TimeoutError."""
        next_deadline = math.inf
        for priority, queue in list(self._queues.items()):
            alive: deque[WorkItem] = deque()
            losers: set[str] = set()  # owners of items dropped
            for item in queue:
                if keep(item):
                    alive.append(item)
                    next_deadline = min(next_deadline, item.deadline)
                    continue
                losers.add(item.owner)
                self._queued_samples -= item.n_samples
                if not item.future.cancelled() and item.future.set_running_or_notify_cancel():
                    self._on_drop("expired")
                    item.future.set_exception(TimeoutError(self._why_late(item, now, batch_s)))
                else:
                    self._on_drop("cancelled")
            self._queues[priority] = self._turns_without_dropped(priority, alive, losers) if losers else alive
        self._next_deadline = next_deadline

    def _turns_without_dropped(self, priority: Priority, queue: deque[WorkItem], owners: set[str]) -> deque[WorkItem]:
        """``queue`` in order of turn again, the turns of ``owners``' items left in it given as if their items
        dropped unserved had never come: each by its audio after its owner's item before it, or after the items
        served, and never later than it was. Held against the owner, a backfill its client gave up on put its next
        request behind all the others' work. The owner's next item follows its last one left (none: served's)."""
        served, turns = self._served[priority], self._owner_turns[priority]
        last: dict[str, int] = {}
        for item in queue:  # an owner's items are in the order they came (its turns only grow)
            if item.owner in owners:
                item.turn = min(item.turn, max(last.get(item.owner, 0), served) + _cost(item))
                last[item.owner] = item.turn
        for owner in owners:
            if owner in last:
                turns[owner] = last[owner]
            else:
                turns.pop(owner, None)
        return deque(sorted(queue, key=_turn))  # stable: items of equal turns keep their order

    @property
    def fixed_shapes(self) -> bool:
        """Batches have one shape per length bucket (``length_bucket_s``)."""
        return self.bucket_samples > 0

    def padded_length(self, n_samples: int) -> int:
        """Samples a piece of ``n_samples`` is padded to at least: the end of its length bucket, or itself."""
        if not self.fixed_shapes:
            return n_samples
        return length_bucket_end(n_samples, self.bucket_samples, self.longest_samples)

    def _form_batch(self, anchor: WorkItem) -> Batch:
        pool_size = POOL_FACTOR * self.max_batch_size
        chosen = [anchor]
        for priority in Priority:  # the anchor's priority first, then less urgent work fills the room
            if priority >= anchor.priority and len(chosen) < self.max_batch_size:
                pool = list(itertools.islice(self._queues[priority], pool_size))
                chosen = self._pick_similar(anchor, pool, chosen)
        taken = {id(item) for item in chosen}
        self._advance_turns(chosen)
        self._queued_samples -= sum(item.n_samples for item in chosen)
        for queue in self._queues.values():  # every chosen item is in a queue's first pool_size
            head = [queue.popleft() for _ in range(min(pool_size, len(queue)))]
            queue.extendleft(reversed([item for item in head if id(item) not in taken]))
        items = []
        for item in chosen:
            if item.future.set_running_or_notify_cancel():  # False: cancelled since; drop it
                items.append(item)
            else:
                self._on_drop("cancelled")
        if not self.fixed_shapes:
            return Batch(items)
        bucket_end = self.padded_length(anchor.n_samples)
        # each bucket's one shape: as many rows as fit the padded-audio limit, which the warm-up's longest batch
        # also has (padding every bucket to max_batch_size rows went past the limit, and past what was warmed up)
        rows = max(1, min(self.max_batch_size, self.max_padded_samples // bucket_end))
        return Batch(items, pad_to=bucket_end, pad_rows=rows)

    def _advance_turns(self, chosen: list[WorkItem]) -> None:
        """Each priority's virtual time moves to where the first of its items taken began: an owner with nothing
        queued comes back at the head of the line, not behind the turns the others' held items were given. (The
        first, not the last: the rest of a batch is picked by length from far down the queue.)"""
        for priority in {item.priority for item in chosen}:
            began = min(item.turn - _cost(item) for item in chosen if item.priority == priority)
            if began > self._served[priority]:
                self._served[priority] = began
                turns = self._owner_turns[priority]  # those at or behind it count as none: dropped
                for owner in [owner for owner, turn in turns.items() if turn <= began]:
                    del turns[owner]

    def _pick_similar(self, anchor: WorkItem, pool: list[WorkItem], chosen: list[WorkItem]) -> list[WorkItem]:
        """Add pool items closest in length to the anchor (of its length bucket, with buckets) while size and
        padded-audio limits hold."""
        chosen = list(chosen)
        taken = set(map(id, chosen))
        fixed, bucket = self.fixed_shapes, self.padded_length(anchor.n_samples)
        candidates = [item for item in pool if id(item) not in taken
                      and (not fixed or self.padded_length(item.n_samples) == bucket)]
        distance = [abs(item.n_samples - anchor.n_samples) for item in candidates]
        # with buckets every row is padded to the anchor's bucket end; without, to the longest item
        longest = bucket if fixed else max(i.n_samples for i in chosen)
        for index in sorted(range(len(candidates)), key=distance.__getitem__):
            if len(chosen) >= self.max_batch_size:
                break
            item = candidates[index]
            new_longest = longest if fixed else max(longest, item.n_samples)
            if (len(chosen) + 1) * new_longest > self.max_padded_samples:
                if fixed:  # every row is the bucket's width: no later candidate fits either
                    break
                continue
            chosen.append(item)
            longest = new_longest
        return chosen


def _turn(item: WorkItem) -> int:
    return item.turn


def _cost(item: WorkItem) -> int:
    """How far an item moves its owner's turn on: its audio (at least one sample)."""
    return max(1, item.n_samples)


def _recent(average: float, value: float) -> float:
    """An average weighted toward recent values; the first value as it is."""
    return value if average == 0 else 0.8 * average + 0.2 * value
