"""The job consumer: reads items from the streams (a job's priority and owner pick its stream; higher priorities
are read first, and each owner's stream in turn), feeds them to the batcher behind HTTP requests and in their job's
priority, writes each result once, then acknowledges.

Cancelling: a job cancelled while a consumer holds some of its items (read ahead, up to its prefetch) has them
cancelled here: ``start_item`` says so of an item not yet begun, and a look every CANCEL_CHECK_INTERVAL_S at the
jobs of the items in hand stops those being read or transcribed (the batcher drops their pieces still queued; a
batch already computing runs on, and their results are dropped).

Failure handling: bad audio or a refused input fails its item at once (dead-lettered); any other error
leaves the delivery unacknowledged, so it is reclaimed (XAUTOCLAIM) after the visibility timeout, and an
item that has been started ``max_attempts`` times is failed with its last error. Deliveries still being worked
on have their idle time reset, so a long item is not reclaimed from a live worker. A worker gone (killed, or
stopped) lets go of its name's lease: its deliveries are claimed by the others a lease's time later (CLAIM_FROM_GONE),
or by itself at once when it comes back under the same name. Redis going away, or
refusing a command (full, read-only), is waited out with backoff; nothing is lost because nothing is
acknowledged before its result is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import secrets
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO, Protocol, TypeVar

import numpy as np
import redis.asyncio as aioredis

from models.audio_io import WHOLE, Stretch
from models.tokenizer import hotword_tokens

from .audio import AudioLimits, AudioRequestError, decode_audio, decode_audio_file
from .audio_budget import AudioBudget, AudioClaim
from .batcher import Priority, QueueFull
from .formats import to_record
from .intervals import Periodic
from .item_streams import STREAM_IDLE_S
from .job_keys import stream_owner, stream_priority
from .job_types import ItemStart, JobInputError, JobPriority, item_record, open_input_file
from .jobs import JobStore
from .redis_outages import REDIS_ERRORS, group_lost, step_until_stopped
from .transcriber import NeverRan, TooManyPieces, Transcriber
from .url_inputs import SourceUnavailable, UrlFetcher
from .webhook_worker import WebhookWorker
from .webhooks import WebhookSender

log = logging.getLogger(__name__)

# what an item's result keeps of formats.to_record (a multichannel item's adds its utterances and channels)
RESULT_KEYS = ("text", "tokens", "token_logprobs", "avg_logprob", "words", "duration_s", "utterances", "channels")
# an item's place in the batcher, by its job's priority: a high job's items go ahead of the normal and low items a
# worker already holds, not just ahead of those still in Redis
BATCHER_PRIORITY = {JobPriority.HIGH: Priority.BULK_HIGH, JobPriority.NORMAL: Priority.BULK,
                    JobPriority.LOW: Priority.BULK_LOW}


FORGET_INTERVAL_S = 600.0  # how often a consumer deletes the names of consumers gone from the group
PRUNE_INTERVAL_S = 60.0  # how often a consumer looks for API keys' streams gone idle (item_streams.STREAM_IDLE_S)
LAG_INTERVAL_S = 1.0  # how often a consumer reads the lag metric: Prometheus scrapes every 15 s, KEDA polls every 30 s
GONE_AFTER_S = 3600.0  # idle this long, holding nothing: a consumer that is gone (at least ten visibility timeouts)
CANCEL_CHECK_INTERVAL_S = 1.0  # how often a consumer asks whether the jobs of the items in its hands were cancelled
NAME_LEASE_S = 15.0  # a consumer's hold on its name (service.item_streams.hold_consumer_name), renewed every third
OUTAGE_PAUSES_S = (0.5, 5.0)  # an item's write tried again through an outage: first pause, doubling to the longest

T = TypeVar("T")


def default_consumer_name(pid: int | None = None) -> str:
    """host-pid: the same again for a container restarted in place (its hostname, and its pid as its entrypoint's)."""
    return f"{socket.gethostname()}-{pid or os.getpid()}"


class JobMetrics(Protocol):
    """What the consumer counts: ``Metrics`` in the engine's process, or a consumer process's link to it."""

    def observe_job_backlog(self, waiting: int, delivered: int) -> None: ...

    def observe_job_store_risks(self, risks: tuple[str, ...]) -> None: ...

    def count_job_items_reclaimed(self, n: int) -> None: ...

    def count_job_item_dead_lettered(self) -> None: ...

    def count_job_item(self, status: str) -> None: ...

    def count_job(self, status: str) -> None: ...

    def count_webhook(self, outcome: str) -> None: ...

    def observe_webhooks_waiting(self, waiting: int) -> None: ...


class JobCancelled(Exception):
    """The item's job was cancelled (or deleted) while the item was read or waited for a batch."""


class CancelWatch:
    """The items a consumer holds, by job: each with an event it waits on beside its work, set once a look finds its
    job cancelled after it started (a cancel's number above the job's cancels then: a retry of a cancelled job's
    failed items runs them, even should a look that began before the retry answer after it), or deleted."""

    def __init__(self):
        self._held: dict[str, list[tuple[int, asyncio.Event]]] = defaultdict(list)

    @contextlib.contextmanager
    def holding(self, job_id: str, cancels: int) -> Iterator[asyncio.Event]:
        """``cancels``: the job's when the item started (ItemStart.cancels)."""
        held = (cancels, asyncio.Event())
        self._held[job_id].append(held)
        try:
            yield held[1]
        finally:
            self._held[job_id].remove(held)
            if not self._held[job_id]:
                del self._held[job_id]

    def jobs(self) -> list[str]:
        return list(self._held)

    def cancelled(self, cancels: dict[str, float]) -> None:
        """``cancels``: each cancelled job's latest cancel (JobStore.cancel_requested)."""
        for job_id, latest in cancels.items():
            for started_after, event in self._held.get(job_id, ()):
                if latest > started_after:
                    event.set()


async def unless_cancelled(cancelled: asyncio.Event, work: Awaitable[T]) -> T:
    """``work``'s result, or ``JobCancelled`` (and ``work`` cancelled: a batcher drops an item whose request is
    gone) should ``cancelled`` be set first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.create_task(cancelled.wait())
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:  # this one cancelled too (shutdown): neither is left behind
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled() and cancelled.is_set():  # cancelled here, for the job: not a cancel from within the work
        raise JobCancelled
    return task.result()


@dataclass(frozen=True)
class ConsumerOptions:
    name: str
    prefetch: int = 64  # items in flight at once (the batcher batches across them)
    block_ms: int = 1000  # how long one XREADGROUP waits for new items
    visibility_timeout_s: float = 300.0  # a delivery unacknowledged this long is reclaimed
    max_attempts: int = 3
    reclaim_interval_s: float = 5.0
    max_audio_s: float = math.inf  # decoded job audio held at once (service.audio_budget)
    first_item_s: float = 30.0  # the length items are expected to have until some are seen
    max_reading: int = 64  # items fetched and decoded at once
    store_check_interval_s: float = 60.0  # how often Redis's settings are read for risks to jobs
    stream_idle_s: float = STREAM_IDLE_S  # an API key's streams given no items this long are pruned when settled
    name_lease_s: float = NAME_LEASE_S  # this consumer's hold on its name; another's lapsed this long is gone


class JobConsumer:
    def __init__(self, store: JobStore, transcriber: Transcriber, limits: AudioLimits, input_roots: list[str],
                 metrics: JobMetrics, options: ConsumerOptions, decode_pool: ThreadPoolExecutor | None = None,
                 webhooks: WebhookSender | None = None, urls: UrlFetcher | None = None,
                 engine_failed: Callable[[], bool] = lambda: False):
        self.store = store
        self.engine_failed = engine_failed  # then every item taken would fail: none is, and ``run`` returns
        self.transcriber = transcriber
        self.limits = limits
        self.input_roots = input_roots
        self.urls = urls  # None: URL inputs are refused
        self.metrics = metrics
        self.options = options
        self.decode_pool = decode_pool
        self.webhook_deliveries = WebhookWorker(store, webhooks, options.name, metrics,
                                                name_held=lambda: self._name_held, gone_after_s=self._gone_after_s)
        self._in_flight: set[asyncio.Task] = set()
        self._held: dict[str, set[bytes]] = defaultdict(set)  # deliveries in hand, by stream
        self.audio = AudioBudget(options.max_audio_s, options.first_item_s, options.max_reading)
        self._reclaim_from: dict[str, bytes | str] = {}  # per stream, where the next look for stalled items goes on
        self._own_left = True  # deliveries to this name that a previous life of it left may be pending still
        self._own_left_why = "that its name held when its last run ended"
        # deliveries this instance left unacknowledged on purpose (a timeout, a source down, an error), by stream,
        # with when: they come back after the visibility timeout, not with those an outage may have lost in flight
        self._left: dict[str, dict[bytes, float]] = defaultdict(dict)
        # this instance's hold on its name: its previous life's deliveries are taken back only while it has it (one
        # killed lets go within NAME_LEASE_S), never from another instance running under the same name
        self._instance, self._name_held, self._name_refused_since = secrets.token_hex(8), False, None
        self._name_clash_said = False
        self._own_taken = 0  # of its previous life's items, taken back so far
        self._hold_name = Periodic()
        self._reclaim, self._keep_claims, self._check_settings = Periodic(), Periodic(), Periodic()
        self._read_lag, self._prune, self._forget = Periodic(), Periodic(), Periodic()
        self._cancels, self._look_for_cancels = CancelWatch(), Periodic()
        self._group_ready = False  # made once, and again after an error (a Redis that lost it)
        self._stopping = asyncio.Event()  # set once the loop has stopped: items in hand no longer wait out an outage
        self._store_risks: dict[str, str] | None = {}  # those last read (JobStore.durability_risks; None: unknown)
        self._connected_since: float | None = None  # since when Redis has answered without a break (None: away)

    # --- loops -----------------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until ``stop`` is set; then finish (and acknowledge) what is in hand and return. Webhook
        deliveries run beside, on a stream of their own (service.webhook_worker)."""
        halt = asyncio.Event()  # stop, or the engine failed
        webhooks = asyncio.create_task(self.webhook_deliveries.run(halt))
        await step_until_stopped(stop, self._step, "job consumer", self._failed, until=self.engine_failed)
        self._stopping.set()
        if self.engine_failed():
            log.error("the engine failed: this consumer takes no more items (those in hand go to other workers once "
                      "it has let go of its name)")
        halt.set()
        if held := sum(not task.done() for task in self._in_flight):  # the stop would otherwise pass in silence
            log.info("job consumer stopping: finishing the %d items in hand", held)
        await self._finish_in_flight()
        with contextlib.suppress(*REDIS_ERRORS):  # a restart under this name need not wait out the lease
            await self.store.release_consumer_name(self.options.name, self._instance)
        await webhooks
        await self.close()

    def _failed(self, exc: Exception) -> None:
        self._group_ready = self._group_ready and not group_lost(exc)
        if isinstance(exc, REDIS_ERRORS):  # a read's reply lost with its connection leaves deliveries to this name
            # that it never saw, pending until the visibility timeout: taken back as a previous life's are
            self._connected_since = None
            self._own_left, self._own_left_why = True, "delivered to this consumer while Redis was away"
            self._reclaim.come_due()

    async def close(self) -> None:
        """Release the URL fetcher's and the webhook sender's connections (``run`` does this when it returns)."""
        if self.urls is not None:
            await self.urls.close()
        await self.webhook_deliveries.close()

    async def drain(self, idle_rounds: int = 2) -> None:
        """Burst mode (tests, one-off runs): consume until the stream has nothing left for this group."""
        idle = 0
        while idle < idle_rounds:
            started = await self._step(block_ms=100)
            await self._finish_in_flight()
            idle = idle + 1 if not started and await self.store.stream_lag() == 0 else 0
        await self.webhook_deliveries.drain()

    async def _step(self, block_ms: int | None = None) -> int:
        """Start what fits in the prefetch window and the audio budget; returns how many items were started."""
        if not self._group_ready:
            await self.store.ensure_group()
            self._group_ready = True
            self._check_settings.come_due()  # Redis may be another now (restarted, failed over): read it again
        self._connected_since = self._connected_since or time.monotonic()
        if self._hold_name.due(self.options.name_lease_s / 3):
            await self._renew_name()
        if self._check_settings.due(self.options.store_check_interval_s):
            await self._check_store()
        if self._keep_claims.due(self.options.visibility_timeout_s / 3):
            for stream, held in list(self._held.items()):
                await self.store.keep_claimed(stream, self.options.name, list(held))
        # items finished leave _in_flight in their done callbacks, which may not have run yet: counted still, they
        # would leave no room, and nothing would ever say there was again (each released its audio already)
        self._in_flight.difference_update([task for task in self._in_flight if task.done()])
        room = self.audio.room(self.options.prefetch - len(self._in_flight))
        started = 0
        if room > 0 and self._reclaim.due(self.options.reclaim_interval_s):
            # started before the upkeep below: its failure would otherwise leave them for another visibility timeout
            started = self._start(await self._reclaim_stalled(room))
            if started == room:  # there may be more: look again as soon as there is room, not an interval on
                self._reclaim.come_due()
            await self.store.trim_acknowledged()
            if self._prune.due(PRUNE_INTERVAL_S):
                retired, deleted = await self.store.prune_idle_streams(self.options.stream_idle_s)
                if retired or deleted:
                    log.info("API keys' streams idle: %d no longer read, %d deleted", retired, deleted)
            if self._forget.due(FORGET_INTERVAL_S):
                await self.store.forget_gone_consumers(max(GONE_AFTER_S, 10 * self.options.visibility_timeout_s))
        room -= started
        if room > 0:
            wait = self.options.block_ms if block_ms is None else block_ms
            if self._in_flight:  # work in hand: look for more often, not for long
                wait = min(wait, 100)
            started += self._start(await self.store.read_items(self.options.name, room, wait))
        elif self._in_flight:  # no room: until an item is read or finishes, but no longer than the next renewal of
            # the deliveries in hand is due (waiting them out, with long items, let another worker take them all)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.audio.changed(), min(LAG_INTERVAL_S, self.options.visibility_timeout_s / 3))
        held_jobs = self._cancels.jobs()
        if held_jobs and self._look_for_cancels.due(CANCEL_CHECK_INTERVAL_S):
            self._cancels.cancelled(await self.store.cancel_requested(held_jobs))
        if self._read_lag.due(LAG_INTERVAL_S):  # not every step: two round trips over every stream
            backlog = await self.store.backlog()
            self.metrics.observe_job_backlog(backlog.waiting, backlog.delivered)
        return started

    def _start(self, messages: list[tuple[str, bytes, dict]]) -> int:
        """A task for each delivery (stream, message id, fields), in flight and held (renewed) until it ends."""
        for stream, message_id, fields in messages:
            task = asyncio.create_task(self._handle(stream, message_id, fields, self.audio.claim()))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)
            held = self._held[stream]
            held.add(message_id)
            task.add_done_callback(lambda _, held=held, message_id=message_id: held.discard(message_id))
        return len(messages)

    async def _check_store(self) -> None:
        """Warn of each setting of Redis that would lose jobs without an error as it appears (Redis's own log says
        nothing of them; Sidekiq warns of the eviction policy the same way), and export them as a metric."""
        risks = await self.store.durability_risks()
        if risks is None and self._store_risks is not None:  # unknown now: said once, and no risk exported
            log.info("cannot read Redis's settings (INFO refused): its eviction policy and persistence are not "
                     "checked; run it with maxmemory-policy noeviction and appendonly yes")
        now, before = risks or {}, self._store_risks or {}
        for name in now.keys() - before.keys():
            log.warning("jobs at risk (%s): %s", name, now[name])
        for name in before.keys() - now.keys():
            log.info("jobs no longer at risk (%s): Redis's setting changed", name)
        self._store_risks = risks
        self.metrics.observe_job_store_risks(tuple(now))

    async def _reclaim_stalled(self, count: int) -> list[tuple[str, bytes, dict]]:
        """Deliveries to this consumer's name that it does not hold (its previous life's, until none is left), then
        other consumers' stalled ones: up to ``count`` in all."""
        streams = await self.store.streams_with_pending()  # the higher priorities' first
        own = await self._claim_own_left(streams, count) if self._own_left and self._name_held else []
        own += await self._claim_from_gone(streams, count - len(own)) if len(own) < count else []
        claimed = []
        for stream in streams:
            if len(own) + len(claimed) < count:
                self._reclaim_from[stream], stalled = await self.store.claim_stalled(
                    stream, self.options.name, self.options.visibility_timeout_s, count - len(own) - len(claimed),
                    self._reclaim_from.get(stream, "0-0"))
                claimed += [(stream, message_id, fields) for message_id, fields in stalled]
        if claimed:
            log.info("reclaimed %d items from stalled consumers", len(claimed))
            self.metrics.count_job_items_reclaimed(len(claimed))
        return own + claimed

    def _gone_after_s(self) -> float | None:
        """How long a consumer whose name no running instance holds must have been idle to be taken for gone; None
        while this one may not judge: only one that holds its own name (leases are kept, then) and has been
        connected for a lease's time does, so that after an outage running consumers renew theirs first."""
        lease, since = self.options.name_lease_s, self._connected_since
        if not self._name_held or since is None or time.monotonic() - since < lease:
            return None
        return lease

    async def _claim_from_gone(self, streams: list[str], count: int) -> list[tuple[str, bytes, dict]]:
        """Deliveries to consumers gone (``_gone_after_s``): a worker killed and replaced under a new name (a pod
        rescheduled) leaves its items for its lease's time, not the visibility timeout."""
        if (idle_s := self._gone_after_s()) is None:
            return []
        claimed, names = await self.store.claim_from_gone(streams, self.options.name, count, idle_s)
        if claimed:
            log.info("reclaimed %d items from consumers gone (no running worker holds the name %s)", len(claimed),
                     ", ".join(sorted(names)))
            self.metrics.count_job_items_reclaimed(len(claimed))
        return claimed

    async def _renew_name(self) -> None:
        """Hold this consumer's name for a lease more (``name_lease_s``); where another instance holds it past a
        lease (two workers given one --name, or host-pid alike under host networking), say so once."""
        name = self.options.name
        self._name_held = await self.store.hold_consumer_name(name, self._instance, self.options.name_lease_s)
        if self._name_held:
            self._name_refused_since = None
            return
        since = self._name_refused_since = self._name_refused_since or time.monotonic()
        lease = self.options.name_lease_s
        if time.monotonic() - since >= lease and not self._name_clash_said:  # not a previous life's lease
            log.warning("another running consumer has the name %s: give each worker a name of its own (--name, "
                        "BATCHASR_WORKER_NAME); the items held under it are left to the visibility timeout", name)
            self._name_clash_said = True

    async def _claim_own_left(self, streams: list[str], count: int) -> list[tuple[str, bytes, dict]]:
        claimed, found = [], 0
        for stream in streams:
            if found < count:
                seen, left = await self.store.claim_own_left(stream, self.options.name, count - found,
                                                             [*self._held.get(stream, ()), *self._left_lately(stream)])
                found += seen
                claimed += [(stream, message_id, fields) for message_id, fields in left]
        self._own_left = found == count  # room for more than were left: none is
        self._own_taken += len(claimed)
        if claimed:
            self.metrics.count_job_items_reclaimed(len(claimed))
        if self._own_taken and not self._own_left:  # said once, when all are taken (a pass takes as many as fit)
            log.info("took back %d items %s (consumer %s)", self._own_taken, self._own_left_why, self.options.name)
            self._own_taken = 0
        return claimed

    def _leave(self, stream: str, message_id: bytes) -> None:
        self._left_lately(stream)  # those past the visibility timeout dropped: as many kept as failed lately
        self._left[stream][message_id] = time.monotonic()

    def _left_lately(self, stream: str) -> list[bytes]:
        """The deliveries of ``stream`` this instance left unacknowledged within the visibility timeout."""
        left = self._left.get(stream)  # a look adds no entry: every stream with pending items is looked at
        if not left:
            return []
        since = time.monotonic() - self.options.visibility_timeout_s
        for message_id in [message_id for message_id, when in left.items() if when < since]:
            del left[message_id]  # another consumer's to reclaim now, or this one's as any stalled item
        return list(left)

    async def _finish_in_flight(self) -> None:
        if self._in_flight:
            await asyncio.gather(*self._in_flight, return_exceptions=True)

    # --- one item --------------------------------------------------------------------------------------

    async def _handle(self, stream: str, message_id: bytes, fields: dict, share: AudioClaim) -> None:
        try:
            job_id, index = fields[b"job"].decode(), int(fields[b"index"])
        except (KeyError, ValueError, UnicodeDecodeError):  # not ours (another writer, another version)
            share.release()
            await self._discard(stream, message_id, fields)
            return
        acknowledged = False
        try:
            await self._process(job_id, index, share, BATCHER_PRIORITY[stream_priority(stream)], stream_owner(stream))
            await self._through_outage(lambda: self.store.ack_item(stream, message_id))
            acknowledged = True
        except TimeoutError as exc:  # the transcription or a fetch took too long (an OSError, but not Redis's)
            log.warning("item %s/%d timed out; it will be retried", job_id, index)
            await self._record_error(job_id, index, f"timed out{': ' + str(exc) if str(exc) else ''}")
        except SourceUnavailable as exc:  # its host is down or busy: back after the visibility timeout
            log.warning("item %s/%d could not be fetched (%s); it will be retried", job_id, index, exc)
            await self._record_error(job_id, index, str(exc))
        except (*REDIS_ERRORS, aioredis.RedisError) as exc:  # unacknowledged: back after the visibility timeout
            log.warning("redis error on %s/%d (%s); it is delivered again after the visibility timeout (%.0f s)",
                        job_id, index, exc, self.options.visibility_timeout_s)
        except Exception as exc:  # likewise retried, until max_attempts
            log.exception("item %s/%d failed; it will be retried", job_id, index)
            await self._record_error(job_id, index, f"{type(exc).__name__}: {exc}")
        finally:
            share.release()
            if not acknowledged:
                self._leave(stream, message_id)

    async def _record_error(self, job_id: str, index: int, error: str) -> None:
        """What a later attempt reports if it gives up (a generic reason instead, if Redis cannot take it)."""
        try:
            await self.store.record_error(job_id, index, error)
        except (*REDIS_ERRORS, aioredis.RedisError) as exc:
            log.warning("redis error recording the error of %s/%d (%s)", job_id, index, exc)

    async def _discard(self, stream: str, message_id: bytes, fields: dict) -> None:
        """A stream entry that names no job item: dead-letter and acknowledge it once, rather than fail it
        on every redelivery."""
        error = f"not a job item (fields: {', '.join(sorted(k.decode(errors='replace') for k in fields))})"
        log.warning("stream entry %s discarded: %s", message_id.decode(), error)
        try:
            await self.store.discard_entry(stream, message_id, error)
            self.metrics.count_job_item_dead_lettered()
        except REDIS_ERRORS as exc:
            log.warning("redis error discarding %s (%s); it will come back", message_id.decode(), exc)

    async def _process(self, job_id: str, index: int, share: AudioClaim, priority: Priority, owner: str) -> None:
        """``share``: the item's part of the consumer's audio budget, told its length once decoded; ``priority``
        and ``owner`` (its job's): its place in the batcher."""
        try:  # through an outage, as its end is: an item in hand met Redis away was left for the visibility timeout
            start = await self._through_outage(lambda: self.store.start_item(job_id, index))
        except JobInputError as exc:
            await self._fail(job_id, index, None, str(exc))
            return
        if start.state == "cancelling":
            await self._cancel(job_id, index, start.record.get("audio"))
            return
        if start.state != "in_progress":
            return  # finished, cancelled or expired meanwhile: just acknowledge
        with self._cancels.holding(job_id, start.cancels) as cancelled:
            try:
                await self._transcribe_item(job_id, index, start, share, priority, owner, cancelled)
            except JobCancelled:
                await self._cancel(job_id, index, start.record.get("audio"))

    async def _transcribe_item(self, job_id: str, index: int, start: ItemStart, share: AudioClaim,
                               priority: Priority, owner: str, cancelled: asyncio.Event) -> None:
        """A started item read, transcribed and finished; ``JobCancelled`` where ``cancelled`` is set while it is
        read or waits for a batch."""
        record, attempts = start.record, start.attempts
        audio = record.get("audio")
        if attempts > self.options.max_attempts:
            last = await self.store.last_error(job_id, index) or "the worker died while processing it"
            await self._fail(job_id, index, audio, _gave_up(attempts - 1, last))
            return
        multichannel, skip_silence = bool(record.get("multichannel")), bool(record.get("skip_silence"))
        try:  # checked at submission through HTTP; a job written straight into Redis is checked here
            hotwords = hotword_tokens(record.get("hotwords") or [], self.transcriber.tokenizer)
            waveform = await unless_cancelled(cancelled, self._load(start, multichannel))
            start.upload = None  # a small upload's bytes: gone once decoded, not when the item ends
        except SourceUnavailable as exc:
            if attempts < self.options.max_attempts:
                raise  # delivered again after the visibility timeout (_handle)
            await self._fail(job_id, index, audio, _gave_up(attempts, str(exc)))
            return
        except (AudioRequestError, JobInputError, OSError, ValueError) as exc:
            await self._fail(job_id, index, audio, str(exc))
            return
        share.decoded(waveform.size / self.limits.sample_rate)  # every channel's samples
        waiting_since = time.monotonic()
        while True:
            try:
                if multichannel:
                    result = await unless_cancelled(cancelled, self.transcriber.transcribe_channels(
                        waveform, priority, skip_silence, hotwords, owner))
                    transcript = result.conversation
                    transcript.names = record.get("channel_names") or []
                else:
                    result = await unless_cancelled(cancelled, self.transcriber.transcribe(
                        waveform, priority, skip_silence, hotwords, owner))
                    transcript = result.transcript
                break
            except QueueFull:  # HTTP traffic holds the queue; bulk work waits its turn
                await asyncio.sleep(0.2)
            except NeverRan:
                # held behind other work for (most of) its timeout, none of it run: queued again without an
                # attempt spent (three such waits failed it for good under hours of HTTP load). Dropped soon after
                # it was queued, it could not be done in time at the engine's pace: that attempt counts.
                if time.monotonic() - waiting_since < self.transcriber.bulk_timeout_s / 2:
                    raise
                log.info("item %s/%d waited its timeout behind other work without running; queued again",
                         job_id, index)
                waiting_since = time.monotonic()
            except TooManyPieces as exc:  # it would wait for ever
                await self._fail(job_id, index, audio, str(exc))
                return
        record_out = item_record(audio, "completed", **{k: v for k, v in to_record(transcript).items()
                                                       if k in RESULT_KEYS})
        del waveform  # not held while the result waits for Redis
        outcome = await self._through_outage(lambda: self.store.finish_item(
            job_id, index, "completed", record_out, audio_s=result.audio_s, compute_s=result.compute_s,
            logprobs=transcript.token_logprobs))
        await self._after_finish(job_id, "completed", outcome)

    async def _load(self, start: ItemStart, multichannel: bool):
        """The item's waveform (or its channels'): a file decoded straight from disk, whatever its size (only its
        duration is limited); a URL's body from the temporary file it was fetched into, and an upload's from the
        one it was read into from Redis."""
        record = start.record
        stretch = Stretch(record["offset_s"], record["duration_s"]) if "offset_s" in record else WHOLE
        if "path" in record:
            return await self._decode(_decode_input_file, record["path"], self.input_roots, self.limits,
                                      multichannel, stretch)
        if "url" in record:
            if self.urls is None:
                raise JobInputError(f"{record['url']}: URL inputs are disabled on this worker "
                                    "(BATCHASR_INPUT_URL_PREFIXES)")
            body = await self.urls.fetch(record["url"])
        elif start.upload_bytes is None:
            raise JobInputError("the uploaded audio expired before it was processed")
        else:
            body = await self.store.read_upload(start)
        return await self._decode(_decode_and_close, body, self.limits, multichannel, stretch)

    async def _decode(self, decode: Callable[..., np.ndarray], *args) -> np.ndarray:
        """``decode(*args)`` in the decode pool. Cancelled (the item's job cancelled, the worker stopping), the
        thread gives up at its next block: a cancelled recording of hours was decoded to the end for no one."""
        stop = threading.Event()
        try:
            return await asyncio.get_running_loop().run_in_executor(self.decode_pool,
                                                                    functools.partial(decode, *args, stop=stop))
        except asyncio.CancelledError:
            stop.set()
            raise

    async def _cancel(self, job_id: str, index: int, audio: str | None) -> None:
        """The item cancelled, its job having been: its record as the cancel gives those still queued."""
        outcome = await self._through_outage(lambda: self.store.finish_item(job_id, index, "cancelled",
                                                                            item_record(audio, "cancelled")))
        await self._after_finish(job_id, "cancelled", outcome)

    async def _fail(self, job_id: str, index: int, audio: str | None, error: str) -> None:
        outcome = await self._through_outage(lambda: self.store.finish_item(  # dead-lettered in the same step
            job_id, index, "failed", item_record(audio, "failed", error=error), error=error))
        if outcome:
            self.metrics.count_job_item_dead_lettered()
        await self._after_finish(job_id, "failed", outcome)

    async def _through_outage(self, write: Callable[[], Awaitable[T]]) -> T:
        """``write()``, an item's start or end (its result, its acknowledgement: each may be written twice, a start
        an attempt more), tried again
        through a Redis outage for up to the visibility timeout while the consumer runs. Given up at once, work
        done was thrown away for want of Redis for seconds (a restart, a failover), and its item transcribed again,
        an attempt more, after the visibility timeout; given up later, the item goes to another worker as before."""
        deadline = time.monotonic() + self.options.visibility_timeout_s
        pause_s = OUTAGE_PAUSES_S[0]
        while True:
            try:
                return await write()
            except REDIS_ERRORS:
                if self._stopping.is_set() or time.monotonic() + pause_s > deadline:
                    raise
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), pause_s)
            pause_s = min(2 * pause_s, OUTAGE_PAUSES_S[1])

    async def _after_finish(self, job_id: str, item_status: str, outcome: int) -> None:
        if outcome == 0:
            return  # a redelivery of an item that already had its result
        if item_status != "cancelled":  # items are counted as they complete or fail (a cancel counts its job)
            self.metrics.count_job_item(item_status)
        if outcome == 2:
            job = await self._through_outage(lambda: self.store.get(job_id))
            self.metrics.count_job(job.status.value)


def _gave_up(attempts: int, why: str) -> str:
    """An item's error once its attempts are spent (dead-lettered, or failed on its last attempt)."""
    return f"gave up after {attempts} attempts: {why}"


def _decode_input_file(path: str, roots: list[str], limits: AudioLimits, multichannel: bool, stretch: Stretch,
                       stop: threading.Event | None = None) -> np.ndarray:
    """``decode_audio_file`` of a path input, opened (open_input_file: checked as opened, not only by name) and
    closed by the thread that reads it, off the event loop."""
    with open_input_file(path, roots) as file:
        return decode_audio_file(file, limits, multichannel, stretch, stop)


def _decode_and_close(body: BinaryIO, limits: AudioLimits, multichannel: bool, stretch: Stretch,
                      stop: threading.Event | None = None) -> np.ndarray:
    """``decode_audio`` of a fetched or read body, decoded where it was received and closed by the thread that reads it:
    never under it, should the item's task be cancelled while the decode runs."""
    with body:
        return decode_audio(body, limits, multichannel, stretch, stop)
