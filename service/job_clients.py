"""The job commands' clients: of a batchasr server's /v1/jobs (``ServerClient``) or of Redis itself
(``RedisClient``), alike to their callers, and the riding out of an outage of either (``Outage``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

import httpx
import redis.asyncio as aioredis

from .job_types import ANONYMOUS, MAX_QUEUED_ITEMS_HEADER, JobNotFound, JobOptions, JobStatus, deleted_job
from .jobs import JobStore
from .logs import redacted_url
from .redis_outages import REDIS_ERRORS
from .stretch_upload import stretch_upload
from .submit_inputs import Input, item_input, json_item, sent_as_json

JobAction = Literal["cancel", "purge", "retry"]  # what `batchasr jobs` may do to jobs instead of listing them
T = TypeVar("T")

# how long submit rides out a server or Redis it cannot reach or that refuses for now (a Redis restart or failover, a
# front end restarting), submitting or following its jobs, before it gives up: jobs submitted go on regardless
WAIT_OUTAGE_S = 300.0
OUTAGE_STATUSES = (502, 503, 504)  # a server's answers that say it, or its Redis, is away for now
OUTAGE_ERRORS = (httpx.TransportError, httpx.HTTPStatusError, *REDIS_ERRORS)  # what submit rides out


class RedisUnreached(aioredis.ConnectionError):
    """No connection to Redis could be made at all."""


# a first try that meets one of these has reached nothing: a wrong address most likely, said at once
NOTHING_THERE = (httpx.ConnectError, RedisUnreached)


class NoSuchJob(ValueError):
    """A job that is not there: it expired, was purged, or is another API key's."""


class AtQueuedLimit(Exception):
    """The key has as many items queued as the server lets one key have (429 ``too_many_queued_items``): the job
    fits once some are done, ``retry_after_s`` from now or later."""

    def __init__(self, reason: str, retry_after_s: float):
        super().__init__(reason)
        self.retry_after_s = retry_after_s


class NeverFits(ValueError):
    """A job of more items than the server lets one key have queued at once (413 ``too_many_items`` with the
    limit in ``MAX_QUEUED_ITEMS_HEADER``): it fits as jobs of at most ``limit`` items."""

    def __init__(self, reason: str, limit: int):
        super().__init__(reason)
        self.limit = limit


def _no_such_job(job_id: str) -> NoSuchJob:
    return NoSuchJob(f"{job_id}: no such job (it expired or was purged)")


def _raise_at_queued_limit(response: httpx.Response) -> None:
    if response.status_code == 429:
        raise AtQueuedLimit(response.json()["error"]["message"], float(response.headers.get("Retry-After", 30)))


def _raise_for_missing_job(response: httpx.Response, job_id: str) -> None:
    """A job that is gone (expired, purged) is the job's news, not a server that cannot be reached."""
    if response.status_code == 404:
        raise _no_such_job(job_id)
    response.raise_for_status()


class ServerClient:
    def __init__(self, url: str, api_key: str | None):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=300)

    async def submit(self, inputs: list[Input], idempotency_key: str | None, options: JobOptions) -> dict[str, Any]:
        """Files (and stretches) as multipart uploads; URLs and workers' paths as a JSON job (the server fetches or
        reads them)."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        sent = [source for source in inputs if sent_as_json(source)]
        fields = {"webhook_url": options.webhook_url, "priority": options.priority.value,
                  "multichannel": options.multichannel, "skip_silence": options.skip_silence}
        if sent:  # split_into_jobs keeps them apart from uploads
            items = [json_item(s) for s in sent]
            body = {"items": items, **fields, "channel_names": list(options.channel_names),
                    "hotwords": list(options.hotwords)}
            response = await self.http.post("/v1/jobs", json=body, headers=headers)
        else:
            with contextlib.ExitStack() as files:  # streamed from disk, not read into memory first
                parts = [("files", (p.name, files.enter_context(open(p, "rb")), "application/octet-stream")
                          if isinstance(p, Path) else stretch_upload(p, options.multichannel))
                         for p in inputs if not sent_as_json(p)]
                # the flags as the form reads them (true/false); the webhook URL as given: lowercased, a receiver's
                # path or token (Hook?token=AbC) was another, and its answer (a 404) was never retried
                form = {name: str(value).lower() if isinstance(value, bool) else str(value)
                        for name, value in fields.items() if value is not None}
                if options.channel_names:
                    form["channel_names"] = ",".join(options.channel_names)
                if options.hotwords:
                    form["hotwords"] = ",".join(options.hotwords)
                response = await self.http.post("/v1/jobs", files=parts, data=form, headers=headers)
        _raise_at_queued_limit(response)
        if response.status_code == 413 and (limit := response.headers.get(MAX_QUEUED_ITEMS_HEADER, "")).isdigit():
            raise NeverFits(response.json()["error"]["message"], int(limit))
        if response.is_client_error:  # the server's reason (a URL it does not take, ...), not just the status
            raise ValueError(f"the server refused the job: {response.json()['error']['message']}")
        response.raise_for_status()
        return response.json()

    async def get(self, job_id: str) -> dict[str, Any]:
        response = await self.http.get(f"/v1/jobs/{job_id}")
        _raise_for_missing_job(response, job_id)
        return response.json()

    async def act(self, job_id: str, action: JobAction) -> dict[str, Any]:
        if action == "retry":
            response = await self.http.post(f"/v1/jobs/{job_id}/retry")
        else:
            purge = {"purge": "true"} if action == "purge" else {}
            response = await self.http.delete(f"/v1/jobs/{job_id}", params=purge)
        if response.status_code == 404:
            raise _no_such_job(job_id)
        _raise_at_queued_limit(response)  # a retry with no room for any of the failed items
        if response.is_client_error:
            raise ValueError(f"{job_id}: {response.json()['error']['message']}")
        response.raise_for_status()
        return response.json()

    async def results(self, job_id: str, start: int = 0) -> AsyncIterator[dict[str, Any]]:
        async with self.http.stream("GET", f"/v1/jobs/{job_id}/results", params={"start": start}) as response:
            _raise_for_missing_job(response, job_id)  # by its status: the body is not read
            async for line in response.aiter_lines():
                if line:
                    yield json.loads(line)

    async def list_jobs(self, limit: int, after: str | None, status: str | None) -> tuple[list[dict[str, Any]], bool]:
        page = await self._list({"limit": limit, **({"after": after} if after else {}),
                                 **({"status": status} if status else {})})
        return page["data"], page["has_more"]

    async def room(self) -> tuple[int, int | None]:
        """The key's items queued or in progress, as the queued-items limit counts them, and that limit (None: none):
        every page of the list says them."""
        page = await self._list({"limit": 1})
        return page["queued_items"], page["max_queued_items"]

    async def _list(self, params: dict[str, Any]) -> dict[str, Any]:
        response = await self.http.get("/v1/jobs", params=params)
        if response.is_client_error:
            raise ValueError(response.json()["error"]["message"])
        response.raise_for_status()
        return response.json()

    async def close(self) -> None:
        await self.http.aclose()


class RedisClient:
    def __init__(self, url: str):
        self.store = JobStore.from_url(url)
        self.reached = False

    async def _reach(self) -> None:
        """Raise ``RedisUnreached`` if Redis cannot be reached at all. redis-py says ConnectionError alike for a
        connection refused and for one lost half-way through a command (a restart, a failover): a first submission cut
        off so was taken for a wrong address and ended the command, though its job may have been written."""
        if self.reached:
            return
        try:
            await self.store.redis.ping()
        except aioredis.ConnectionError as exc:
            raise RedisUnreached(str(exc)) from exc
        self.reached = True

    async def submit(self, inputs: list[Input], idempotency_key: str | None, options: JobOptions) -> dict[str, Any]:
        await self._reach()
        # the workers check the webhook URL against their own settings when they post (and record a refusal)
        job, _ = await self.store.submit([item_input(source, options.multichannel) for source in inputs],
                                         idempotency_key, options)
        return job.to_dict()

    async def get(self, job_id: str) -> dict[str, Any]:
        await self._reach()
        try:
            return (await self.store.get(job_id)).to_dict()
        except JobNotFound as exc:
            raise _no_such_job(job_id) from exc

    async def act(self, job_id: str, action: JobAction) -> dict[str, Any]:
        # straight in Redis, any job: whoever reaches Redis runs the store
        await self._reach()
        try:
            if action == "purge":
                await self.store.delete(job_id)
                return deleted_job(job_id)
            if action == "retry":
                return (await self.store.retry_failed(job_id)).to_dict()
            job, _ = await self.store.cancel(job_id)  # straight in Redis: no process to count it in
            return job.to_dict()
        except JobNotFound as exc:
            raise _no_such_job(job_id) from exc

    async def results(self, job_id: str, start: int = 0) -> AsyncIterator[dict[str, Any]]:
        try:
            async for record in self.store.iter_results(job_id, start=start):
                yield record
        except JobNotFound as exc:
            raise _no_such_job(job_id) from exc

    async def list_jobs(self, limit: int, after: str | None, status: str | None) -> tuple[list[dict[str, Any]], bool]:
        await self._reach()
        try:  # straight from Redis: the jobs submitted without an API key
            jobs, more = await self.store.list_jobs(ANONYMOUS, limit, after, JobStatus(status) if status else None)
        except JobNotFound as exc:
            raise ValueError(f"no job {after} in the list") from exc
        return [job.to_dict() for job in jobs], more

    async def room(self) -> tuple[int, int | None]:
        # no limit: the queued-items limit is the API's, and straight to Redis is the operator's way in
        await self._reach()
        return await self.store.queued_items(ANONYMOUS), None

    async def close(self) -> None:
        await self.store.close()


JobClient = ServerClient | RedisClient


def client_for(redis_url: str | None, server: str | None, api_key: str | None) -> JobClient:
    """A client of the server where one is named, else of Redis."""
    return ServerClient(server, api_key) if server else RedisClient(redis_url or "")


class Outage:
    """A server or Redis that cannot be reached, or refuses for now, while the jobs are submitted or followed: tried
    again with backoff for up to ``WAIT_OUTAGE_S``: a poll that met a Redis restart ended the wait (and lost the
    results' output) while the job went on, and a submission that met a failover ended the command."""

    def __init__(self, doing: str = "following the jobs") -> None:
        self.doing = doing
        self.deadline, self.backoff_s, self.tries = time.monotonic() + WAIT_OUTAGE_S, 1.0, 0

    async def ride_out(self, exc: Exception) -> None:
        """Wait before the next try, or raise ``exc``: it is not an outage, or the outage lasted too long."""
        away = not isinstance(exc, httpx.HTTPStatusError) or exc.response.status_code in OUTAGE_STATUSES
        if not away or time.monotonic() + self.backoff_s > self.deadline:
            raise exc
        print(f"\nwarning: {self.doing}: {said(exc)}; trying again in {self.backoff_s:.0f} s", file=sys.stderr)
        await asyncio.sleep(self.backoff_s)
        self.backoff_s, self.tries = min(2 * self.backoff_s, 30.0), self.tries + 1


def said(exc: Exception) -> str:
    """The error, with the address httpx's messages leave out ("All connection attempts failed"); Redis's name
    theirs."""
    try:
        url = exc.request.url  # type: ignore[attr-defined]  # an httpx error knows the request it failed
    except (AttributeError, RuntimeError):
        return str(exc)
    return f"{exc} ({redacted_url(str(url.copy_with(query=None)))})"


async def riding_out(call: Callable[[], Awaitable[T]], doing: str = "following the jobs",
                     unreached_ends: bool = False) -> T:
    """``call()``, tried again through an outage (``Outage``); with ``unreached_ends``, not after a first try that
    reached nothing at all (``NOTHING_THERE``)."""
    outage = Outage(doing)
    while True:
        try:
            return await call()
        except OUTAGE_ERRORS as exc:
            if unreached_ends and outage.tries == 0 and isinstance(exc, NOTHING_THERE):
                raise
            await outage.ride_out(exc)


async def job_records(client: JobClient, job_id: str, total_items: int) -> AsyncIterator[dict[str, Any]]:
    """A job's results, one per item in item order, as they stream in (a job of 100,000 items was a list of results
    in memory first: 12 KB each as Python objects). Through an outage they are fetched again from the first not
    given yet (they were fetched from the start, and a job's first 99,000 results again for its last 1,000).
    ValueError if there are not ``total_items`` of them."""
    given, outage = 0, Outage()
    while True:
        try:
            async with contextlib.aclosing(client.results(job_id, given)) as records:
                async for record in records:
                    if given == total_items:
                        raise ValueError(f"job {job_id}: more results than its {total_items} items")
                    given += 1
                    yield record
            break
        except OUTAGE_ERRORS as exc:
            await outage.ride_out(exc)
    if given != total_items:
        raise ValueError(f"job {job_id}: {given} results for its {total_items} items")


async def results_in_order(client: JobClient, job_id: str, sources: list[Input]
                           ) -> AsyncIterator[tuple[Input, dict[str, Any]]]:
    """Each of a job's items (``sources``, as submitted) with its result, as they stream in (``job_records``)."""
    async with contextlib.aclosing(job_records(client, job_id, len(sources))) as records:
        index = 0
        async for record in records:
            yield sources[index], record
            index += 1
