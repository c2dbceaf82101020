"""Delivers finished jobs' completion webhooks, at least once, whatever happens to the worker that finished them.

The script that finishes a job with a webhook also queues its delivery on the webhook stream, read by the
workers' consumer group as the items are. A delivery is acknowledged in the transaction that records its
outcome on the job; one a worker dropped (killed mid-delivery) is reclaimed after ``CLAIM_IDLE_S``, at once by the
worker restarted under its name, or by any worker once no running one holds the name (``gone_after_s``); one a
stopping worker had in hand is queued again at once. A read whose reply was lost as Redis went away left its
deliveries pending under the worker's name, unseen: it takes them back once Redis is back. A receiver may therefore
get a message twice: its ``webhook-id`` stays the same, for the receiver to drop the second, as Standard Webhooks
asks of receivers.

A delivery is one attempt. One that failed and may be tried again leaves the stream for a sorted set of retries,
in the step that acknowledges it, and is put back on the stream when due (``WebhookSender`` sets the wait: hours
in all, so a receiver down for a deploy or a night still gets it). A slot is never held through the pause: a few
failing receivers held every slot for minutes, and everyone else's webhooks waited behind them.

A job whose failed items are retried ends again, and owes a webhook again: each delivery names the end it
announces (the job's ``ends`` then), and one whose job has ended again since, or is in progress again, or has been
deleted, is dropped unsent: the later end has its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from .intervals import Periodic
from .job_keys import GROUP, WEBHOOK_STREAM
from .job_types import Job, JobNotFound
from .jobs import JobStore
from .redis_outages import REDIS_ERRORS, REDIS_FULL, group_lost, step_until_stopped
from .webhooks import WebhookSender

log = logging.getLogger(__name__)

CLAIM_IDLE_S = 300.0  # far longer than one attempt can take (10 s)
PROMOTE_INTERVAL_S = 1.0  # how often due retries are put back on the stream
STOP_GRACE_S = 5.0  # a stopping worker lets deliveries run this long, then hands the rest back
IN_FLIGHT = 32  # deliveries at once, per worker
NO_SECRET = "the worker that took the delivery cannot sign webhooks (it has no BATCHASR_WEBHOOK_SECRET)"


class WebhookMetrics(Protocol):
    def count_webhook(self, outcome: str) -> None: ...

    def observe_webhooks_waiting(self, waiting: int) -> None: ...


class WebhookWorker:
    """One consumer's share of the webhook stream. ``sender`` None: deliveries are recorded as failed, with why.
    ``name_held`` says whether this instance holds its consumer name (the job consumer's lease): only then are the
    deliveries to the name that it does not have in hand its own, to take back without waiting for the claim
    timeout; never from another instance running under the same name. ``gone_after_s``: how long a consumer whose
    name no running instance holds must have been idle for its deliveries to be taken (None: not now)."""

    def __init__(self, store: JobStore, sender: WebhookSender | None, name: str, metrics: WebhookMetrics,
                 in_flight: int = IN_FLIGHT,
                 claim_idle_s: float = CLAIM_IDLE_S, reclaim_interval_s: float = 5.0,
                 stop_grace_s: float = STOP_GRACE_S, name_held: Callable[[], bool] = lambda: False,
                 gone_after_s: Callable[[], float | None] = lambda: None):
        self.store = store
        self.sender = sender
        self.name = name
        self.metrics = metrics
        self.in_flight = in_flight
        self.claim_idle_s = claim_idle_s
        self.stop_grace_s = stop_grace_s
        # task -> (stream entry, job id, end, attempt)
        self._deliveries: dict[asyncio.Task, tuple[bytes, str, int, int]] = {}
        self.reclaim_interval_s = reclaim_interval_s
        self._reclaim = Periodic()
        self._promote = Periodic()
        self._group_ready = False
        self._reclaim_from: bytes | str = "0-0"  # where the next look for stalled deliveries goes on
        self.name_held = name_held
        self.gone_after_s = gone_after_s
        self._own_left = True  # deliveries to this name that a previous life of it left may be pending still
        self._own_left_why = "that its name held when its last run ended"

    async def run(self, stop: asyncio.Event, block_ms: int = 1000) -> None:
        """Deliver until ``stop`` is set; then give deliveries in progress ``stop_grace_s`` and hand back the rest."""
        await step_until_stopped(stop, lambda: self.step(block_ms), "webhook deliveries", self._failed)
        await self._hand_back()

    def _failed(self, exc: Exception) -> None:
        self._group_ready = self._group_ready and not group_lost(exc)
        if isinstance(exc, REDIS_ERRORS):  # a read's reply lost with its connection leaves deliveries to this name
            # that it never saw, pending until the claim timeout: taken back as a previous life's are
            self._own_left, self._own_left_why = True, "delivered to this worker while Redis was away"
            self._reclaim.come_due()

    async def close(self) -> None:
        """Release the sender's connections (after ``run`` or ``drain``)."""
        if self.sender is not None:
            await self.sender.close()

    async def drain(self) -> None:
        """Burst mode (tests): deliver until the stream has nothing left for this consumer and no retry waits."""
        while await self.step(block_ms=100) or self._deliveries or await self.store.scheduled_webhooks():
            await asyncio.gather(*self._deliveries, return_exceptions=True)

    async def step(self, block_ms: int) -> int:
        """Start the deliveries there is room for (reclaiming stalled ones first); returns how many started."""
        if not self._group_ready:  # the job consumer beside this may not have made it yet
            await self.store.ensure_group()
            self._group_ready = True
        room = self.in_flight - len(self._deliveries)
        if room <= 0:
            await asyncio.wait(self._deliveries, timeout=block_ms / 1000, return_when=asyncio.FIRST_COMPLETED)
            return 0
        if self._promote.due(PROMOTE_INTERVAL_S):
            _, waiting = await self.store.promote_webhooks()
            self.metrics.observe_webhooks_waiting(waiting)
        entries: list[tuple[bytes, dict]] = []
        if self._reclaim.due(self.reclaim_interval_s):
            entries += await self._reclaim_stalled(room)
        if len(entries) < room:
            reply = await self.store.redis.xreadgroup(GROUP, self.name, {WEBHOOK_STREAM: ">"},
                                                      count=room - len(entries), block=block_ms)
            for _, new in reply or []:
                entries += new
        for message_id, fields in entries:
            job_id = fields.get(b"job", b"").decode(errors="replace")
            end = _number(fields, b"end", 0)  # 0: queued before a job's ends were counted
            attempt = max(_number(fields, b"attempt", 1), 1)
            task = asyncio.create_task(self._deliver(message_id, job_id, end, attempt))
            self._deliveries[task] = (message_id, job_id, end, attempt)
            task.add_done_callback(self._deliveries.pop)
        return len(entries)

    async def _reclaim_stalled(self, count: int) -> list[tuple[bytes, dict]]:
        """Deliveries to this worker's name that it does not have in hand, then those of workers gone, then other
        workers' stalled ones: up to ``count`` in all."""
        own = await self._take_back_own_left(count) if self._own_left and self.name_held() else []
        if len(own) < count and (idle_s := self.gone_after_s()) is not None:
            gone, names = await self.store.claim_from_gone([WEBHOOK_STREAM], self.name, count - len(own), idle_s)
            own += [(message_id, fields) for _, message_id, fields in gone]
            if gone:
                log.info("reclaimed %d webhook deliveries from consumers gone (no running worker holds the name %s)",
                         len(gone), ", ".join(sorted(names)))
        if len(own) == count:
            return own
        self._reclaim_from, claimed = await self.store.claim_stalled(WEBHOOK_STREAM, self.name, self.claim_idle_s,
                                                                     count - len(own), self._reclaim_from)
        if claimed:
            log.info("reclaimed %d webhook deliveries from stalled consumers", len(claimed))
        return own + claimed

    async def _take_back_own_left(self, count: int) -> list[tuple[bytes, dict]]:
        in_hand = [message_id for message_id, *_ in self._deliveries.values()]
        found, taken = await self.store.claim_own_left(WEBHOOK_STREAM, self.name, count, in_hand)
        self._own_left = found == count  # room for more than were left: none is
        if taken:
            log.info("took back %d webhook deliveries %s (consumer %s)", len(taken), self._own_left_why, self.name)
        return taken

    async def _deliver(self, message_id: bytes, job_id: str, end: int, attempt: int) -> None:
        try:
            job = await self._owed(job_id, end)  # asked at each attempt: the job may be deleted, or end again,
            if job is None:                      # while a retry waits
                await self.store.ack_webhook(message_id)
                if attempt > 1:
                    self.metrics.count_webhook("dropped")
                return
            if self.sender is None:
                await self.store.record_webhook(job.id, end, message_id, False, attempt - 1, NO_SECRET)
                self.metrics.count_webhook("failed")
                return
            tried = await self.sender.attempt(job, end, attempt)
            if tried.retry_in_s is not None:
                await self.store.defer_webhook(message_id, job.id, end, attempt + 1, tried.retry_in_s,
                                               tried.error or "")
                self.metrics.count_webhook("retried")
                return
            await self.store.record_webhook(job.id, end, message_id, tried.delivered, attempt, tried.error)
            self.metrics.count_webhook("delivered" if tried.delivered else "failed")
        except (*REDIS_ERRORS, REDIS_FULL) as exc:  # unacknowledged: reclaimed after the claim timeout
            log.warning("redis error delivering the webhook of %s (%s); it will be retried", job_id, exc)

    async def _owed(self, job_id: str, end: int) -> Job | None:
        """The job, if its webhook for ``end`` is still owed: not once it has expired or been deleted, ended again
        or is in progress again (retried since: a later end has its own), or its webhook's outcome is recorded."""
        try:
            job = await self.store.get(job_id)
        except JobNotFound:  # expired, deleted, or an entry naming no job
            return None
        passed = not job.finished or (end and job.ends != end)
        if not job.webhook_url or passed or job.webhook_status in ("delivered", "failed"):
            return None
        return job

    async def _hand_back(self) -> None:
        if not self._deliveries:
            return
        _, running = await asyncio.wait(self._deliveries, timeout=self.stop_grace_s)
        handed = [self._deliveries[task] for task in running]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        for message_id, job_id, end, attempt in handed:
            self.metrics.count_webhook("handed_back")
            try:
                await self.store.requeue_webhook(message_id, job_id, end, attempt)
            except (*REDIS_ERRORS, REDIS_FULL) as exc:  # still pending: taken by another worker once this one's
                # name is let go (about 20 s), else after the claim timeout; a full Redis refuses the entry added
                log.warning("could not hand back the webhook of %s (%s)", job_id, exc)
        if handed:
            log.info("handed back %d webhook deliveries in progress", len(handed))


def _number(fields: dict, name: bytes, default: int) -> int:
    """A whole number from a stream entry's fields (``default`` where it is missing or not one)."""
    raw = fields.get(name, b"")
    return int(raw) if raw.isdigit() else default
