"""Bulk jobs on Redis Streams: submission, item state changes (service.job_scripts), results, cancel, retry and
delete. The streams the items go on, and the workers' reading of them, are service.item_streams'.

Delivery is at-least-once (a consumer group on each stream; stuck deliveries are reclaimed), and every state
change of an item runs as one Lua script, so an item redelivered after a crash can never write a second result or
be counted twice. A job's items go on a stream of its priority and its owner (service.job_keys.item_stream):
workers take a higher priority's items before any of a lower one, and within a priority each owner's in turn.

Per job (service.job_keys): a hash (status, times, counters), and per-item hashes keyed by the item's index:
inputs, states, attempts, errors, results. Uploaded audio lives in its own keys with a TTL, written a piece at a
time before the job (service.job_uploads). What a job is, its items and options: service.job_types.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import secrets
import time
from collections.abc import AsyncIterator, Collection, Sequence
from typing import Any, BinaryIO

import redis.asyncio as aioredis

from .item_streams import ItemStreams
from .job_keys import (
    ATTEMPTS_KEY,
    DEAD_LETTER_STREAM,
    ERRORS_KEY,
    GROUP,
    IDEMPOTENCY_KEY,
    INPUTS_KEY,
    JOB_ID,
    JOB_KEY,
    JOB_KEYS,
    OWNER_JOBS_KEY,
    REPLICATION_MARK_KEY,
    RESERVED_KEY,
    RESULTS_KEY,
    STATES_KEY,
    UPLOAD_KEY,
    WEBHOOK_RETRIES_KEY,
    WEBHOOK_STREAM,
    item_stream,
)
from .job_scripts import (
    CANCEL_QUEUED,
    DEFER_WEBHOOK,
    EXPIRE_ALL,
    EXPIRE_FINISHED,
    FINISH_ITEM,
    MARK_REPLICATION,
    OWNER_ITEMS,
    PROMOTE_WEBHOOKS,
    PRUNE_OWNER_JOBS,
    PURGE_JOB,
    RECORD_ERROR,
    RECORD_WEBHOOK,
    REQUEST_CANCEL,
    RESERVE_ITEMS,
    RETRY_FAILED,
    START_ITEM,
)
from .job_types import (
    ANONYMOUS,
    IdempotencyKeyReused,
    ItemInput,
    ItemStart,
    Job,
    JobInputError,
    JobNotFound,
    JobOptions,
    JobPriority,
    JobStatus,
    NoRoomToRetry,
    Retried,
    TooManyQueued,
    UploadTooLarge,
    item_record,
    job_from_fields,
    submission_fingerprint,
)
from .job_uploads import UploadRefused, read_upload, upload_size, write_uploads
from .redis_outages import REDIS_ERRORS, NotReplicatedError, SubmissionUnconfirmed
from .redis_pools import close_pool, connection_pool, split_wait_replicas
from .spool import SPOOL_MEMORY_BYTES

DEAD_LETTERS_KEPT = 100_000  # the newest dead letters the stream keeps (about; a noeviction Redis must not fill)
RESULTS_PAGE = 1000  # items read (results) or cancelled per round trip
LIST_PAGE = 100  # job ids read per round trip when listing
POOL_WAIT_S = 30.0  # a command waits this long for a free connection before it counts as Redis unreachable
REPLICA_WAIT_MS = 1000  # how long a write waits for the replicas wait_replicas asks for before it is refused
# a job's items count against its owner's JOB_MAX_QUEUED_ITEMS from before its uploads are written (1 GiB of them
# takes seconds) until its transaction queues them; a reservation whose submitter died meanwhile lapses then
RESERVATION_HOLD_MS = 300_000
MAX_JOB_ITEMS = 100_000  # items in one job by default (BATCHASR_MAX_JOB_ITEMS): more go as several jobs
# a JSON submission's body: paths and URLs, no audio. Its items are validated and checked one by one, and a body of
# the upload limit (1 GiB) made twenty million of them, and gigabytes of memory
JSON_JOB_BYTES = 64 * 1024 * 1024
# an upload this small comes with its item's start, in the same round trip: a temporary file would hold it in
# memory all the same (service.spool), and a GETRANGE a clip costs a worker's event loop at thousands a second
INLINE_UPLOAD_BYTES = SPOOL_MEMORY_BYTES


def _now() -> str:
    return f"{time.time():.3f}"


class JobStore(ItemStreams):
    """Everything jobs do in Redis. One instance per process; safe to share between tasks.

    With ``wait_replicas``, what the store acknowledges to a client (a job accepted, cancelled, retried, deleted)
    is first confirmed by that many replicas (Redis's WAIT), or refused as ``NotReplicatedError``: a failover to one
    of them cannot drop it. The workers' own writes need no wait: a replica holds a prefix of the primary's writes,
    so a result lost in a failover went with its acknowledgement, and the item is delivered again."""

    def __init__(self, client: aioredis.Redis, input_ttl_s: int = 7 * 86400, result_ttl_s: int = 7 * 86400,
                 max_upload_bytes: int = 200 * 1024 * 1024, wait_replicas: int = 0,
                 max_queued_items: int | None = None):
        super().__init__(client)
        self.max_queued_items = max_queued_items  # per owner, over its streams (None: no limit)
        self.wait_replicas = wait_replicas
        self.input_ttl_s = input_ttl_s
        self.result_ttl_s = result_ttl_s
        self.max_upload_bytes = max_upload_bytes
        self._start = client.register_script(START_ITEM)
        self._finish = client.register_script(FINISH_ITEM)
        self._record_webhook = client.register_script(RECORD_WEBHOOK)
        self._defer_webhook = client.register_script(DEFER_WEBHOOK)
        self._promote_webhooks = client.register_script(PROMOTE_WEBHOOKS)
        self._cancel_queued = client.register_script(CANCEL_QUEUED)
        self._request_cancel = client.register_script(REQUEST_CANCEL)
        self._record_error = client.register_script(RECORD_ERROR)
        self._expire_all = client.register_script(EXPIRE_ALL)
        self._purge = client.register_script(PURGE_JOB)
        self._expire_if_finished = client.register_script(EXPIRE_FINISHED)
        self._prune_owner_jobs = client.register_script(PRUNE_OWNER_JOBS)
        self._mark_replication = client.register_script(MARK_REPLICATION)
        self._retry_failed = client.register_script(RETRY_FAILED)
        self._reserve_items = client.register_script(RESERVE_ITEMS)
        self._owner_items = client.register_script(OWNER_ITEMS)

    @classmethod
    def from_url(cls, url: str, max_connections: int = 128, **kwargs: Any) -> JobStore:
        """A client of the Redis ``url`` names (one server, or Sentinel's primary: see service.redis_pools) whose
        commands wait for a free connection past ``max_connections`` in use. redis-py's
        default pool raises "Too many connections" there instead, which looks like Redis going away: a worker
        with more items in flight than the pool holds left them unacknowledged until the visibility timeout.
        The URL's ``wait_replicas`` parameter is the store's ``wait_replicas``."""
        url, wait_replicas = split_wait_replicas(url)
        pool = connection_pool(url, max_connections, POOL_WAIT_S)
        return cls(aioredis.Redis.from_pool(pool), wait_replicas=wait_replicas, **kwargs)

    async def queued_items(self, owner: str) -> int:
        """The owner's items queued or in progress, over its streams, and reserved by its submissions under way: as
        ``max_queued_items`` counts them (one round trip; a replica answers it too)."""
        return int(await self._owner_items(keys=self._owner_items_keys(owner), args=[GROUP, RESERVATION_HOLD_MS]))

    # --- submission --------------------------------------------------------------------------------------------

    async def submit(self, items: list[ItemInput], idempotency_key: str | None = None,
                     options: JobOptions | None = None) -> tuple[Job, bool]:
        """Create a job and queue its items on its priority's stream; returns (job, created). A repeated
        idempotency key (of the same owner) returns the job the first request created, if the request is the
        same (``IdempotencyKeyReused`` if not)."""
        options = options or JobOptions()
        if not items:
            raise JobInputError("a job needs at least one item")
        job_id = "job_" + secrets.token_urlsafe(18)  # random and unguessable
        sizes = _upload_sizes(items)  # measured once: what is written is what the limit was checked against
        for index, size in sizes.items():
            if size > self.max_upload_bytes:
                raise UploadTooLarge(f"{items[index].audio}: {size} bytes exceeds the upload limit of "
                                     f"{self.max_upload_bytes}")
        uploads = {UPLOAD_KEY.format(job_id=job_id, index=index): (items[index], size)
                   for index, size in sizes.items()}
        fingerprint = submission_fingerprint(items, options, sizes)
        stream = item_stream(options.priority, options.owner)
        key = _idempotency_key(idempotency_key, options.owner) if idempotency_key else None
        if idempotency_key and (job := await self.submitted_under(idempotency_key, options.owner,
                                                                  fingerprint)) is not None:
            return job, False  # a retried submission: nothing of it is written again
        reserved = await self._reserve(job_id, options.owner, len(items))  # before a byte is written
        try:
            try:
                await write_uploads(self.redis, {name: (item.upload, size) for name, (item, size) in uploads.items()})
            except UploadRefused as exc:
                error = UploadTooLarge if exc.too_large else JobInputError
                raise error(f"{uploads[exc.key][0].audio}: {exc}") from exc
            job, created = await self._create(job_id, items, options, key, list(uploads), stream, reserved,
                                              fingerprint)
        except SubmissionUnconfirmed:
            raise  # the job may be there, and these uploads its audio: left to expire with it, or with staging's TTL
        except BaseException:
            await self._discard(job_id, uploads, reserved)
            raise
        if not created:  # another request with this key wrote its job while these uploads were written
            await self._discard(job_id, uploads, reserved)
            _check_same_request(job, fingerprint)
        await self._confirm_replicated()
        return job, created

    async def submitted_under(self, idempotency_key: str, owner: str = ANONYMOUS,
                              fingerprint: str | None = None) -> Job | None:
        """The job ``owner`` submitted under ``idempotency_key``, if it is still there: a retried submission's answer,
        before its inputs are checked again (a file the first one named may be gone since). With the retry's
        ``fingerprint`` (``submission_fingerprint``), ``IdempotencyKeyReused`` if the job was made by another."""
        job = await self._job_named_by(self.redis, _idempotency_key(idempotency_key, owner))
        if job is not None:
            if fingerprint is not None:
                _check_same_request(job, fingerprint)
            await self._confirm_replicated()  # it may be the retry of one refused as unconfirmed
        return job

    async def _create(self, job_id: str, items: list[ItemInput], options: JobOptions, key: str | None,
                      uploads: list[str], stream: str, reserved: str | None,
                      fingerprint: str) -> tuple[Job, bool]:
        """The job's transaction (its ``uploads`` written already: it gives them the input TTL), queueing its items
        on ``stream`` and dropping their ``reserved`` count; the job an idempotency ``key`` names if it has one by
        now. A transaction whose reply was lost (the connection closed after it was sent) may have run: the job is
        looked for, and ``SubmissionUnconfirmed`` raised if Redis cannot say."""
        sent = False
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        if key is not None and (job := await self._watched_job(pipe, key)) is not None:
                            # this job's own where the transaction ran and its reply was lost (redis-py raises that
                            # on a watching connection as a WatchError, as it does another request's write)
                            return job, job.id == job_id
                        fields = await self._queue_job_in(pipe, job_id, items, options, key, uploads, stream,
                                                          reserved, fingerprint)
                        if pipe.connection is None:  # connected first (as execute would): Redis not reached is
                            # then told apart from a transaction sent whose reply was lost
                            pipe.connection = await self.redis.connection_pool.get_connection()
                        sent = True
                        await pipe.execute()
                        break
                    except aioredis.WatchError:  # another request with this key got there first, or the reply
                        continue  # was lost: the key says whose job it is
        except REDIS_ERRORS as exc:
            if not sent or not await self._written_after_all(job_id, exc):
                raise
        # as written, not read back: a purge (or a Redis that lost it) a moment later made the submission a 500
        return job_from_fields(job_id, {name: str(value) for name, value in fields.items()}), True

    async def _watched_job(self, pipe: Any, key: str) -> Job | None:
        """The job idempotency ``key`` names, if any (the pipe reset), else None with ``key`` watched by ``pipe``."""
        await pipe.watch(key)
        if (job := await self._job_named_by(pipe, key)) is not None:
            await pipe.reset()
        return job

    async def _queue_job_in(self, pipe: Any, job_id: str, items: list[ItemInput], options: JobOptions,
                            key: str | None, uploads: list[str], stream: str, reserved: str | None,
                            fingerprint: str) -> dict[str, Any]:
        """The job's writes, in ``pipe``'s transaction; returns its fields as written."""
        pipe.multi()
        if reserved is not None:  # queued now: counted on the streams from here on
            pipe.hdel(reserved, job_id)
        if key is not None:  # set with the job, in one transaction (over a key whose job is gone), and kept as long
            # as the job is: it lapsed at the result TTL, so a retry of a job still running (or whose results were
            # still kept) made a second job
            pipe.set(key, job_id, ex=self.input_ttl_s + self.result_ttl_s)
        await self._open_stream_in(pipe, stream)
        fields = self._queue_job(pipe, job_id, items, options, key, stream, fingerprint)
        # the owner's list: ids of jobs long expired are dropped here, those expired early (finished) when listed
        horizon = float(fields["created_at"]) - self.input_ttl_s - self.result_ttl_s
        await self._prune_owner_jobs(keys=[OWNER_JOBS_KEY.format(owner=options.owner)],
                                     args=[horizon, JOB_KEY.format(job_id="")], client=pipe)
        if uploads:
            await self._expire_all(keys=uploads, args=[self.input_ttl_s], client=pipe)
        return fields

    async def _written_after_all(self, job_id: str, lost: Exception) -> bool:
        """Whether a job whose transaction's reply was ``lost`` is there (the reply lost) or not (the transaction
        with it); ``SubmissionUnconfirmed`` where Redis cannot be asked."""
        try:
            return bool(await self.redis.exists(JOB_KEY.format(job_id=job_id)))
        except REDIS_ERRORS:
            raise SubmissionUnconfirmed(f"the job store (Redis) went away as job {job_id} was written: it may have "
                                        f"been queued") from lost

    async def _reserve(self, job_id: str, owner: str, items: int) -> str | None:
        """With ``max_queued_items``: count ``items`` against ``owner``'s limit until the job's transaction queues
        them (RESERVE_ITEMS), or raise ``TooManyQueued``; returns the reservations' key (None: no limit)."""
        if self.max_queued_items is None:
            return None
        keys = self._owner_items_keys(owner)
        granted, counted = await self._reserve_items(
            keys=keys, args=[GROUP, job_id, items, self.max_queued_items, RESERVATION_HOLD_MS])
        if not granted:
            raise TooManyQueued(int(counted), self.max_queued_items, items)
        return keys[0]

    @staticmethod
    def _owner_items_keys(owner: str) -> list[str]:
        """What an owner's items are counted over against the limit: its reservations, then its item streams."""
        return [RESERVED_KEY.format(owner=owner), *(item_stream(priority, owner) for priority in JobPriority)]

    async def _confirm_replicated(self) -> None:
        """With ``wait_replicas``: return once that many replicas hold every write made so far, or raise
        ``NotReplicatedError`` after ``REPLICA_WAIT_MS``. WAIT counts only the writes of the connection it is sent
        on, and the pool's are many, so a mark is written first on the waiting one: it follows in the replication
        stream every write that has been answered, and a replica that holds it holds them all."""
        if not self.wait_replicas:
            return
        pipe = self.redis.pipeline(transaction=False)  # one connection, in order; WAIT in a MULTI would not wait
        await self._mark_replication(keys=[REPLICATION_MARK_KEY], client=pipe)
        pipe.wait(self.wait_replicas, REPLICA_WAIT_MS)
        _, confirmed = await pipe.execute()
        if confirmed < self.wait_replicas:
            raise NotReplicatedError(f"{confirmed} of the {self.wait_replicas} replica(s) asked for confirmed the "
                                     f"write within {REPLICA_WAIT_MS} ms")

    async def _job_named_by(self, reader: Any, key: str) -> Job | None:
        """The job an idempotency key names, if it is still there (``reader``: the client, or a watching pipe)."""
        existing = await reader.get(key)
        return await self._get_or_none(existing.decode()) if existing is not None else None

    async def _discard(self, job_id: str, uploads: Collection[str], reserved: str | None) -> None:
        """Uploads written, and items reserved, for a job that was not: deleted now if Redis answers (else their
        staging TTL, and the reservation's hold, end them)."""
        with contextlib.suppress(*REDIS_ERRORS):
            if uploads:
                await self.redis.delete(*uploads)
            if reserved is not None:
                await self.redis.hdel(reserved, job_id)

    def _queue_job(self, pipe: Any, job_id: str, items: list[ItemInput], options: JobOptions,
                   idempotency_key: str | None, stream: str, fingerprint: str) -> dict[str, Any]:
        """The writes that create a job and queue its items, added to ``pipe`` (a transaction); returns the job's
        fields as written."""
        inputs, states = {}, {}
        for index, item in enumerate(items):
            record: dict[str, Any] = {"audio": item.audio}
            for name in ("multichannel", "skip_silence"):  # the worker reads them from the item's own record
                if getattr(options, name):
                    record[name] = True
            if options.channel_names:
                record["channel_names"] = list(options.channel_names)
            if options.hotwords:
                record["hotwords"] = list(options.hotwords)
            if item.upload is not None:
                record["upload"] = UPLOAD_KEY.format(job_id=job_id, index=index)  # written already
            elif item.url is not None:
                record["url"] = item.url
            else:
                record["path"] = item.path
            if item.stretch is not None:
                record["offset_s"], record["duration_s"] = item.stretch.offset_s, item.stretch.duration_s
            inputs[index] = json.dumps(record)
            states[index] = "queued"
        created_at, kept_s = _now(), self.input_ttl_s + self.result_ttl_s
        fields = {
            "status": JobStatus.QUEUED.value, "created_at": created_at, "owner": options.owner, "total": len(items),
            "idempotency_key": idempotency_key or "", "fingerprint": fingerprint, "n_queued": len(items),
            "n_in_progress": 0, "n_completed": 0, "n_failed": 0, "n_cancelled": 0, "audio_s": 0, "compute_s": 0,
            "webhook_url": options.webhook_url or "", "webhook_status": "pending" if options.webhook_url else "",
            "priority": options.priority.value, "multichannel": int(options.multichannel),
            "skip_silence": int(options.skip_silence), "channel_names": json.dumps(list(options.channel_names)),
            "hotwords": json.dumps(list(options.hotwords))}
        pipe.hset(JOB_KEY.format(job_id=job_id), mapping=fields)
        pipe.hset(INPUTS_KEY.format(job_id=job_id), mapping=inputs)
        pipe.hset(STATES_KEY.format(job_id=job_id), mapping=states)
        for index in range(len(items)):
            pipe.xadd(stream, {"job": job_id, "index": index})
        for template in JOB_KEYS:
            pipe.expire(template.format(job_id=job_id), kept_s)
        owned = OWNER_JOBS_KEY.format(owner=options.owner)  # the owner's list (kept as long as its newest job)
        pipe.zadd(owned, {job_id: float(created_at)})
        pipe.expire(owned, kept_s)
        return fields

    # --- reading -----------------------------------------------------------------------------------------------

    async def get(self, job_id: str, owner: str | None = None) -> Job:
        """The job; ``JobNotFound`` if there is none, or (``owner`` given) it is another owner's."""
        job = await self._get_or_none(job_id)
        if job is None or (owner is not None and job.owner != owner):
            raise JobNotFound(job_id)
        return job

    async def _get_or_none(self, job_id: str) -> Job | None:
        if not JOB_ID.fullmatch(job_id):  # a client's id names a key: `job_x:inputs` would read another hash
            return None
        raw = await self.redis.hgetall(JOB_KEY.format(job_id=job_id))
        return _job(job_id, raw) if raw else None

    async def list_jobs(self, owner: str, limit: int = 20, after: str | None = None,
                        status: JobStatus | None = None) -> tuple[list[Job], bool]:
        """The owner's jobs, newest first: at most ``limit`` of them (of ``status`` only, when given), from the
        one after job ``after`` (``JobNotFound`` if that is not in the list); and whether there are more."""
        owned = OWNER_JOBS_KEY.format(owner=owner)
        start = 0
        if after is not None:
            rank = await self.redis.zrevrank(owned, after)
            if rank is None:
                raise JobNotFound(after)
            start = rank + 1
        jobs: list[Job] = []
        expired: list[bytes] = []
        while len(jobs) <= limit:  # one more than asked for says whether there are more
            ids = await self.redis.zrevrange(owned, start, start + LIST_PAGE - 1)
            if not ids:
                break
            start += len(ids)
            pipe = self.redis.pipeline(transaction=False)
            for job_id in ids:
                pipe.hgetall(JOB_KEY.format(job_id=job_id.decode()))
            for job_id, raw in zip(ids, await pipe.execute(), strict=True):
                if not raw:
                    expired.append(job_id)
                    continue
                job = _job(job_id.decode(), raw)
                if status is None or job.status == status:
                    jobs.append(job)
        if expired:
            await self.redis.zrem(owned, *expired)
        return jobs[:limit], len(jobs) > limit

    async def results(self, job_id: str) -> list[dict[str, Any]]:
        """One record per item, in submission order; unfinished items say their state."""
        return [record async for record in self.iter_results(job_id)]

    async def iter_results(self, job_id: str, page: int = RESULTS_PAGE, start: int = 0
                           ) -> AsyncIterator[dict[str, Any]]:
        """``results`` from item ``start`` on, a page of items at a time (one round trip each): a job of 100k items
        is neither read in one reply that holds Redis up, nor held whole. JobNotFound before the first record."""
        job = await self.get(job_id)
        for first in range(start, job.total_items, page):
            for record in await self._records(job_id, range(first, min(first + page, job.total_items))):
                yield record

    async def result(self, job_id: str, index: int, owner: str | None = None) -> dict[str, Any]:
        """One item's record, as ``results`` gives it; ``JobNotFound`` for no such job (as ``get``), ``IndexError``
        for no such item."""
        job = await self.get(job_id, owner)
        if not 0 <= index < job.total_items:
            raise IndexError(f"job {job_id} has {job.total_items} items: no item {index}")
        return (await self._records(job_id, [index]))[0]

    async def _records(self, job_id: str, indices: Sequence[int]) -> list[dict[str, Any]]:
        """The records of the items at ``indices``, in one round trip: the result of each that has one, else its
        state (queued where none is written yet) and error. ``JobNotFound`` if the job is gone (purged or expired
        while its results were read page by page: its items were made up as queued, and the stream ended as if
        whole)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.exists(JOB_KEY.format(job_id=job_id))
        for template in (RESULTS_KEY, INPUTS_KEY, STATES_KEY, ERRORS_KEY):
            pipe.hmget(template.format(job_id=job_id), list(indices))
        there, results, inputs, states, errors = await pipe.execute()
        if not there:
            raise JobNotFound(job_id)
        return [json.loads(result) if result is not None else
                item_record(json.loads(inputs[i])["audio"] if inputs[i] else None, (states[i] or b"queued").decode(),
                            error=errors[i].decode() if errors[i] else None)
                for i, result in enumerate(results)]

    # --- item transitions (used by the consumer) ---------------------------------------------------------------

    async def start_item(self, job_id: str, index: int) -> ItemStart:
        """Mark the item in progress (unless it is finished) and read its input, in one round trip; an input that
        cannot be read is ``JobInputError``."""
        keys = [JOB_KEY.format(job_id=job_id), STATES_KEY.format(job_id=job_id), ATTEMPTS_KEY.format(job_id=job_id),
                INPUTS_KEY.format(job_id=job_id), UPLOAD_KEY.format(job_id=job_id, index=index)]
        state, attempts, *item = await self._start(keys=keys, args=[index, _now(), INLINE_UPLOAD_BYTES])
        state = state.decode() if isinstance(state, bytes) else state
        if state == "cancelling":  # its input, for the name its cancelled record gives
            with contextlib.suppress(TypeError, ValueError, AttributeError):
                return ItemStart(state, int(attempts), {"audio": json.loads(item[1]).get("audio")})
            return ItemStart(state, int(attempts))
        if state != "in_progress":
            return ItemStart(state, int(attempts))
        cancels, raw_input, upload_bytes, *upload = item
        try:  # a job written straight into Redis may lack one: failed, not delivered again for good
            record = json.loads(raw_input)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except (TypeError, ValueError) as exc:
            raise JobInputError(f"item {index} of job {job_id} has no input record that can be read "
                                f"({'none' if raw_input is None else exc})") from exc
        return ItemStart(state, int(attempts), record, None if upload_bytes < 0 else upload_bytes,
                         upload[0] if upload else None, int(cancels))

    async def read_upload(self, start: ItemStart) -> BinaryIO:
        """A started item's upload as a file, the caller's to close: the bytes ``start`` brought, or a temporary
        file read a piece at a time (service.job_uploads)."""
        if start.upload is not None:
            return io.BytesIO(start.upload)
        return await read_upload(self.redis, start.record["upload"], start.upload_bytes or 0)

    async def finish_item(self, job_id: str, index: int, state: str, result: dict[str, Any], error: str = "",
                          audio_s: float = 0.0, compute_s: float = 0.0, logprobs: list[float] | None = None) -> int:
        """Write the item's one result (``logprobs``: its tokens' scores, which the job's ``avg_logprob`` counts);
        a failed item is dead-lettered with it. 0: it had one already, 1: written, 2: written and the job
        finished."""
        keys = [*(t.format(job_id=job_id) for t in (JOB_KEY, STATES_KEY, RESULTS_KEY, ERRORS_KEY)), WEBHOOK_STREAM,
                UPLOAD_KEY.format(job_id=job_id, index=index), DEAD_LETTER_STREAM]
        scores = logprobs or []
        outcome = int(await self._finish(keys=keys, args=[index, state, json.dumps(result), error, _now(),
                                                          audio_s, compute_s, job_id, len(scores), sum(scores),
                                                          DEAD_LETTERS_KEPT]))
        if outcome == 2 or (outcome == 0 and await self._finished(job_id)):  # 0: a write tried again after an
            await self._expire_finished(job_id)  # outage may have ended the job, and met the outage here
        return outcome

    async def _finished(self, job_id: str) -> bool:
        return bool(await self.redis.hexists(JOB_KEY.format(job_id=job_id), "finished_at"))  # Job.finished

    async def record_error(self, job_id: str, index: int, error: str) -> None:
        await self._record_error(keys=[JOB_KEY.format(job_id=job_id), ERRORS_KEY.format(job_id=job_id)],
                                 args=[index, error])

    async def last_error(self, job_id: str, index: int) -> str | None:
        raw = await self.redis.hget(ERRORS_KEY.format(job_id=job_id), index)
        return raw.decode() if raw else None

    async def discard_entry(self, stream: str, message_id: bytes, error: str) -> None:
        """Dead-letter and acknowledge a stream entry that names no job item."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.xadd(DEAD_LETTER_STREAM, {"stream": stream, "message": message_id, "error": error, "at": _now()},
                  maxlen=DEAD_LETTERS_KEPT, approximate=True)
        pipe.xack(stream, GROUP, message_id)
        await pipe.execute()

    async def _expire_finished(self, job_id: str) -> None:
        """Results (and what is left of the inputs) expire ``result_ttl_s`` after the job finishes; not if a retry
        of its failed items has begun it again since (EXPIRE_FINISHED): its end does it again."""
        records = [template.format(job_id=job_id) for template in JOB_KEYS]
        if not int(await self._expire_if_finished(keys=records, args=[self.result_ttl_s])):
            return
        pipe = self.redis.pipeline(transaction=False)
        inputs = await self.redis.hgetall(INPUTS_KEY.format(job_id=job_id))
        for raw in inputs.values():
            with contextlib.suppress(ValueError):  # an input that cannot be read (its item failed for it) names none
                record = json.loads(raw)
                if isinstance(record, dict) and "upload" in record:
                    pipe.delete(record["upload"])  # audio is not kept once its result is
        await pipe.execute()
        await self._keep_idempotency_key(job_id, self.result_ttl_s)

    async def _keep_idempotency_key(self, job_id: str, ttl_s: int) -> None:
        """The job's idempotency key, if it still names the job, expires with it ``ttl_s`` from now."""
        key = await self.redis.hget(JOB_KEY.format(job_id=job_id), "idempotency_key")
        if key and await self.redis.get(key) == job_id.encode():
            await self.redis.expire(key, ttl_s)

    # --- cancel, retry, delete ---------------------------------------------------------------------------------

    async def cancel(self, job_id: str) -> tuple[Job, bool]:
        """Items still queued are cancelled here; items a worker holds are cancelled by it (``start_item`` says
        "cancelling", and a consumer looks for cancels of the jobs in its hands: service.job_worker), those in a
        batch being computed too (their results are dropped). Returns the job after, and whether this call ended it
        (then it is this caller's to count: a job ends once). A page of items per script call (20k items took 7.7 s
        one by one, two round trips each)."""
        job = await self.get(job_id)
        keys = [*(t.format(job_id=job_id) for t in (JOB_KEY, STATES_KEY, RESULTS_KEY, INPUTS_KEY)), WEBHOOK_STREAM]
        await self._request_cancel(keys=keys[:1])  # first: an item started from now on is cancelled
        ended = False
        cancelled = json.dumps(item_record(None, "cancelled"))
        for first in range(0, job.total_items, RESULTS_PAGE):
            indices = range(first, min(first + RESULTS_PAGE, job.total_items))
            ended |= int(await self._cancel_queued(keys=keys, args=[_now(), job_id, cancelled, *indices])) == 2
        if ended:
            await self._expire_finished(job_id)
        await self._confirm_replicated()
        return await self.get(job_id), ended

    async def cancel_requested(self, job_ids: list[str]) -> dict[str, float]:
        """Those of these jobs that were cancelled, each with its cancel's number (REQUEST_CANCEL), and those
        deleted (their items are not worth finishing either) with infinity, in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hmget(JOB_KEY.format(job_id=job_id), "cancel_requested", "total")
        found = await pipe.execute()
        return {job_id: math.inf if total is None else float(requested)
                for job_id, (requested, total) in zip(job_ids, found, strict=True)
                if requested is not None or total is None}

    async def retry_failed(self, job_id: str, owner: str | None = None) -> Retried:
        """Queue the job's failed items again, each from a first attempt, on its owner's stream: those of a path
        or a URL (an upload's audio went with its failure), as many as the owner's ``max_queued_items`` has room
        for (the rest stay failed, for a later retry; none: ``NoRoomToRetry``). The job is in progress until they
        finish, and then ends (and is counted, and its webhook sent) again; its records keep a new job's TTL
        meanwhile (``JobNotFound`` as ``get``)."""
        job = await self.get(job_id, owner)
        stream = item_stream(job.priority, job.owner)  # the job may be older than owners' streams: its owner's now
        keys = [*(t.format(job_id=job_id) for t in (JOB_KEY, STATES_KEY, RESULTS_KEY, ERRORS_KEY, ATTEMPTS_KEY,
                                                    INPUTS_KEY)), stream]
        limit: int | str = ""
        if self.max_queued_items is not None:  # counted in each page's step, as a submission's reservation is
            keys += self._owner_items_keys(job.owner)
            limit = self.max_queued_items
        kept_ms = (self.input_ttl_s + self.result_ttl_s) * 1000
        queued = left = deferred = counted = 0
        for first in range(0, job.total_items, RESULTS_PAGE):
            indices = range(first, min(first + RESULTS_PAGE, job.total_items))
            async with self.redis.pipeline(transaction=True) as pipe:
                await self._open_stream_in(pipe, stream)
                await self._retry_failed(keys=keys, args=[job_id, kept_ms, limit, GROUP, RESERVATION_HOLD_MS,
                                                          *indices], client=pipe)
                _, (n_queued, n_left, n_deferred, counted) = await pipe.execute()
            queued, left, deferred = queued + int(n_queued), left + int(n_left), deferred + int(n_deferred)
        if deferred and not queued:  # nothing written: refused, as a submission past the limit is
            raise NoRoomToRetry(int(counted), int(limit), deferred)
        if queued:  # in progress again, its records kept as a new job's: its key and its owner's list too
            await self._keep_idempotency_key(job_id, self.input_ttl_s + self.result_ttl_s)
            await self.redis.expire(OWNER_JOBS_KEY.format(owner=job.owner), self.input_ttl_s + self.result_ttl_s)
        await self._confirm_replicated()
        return Retried(await self.get(job_id), queued, left, deferred)

    async def delete(self, job_id: str, owner: str | None = None) -> None:
        """Everything of the job, at once: its records and results, its uploaded audio, its place in its owner's
        list and its idempotency key (``JobNotFound`` as ``get``). Items not started never start; the consumers
        holding items let them go (``cancel_requested``), and any that finishes writes nothing (``finish_item``
        writes nothing for a job that is gone)."""
        try:
            job = await self.get(job_id, owner)
        except JobNotFound:
            # it may be the retry of a delete refused as unconfirmed: that the job is gone, a replica holds first
            await self._confirm_replicated()
            raise
        job_key, owned = JOB_KEY.format(job_id=job_id), OWNER_JOBS_KEY.format(owner=job.owner)
        idempotency_key = await self.redis.hget(job_key, "idempotency_key")
        records = [template.format(job_id=job_id) for template in JOB_KEYS] + ([idempotency_key] if idempotency_key
                                                                               else [])
        await self._purge(keys=[owned, *records], args=[job_id])  # first: no item starts from here on
        for first in range(0, job.total_items, RESULTS_PAGE):
            last = min(first + RESULTS_PAGE, job.total_items)
            await self._purge(keys=[owned, *(UPLOAD_KEY.format(job_id=job_id, index=i) for i in range(first, last))],
                              args=[job_id])
        await self._confirm_replicated()

    # --- webhook deliveries (used by service.webhook_worker) ---------------------------------------------------

    async def record_webhook(self, job_id: str, end: int, message_id: bytes, delivered: bool, attempts: int,
                             error: str | None) -> None:
        """How the webhook of the job's ``end`` went (nothing once the job has expired, or owes another: retried
        since), and its delivery acknowledged, in one script (RECORD_WEBHOOK)."""
        fields = ["webhook_status", "delivered" if delivered else "failed", "webhook_attempts", attempts,
                  "webhook_error", error or ""]
        await self._record_webhook(keys=[JOB_KEY.format(job_id=job_id), WEBHOOK_STREAM],
                                   args=[GROUP, message_id, end, *fields])

    async def ack_webhook(self, message_id: bytes) -> None:
        await self.redis.xack(WEBHOOK_STREAM, GROUP, message_id)

    async def requeue_webhook(self, message_id: bytes, job_id: str, end: int, attempt: int = 1) -> None:
        """Hand a delivery back (a worker stopping): queued again for any worker, now, not after the claim
        timeout, at the attempt it had reached."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.xadd(WEBHOOK_STREAM, {"job": job_id, "end": end, "attempt": attempt})
        pipe.xack(WEBHOOK_STREAM, GROUP, message_id)
        await pipe.execute()

    async def defer_webhook(self, message_id: bytes, job_id: str, end: int, attempt: int, retry_in_s: float,
                            error: str) -> None:
        """A delivery whose attempt failed, tried again as ``attempt`` in ``retry_in_s``: acknowledged, and kept
        meanwhile in Redis rather than in a worker's slot (DEFER_WEBHOOK); the job shows the attempts so far and
        the last error."""
        due_ms = int((time.time() + retry_in_s) * 1000)
        retry = json.dumps({"job": job_id, "end": str(end), "attempt": str(attempt), "entry": message_id.decode()})
        await self._defer_webhook(keys=[JOB_KEY.format(job_id=job_id), WEBHOOK_STREAM, WEBHOOK_RETRIES_KEY],
                                  args=[GROUP, message_id, end, attempt, due_ms, retry, error])

    async def promote_webhooks(self, limit: int = 100) -> tuple[int, int]:
        """Retries now due back on the webhook stream (PROMOTE_WEBHOOKS); returns how many, and how many wait
        still."""
        moved, waiting = await self._promote_webhooks(keys=[WEBHOOK_RETRIES_KEY, WEBHOOK_STREAM],
                                                      args=[int(time.time() * 1000), limit])
        return int(moved), int(waiting)

    async def scheduled_webhooks(self) -> int:
        """Deliveries waiting to be tried again."""
        return int(await self.redis.zcard(WEBHOOK_RETRIES_KEY))

    # --- Redis itself ------------------------------------------------------------------------------------------

    async def durability_risks(self) -> dict[str, str] | None:
        """What in Redis's settings would lose jobs without an error: each risk's name (``metrics.JOB_STORE_RISKS``)
        and why. Read with INFO, which managed services allow where they refuse CONFIG; None where INFO is refused
        too (a proxy, or an ACL without it): nothing can be said."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.info("memory")
        pipe.info("persistence")
        pipe.info("replication")
        try:
            memory, persistence, replication = await pipe.execute()
        except aioredis.ResponseError:
            return None
        risks = {}
        policy = memory.get("maxmemory_policy", "noeviction")
        if policy != "noeviction":
            # every job key has a TTL, so the volatile-* policies take them as readily as allkeys-* ones
            risks["eviction"] = (f"Redis's maxmemory-policy is {policy}: once full it deletes keys to make room, and "
                                 "jobs, their audio and their results go without an error. Set maxmemory-policy "
                                 "noeviction: a full Redis then refuses new jobs (503 job_store_full) and loses none")
        if not int(persistence.get("aof_enabled", 1)):
            risks["no_appendonly"] = ("Redis has appendonly off: a restart loses the jobs written since its last "
                                      "snapshot (all of them, without snapshots). Set appendonly yes")
        replicas = int(replication.get("connected_slaves", 0))
        if replicas and not self.wait_replicas:
            risks["unconfirmed_replication"] = (
                f"Redis has {replicas} replica(s) and the store acknowledges writes before they reach one: a failover "
                "drops the jobs accepted in the moments before it, and those an old primary cut off from the new one "
                "takes meanwhile. Add wait_replicas=1 to the Redis URL")
        return risks

    async def ping(self) -> bool:
        try:
            return bool(await self.redis.ping())
        except (aioredis.ConnectionError, aioredis.TimeoutError, OSError):
            return False

    async def close(self) -> None:
        await self.redis.aclose()
        await close_pool(self.redis.connection_pool)


def _job(job_id: str, raw: dict[bytes, bytes]) -> Job:
    """A job from its hash."""
    return job_from_fields(job_id, {k.decode(): v.decode() for k, v in raw.items()})


def _upload_sizes(items: list[ItemInput]) -> dict[int, int]:
    """The bytes of each item's upload, by item index, without reading them (``JobInputError`` for one that cannot
    be measured)."""
    sizes = {}
    for index, item in enumerate(items):
        if item.upload is not None:
            try:
                sizes[index] = upload_size(item.upload)
            except UploadRefused as exc:
                raise JobInputError(f"{item.audio}: {exc}") from exc
    return sizes


def request_fingerprint(items: list[ItemInput], options: JobOptions) -> str:
    """A submission's fingerprint (``submission_fingerprint``), its uploads measured."""
    return submission_fingerprint(items, options, _upload_sizes(items))


def _check_same_request(job: Job, fingerprint: str) -> None:
    """``IdempotencyKeyReused`` where ``job``, named by a retry's idempotency key, was made by another request."""
    if job.fingerprint and job.fingerprint != fingerprint:
        raise IdempotencyKeyReused(job.id)


def _idempotency_key(idempotency_key: str, owner: str) -> str:
    """The Redis key of an owner's idempotency key: one owner's key never names another's job."""
    return IDEMPOTENCY_KEY.format(key=idempotency_key if owner == ANONYMOUS else f"{owner}:{idempotency_key}")
