"""What Redis going away looks like, and the loop a consumer runs so that it outlives that."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis._parsers.base import BaseParser
from redis.exceptions import OutOfMemoryError, ReadOnlyError, ResponseError

log = logging.getLogger(__name__)


class NoReplicasError(ResponseError):
    """NOREPLICAS: a primary run with ``min-replicas-to-write`` refusing writes while fewer replicas than that are in
    sync: it is cut off from them, or a failover has promoted one (the setting keeps a primary on the losing side of
    a failover from taking writes that the failover then drops)."""


class NotReplicatedError(aioredis.RedisError):
    """Writes the primary took that fewer replicas than the job store's ``wait_replicas`` confirmed in time: the
    replicas are behind or cut off, or a failover has promoted one. Not acknowledged, so the caller tries again
    (what it wrote may yet stay: a retried submission without an idempotency key may then make a second job)."""


class SubmissionUnconfirmed(aioredis.ConnectionError):
    """Redis went away as a job was written, and could not be asked whether the write was done: the job may be
    queued. A retry with the submission's idempotency key finds it if it is; the uploads written for it are left to
    their TTLs, not deleted (they may be its audio)."""


# redis-py has no class of its own for this reply (a plain ResponseError: a 500); parsed to ours, it is an outage
BaseParser.EXCEPTION_CLASSES.setdefault("NOREPLICAS", NoReplicasError)

# Redis unreachable, a replica refusing writes (a failover under way, or a URL that names a replica), or a primary
# without the replicas it is told to write to (refusing writes, or leaving them unconfirmed): all pass, and are
# waited out alike; nothing of a job is acknowledged while any lasts
REDIS_ERRORS = (aioredis.ConnectionError, aioredis.TimeoutError, ReadOnlyError, NoReplicasError, NotReplicatedError,
                ConnectionError, OSError)
REDIS_FULL = OutOfMemoryError  # Redis at its maxmemory (with noeviction, as a job store must be) refused a write
MAX_BACKOFF_S = 30.0  # the longest a consumer waits before trying an unreachable Redis again


async def step_until_stopped(stop: asyncio.Event, step: Callable[[], Awaitable[object]], what: str,
                             on_failure: Callable[[Exception], None] = lambda exc: None,
                             until: Callable[[], bool] = lambda: False) -> None:
    """Runs ``step`` until ``stop`` is set (or ``until()`` is true), outliving every failure: Redis unreachable,
    Redis refusing (full, read-only, a lost group) or a bug. A consumer that stopped would strand its stream,
    silently; so each failure is logged, handed to ``on_failure`` and waited out, from 1 s doubling to
    ``MAX_BACKOFF_S``, or less if ``stop`` is set meanwhile."""
    backoff_s, away = 1.0, False
    while not stop.is_set() and not until():
        try:
            await step()
            if away:  # the outage's end said, as its start was: a log that ends at "retrying" reads as still away
                log.info("%s: redis reachable again", what)
            backoff_s, away = 1.0, False
            continue
        except Exception as exc:
            away = away or isinstance(exc, REDIS_ERRORS)
            if isinstance(exc, REDIS_ERRORS):
                log.warning("%s: redis %s (%s); retrying in %.0f s", what, outage(exc), exc, backoff_s)
            elif isinstance(exc, aioredis.RedisError):
                log.warning("%s: redis refused (%s: %s); retrying in %.0f s", what, type(exc).__name__, exc,
                            backoff_s)
            else:
                log.exception("%s failed; retrying in %.0f s", what, backoff_s)
            on_failure(exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), backoff_s)
        backoff_s = min(MAX_BACKOFF_S, backoff_s * 2)


def group_lost(exc: Exception) -> bool:
    """Whether a consumer must make its group again: Redis was away (and may be back without its data) or said
    the group is not there."""
    return isinstance(exc, REDIS_ERRORS) or "NOGROUP" in str(exc)


def outage(exc: Exception) -> str:
    """What one of ``REDIS_ERRORS`` says of Redis, in a word or two."""
    if isinstance(exc, ReadOnlyError):
        return "read-only"
    if isinstance(exc, (NoReplicasError, NotReplicatedError)):
        return "without the replicas it writes to"
    return "unreachable"
