"""`batchasr worker` (a job consumer for scale-out) and `batchasr submit` (a bulk job from files, URLs or a manifest's
stretches of files)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TextIO, TypeVar

import httpx
import redis.asyncio as aioredis

from models.audio_io import AudioClip, find_audio_files

from .config import Settings
from .job_types import ANONYMOUS, ItemInput, JobNotFound, JobOptions, JobStatus
from .jobs import JSON_JOB_BYTES, MAX_JOB_ITEMS, JobStore
from .line_output import cannot_write
from .logs import redacted_url
from .output_files import is_url
from .redis_outages import REDIS_ERRORS, REDIS_FULL
from .stretch_upload import stretch_upload, stretch_upload_size

log = logging.getLogger(__name__)
JobAction = Literal["cancel", "purge", "retry"]  # what `batchasr jobs` may do to jobs instead of listing them
T = TypeVar("T")

JOB_BYTES = 256 * 1024 * 1024  # uploads per job by default: well under a server's MAX_JOB_UPLOAD_BYTES (1 GiB)
JSON_FIELDS_ROOM = 1 << 20  # of a JSON job's body, left for its fields beside the items (webhook, hotwords, ...)
SIZE_SUFFIXES = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}
FINAL_STATUSES = {"completed", "completed_with_errors", "failed", "cancelled"}
# how long submit rides out a server or Redis it cannot reach or that refuses for now (a Redis restart or failover, a
# front end restarting), submitting or following its jobs, before it gives up: jobs submitted go on regardless
WAIT_OUTAGE_S = 300.0
OUTAGE_STATUSES = (502, 503, 504)  # a server's answers that say it, or its Redis, is away for now
OUTAGE_ERRORS = (httpx.TransportError, httpx.HTTPStatusError, *REDIS_ERRORS)  # what submit rides out
# a first try that meets one of these has reached nothing: a wrong address most likely, said at once
NOTHING_THERE = (httpx.ConnectError, aioredis.ConnectionError)


# --- worker -------------------------------------------------------------------------------------------------


async def run_worker(settings: Settings, metrics_port: int | None) -> int:
    from models.asr_model import load_model

    from .runtime import build_stack

    model = await asyncio.to_thread(load_model, settings.model, settings.device, settings.dtype,
                                    settings.attention_kernel)
    stack = build_stack(settings, model)
    if not await asyncio.to_thread(stack.engine.wait_ready):
        log.error("engine failed: %s", stack.engine.error)
        await stack.stop()
        return 1
    if metrics_port:
        from prometheus_client import start_http_server

        start_http_server(metrics_port, registry=stack.metrics.registry)
    loop_cpu = asyncio.create_task(stack.metrics.count_event_loop_cpu())  # the consumer's loop: no scrape runs on it
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stack.request_stop)
    log.info("worker consuming jobs from %s", redacted_url(settings.redis_url or ""))
    stack.start_consumer()
    await stack.wait_consumer()  # returns after a stop signal, with the items in hand finished and acked
    loop_cpu.cancel()
    await stack.stop()
    if stack.engine.failed:  # the consumer stopped taking items; a new process may find the device working
        log.error("worker stopped: the engine failed: %s", stack.engine.error)
        return 1
    log.info("worker stopped")
    return 0


# --- submit -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerPath:
    """A file (or a stretch of it) the workers read from their own disk, under their input roots: its path is sent,
    not its bytes (``submit --paths``: a filesystem the submitter and the workers share)."""

    clip: AudioClip

    def __str__(self) -> str:
        return str(self.clip)

    def item(self) -> dict[str, Any]:
        """The JSON job item (POST /v1/jobs)."""
        item: dict[str, Any] = {"path": str(self.clip.path.resolve())}
        if not self.clip.whole:
            item.update(offset=self.clip.offset_s, duration=self.clip.duration_s)
        return item


# a local file, an http(s) URL the workers fetch, a stretch of a local file, or a file the workers read themselves
Input = Path | str | AudioClip | WorkerPath


def collect_audio(paths: list[str], url_lists: Sequence[str] = ()) -> list[Input]:
    """Files as given, audio files found under directories (sorted, recursively), URLs as given, and the URLs
    listed one a line in each of ``url_lists`` (``-``: standard input; blank lines and ``#`` comments skipped)."""
    found: list[Input] = []
    for raw in paths:
        found += [raw] if is_url(raw) else find_audio_files([raw])
    for listing in url_lists:
        text = sys.stdin.read() if listing == "-" else Path(listing).read_text(encoding="utf-8")
        for number, line in enumerate(text.splitlines(), start=1):
            line = line.strip()
            if line and not line.startswith("#"):
                if not is_url(line):
                    raise ValueError(f"{listing}:{number}: not an http(s) URL: {line[:200]}")
                found.append(line)
    return found


def parse_size(text: str) -> int:
    """Bytes from ``1048576``, ``512K``, ``256M`` or ``1G`` (binary multiples)."""
    number, suffix = (text[:-1], text[-1].upper()) if text[-1:].isalpha() else (text, "")
    if suffix not in SIZE_SUFFIXES or not number.isdigit() or int(number) < 1:
        raise ValueError(f"{text!r}: give a size as a number of bytes, or with K, M or G")
    return int(number) * SIZE_SUFFIXES[suffix]


def split_into_jobs(inputs: list[Input], max_bytes: int, multichannel: bool = False,
                    max_items: int = MAX_JOB_ITEMS) -> list[list[Input]]:
    """Runs of consecutive inputs whose uploads total at most ``max_bytes`` (a file larger than that goes alone),
    of at most ``max_items`` inputs, files and URLs in separate runs: each run one job, in input order. URLs and
    workers' paths count their JSON items' bytes, and their jobs' bodies stay within the server's JSON_JOB_BYTES."""
    jobs: list[list[Input]] = []
    size = 0
    for source in inputs:
        as_json = sent_as_json(source)
        n = len(json.dumps(json_item(source))) + 2 if as_json else upload_size(source, multichannel)
        limit = min(max_bytes, JSON_JOB_BYTES - JSON_FIELDS_ROOM) if as_json else max_bytes
        if (not jobs or size + n > limit or len(jobs[-1]) >= max_items
                or sent_as_json(jobs[-1][-1]) != as_json):
            jobs.append([])
            size = 0
        jobs[-1].append(source)
        size += n
    return jobs


def json_item(source: str | WorkerPath) -> dict[str, Any]:
    """A URL's or a worker's path's item in a JSON job (POST /v1/jobs)."""
    return {"url": source} if isinstance(source, str) else source.item()


def sent_as_json(source: Input) -> bool:
    """URLs and workers' paths go as a JSON job; files and stretches as uploads (split_into_jobs keeps them apart)."""
    return isinstance(source, (str, WorkerPath))


def upload_size(source: Input, multichannel: bool = False) -> int:
    """What an input adds to its job's uploads: a file's bytes, a URL's length, a stretch's most
    (``stretch_upload_size``)."""
    if isinstance(source, (str, WorkerPath)):
        return len(source) if isinstance(source, str) else len(str(source.clip.path))
    if isinstance(source, Path):
        return source.stat().st_size
    return stretch_upload_size(source, multichannel)


def item_input(source: Input, multichannel: bool = False) -> ItemInput:
    """A job item for a local file (uploaded: read as the job is written), a URL (fetched by the worker) or a
    stretch of a file (``stretch_upload``)."""
    if isinstance(source, str):
        return ItemInput(audio=source, url=source)
    if isinstance(source, WorkerPath):
        clip = source.clip
        stretch = None if clip.whole else clip.stretch
        return ItemInput(audio=str(clip), path=source.item()["path"], stretch=stretch)
    if isinstance(source, AudioClip):
        return ItemInput(audio=str(source), upload=stretch_upload(source, multichannel)[1])
    return ItemInput(audio=str(source), upload=source)


class Progress:
    """One line on stderr, redrawn: done/total, failures, elapsed."""

    def __init__(self, stream: TextIO = sys.stderr, width: int = 30):
        self.stream, self.width, self.started = stream, width, time.monotonic()

    def update(self, job: dict[str, Any]) -> None:
        total = max(1, job["total_items"])
        counts = job["counts"]
        done = counts["completed"] + counts["failed"] + counts["cancelled"]
        filled = int(self.width * done / total)
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r[{bar}] {done}/{total} items, {counts['failed']} failed, "
                          f"{time.monotonic() - self.started:.1f} s  ")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")


def _no_such_job(job_id: str) -> ValueError:
    return ValueError(f"{job_id}: no such job (it expired or was purged)")


def _raise_for_missing_job(response: httpx.Response, job_id: str) -> None:
    """A job that is gone (expired, purged) is the job's news, not a server that cannot be reached."""
    if response.status_code == 404:
        raise _no_such_job(job_id)
    response.raise_for_status()


class _ServerClient:
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
                form = {name: str(value).lower() for name, value in fields.items() if value is not None}
                if options.channel_names:
                    form["channel_names"] = ",".join(options.channel_names)
                if options.hotwords:
                    form["hotwords"] = ",".join(options.hotwords)
                response = await self.http.post("/v1/jobs", files=parts, data=form, headers=headers)
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
        if response.is_client_error:
            raise ValueError(f"{job_id}: {response.json()['error']['message']}")
        response.raise_for_status()
        return response.json()

    async def results(self, job_id: str) -> AsyncIterator[dict[str, Any]]:
        async with self.http.stream("GET", f"/v1/jobs/{job_id}/results") as response:
            _raise_for_missing_job(response, job_id)  # by its status: the body is not read
            async for line in response.aiter_lines():
                if line:
                    yield json.loads(line)

    async def list_jobs(self, limit: int, after: str | None, status: str | None) -> tuple[list[dict[str, Any]], bool]:
        params = {"limit": limit, **({"after": after} if after else {}), **({"status": status} if status else {})}
        response = await self.http.get("/v1/jobs", params=params)
        if response.is_client_error:
            raise ValueError(response.json()["error"]["message"])
        response.raise_for_status()
        page = response.json()
        return page["data"], page["has_more"]

    async def close(self) -> None:
        await self.http.aclose()


class _RedisClient:
    def __init__(self, url: str):
        self.store = JobStore.from_url(url)

    async def submit(self, inputs: list[Input], idempotency_key: str | None, options: JobOptions) -> dict[str, Any]:
        # the workers check the webhook URL against their own settings when they post (and record a refusal)
        job, _ = await self.store.submit([item_input(source, options.multichannel) for source in inputs],
                                         idempotency_key, options)
        return job.to_dict()

    async def get(self, job_id: str) -> dict[str, Any]:
        try:
            return (await self.store.get(job_id)).to_dict()
        except JobNotFound as exc:
            raise _no_such_job(job_id) from exc

    async def act(self, job_id: str, action: JobAction) -> dict[str, Any]:
        # straight in Redis, any job: whoever reaches Redis runs the store
        try:
            if action == "purge":
                await self.store.delete(job_id)
                return {"id": job_id, "object": "transcription.job.deleted", "deleted": True}
            if action == "retry":
                job, retried, unretried = await self.store.retry_failed(job_id)
                return job.retried_dict(retried, unretried)
            job, _ = await self.store.cancel(job_id)  # straight in Redis: no process to count it in
            return job.to_dict()
        except JobNotFound as exc:
            raise _no_such_job(job_id) from exc

    async def results(self, job_id: str) -> AsyncIterator[dict[str, Any]]:
        try:
            async for record in self.store.iter_results(job_id):
                yield record
        except JobNotFound as exc:
            raise _no_such_job(job_id) from exc

    async def list_jobs(self, limit: int, after: str | None, status: str | None) -> tuple[list[dict[str, Any]], bool]:
        try:  # straight from Redis: the jobs submitted without an API key
            jobs, more = await self.store.list_jobs(ANONYMOUS, limit, after, JobStatus(status) if status else None)
        except JobNotFound as exc:
            raise ValueError(f"no job {after} in the list") from exc
        return [job.to_dict() for job in jobs], more

    async def close(self) -> None:
        await self.store.close()


async def run_submit(inputs: list[Input], redis_url: str | None, server: str | None, api_key: str | None, wait: bool,
                     output: TextIO, idempotency_key: str | None = None, poll_s: float = 1.0,
                     progress: Callable[[], Progress] = Progress, job_bytes: int = JOB_BYTES,
                     options: JobOptions | None = None,
                     write_result: Callable[[Input, dict[str, Any]], None] | None = None) -> int:
    """Submit ``inputs`` as one job, or as several of at most ``job_bytes`` of uploads each (in input order; the n-th
    job's idempotency key is ``KEY.n``, KEY one of its own where none is given); with ``wait``, follow them and
    write every result in input order: a JSON line each to ``output``, or as ``write_result(input, record)`` does."""
    if write_result is None:
        def write_result(source: Input, record: dict[str, Any]) -> None:
            output.write(json.dumps(record, ensure_ascii=False) + "\n")

    options = options or JobOptions()
    client = _ServerClient(server, api_key) if server else _RedisClient(redis_url or "")
    parts = split_into_jobs(inputs, job_bytes, options.multichannel)
    idempotency_key = idempotency_key or f"submit-{secrets.token_urlsafe(16)}"  # a job's tries make one job
    try:
        jobs = []
        for number, part in enumerate(parts, start=1):
            key = f"{idempotency_key}.{number}" if len(parts) > 1 else idempotency_key
            jobs.append(await _submitted(client, part, key, options, first=number == 1))
            print(f"job {jobs[-1]['id']}: {jobs[-1]['total_items']} items", file=sys.stderr)
        if not wait:
            output.writelines(json.dumps(job) + "\n" for job in jobs)
            return 0
        bar = progress()
        while True:
            bar.update(_overall(jobs))
            if all(job["status"] in FINAL_STATUSES for job in jobs):
                break
            await asyncio.sleep(poll_s)
            jobs = [job if job["status"] in FINAL_STATUSES else await _riding_out(lambda i=job["id"]: client.get(i))
                    for job in jobs]
        bar.close()
        for part, job in zip(parts, jobs, strict=True):
            try:  # flushed a job at a time: a full disk or a closed pipe is told here, not as a traceback at exit
                async with contextlib.aclosing(_results_in_order(client, job["id"], part)) as results:
                    async for source, record in results:
                        write_result(source, {**record, "audio": str(source)})
                output.flush()
            except OSError as exc:
                kept = ", ".join(j["id"] for j in jobs)
                return cannot_write(exc, f" (the jobs are kept, their results at /v1/jobs/ID/results until they "
                                         f"expire: {kept})")
            print(f"job {job['id']}: {job['status']}, RTFx {job['rtfx']}", file=sys.stderr)
        return 0 if all(job["status"] == "completed" for job in jobs) else 1
    except (httpx.HTTPError, *REDIS_ERRORS) as exc:
        print(f"error: cannot reach {'the server' if server else 'Redis'}: {exc}", file=sys.stderr)
        return 2
    except REDIS_FULL:
        print("error: Redis is out of memory: nothing of that job was queued (submit fewer bytes a job with "
              "--job-bytes, or raise Redis's maxmemory)", file=sys.stderr)
        return 2
    except ValueError as exc:  # a job the server or the store refused, with the reason
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        await client.close()


async def _submitted(client: _ServerClient | _RedisClient, part: list[Input], key: str, options: JobOptions,
                     first: bool) -> dict[str, Any]:
    """``client.submit``, tried again through an outage (``_Outage``) under the same idempotency key, so a try whose
    answer was lost, or that was refused after its job was written (no replica confirmed it: ``wait_replicas``),
    gets that job rather than making a second. Only the first job's first try is not tried again if it reaches
    nothing at all (``NOTHING_THERE``)."""
    outage = _Outage("submitting")
    while True:
        try:
            return await client.submit(part, key, options)
        except OUTAGE_ERRORS as exc:
            if first and outage.tries == 0 and isinstance(exc, NOTHING_THERE):
                raise
            await outage.ride_out(exc)


class _Outage:
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
        print(f"\nwarning: {self.doing}: {exc}; trying again in {self.backoff_s:.0f} s", file=sys.stderr)
        await asyncio.sleep(self.backoff_s)
        self.backoff_s, self.tries = min(2 * self.backoff_s, 30.0), self.tries + 1


async def _riding_out(call: Callable[[], Awaitable[T]]) -> T:
    """``call()``, tried again through an outage (``_Outage``)."""
    outage = _Outage()
    while True:
        try:
            return await call()
        except OUTAGE_ERRORS as exc:
            await outage.ride_out(exc)


async def _results_in_order(client: _ServerClient | _RedisClient, job_id: str, sources: list[Input]
                            ) -> AsyncIterator[tuple[Input, dict[str, Any]]]:
    """Each of a job's items with its result, as they stream in: a job of 100,000 items was a list of results
    in memory first (12 KB each as Python objects). Through an outage the results are fetched again from the
    start, and those already given skipped. ValueError if they do not match the items one for one."""
    given, outage = 0, _Outage()
    while True:
        try:
            seen = 0
            async with contextlib.aclosing(client.results(job_id)) as records:
                async for record in records:
                    seen += 1
                    if seen <= given:
                        continue
                    if given == len(sources):
                        raise ValueError(f"job {job_id}: more results than its {len(sources)} items")
                    given += 1
                    yield sources[given - 1], record
            break
        except OUTAGE_ERRORS as exc:
            await outage.ride_out(exc)
    if given != len(sources):
        raise ValueError(f"job {job_id}: {given} results for its {len(sources)} items")


def _overall(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """The jobs' progress as one job's, for the progress bar."""
    counts = {state: sum(job["counts"][state] for job in jobs) for state in ("completed", "failed", "cancelled")}
    return {"total_items": sum(job["total_items"] for job in jobs), "counts": counts}


# --- list ---------------------------------------------------------------------------------------------------

LIST_PAGE = 100


async def run_list(redis_url: str | None, server: str | None, api_key: str | None, limit: int, status: str | None,
                   as_json: bool, output: TextIO) -> int:
    """The newest ``limit`` jobs (the API key's, through a server; those submitted without a key, through Redis),
    as a table or JSON lines."""
    async def newest(client: _ServerClient | _RedisClient) -> None:
        jobs: list[dict[str, Any]] = []
        more, after = True, None
        while more and len(jobs) < limit:
            page, more = await client.list_jobs(min(LIST_PAGE, limit - len(jobs)), after, status)
            jobs += page
            after = page[-1]["id"] if page else None
            more = more and after is not None
        output.write("".join(json.dumps(job) + "\n" for job in jobs) if as_json else format_jobs(jobs))

    return await _with_client(redis_url, server, api_key, newest)


async def run_action(redis_url: str | None, server: str | None, api_key: str | None, job_ids: list[str],
                     action: JobAction, output: TextIO) -> int:
    """Cancel each job (items not started are dropped), purge it (delete it at once), or retry its failed items; a
    JSON line each."""
    async def act_on_all(client: _ServerClient | _RedisClient) -> None:
        for job_id in job_ids:
            output.write(json.dumps(await client.act(job_id, action)) + "\n")

    return await _with_client(redis_url, server, api_key, act_on_all)


async def _with_client(redis_url: str | None, server: str | None, api_key: str | None,
                       work: Callable[[_ServerClient | _RedisClient], Awaitable[None]]) -> int:
    """``work`` with a client of the server or of Redis; its failures as an exit status, said on stderr."""
    client = _ServerClient(server, api_key) if server else _RedisClient(redis_url or "")
    try:
        await work(client)
        return 0
    except (httpx.HTTPError, *REDIS_ERRORS) as exc:
        print(f"error: cannot reach {'the server' if server else 'Redis'}: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        await client.close()


def format_jobs(jobs: list[dict[str, Any]]) -> str:
    """A table: id, status, priority, items done of total, failed, created (UTC), audio seconds, RTFx, and the mean
    token log-probability of the items done (a falling one: harder audio than expected)."""
    rows = [("ID", "STATUS", "PRIORITY", "DONE", "FAILED", "CREATED (UTC)", "AUDIO_S", "RTFX", "AVG_LOGPROB")]
    for job in jobs:
        counts = job["counts"]
        done = counts["completed"] + counts["failed"] + counts["cancelled"]
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(job["created_at"]))
        rows.append((job["id"], job["status"], job["priority"], f"{done}/{job['total_items']}", str(counts["failed"]),
                     created, f"{job['audio_s']:.1f}", f"{job['rtfx']:.1f}",
                     "-" if job.get("avg_logprob") is None else f"{job['avg_logprob']:.3f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() + "\n"
                   for row in rows)
