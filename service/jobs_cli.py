"""`batchasr worker` (a job consumer for scale-out), `batchasr submit` (a bulk job from files, URLs or a manifest's
stretches of files; what it sends: service.submit_inputs) and `batchasr jobs` (list, cancel, purge, retry, or write
their results), through a server or straight in Redis (service.job_clients)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import secrets
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TextIO, TypeVar

import httpx

from .config import Settings
from .job_clients import (
    AtQueuedLimit,
    JobAction,
    JobClient,
    NeverFits,
    NoSuchJob,
    client_for,
    job_records,
    results_in_order,
    riding_out,
)
from .job_types import FINAL_ITEM_STATES, JobOptions, deleted_job
from .line_output import cannot_write
from .logs import redacted_url
from .redis_outages import REDIS_ERRORS, REDIS_FULL
from .submit_inputs import JOB_BYTES, Input, split_into_jobs

log = logging.getLogger(__name__)
GONE = "gone"  # a job purged or expired while followed, as ``submit --wait`` marks it
FINAL_STATUSES = {"completed", "completed_with_errors", "failed", "cancelled", GONE}
T = TypeVar("T")


# --- worker -------------------------------------------------------------------------------------------------


async def run_worker(settings: Settings, metrics_port: int | None) -> int:
    from .processes import check_port_free
    from .runtime import build_stack, load_serving_model

    if metrics_port:
        check_port_free(metrics_port)  # before the model loads
    model = await asyncio.to_thread(load_serving_model, settings)
    stack = build_stack(settings, model)
    try:
        return await _consume_jobs(settings, stack, metrics_port)
    finally:  # whatever ends it, the engine drains and its thread stops
        await stack.stop()


async def _consume_jobs(settings: Settings, stack: Any, metrics_port: int | None) -> int:
    if not await asyncio.to_thread(stack.engine.wait_ready):
        log.error("engine failed: %s", stack.engine.error)
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
    if stack.engine.failed:  # the consumer stopped taking items; a new process may find the device working
        log.error("worker stopped: the engine failed: %s", stack.engine.error)
        return 1
    log.info("worker stopped")
    return 0


# --- submit -------------------------------------------------------------------------------------------------


class Progress:
    """One line on stderr, redrawn: done/total, failures, elapsed, and about how long is left at the rate items
    have ended since the line was first drawn (a job followed when half done is not taken for half done in no
    time). Where stderr is no terminal (a log, CI), a line of its own every LOG_EVERY_S and at the end instead:
    redrawn there, a long item's wait was dozens of frames joined by carriage returns."""

    LOG_EVERY_S = 30.0

    def __init__(self, stream: TextIO | None = None, width: int = 30, clock: Callable[[], float] = time.monotonic,
                 tty: bool | None = None):
        # stderr as it is now, not as it was when this module was imported (a test's capture, closed since)
        self.stream, self.width, self.clock = stream or sys.stderr, width, clock
        self.tty = self.stream.isatty() if tty is None else tty
        self.started, self.done_at_start, self.drawn, self.logged_at = clock(), None, 0, -math.inf

    def update(self, job: dict[str, Any]) -> None:
        total = max(1, job["total_items"])
        done = _items_ended(job)
        if self.done_at_start is None:
            self.done_at_start = done
        now = self.clock()
        elapsed, progressed = now - self.started, done - self.done_at_start
        filled = int(self.width * done / total)
        bar = "#" * filled + "." * (self.width - filled)
        line = f"[{bar}] {done}/{total} items, {job['counts']['failed']} failed, {elapsed:.1f} s"
        if progressed and done < total:
            line += f", about {_spoken(elapsed / progressed * (total - done))} left"
        if not self.tty:
            if done >= total or now - self.logged_at >= self.LOG_EVERY_S:
                self.stream.write(line + "\n")
                self.logged_at = now
                self.stream.flush()
            return
        self.stream.write(f"\r{line.ljust(self.drawn)}")  # over all of the line before, however long it was
        self.drawn = len(line)
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")


def _spoken(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 90 * 60 else f"{seconds / 3600:.1f} h"


async def _submitted_when_it_fits(client: JobClient, inputs: list[Input], idempotency_key: str,
                                  options: JobOptions, first: bool) -> dict[str, Any]:
    """The job, submitted through outages (``riding_out``), and again each time the server says the key's items
    queued are at their limit, as long as it takes: the jobs before it are done meanwhile, so a backfill of any size
    goes in at the pace the workers take it."""
    return await _when_there_is_room(
        lambda first: riding_out(lambda: client.submit(inputs, idempotency_key, options), "submitting",
                                 unreached_ends=first), first)


async def _when_there_is_room(attempt: Callable[[bool], Awaitable[T]], first: bool) -> T:
    """``attempt(first)``, and again each time the server says the key's items queued are at their limit, after
    the wait it names. ``first``: the command's first try, where reaching nothing at all is a wrong address most
    likely, and ends the command; a refusal reached the server, so from then on its going away (a restart) is an
    outage, which the tries after it ride out."""
    while True:
        try:
            return await attempt(first)
        except AtQueuedLimit as exc:
            first = False
            print(f"waiting for room: {exc}; trying again in {exc.retry_after_s:.0f} s", file=sys.stderr)
            await asyncio.sleep(exc.retry_after_s)


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
    client = client_for(redis_url, server, api_key)
    parts = split_into_jobs(inputs, job_bytes, options.multichannel)
    # each job is tried again through an outage under one key, so a try whose answer was lost, or that was refused
    # after its job was written (no replica confirmed it: wait_replicas), gets that job rather than making a second;
    # but a first try that reaches nothing at all is a wrong address most likely, and said at once
    idempotency_key = idempotency_key or f"submit-{secrets.token_urlsafe(16)}"
    to_send = [(f"{idempotency_key}.{n}" if len(parts) > 1 else idempotency_key, part)
               for n, part in enumerate(parts, start=1)]
    jobs: list[dict[str, Any]] = []
    sent, first = [], True  # the parts sent, in order, each its job's; whether the server has answered yet
    try:
        while to_send:
            key, part = to_send[0]  # left there until sent: a Ctrl-C meanwhile counts it as still to send
            try:
                job = await _submitted_when_it_fits(client, part, key, options, first=first)
            except NeverFits as exc:  # more than a key may have queued: as jobs it can, each when there is room
                if not 0 < exc.limit < len(part):  # a limit of none, or one it is within: no split would fit
                    raise ValueError(f"the server refused the job: {exc}") from exc
                first = False
                smaller = split_into_jobs(part, job_bytes, options.multichannel, max_items=exc.limit)
                print(f"{exc}: sent as {len(smaller)} jobs of at most {exc.limit} items", file=sys.stderr)
                to_send[:1] = [(f"{key}.{n}", p) for n, p in enumerate(smaller, start=1)]  # the same keys again
                continue
            to_send.pop(0)
            jobs.append(job)
            sent.append(part)
            first = False
            print(f"job {job['id']}: {job['total_items']} items", file=sys.stderr)
            if not wait:  # its line as it is accepted: a run cut short has named every job it sent
                try:  # flushed: a full disk or a closed pipe is told, with the jobs it could not name
                    _write_out(output, json.dumps(job) + "\n")
                except CannotWrite as exc:
                    return cannot_write(exc.error, f" (the jobs were submitted: {', '.join(j['id'] for j in jobs)})")
        if not wait:
            return 0
        jobs = await _followed(client, jobs, progress, poll_s)
        gone = 0  # jobs purged or expired meanwhile: the others' results are written all the same
        for part, job in zip(sent, jobs, strict=True):
            try:  # flushed a job at a time: a full disk or a closed pipe is told here, not as a traceback at exit
                async with contextlib.aclosing(results_in_order(client, job["id"], part)) as results:
                    async for source, record in results:
                        write_result(source, {**record, "audio": str(source)})
                output.flush()
            except OSError as exc:
                kept = ", ".join(j["id"] for j in jobs)
                return cannot_write(exc, f" (the jobs are kept, their results at /v1/jobs/ID/results until they "
                                         f"expire: {kept})")
            except NoSuchJob as exc:  # purged or expired while followed (GONE), or since
                _say_gone(exc)
                gone += 1
                continue
            print(_how_it_stands(job), file=sys.stderr)
        return 2 if gone else 0 if all(job["status"] == "completed" for job in jobs) else 1
    except (httpx.HTTPError, *REDIS_ERRORS) as exc:
        print(f"error: cannot reach {_target(server, redis_url)}: {exc}", file=sys.stderr)
        return _sent_before_failing(jobs, to_send, idempotency_key)
    except REDIS_FULL:
        print("error: Redis is out of memory: nothing of that job was queued (submit fewer bytes a job with "
              "--job-bytes, or raise Redis's maxmemory)", file=sys.stderr)
        return _sent_before_failing(jobs, to_send, idempotency_key)
    except ValueError as exc:  # a job the server or the store refused, with the reason
        print(f"error: {exc}", file=sys.stderr)
        return _sent_before_failing(jobs, to_send, idempotency_key, refused=True)
    except asyncio.CancelledError:  # Ctrl-C (asyncio.run cancels this task): the jobs sent go on without us
        if jobs:
            print(_how_to_take_up(jobs, idempotency_key, len(jobs) + len(to_send)), file=sys.stderr)
        raise
    finally:
        await client.close()


def _sent_before_failing(jobs: list[dict[str, Any]], to_send: list, idempotency_key: str, refused: bool = False
                         ) -> int:
    """Status 2, and where a submission of several jobs failed part-way, the jobs it had sent: they go on, and were
    named nowhere (run again under a new key, their audio was transcribed twice)."""
    if jobs and to_send:
        if refused:  # the same command would be refused again: the jobs sent are had, or cancelled, by id
            ids = " ".join(job["id"] for job in jobs)
            print(f"{len(jobs)} of {len(jobs) + len(to_send)} jobs were sent before that and go on: {ids}; their "
                  f"results: batchasr jobs --results {ids} --wait; or cancel them: batchasr jobs --cancel {ids}",
                  file=sys.stderr)
        else:
            print(_how_to_take_up(jobs, idempotency_key, len(jobs) + len(to_send)), file=sys.stderr)
    return 2


def _how_to_take_up(jobs: list[dict[str, Any]], idempotency_key: str, total: int) -> str:
    """What a submit cut short says: the jobs it sent go on, and how their results are had (a cut-short
    ``--wait --format manifest`` wrote nothing: it is the same command again, under the same key, that writes it)."""
    ids = " ".join(job["id"] for job in jobs)
    how = f"{len(jobs)} of {total} jobs were sent" if len(jobs) < total else "the jobs go on"
    return (f"{how}: {ids}; their results: batchasr jobs --results {ids} --wait; or run this command again with "
            f"--idempotency-key {idempotency_key}: it takes up these jobs (and sends the rest) instead of new ones")


async def _followed(client: JobClient, jobs: list[dict[str, Any]], progress: Callable[[], Progress], poll_s: float
                    ) -> list[dict[str, Any]]:
    """The jobs once each has ended, polled every ``poll_s`` (through outages) with a progress bar meanwhile."""
    bar = progress()
    while True:
        bar.update(_overall(jobs))
        if all(job["status"] in FINAL_STATUSES for job in jobs):  # GONE among them
            break
        await asyncio.sleep(poll_s)
        jobs = [job if job["status"] in FINAL_STATUSES else await _still_there(client, job)
                for job in jobs]
    bar.close()
    return jobs


async def _still_there(client: JobClient, job: dict[str, Any]) -> dict[str, Any]:
    """The job as it stands now; one purged or expired meanwhile as it was last seen, marked ``GONE``, followed no
    more (it ended the wait before the other jobs' results were written): reading its results says it is not there."""
    try:
        return await riding_out(lambda: client.get(job["id"]))
    except NoSuchJob:
        return {**job, "status": GONE}


def _say_gone(exc: NoSuchJob) -> None:
    """A job whose results are not there (purged or expired): said, and the others' written all the same; the
    command then ends with status 2."""
    print(f"error: {exc}: its results are not there", file=sys.stderr)


def _overall(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """The jobs' progress as one job's, for the progress bar."""
    counts = {state: sum(job["counts"][state] for job in jobs) for state in FINAL_ITEM_STATES}
    return {"total_items": sum(job["total_items"] for job in jobs), "counts": counts}


class CannotWrite(Exception):
    """The command's own output failed (a full disk, a closed pipe): told as that, not as Redis or the server being
    away, which OSError stands for too."""

    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error


def _write_out(output: TextIO, text: str) -> None:
    """``text`` written and flushed (a write error shows at the flush, else only at exit as a traceback)."""
    try:
        output.write(text)
        output.flush()
    except OSError as exc:
        raise CannotWrite(exc) from exc


# --- list ---------------------------------------------------------------------------------------------------

LIST_PAGE = 100


async def run_list(redis_url: str | None, server: str | None, api_key: str | None, limit: int, status: str | None,
                   as_json: bool, output: TextIO) -> int:
    """The newest ``limit`` jobs (the API key's, through a server; those submitted without a key, through Redis),
    as a table or JSON lines. Under the table, on stderr: the owner's items queued now, and the limit on them."""
    async def newest(client: JobClient) -> None:
        jobs: list[dict[str, Any]] = []
        more, after = True, None
        while more and len(jobs) < limit:
            page, more = await client.list_jobs(min(LIST_PAGE, limit - len(jobs)), after, status)
            jobs += page
            after = page[-1]["id"] if page else None
            more = more and after is not None
        if as_json:
            _write_out(output, "".join(json.dumps(job) + "\n" for job in jobs))
            return
        _write_out(output, format_jobs(jobs))
        print(_room(*await client.room()), file=sys.stderr)

    return await _with_client(redis_url, server, api_key, newest)


async def run_action(redis_url: str | None, server: str | None, api_key: str | None, job_ids: list[str],
                     action: JobAction, output: TextIO) -> int:
    """Cancel each job (items not finished are dropped), purge it (delete it at once), or retry its failed items (all
    of them, as the key's queued-items limit makes room: ``_retried_in_full``); a JSON line each. Each is tried
    again through an outage, as submit does."""
    async def act_on_all(client: JobClient) -> None:
        for number, job_id in enumerate(job_ids):
            if action == "retry":
                answer = await _retried_in_full(client, job_id, first=number == 0)
                if answer.get("unretried_items"):
                    print(f"{job_id}: {answer['unretried_items']} failed items not retried: they were uploads, whose "
                          "audio is not kept past a failure; submit those files again", file=sys.stderr)
            else:
                answer = await _acted_on(client, job_id, action, first=number == 0)
            _write_out(output, json.dumps(answer) + "\n")

    return await _with_client(redis_url, server, api_key, act_on_all)


async def _retried_in_full(client: JobClient, job_id: str, first: bool) -> dict[str, Any]:
    """The job's failed items retried until none is left for want of room under the key's queued-items limit: a
    retry queues as many as fit (the rest are ``deferred_items``), the next one at once, and one that finds no room
    (429) waits as the server says, while the workers take the items before; answers the last retry, with the
    items queued again by all of them."""
    retried = 0
    while True:
        answer = await _when_there_is_room(lambda first: _acted_on(client, job_id, "retry", first), first)
        first = False
        retried += answer["retried_items"]
        if not answer.get("deferred_items"):
            return {**answer, "retried_items": retried}


ACTING = {"cancel": "cancelling", "purge": "purging", "retry": "retrying"}


async def _acted_on(client: JobClient, job_id: str, action: JobAction, first: bool) -> dict[str, Any]:
    """``action`` done to the job, tried again through an outage: cancelling again does no more, and a retry's
    second try finds the failed items queued already (it answers for itself: none retried); a purge whose later try
    finds the job gone was done by a try the outage cut short (refused after Redis deleted it: no replica had
    confirmed it yet), and so it is answered as done. ``first``: the command's first try, which ends at once where
    it reaches nothing at all (a wrong address)."""
    tries = 0

    async def once() -> dict[str, Any]:
        nonlocal tries
        tries += 1
        try:
            return await client.act(job_id, action)
        except NoSuchJob:
            if action == "purge" and tries > 1:
                return deleted_job(job_id)
            raise

    return await riding_out(once, f"{ACTING[action]} job {job_id}", unreached_ends=first)


# --- results ------------------------------------------------------------------------------------------------


async def run_results(redis_url: str | None, server: str | None, api_key: str | None, job_ids: list[str], wait: bool,
                      output: TextIO, write_result: Callable[[dict[str, Any]], None] | None = None,
                      poll_s: float = 1.0, progress: Callable[[], Progress] = Progress) -> int:
    """Each job's results in turn, one per item in item order (an item not ended says its state): a JSON line each to
    ``output``, the record as the job holds it (``audio``: the name the item was submitted under), or as
    ``write_result(record)`` does; with ``wait``, once every job has ended, a progress bar meanwhile. Exit status 0
    when every item completed, 1 when one failed, was cancelled or has not ended yet."""
    if write_result is None:
        def write_result(record: dict[str, Any]) -> None:
            output.write(json.dumps(record, ensure_ascii=False) + "\n")

    async def collect(client: JobClient) -> int:
        # a first job that cannot be reached at all is a wrong address most likely, said at once
        jobs = [await riding_out(lambda i=job_id: client.get(i), "reading the jobs", unreached_ends=number == 0)
                for number, job_id in enumerate(job_ids)]
        if wait:
            jobs = await _followed(client, jobs, progress, poll_s)
        gone = 0
        for job in jobs:
            try:  # flushed a job at a time: a full disk or a closed pipe is told here, not as a traceback at exit
                async with contextlib.aclosing(job_records(client, job["id"], job["total_items"])) as records:
                    async for record in records:
                        write_result(record)
                output.flush()
            except OSError as exc:
                return cannot_write(exc)
            except NoSuchJob as exc:  # purged or expired while followed (GONE), or since
                _say_gone(exc)
                gone += 1
                continue
            print(_how_it_stands(job), file=sys.stderr)
        return 2 if gone else 0 if all(job["status"] == "completed" for job in jobs) else 1

    return await _with_client(redis_url, server, api_key, collect)


def _how_it_stands(job: dict[str, Any]) -> str:
    if job["status"] in FINAL_STATUSES:
        return f"job {job['id']}: {job['status']}, RTFx {job['rtfx']}"
    return (f"job {job['id']}: {job['status']}, {_items_ended(job)} of {job['total_items']} items ended (--wait waits "
            "for the rest)")


def _items_ended(job: dict[str, Any]) -> int:
    """The job's items completed, failed or cancelled (``GET /v1/jobs/{id}``'s counts)."""
    return sum(job["counts"][state] for state in FINAL_ITEM_STATES)


async def _with_client(redis_url: str | None, server: str | None, api_key: str | None,
                       work: Callable[[JobClient], Awaitable[int | None]]) -> int:
    """``work`` with a client of the server or of Redis: its exit status (None: 0), or its failures as one, said on
    stderr."""
    client = client_for(redis_url, server, api_key)
    try:
        return await work(client) or 0
    except CannotWrite as exc:
        return cannot_write(exc.error)
    except (httpx.HTTPError, *REDIS_ERRORS) as exc:
        print(f"error: cannot reach {_target(server, redis_url)}: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        await client.close()


def _target(server: str | None, redis_url: str | None) -> str:
    """What a command could not reach, named as given (a URL's password as ***)."""
    return f"the server at {redacted_url(server)}" if server else f"Redis at {redacted_url(redis_url or '')}"


def _room(queued_items: int, max_queued_items: int | None) -> str:
    limit = "no limit" if max_queued_items is None else f"limit: {max_queued_items:,}"
    return f"items queued or in progress: {queued_items:,} ({limit})"


def format_jobs(jobs: list[dict[str, Any]]) -> str:
    """A table: id, status, priority, items done of total, failed, created (UTC), audio seconds, RTFx, and the mean
    token log-probability of the items done (a falling one: harder audio than expected)."""
    rows = [("ID", "STATUS", "PRIORITY", "DONE", "FAILED", "CREATED (UTC)", "AUDIO_S", "RTFX", "AVG_LOGPROB")]
    for job in jobs:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(job["created_at"]))
        rows.append((job["id"], job["status"], job["priority"], f"{_items_ended(job)}/{job['total_items']}",
                     str(job["counts"]["failed"]), created, f"{job['audio_s']:.1f}", f"{job['rtfx']:.1f}",
                     "-" if job.get("avg_logprob") is None else f"{job['avg_logprob']:.3f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() + "\n"
                   for row in rows)
