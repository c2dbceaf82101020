"""Delivers finished jobs' completion webhooks, at least once, whatever happens to the worker that finished them.

The script that finishes a job with a webhook also queues its delivery on the webhook stream, read by the
workers' consumer group as the items are. A delivery is acknowledged in the transaction that records its
outcome on the job; one a worker dropped (killed mid-delivery) is reclaimed after ``CLAIM_IDLE_S``; one a
stopping worker had in hand is queued again at once. A receiver may therefore get a message twice: its
``webhook-id`` stays the same, for the receiver to drop the second, as Standard Webhooks asks of receivers.

A job whose failed items are retried ends again, and owes a webhook again: each delivery names the end it
announces (the job's ``ends`` then), and one whose job has ended again since, or is in progress again, is dropped
unsent: the later end has its own.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from .intervals import Periodic
from .job_keys import GROUP, WEBHOOK_STREAM
from .job_types import Job, JobNotFound
from .jobs import JobStore
from .redis_outages import REDIS_ERRORS, REDIS_FULL, group_lost, step_until_stopped
from .webhooks import Delivery, WebhookSender

log = logging.getLogger(__name__)

CLAIM_IDLE_S = 300.0  # longer than one delivery can take: 6 attempts of at most 10 s each, and 48 s of pauses
STOP_GRACE_S = 5.0  # a stopping worker lets deliveries run this long, then hands the rest back
IN_FLIGHT = 32  # deliveries at once, per worker
NO_SECRET = "the worker that took the delivery cannot sign webhooks (it has no BATCHASR_WEBHOOK_SECRET)"


class WebhookMetrics(Protocol):
    def count_webhook(self, outcome: str) -> None: ...


class WebhookWorker:
    """One consumer's share of the webhook stream. ``sender`` None: deliveries are recorded as failed, with why."""

    def __init__(self, store: JobStore, sender: WebhookSender | None, name: str, metrics: WebhookMetrics,
                 in_flight: int = IN_FLIGHT,
                 claim_idle_s: float = CLAIM_IDLE_S, reclaim_interval_s: float = 5.0,
                 stop_grace_s: float = STOP_GRACE_S):
        self.store = store
        self.sender = sender
        self.name = name
        self.metrics = metrics
        self.in_flight = in_flight
        self.claim_idle_s = claim_idle_s
        self.stop_grace_s = stop_grace_s
        self._deliveries: dict[asyncio.Task, tuple[bytes, str, int]] = {}  # task -> (stream entry, job id, end)
        self.reclaim_interval_s = reclaim_interval_s
        self._reclaim = Periodic()
        self._group_ready = False
        self._reclaim_from: bytes | str = "0-0"  # where the next look for stalled deliveries goes on

    async def run(self, stop: asyncio.Event, block_ms: int = 1000) -> None:
        """Deliver until ``stop`` is set; then give deliveries in progress ``stop_grace_s`` and hand back the rest."""
        await step_until_stopped(stop, lambda: self.step(block_ms), "webhook deliveries", self._failed)
        await self._hand_back()

    def _failed(self, exc: Exception) -> None:
        self._group_ready = self._group_ready and not group_lost(exc)

    async def close(self) -> None:
        """Release the sender's connections (after ``run`` or ``drain``)."""
        if self.sender is not None:
            await self.sender.close()

    async def drain(self) -> None:
        """Burst mode (tests, one-off runs): deliver until the stream has nothing left for this consumer."""
        while await self.step(block_ms=100) or self._deliveries:
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
            raw_end = fields.get(b"end", b"")
            end = int(raw_end) if raw_end.isdigit() else 0  # 0: queued before a job's ends were counted
            task = asyncio.create_task(self._deliver(message_id, job_id, end))
            self._deliveries[task] = (message_id, job_id, end)
            task.add_done_callback(self._deliveries.pop)
        return len(entries)

    async def _reclaim_stalled(self, count: int) -> list[tuple[bytes, dict]]:
        self._reclaim_from, claimed = await self.store.claim_stalled(WEBHOOK_STREAM, self.name, self.claim_idle_s,
                                                                     count, self._reclaim_from)
        if claimed:
            log.info("reclaimed %d webhook deliveries from stalled consumers", len(claimed))
        return claimed

    async def _deliver(self, message_id: bytes, job_id: str, end: int) -> None:
        try:
            job = await self._owed(job_id, end)
            if job is None:
                await self.store.ack_webhook(message_id)
                return
            if self.sender is None:
                delivery = Delivery(False, 0, NO_SECRET)
            else:  # asked again before each retry: the job may be deleted, or end again, in the pauses
                delivery = await self.sender.job_finished(job, end, lambda: self._still_owed(job_id, end))
            if delivery.dropped:
                await self.store.ack_webhook(message_id)
                self.metrics.count_webhook("dropped")
                return
            await self.store.record_webhook(job.id, end, message_id, delivery.delivered, delivery.attempts,
                                            delivery.error)
            self.metrics.count_webhook("delivered" if delivery.delivered else "failed")
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

    async def _still_owed(self, job_id: str, end: int) -> bool:
        """Before a retry: Redis unreachable counts as owed (the POST is what matters; its outcome waits)."""
        try:
            return await self._owed(job_id, end) is not None
        except REDIS_ERRORS:
            return True

    async def _hand_back(self) -> None:
        if not self._deliveries:
            return
        _, running = await asyncio.wait(self._deliveries, timeout=self.stop_grace_s)
        handed = [self._deliveries[task] for task in running]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        for message_id, job_id, end in handed:
            self.metrics.count_webhook("handed_back")
            try:
                await self.store.requeue_webhook(message_id, job_id, end)
            except REDIS_ERRORS as exc:  # still pending: reclaimed after the claim timeout
                log.warning("could not hand back the webhook of %s (%s)", job_id, exc)
        if handed:
            log.info("handed back %d webhook deliveries in progress", len(handed))
