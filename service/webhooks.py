"""Job-completion webhooks, signed the Standard Webhooks way (webhook-id, webhook-timestamp,
webhook-signature: ``v1,<base64 HMAC-SHA256 of "id.timestamp.body">``), with a thin payload: the receiver
fetches the results with a GET. Each API key's webhooks are signed with a secret of its own (``owner_secret``).

Where they may go (service.url_rules): under ``BATCHASR_WEBHOOK_URL_PREFIXES`` when the server has any, else to
public addresses only, checked when the job is submitted and again as each delivery connects. Redirects are not
followed: a 3xx answer fails the delivery like any other refusal.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import random
import time
from dataclasses import dataclass

import aiohttp

from .job_types import ANONYMOUS, Job
from .url_rules import (
    NoPublicAddress,
    PublicAddressResolver,
    UrlRefused,
    check_public_url,
    check_under_prefixes,
    retry_after_s,
)

log = logging.getLogger(__name__)

# after each failed attempt, the wait before the next (a receiver down for a deploy, or a night, still gets it:
# about 11 hours in all, as Standard Webhooks' providers retry), each drawn within JITTER of it so that the
# webhooks an outage held back do not all come back at one moment
RETRY_DELAYS_S = (5.0, 30.0, 120.0, 600.0, 1800.0, 3600.0, 3 * 3600.0, 6 * 3600.0)
JITTER = 0.2
MAX_RETRY_AFTER_S = 6 * 3600.0  # a receiver's Retry-After is taken up to this
RETRYABLE_STATUS = {408, 409, 425, 429}
CONNECTIONS = 32  # to receivers, per consumer


MIN_SECRET_BYTES = 24  # Standard Webhooks' least


def secret_bytes(secret: str) -> bytes:
    """A ``whsec_<base64>`` secret as Standard Webhooks defines it, the prefix optional, decoded as its libraries
    decode it: a secret used as its own bytes made signatures no receiver's library could verify. ``ValueError``
    for one that is not base64, or shorter than ``MIN_SECRET_BYTES``."""
    decoded = base64.b64decode(secret.strip().removeprefix("whsec_"), validate=True)
    if len(decoded) < MIN_SECRET_BYTES:
        raise ValueError(f"it decodes to {len(decoded)} bytes; at least {MIN_SECRET_BYTES}")
    return decoded


def owner_secret(secret: str, owner: str) -> str:
    """The secret an owner's webhooks are signed with: the server's own for the anonymous owner (no API keys, or a
    job submitted straight into Redis); for an API key's owner one drawn from it and the owner (HMAC-SHA256), so
    that each key verifies its own webhooks and no key's holder can sign one another key's receiver would take.
    ``GET /v1/webhooks/secret`` gives a key its own."""
    if owner == ANONYMOUS:
        return secret
    drawn = hmac.new(secret_bytes(secret), b"batchasr webhook secret " + owner.encode(), hashlib.sha256).digest()
    return "whsec_" + base64.b64encode(drawn).decode()


def sign(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    signed = f"{message_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret_bytes(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def check_webhook_url(url: str, prefixes: list[str]) -> None:
    """Refuse (UrlRefused) a webhook URL this server would not post to: one outside ``prefixes`` when there are
    any, else one at an address that is not public."""
    if prefixes:
        check_under_prefixes(url, prefixes, "webhook URL")
    else:
        check_public_url(url)


@dataclass(frozen=True)
class Attempt:
    """How one attempt at a job's webhook went: delivered (a 2xx came back), or not and why, with the wait before
    the next attempt (None: there is none, the receiver refused or the retries have run out)."""

    delivered: bool
    error: str | None = None
    retry_in_s: float | None = None


class WebhookSender:
    """Posts job-completion webhooks for one consumer, over one connection pool, an attempt at a time: the worker
    waits out the pause between attempts in Redis (service.webhook_worker), not in a delivery slot. ``close`` when
    done."""

    def __init__(self, secret: str, url_prefixes: list[str] | None = None, timeout_s: float = 10.0,
                 delays_s: tuple[float, ...] = RETRY_DELAYS_S):
        self.secret = secret
        self.url_prefixes = url_prefixes or []
        self.timeout_s = timeout_s
        self.delays_s = delays_s
        self._session: aiohttp.ClientSession | None = None  # made on the event loop, at the first delivery

    async def attempt(self, job: Job, end: int = 0, attempt: int = 1) -> Attempt:
        """POST ``transcription.job.completed`` for the job's ``end`` (0: its ``ends`` now), the ``attempt``-th
        time. Connection errors, timeouts, 5xx and the statuses that ask for it are retried, after the schedule's
        wait or the receiver's Retry-After, while the schedule lasts."""
        assert job.webhook_url
        try:
            check_webhook_url(job.webhook_url, self.url_prefixes)  # again here: the rules may have changed
        except UrlRefused as exc:
            log.warning("webhook for %s refused: %s", job.id, exc)
            return Attempt(False, str(exc))
        # stable: receivers deduplicate redeliveries on it; a job that ends again after a retry is news again
        end = end or job.ends
        message_id = f"msg_{job.id}_finished" + (f"_{end}" if end > 1 else "")
        body = json.dumps({"type": "transcription.job.completed", "created_at": time.time(),
                           "data": {"id": job.id, "status": job.status.value}}).encode()
        retry_after_s = None
        try:
            status, reason, retry_after_s = await self._post(job.webhook_url, job.owner, message_id, body)
        except aiohttp.ClientConnectorError as exc:
            if isinstance(exc.os_error, NoPublicAddress):
                log.warning("webhook for %s refused: %s", job.id, exc.os_error)
                return Attempt(False, str(exc.os_error))
            error = f"{type(exc).__name__}: {exc}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            # a timeout's own says nothing (it was recorded as "TimeoutError: ")
            detail = str(exc) or (f"no answer within {self.timeout_s:g} s" if isinstance(exc, TimeoutError)
                                  else "no detail")
            error = f"{type(exc).__name__}: {detail}"
        else:
            if 200 <= status < 300:
                return Attempt(True)
            error = f"HTTP {status} {reason}"
            if status < 500 and status not in RETRYABLE_STATUS:  # 3xx too: redirects are not followed
                log.warning("webhook for %s refused with %s; not retried", job.id, error)
                return Attempt(False, error)
        if attempt > len(self.delays_s):
            log.warning("webhook for %s gave up after %d attempts: %s", job.id, attempt, error)
            return Attempt(False, error)
        wait_s = self.delays_s[attempt - 1] * random.uniform(1 - JITTER, 1 + JITTER)
        if retry_after_s is not None:
            wait_s = max(wait_s, min(retry_after_s, MAX_RETRY_AFTER_S))
        log.warning("webhook for %s failed (attempt %d): %s; next in %.0f s", job.id, attempt, error, wait_s)
        return Attempt(False, error, wait_s)

    async def _post(self, url: str, owner: str, message_id: str, body: bytes) -> tuple[int, str, float | None]:
        """The answer's status, reason and Retry-After (in seconds, where it gives them)."""
        if self._session is None:
            # with no prefixes, names resolve to public addresses only, at the connection that uses them
            resolver = None if self.url_prefixes else PublicAddressResolver()
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=CONNECTIONS, resolver=resolver),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        timestamp = int(time.time())
        headers = {"content-type": "application/json", "webhook-id": message_id, "webhook-timestamp": str(timestamp),
                   "webhook-signature": sign(owner_secret(self.secret, owner), message_id, timestamp, body)}
        async with self._session.post(url, data=body, headers=headers, allow_redirects=False) as response:
            return response.status, response.reason or "", retry_after_s(response.headers.get("retry-after"))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

