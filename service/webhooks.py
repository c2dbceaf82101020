"""Job-completion webhooks, signed the Standard Webhooks way (webhook-id, webhook-timestamp,
webhook-signature: ``v1,<base64 HMAC-SHA256 of "id.timestamp.body">``), with a thin payload: the receiver
fetches the results with a GET."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import time

import httpx

from .jobs import Job

log = logging.getLogger(__name__)

RETRY_DELAYS_S = (1.0, 2.0, 5.0, 10.0, 30.0)
RETRYABLE_STATUS = {408, 409, 425, 429}


def secret_bytes(secret: str) -> bytes:
    """A ``whsec_<base64>`` secret as Standard Webhooks defines it; any other string is used as is."""
    if secret.startswith("whsec_"):
        return base64.b64decode(secret.removeprefix("whsec_"))
    return secret.encode()


def sign(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    signed = f"{message_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret_bytes(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


class WebhookSender:
    def __init__(self, secret: str, timeout_s: float = 10.0, delays_s: tuple[float, ...] = RETRY_DELAYS_S):
        self.secret = secret
        self.timeout_s = timeout_s
        self.delays_s = delays_s

    async def job_finished(self, job: Job) -> bool:
        """POST ``transcription.job.completed``; retries on errors and 5xx; True once a 2xx comes back."""
        assert job.webhook_url
        message_id = f"msg_{job.id}_finished"  # stable: receivers deduplicate redeliveries on it
        body = json.dumps({"type": "transcription.job.completed", "created_at": time.time(),
                           "data": {"id": job.id, "status": job.status.value}}).encode()
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            for attempt, delay in enumerate((0.0, *self.delays_s)):
                await asyncio.sleep(delay)
                timestamp = int(time.time())
                headers = {"content-type": "application/json", "webhook-id": message_id,
                           "webhook-timestamp": str(timestamp),
                           "webhook-signature": sign(self.secret, message_id, timestamp, body)}
                try:
                    response = await client.post(job.webhook_url, content=body, headers=headers)
                except httpx.HTTPError as exc:
                    log.warning("webhook for %s failed (attempt %d): %s", job.id, attempt + 1, exc)
                    continue
                if response.is_success:
                    return True
                if response.status_code < 500 and response.status_code not in RETRYABLE_STATUS:
                    log.warning("webhook for %s refused with %d; not retried", job.id, response.status_code)
                    return False
        log.warning("webhook for %s gave up after %d attempts", job.id, len(self.delays_s) + 1)
        return False
