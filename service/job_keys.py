"""The Redis key schema of bulk jobs, in one place: the streams items and webhooks are queued on, and the keys of
a job's records (service.jobs writes and reads them; service.job_scripts' Lua scripts are handed them)."""

from __future__ import annotations

import hashlib
import re

from .job_types import ANONYMOUS, JobPriority

PREFIX = "batchasr"
ITEM_STREAM = f"{PREFIX}:items"  # XADD job=<id> index=<i>; consumer group GROUP (normal priority's items)
DEAD_LETTER_STREAM = f"{PREFIX}:items:dead"  # items that failed for good, with their last error
# XADD job=<id> in the same script that finishes a job with a webhook; consumer group GROUP delivers it
WEBHOOK_STREAM = f"{PREFIX}:webhooks"
# sorted set: a delivery waiting to be tried again ({"job", "end", "attempt"} JSON) -> when, in ms; put back on
# WEBHOOK_STREAM when due (the script PROMOTE_WEBHOOKS)
WEBHOOK_RETRIES_KEY = f"{PREFIX}:webhooks:later"
GROUP = "workers"
# each priority's item stream, in the order workers read them: the anonymous owner's (jobs submitted without API
# keys, or straight into Redis); another owner's items go on a stream of their own beside it (item_stream)
ITEM_STREAMS = {JobPriority.HIGH: f"{PREFIX}:items:high", JobPriority.NORMAL: ITEM_STREAM,
                JobPriority.LOW: f"{PREFIX}:items:low"}
OWNER_STREAM_MARK = ":owner:"  # an owner's stream is its priority's stream, this, and the owner
# hash: every owner's item stream -> its priority, written with each job's items (with the stream's group: the
# script OPEN_STREAM); workers read from each stream listed, and from every priority's own stream, never listed
OWNER_STREAMS_KEY = f"{PREFIX}:item-streams"
STREAMS_USED_KEY = f"{PREFIX}:item-streams:used"  # hash: owner's stream -> when it was last given items (ms)
# hash: owner's stream -> "ms:priority", unlisted then as idle and deleted a grace later (the script PRUNE_STREAMS)
RETIRED_STREAMS_KEY = f"{PREFIX}:item-streams:retired"
CONSUMER_NAME_KEY = PREFIX + ":consumer:{name}"  # string: the running instance that holds this consumer name (TTL)

JOB_KEY = PREFIX + ":job:{job_id}"  # hash: status, created_at, started_at, finished_at, total, n_<state>, ...
INPUTS_KEY = PREFIX + ":job:{job_id}:inputs"  # hash index -> JSON {"audio", "path" | "url" | "upload"}
STATES_KEY = PREFIX + ":job:{job_id}:states"  # hash index -> queued | in_progress | completed | failed | cancelled
ATTEMPTS_KEY = PREFIX + ":job:{job_id}:attempts"  # hash index -> deliveries started
ERRORS_KEY = PREFIX + ":job:{job_id}:errors"  # hash index -> last error
RESULTS_KEY = PREFIX + ":job:{job_id}:results"  # hash index -> result JSON, written once (HSETNX)
JOB_KEYS = (JOB_KEY, INPUTS_KEY, STATES_KEY, ATTEMPTS_KEY, ERRORS_KEY, RESULTS_KEY)  # a job's records, one TTL
UPLOAD_KEY = PREFIX + ":upload:{job_id}:{index}"  # audio bytes, with the input TTL
IDEMPOTENCY_KEY = PREFIX + ":idempotency:{key}"  # -> job id (the key prefixed with its owner, but for ANONYMOUS)
OWNER_JOBS_KEY = PREFIX + ":owner:{owner}:jobs"  # sorted set: the owner's job ids, scored by creation time
# hash: job id -> "items:ms", the owner's items counted against JOB_MAX_QUEUED_ITEMS while their job's transaction
# is under way (the script RESERVE_ITEMS; the transaction deletes its job's field as it queues the items)
RESERVED_KEY = PREFIX + ":owner:{owner}:reserved"
# INCR before a WAIT: a write on the waiting connection that follows the writes to confirm (JobStore.wait_replicas)
REPLICATION_MARK_KEY = f"{PREFIX}:replication-mark"
# what submit makes ("job_" and 24 of token_urlsafe's characters); a client's id is checked against it before it
# names a key, since `job_x:inputs` would read another hash
JOB_ID = re.compile(r"job_[A-Za-z0-9_-]{1,64}")


def owner_of(api_key: str) -> str:
    """The owner a key's jobs are kept under, and its streams named by: a hash of the key, so Redis never holds the
    key itself."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:24]


def item_stream(priority: JobPriority, owner: str) -> str:
    """The stream a job's items are queued on: one per priority and owner, so that workers can take each owner's
    share of a priority in turn (``JobStore.read_items``) and one owner's backfill does not hold up another's jobs.
    The anonymous owner's is the priority's own stream (the one every job used before owners had their own)."""
    if owner == ANONYMOUS:
        return ITEM_STREAMS[priority]
    return ITEM_STREAMS[priority] + OWNER_STREAM_MARK + owner


def stream_priority(stream: str) -> JobPriority:
    """The priority of the items ``stream`` holds (``KeyError`` for a stream that holds no items)."""
    return _PRIORITY_OF[stream.partition(OWNER_STREAM_MARK)[0]]


def stream_owner(stream: str) -> str:
    """The owner of the jobs whose items ``stream`` holds (an item stream's)."""
    return stream.partition(OWNER_STREAM_MARK)[2] or ANONYMOUS


_PRIORITY_OF = {stream: priority for priority, stream in ITEM_STREAMS.items()}
