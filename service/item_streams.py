"""The job items' streams in Redis (service.job_keys.item_stream: one per priority and owner): the workers'
consumer group on each, reading them the higher priorities' first and each owner's in turn, renewing and
reclaiming deliveries, and their upkeep (entries acknowledged trimmed, owners' idle streams pruned, gone consumers
forgotten). What the items are and what becomes of them is service.jobs'.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from .job_keys import (
    CONSUMER_NAME_KEY,
    GROUP,
    ITEM_STREAMS,
    OWNER_STREAMS_KEY,
    RETIRED_STREAMS_KEY,
    STREAMS_USED_KEY,
    WEBHOOK_STREAM,
    stream_priority,
)
from .job_scripts import (
    CLAIM_FROM_GONE,
    CLAIM_OWN_LEFT,
    FORGET_CONSUMERS,
    GROUP_COUNTS,
    HOLD_NAME,
    KEEP_CLAIMED,
    OPEN_STREAM,
    PRUNE_STREAMS,
    RELEASE_NAME,
    TRIM_ACKNOWLEDGED,
)
from .job_types import JobPriority
from .redis_outages import REDIS_FULL

MAX_CLAIM_LOOKS = 16  # XAUTOCLAIM calls one look for stalled deliveries may make (each sees 10 per one asked for)
STREAM_IDLE_S = 3600.0  # an owner's stream given no items this long, all of them acknowledged, is pruned
STREAM_GRACE_S = 60.0  # and deleted this long after workers stopped reading it (their reads block for 1 s at most)


@dataclass(frozen=True)
class Backlog:
    """Job items over every stream: ``waiting`` to be delivered to a consumer, ``delivered`` and not acknowledged
    yet (in a consumer's hands)."""

    waiting: int
    delivered: int

    @property
    def total(self) -> int:
        return self.waiting + self.delivered


class ItemStreams:
    """The item streams of one Redis, as the workers' consumer group sees them. Safe to share between tasks."""

    def __init__(self, client: aioredis.Redis):
        self.redis = client
        self._turn = 0  # which owner's stream a share of less than one each goes to first (fair_shares)
        self._keep_claimed = client.register_script(KEEP_CLAIMED)
        self._group_counts = client.register_script(GROUP_COUNTS)
        self._trim_acknowledged = client.register_script(TRIM_ACKNOWLEDGED)
        self._forget_consumers = client.register_script(FORGET_CONSUMERS)
        self._open_stream = client.register_script(OPEN_STREAM)
        self._prune_streams = client.register_script(PRUNE_STREAMS)
        self._hold_name = client.register_script(HOLD_NAME)
        self._claim_own_left = client.register_script(CLAIM_OWN_LEFT)
        self._claim_from_gone = client.register_script(CLAIM_FROM_GONE)
        self._release_name = client.register_script(RELEASE_NAME)

    async def ensure_group(self) -> None:
        """The consumer group on every item stream and the webhook stream (again after a Redis that lost them)."""
        await self._make_groups(await self._every_item_stream())

    async def _make_groups(self, streams: Collection[str]) -> None:
        """The consumer group on ``streams``, the priorities' own and the webhook stream, in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for stream in dict.fromkeys((*ITEM_STREAMS.values(), WEBHOOK_STREAM, *streams)):
            pipe.xgroup_create(stream, GROUP, id="0", mkstream=True)
        for reply in await pipe.execute(raise_on_error=False):
            # BUSYGROUP: there already; a full Redis refuses even that, and one that has lost the group says NOGROUP
            # to the next read, which asks again
            if isinstance(reply, Exception) and "BUSYGROUP" not in str(reply) and not isinstance(reply, REDIS_FULL):
                raise reply

    async def _open_stream_in(self, pipe: Any, stream: str) -> None:
        """Add to ``pipe`` (a transaction that then queues items on ``stream``) the script that makes the group on
        the stream and on the shared ones where they are not there, and lists an owner's stream for the workers: in
        the same atomic step as the items, so none is queued on a stream pruned as idle meanwhile, or on one workers
        do not read."""
        listed = "" if stream in ITEM_STREAMS.values() else stream_priority(stream).value
        await self._open_stream(keys=[stream, OWNER_STREAMS_KEY, STREAMS_USED_KEY, *ITEM_STREAMS.values(),
                                      WEBHOOK_STREAM], args=[GROUP, listed], client=pipe)

    async def item_streams(self) -> dict[JobPriority, list[str]]:
        """Every item stream, by priority in the order workers read them: the priority's own stream (the anonymous
        owner's), then each other owner's (one round trip)."""
        streams = {priority: [stream] for priority, stream in ITEM_STREAMS.items()}
        for stream, priority in sorted((await self.redis.hgetall(OWNER_STREAMS_KEY)).items()):
            with contextlib.suppress(ValueError):  # not one of ours: skipped rather than read
                streams[JobPriority(priority.decode())].append(stream.decode())
        return streams

    async def _every_item_stream(self) -> list[str]:
        return [stream for streams in (await self.item_streams()).values() for stream in streams]

    async def read_items(self, consumer: str, count: int, block_ms: int) -> list[tuple[str, bytes, dict]]:
        """Up to ``count`` new deliveries for ``consumer``, as (stream, message id, fields): the high priority's
        first, then normal's, then low's, and within a priority an equal share to each owner's stream with items
        waiting (``fair_shares``), so that one owner's backfill does not hold up another's job. With none waiting
        on any, waits up to ``block_ms`` for the first to come on any stream (taking up to count // streams from
        each, at least one: a few over a ``count`` below the streams'). Three round trips."""
        by_priority = await self.item_streams()
        streams = [stream for same_priority in by_priority.values() for stream in same_priority]
        waiting = await self._waiting(streams)
        shares: dict[str, int] = {}
        for same_priority in by_priority.values():  # the higher priorities' first
            shares |= fair_shares({stream: waiting[stream] for stream in same_priority if stream in waiting},
                                  count - sum(shares.values()), self._turn)
        self._turn += 1
        taken: list[tuple[str, bytes, dict]] = []
        if any(shares.values()):
            by_share: dict[int, list[str]] = {}
            for stream, share in shares.items():
                if share:
                    by_share.setdefault(share, []).append(stream)
            pipe = self.redis.pipeline(transaction=False)
            for share, names in by_share.items():  # XREADGROUP's COUNT is per stream: one call per share
                pipe.xreadgroup(GROUP, consumer, dict.fromkeys(names, ">"), count=share)
            for reply in await pipe.execute():
                taken += _deliveries(reply)
        if taken or block_ms <= 0:
            return taken
        per_stream = max(1, count // len(streams))
        return _deliveries(await self.redis.xreadgroup(GROUP, consumer, dict.fromkeys(streams, ">"),
                                                       count=per_stream, block=block_ms))

    async def _waiting(self, streams: list[str]) -> dict[str, int | None]:
        """How many items each stream holds not yet delivered to the workers' group: None where that is not known
        (Redis cannot count it; or the stream has no group, which the read then says), and no entry for a stream
        that does not exist."""
        return {stream: None if lag < 0 else lag for stream, (lag, _) in (await self._counts(streams)).items()}

    async def _counts(self, streams: list[str]) -> dict[str, tuple[int, int]]:
        """Each existing stream's (lag, pending) in the workers' group, in one round trip (GROUP_COUNTS: lag -1 where
        not known)."""
        if not streams:
            return {}
        counts = await self._group_counts(keys=streams, args=[GROUP])
        return {stream: (int(counts[2 * i]), int(counts[2 * i + 1])) for i, stream in enumerate(streams)
                if int(counts[2 * i]) != -2}

    async def streams_with_pending(self) -> list[str]:
        """The item streams holding deliveries not acknowledged yet, the higher priorities' first: where stalled
        ones may be (two round trips, rather than a look at every owner's stream)."""
        return [stream for stream, (_, pending) in (await self._counts(await self._every_item_stream())).items()
                if pending]

    async def ack_item(self, stream: str, message_id: bytes) -> None:
        await self.redis.xack(stream, GROUP, message_id)

    async def keep_claimed(self, stream: str, consumer: str, message_ids: list[bytes]) -> int:
        """Reset the idle time of deliveries ``consumer`` is still working on, so that an item that takes longer
        than the visibility timeout is not handed to another worker (and counted as another attempt). Those another
        consumer has reclaimed meanwhile stay its own. Returns how many were renewed."""
        if not message_ids:
            return 0
        return int(await self._keep_claimed(keys=[stream], args=[GROUP, consumer, *message_ids]))

    async def claim_stalled(self, stream: str, consumer: str, idle_s: float, count: int, start: bytes | str = "0-0"
                            ) -> tuple[bytes | str, list[tuple[bytes, dict]]]:
        """Up to ``count`` of ``stream``'s deliveries left unacknowledged ``idle_s`` or longer, now ``consumer``'s,
        looking from ``start`` to the end of the pending list (at most ``MAX_CLAIM_LOOKS`` calls); and where the next
        look goes on from ("0-0": the start again). Redis looks at ten entries per one asked for, so a consumer that
        looked once from the start would never reach a stalled delivery behind many live ones, and one that went on
        from there at its next look would pass over deliveries that had not stalled yet until it came round again.
        Entries trimmed away while pending are acknowledged (nothing is left to deliver)."""
        claimed: list[tuple[bytes, dict]] = []
        for _ in range(MAX_CLAIM_LOOKS):
            reply = await self.redis.xautoclaim(stream, GROUP, consumer, int(idle_s * 1000), start,
                                                count=count - len(claimed))
            for message_id in reply[2] if len(reply) > 2 else []:
                await self.redis.xack(stream, GROUP, message_id)
            claimed += [(message_id, fields) for message_id, fields in reply[1] if fields]
            start = reply[0]
            if start in (b"0-0", "0-0") or len(claimed) >= count:
                break
        return start, claimed

    async def hold_consumer_name(self, name: str, instance: str, lease_s: float) -> bool:
        """Whether ``name`` is ``instance``'s for the next ``lease_s`` (taken or renewed), or another running
        consumer's under the same name."""
        return bool(await self._hold_name(keys=[CONSUMER_NAME_KEY.format(name=name)],
                                          args=[instance, int(lease_s * 1000)]))

    async def release_consumer_name(self, name: str, instance: str) -> None:
        await self._release_name(keys=[CONSUMER_NAME_KEY.format(name=name)], args=[instance])

    async def claim_own_left(self, stream: str, consumer: str, count: int, held: Collection[bytes]
                             ) -> tuple[int, list[tuple[bytes, dict]]]:
        """Up to ``count`` of ``stream``'s deliveries to ``consumer`` that it does not hold: those its previous life
        left when it was killed (a container restarted in place keeps its host-pid name), claimed again at once,
        not after the visibility timeout (one step: CLAIM_OWN_LEFT); the webhook stream's too. Returns how many it
        found, and those claimed (not entries trimmed away meanwhile). The caller must hold the name
        (``hold_consumer_name``)."""
        found, entries = await self._claim_own_left(keys=[stream], args=[GROUP, consumer, count, *held])
        return int(found), [(message_id, _fields(flat)) for message_id, flat in entries]

    async def claim_from_gone(self, streams: list[str], consumer: str, count: int, idle_s: float
                              ) -> tuple[list[tuple[str, bytes, dict]], set[str]]:
        """Up to ``count`` deliveries, over ``streams`` in turn, to consumers that are gone (no running instance
        holds their name: ``hold_consumer_name``) and have been idle ``idle_s``, each delivery idle as long: claimed
        by ``consumer`` at once, not after the visibility timeout (one step: CLAIM_FROM_GONE). A worker replaced under
        a new name (a pod rescheduled) so loses no more than its lease's time. The entries claimed, as (stream,
        message id, fields), and the names they were taken from. ``idle_s`` must be past a name's lease: a running
        consumer renews it more often."""
        prefix = CONSUMER_NAME_KEY.format(name="")
        reply = await self._claim_from_gone(keys=streams, args=[GROUP, consumer, count, int(idle_s * 1000), prefix])
        claimed, names = [], set()
        for stream, entries, gone in reply:
            stream = stream.decode() if isinstance(stream, bytes) else stream
            claimed += [(stream, message_id, _fields(flat)) for message_id, flat in entries]
            names.update(name.decode(errors="replace") for name in gone)
        return claimed, names

    async def backlog(self) -> Backlog:
        """Items waiting, and delivered and not acknowledged, over every stream (two round trips: the streams, then
        GROUP_COUNTS; a lag not known counts none)."""
        counts = (await self._counts(await self._every_item_stream())).values()
        return Backlog(waiting=sum(max(lag, 0) for lag, _ in counts), delivered=sum(pending for _, pending in counts))

    async def stream_lag(self) -> int:
        """Items not yet delivered to a consumer plus those delivered and not acknowledged, over every stream."""
        return (await self.backlog()).total

    async def trim_acknowledged(self) -> int:
        """Drop the item and webhook streams' entries before the oldest one the workers have not acknowledged
        (TRIM_ACKNOWLEDGED); returns how many. Without this the item stream keeps an entry for every item ever
        submitted: 48 bytes each, about 0.5 GB of Redis memory per 10 M items. (Another consumer group on these
        streams would lose entries.) Two round trips, however many owners' streams there are."""
        streams = [*await self._every_item_stream(), WEBHOOK_STREAM]
        return int(await self._trim_acknowledged(keys=streams, args=[GROUP]))

    async def forget_gone_consumers(self, idle_s: float) -> int:
        """Delete the group's consumers that hold nothing and have been idle ``idle_s`` or longer: the names of
        workers gone (a restart is a new host-pid name), which would otherwise pile up in the group for good. One
        still alive loses nothing: it holds no delivery, and its next read makes it again. Returns how many. One
        round trip over every stream (FORGET_CONSUMERS), rather than one per stream and one per name deleted."""
        streams = [*await self._every_item_stream(), WEBHOOK_STREAM]
        return int(await self._forget_consumers(keys=streams, args=[GROUP, int(idle_s * 1000)]))

    async def prune_idle_streams(self, idle_s: float = STREAM_IDLE_S, grace_s: float = STREAM_GRACE_S
                                 ) -> tuple[int, int]:
        """Unlist the owners' streams given no items for ``idle_s``, all their items acknowledged, so that workers
        read them no more; delete those unlisted ``grace_s`` ago or more (longer than a worker's read can have one in
        hand) and not listed again since by a new job. A key's streams so cost the workers' reads only while it is
        in use (the next job makes them again). Returns (unlisted, deleted); one round trip."""
        retired, deleted = await self._prune_streams(keys=[OWNER_STREAMS_KEY, STREAMS_USED_KEY, RETIRED_STREAMS_KEY],
                                                     args=[GROUP, int(idle_s * 1000), int(grace_s * 1000)])
        return int(retired), int(deleted)


def fair_shares(waiting: dict[str, int | None], count: int, turn: int = 0) -> dict[str, int]:
    """How many of ``count`` items to read from each stream, given how many each holds (``waiting``; None: not
    known, so as many as it is given): equal shares, and what a stream holding fewer than its share leaves goes to
    the others in equal shares again (max-min fairness). Shares of less than one each go to the streams in turn,
    from the ``turn``-th on: a later read gives them to the next ones."""
    left = {stream: count if n is None else n for stream, n in waiting.items()}
    shares = dict.fromkeys(waiting, 0)
    open_ = [stream for stream, n in left.items() if n > 0]
    while open_ and count > 0:
        share = count // len(open_)
        if share == 0:  # fewer than one each: one each for the next ``count`` of them
            first = turn % len(open_)
            for stream in (open_[first:] + open_[:first])[:count]:
                shares[stream] += 1
            break
        for stream in open_:
            given = min(share, left[stream])
            shares[stream] += given
            left[stream] -= given
            count -= given
        open_ = [stream for stream in open_ if left[stream] > 0]
    return shares


def _fields(flat: list[bytes]) -> dict[bytes, bytes]:
    """A stream entry's fields as a script returns them, name and value in turn, as redis-py gives them: a dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _deliveries(reply: Any) -> list[tuple[str, bytes, dict]]:
    """XREADGROUP's reply as (stream, message id, fields) tuples."""
    return [(stream.decode() if isinstance(stream, bytes) else stream, message_id, fields)
            for stream, entries in reply or [] for message_id, fields in entries]
