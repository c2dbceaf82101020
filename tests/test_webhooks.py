"""Job-completion webhooks: signed, posted only where the server allows (under its webhook URL prefixes, or else
to public addresses), retried when the receiver may recover, and how each went recorded on the job."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import itertools
import json
import logging
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import redis
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from service.config import Settings
from service.job_keys import GROUP, ITEM_STREAM, WEBHOOK_STREAM
from service.job_types import ItemInput, Job, JobOptions, JobStatus, item_record
from service.jobs import JobStore
from service.metrics import Metrics
from service.runtime import build_stack
from service.url_rules import NoPublicAddress, PublicAddressResolver, UrlRefused
from service.webhook_worker import WebhookWorker
from service.webhooks import WebhookSender, check_webhook_url, sign
from tests.servers import drain_jobs, run_server

SECRET_RAW = b"0123456789abcdef0123456789abcdef"
SECRET = "whsec_" + base64.b64encode(SECRET_RAW).decode()


class Receiver:
    """A real HTTP server taking webhook POSTs on every interface: it answers with ``statuses`` in turn (the
    last one from then on) and keeps what it was sent. A status of None holds the answer (a receiver that
    hangs) until ``release`` is set, then answers 200."""

    def __init__(self, *statuses: int | None, retry_after: str | None = None):
        self.statuses = list(statuses) or [200]
        self.received: list[tuple[dict[str, str], bytes]] = []
        self.times: list[float] = []  # when each POST came (monotonic)
        self.release = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                receiver.received.append((dict(self.headers), self.rfile.read(int(self.headers["content-length"]))))
                receiver.times.append(time.monotonic())
                status = receiver.statuses[min(len(receiver.received), len(receiver.statuses)) - 1]
                if status is None:
                    receiver.release.wait(30)
                    status = 200
                self.send_response(status)
                if 300 <= status < 400:
                    self.send_header("Location", "http://127.0.0.1:9/elsewhere")
                if status >= 429 and retry_after is not None:
                    self.send_header("Retry-After", retry_after)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("0.0.0.0", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}/hook"

    def prefix(self, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}/"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    made: list[Receiver] = []

    def make(*statuses: int | None, retry_after: str | None = None) -> Receiver:
        made.append(Receiver(*statuses, retry_after=retry_after))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _upload(parity_audio: list[str]) -> list[tuple[str, tuple[str, bytes, str]]]:
    return [("files", ("a.wav", Path(parity_audio[0]).read_bytes(), "audio/wav"))]


def _wait_for(predicate, timeout: float, message: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.1)
    raise AssertionError(message)


def test_completion_webhook_is_signed_and_its_delivery_recorded(redis_server, model, parity_audio, receiver):
    hook = receiver(200)
    settings = Settings(redis_url=redis_server.url, webhook_secret=SECRET, webhook_url_prefixes=[hook.prefix()])
    with run_server(settings, model) as running:
        job = httpx.post(f"{running.url}/v1/jobs", files=_upload(parity_audio), data={"webhook_url": hook.url()}).json()
        assert job["webhook"] == {"url": hook.url(), "status": "pending", "attempts": 0, "error": None}

        def delivered() -> dict | None:
            webhook = httpx.get(f"{running.url}/v1/jobs/{job['id']}").json()["webhook"]
            return webhook if webhook["status"] != "pending" else None
        assert _wait_for(delivered, 60, "the delivery was never recorded") == {
            "url": hook.url(), "status": "delivered", "attempts": 1, "error": None}
    headers, body = hook.received[0]
    assert json.loads(body)["type"] == "transcription.job.completed"
    assert json.loads(body)["data"] == {"id": job["id"], "status": "completed"}
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
    expected_sig = base64.b64encode(hmac.new(SECRET_RAW, signed, hashlib.sha256).digest()).decode()
    assert headers["webhook-signature"] == f"v1,{expected_sig}"
    assert abs(int(headers["webhook-timestamp"]) - time.time()) < 60
    # and as a receiver checks it, with the Standard Webhooks library (its timestamp tolerance included)
    assert Webhook(SECRET).verify(body, headers) == json.loads(body)


def test_each_api_key_verifies_its_own_webhooks_with_a_secret_no_other_key_holds(redis_server, model, parity_audio,
                                                                                  receiver):
    """Every key's webhooks were signed with the server's one secret, which each key's holder needed to verify
    theirs: any of them could then sign a webhook another key's receiver would take (a job "completed" that was
    not). Each key has a secret of its own now, from GET /v1/webhooks/secret."""
    hook = receiver(200)
    settings = Settings(redis_url=redis_server.url, webhook_secret=SECRET, webhook_url_prefixes=[hook.prefix()],
                        api_keys=["alice-key", "bob-key"])
    with run_server(settings, model) as running:
        secrets, jobs = {}, {}
        for key in ("alice-key", "bob-key"):
            auth = {"authorization": f"Bearer {key}"}
            answer = httpx.get(f"{running.url}/v1/webhooks/secret", headers=auth)
            assert answer.status_code == 200, answer.text
            secrets[key] = answer.json()["secret"]
            jobs[key] = httpx.post(f"{running.url}/v1/jobs", files=_upload(parity_audio), headers=auth,
                                   data={"webhook_url": hook.url()}).json()["id"]
        assert httpx.get(f"{running.url}/v1/webhooks/secret").status_code == 401
        _wait_for(lambda: len(hook.received) == 2, 60, "the webhooks never came")
    assert len({SECRET, *secrets.values()}) == 3
    for headers, body in hook.received:
        owner = next(key for key, job in jobs.items() if job == json.loads(body)["data"]["id"])
        Webhook(secrets[owner]).verify(body, headers)
        for other in {SECRET, *secrets.values()} - {secrets[owner]}:
            with pytest.raises(WebhookVerificationError):
                Webhook(other).verify(body, headers)


def test_without_api_keys_the_webhook_secret_is_the_operators(redis_server, model):
    settings = Settings(redis_url=redis_server.url, webhook_secret=SECRET)
    with run_server(settings, model) as running:
        answer = httpx.get(f"{running.url}/v1/webhooks/secret")
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "no_api_keys"
    assert SECRET not in answer.text
    with run_server(Settings(redis_url=redis_server.url, api_keys=["k"]), model) as running:
        answer = httpx.get(f"{running.url}/v1/webhooks/secret", headers={"authorization": "Bearer k"})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "webhooks_disabled"


REFUSED_WITHOUT_PREFIXES = [
    "http://127.0.0.1:8080/hook", "http://localhost:8080/hook", "http://api.localhost/hook", "http://[::1]/hook",
    "http://169.254.169.254/latest/meta-data", "http://10.0.0.5/hook", "http://192.168.1.1/hook",
    "http://100.64.0.1/hook", "http://[::ffff:127.0.0.1]/hook", "http://[fd00::1]/hook", "http://0.0.0.0/hook",
    "http://224.0.0.1/hook", "ftp://hooks.example.com/hook", "file:///etc/passwd", "not a url", "http:///hook",
    # what the C library reads as 127.0.0.1 or 0.0.0.0: aiohttp before 3.14 connects to an all-digit host without
    # the resolver that checks names (with 3.11, a webhook to http://2130706433:PORT/ reached a loopback receiver)
    "http://2130706433/hook", "http://127.1/hook", "http://0/hook", "http://0177.0.0.1/hook", "http://0x7f.1/hook",
    # IPv6 addresses that carry a private IPv4 one: NAT64 (169.254.169.254), 6to4 (10.0.0.5), IPv4-compatible
    "http://[64:ff9b::a9fe:a9fe]/hook", "http://[2002:a00:5::1]/hook", "http://[::7f00:1]/hook",
    "http://[64:ff9b:1::1]/hook",
    "http://hooks.example.com\x00/hook", "http://127.0.0.1\x00/hook",  # no host has a NUL byte
]


@pytest.mark.parametrize("url", REFUSED_WITHOUT_PREFIXES)
def test_without_prefixes_webhooks_go_to_public_addresses_only(url):
    with pytest.raises(UrlRefused):
        check_webhook_url(url, [])


@pytest.mark.parametrize("url", ["https://hooks.example.com/batchasr", "http://8.8.8.8:8080/hook",
                                 "http://[2606:4700::1111]/hook", "https://hooks.example.com:8443/x?job=1",
                                 "http://[64:ff9b::808:808]/hook", "https://123.example/hook"])
def test_public_webhook_urls_are_taken(url):
    check_webhook_url(url, [])


def test_with_prefixes_webhooks_go_under_them_only():
    prefixes = ["http://127.0.0.1:9000/hooks/", "https://hooks.example.com/"]
    for url in ("http://127.0.0.1:9000/hooks/a", "https://hooks.example.com/any/thing"):
        check_webhook_url(url, prefixes)  # a private address too, when the operator names it
    for url in ("http://127.0.0.1:9000/other", "http://127.0.0.1:9001/hooks/a", "http://127.0.0.1:9000/hooks/../x",
                "https://hooks.example.com.evil.test/", "http://hooks.example.com/", "https://8.8.8.8/"):
        with pytest.raises(UrlRefused, match="webhook URL prefixes"):
            check_webhook_url(url, prefixes)
    # a server that reads \ as / (IIS) resolves ..\ out of the prefix: refused, raw or percent-encoded
    for url in ("http://127.0.0.1:9000/hooks/..%5cadmin", "http://127.0.0.1:9000/hooks/..%5Cadmin",
                "http://127.0.0.1:9000/hooks/a\\b"):
        with pytest.raises(UrlRefused, match="backslash"):
            check_webhook_url(url, prefixes)
    # Tomcat, Jetty and Spring drop a segment's ;parameters before resolving dots; a double encoding decoded twice
    for url in ("http://127.0.0.1:9000/hooks/..;/admin", "http://127.0.0.1:9000/hooks/%2e%2e;/admin",
                "http://127.0.0.1:9000/hooks/%252e%252e/admin", "http://127.0.0.1:9000/hooks/a%252fb"):
        with pytest.raises(UrlRefused, match="resolve it out of the prefix"):
            check_webhook_url(url, prefixes)
    check_webhook_url("http://127.0.0.1:9000/hooks/a;v=1/b%20c..d", prefixes)  # parameters and dots elsewhere: taken


def test_webhook_urls_the_workers_would_not_post_to_are_refused_when_submitted(redis_server, model, parity_audio,
                                                                              receiver, tmp_path):
    hook = receiver(200)
    cases = [
        (Settings(redis_url=redis_server.url), "https://hooks.example.com/x", "webhooks_disabled"),
        (Settings(redis_url=redis_server.url, webhook_secret=SECRET), hook.url(), "invalid_webhook_url"),
        (Settings(redis_url=redis_server.url, webhook_secret=SECRET), "gopher://hooks.example.com/",
         "invalid_webhook_url"),
        # a NUL byte in the host was a 500 (socket.inet_aton raises ValueError for it, not OSError)
        (Settings(redis_url=redis_server.url, webhook_secret=SECRET), "http://hooks.example.com\x00/x",
         "invalid_webhook_url"),
        (Settings(redis_url=redis_server.url, webhook_secret=SECRET, webhook_url_prefixes=[hook.prefix()],
                  input_roots=[str(Path(parity_audio[0]).parent)]),
         "https://hooks.example.com/x", "invalid_webhook_url"),
    ]
    for settings, url, code in cases:
        with run_server(settings, model) as running:
            refused = httpx.post(f"{running.url}/v1/jobs", files=_upload(parity_audio), data={"webhook_url": url})
            assert refused.status_code == 400, (url, refused.text)
            assert (refused.json()["error"]["code"], refused.json()["error"]["param"]) == (code, "webhook_url")
            if settings.input_roots:  # JSON submissions are checked the same way
                body = {"items": [{"path": parity_audio[0]}], "webhook_url": url}
                assert httpx.post(f"{running.url}/v1/jobs", json=body).json()["error"]["code"] == code
            # the URL sent as a file part (a filename with it) was dropped: a job queued that would call no one
            as_file = httpx.post(f"{running.url}/v1/jobs", files=[*_upload(parity_audio),
                                                                  ("webhook_url", ("hook.txt", hook.url().encode()))])
            assert as_file.status_code == 400 and as_file.json()["error"]["param"] == "webhook_url", as_file.text
    assert redis_server.client().xlen(ITEM_STREAM) == 0  # nothing was queued
    assert hook.received == []


def test_a_name_resolving_to_a_private_address_is_refused_as_the_webhook_connects(receiver):
    host = socket.gethostname()  # a name (not an address) for this machine, resolving to one of its addresses
    hook = receiver(200)
    job = Job(id="job_x", status=JobStatus.COMPLETED, total_items=1, counts={}, created_at=0.0, started_at=None,
              finished_at=None, audio_s=0.0, compute_s=0.0, webhook_url=hook.url(host))

    async def deliver(sender: WebhookSender):
        try:
            return await sender.attempt(job)
        finally:
            await sender.close()

    check_webhook_url(hook.url(host), [])  # a name passes the check made when the job is submitted
    refused = asyncio.run(deliver(WebhookSender(SECRET, delays_s=(0.1, 0.1))))
    assert (refused.delivered, refused.retry_in_s) == (False, None) and "no public address" in refused.error
    assert hook.received == []
    # the receiver is there: under a prefix the operator configured, the same name is posted to
    delivered = asyncio.run(deliver(WebhookSender(SECRET, url_prefixes=[hook.prefix(host)])))
    assert delivered.delivered and len(hook.received) == 1


def test_the_public_address_resolver_drops_local_addresses():
    async def resolve():
        resolver = PublicAddressResolver()
        try:
            return await resolver.resolve("localhost", 80, socket.AF_UNSPEC)
        finally:
            await resolver.close()

    with pytest.raises(NoPublicAddress):
        asyncio.run(resolve())


@pytest.mark.parametrize(("statuses", "outcome"), [
    ((500, 503, 200), ("delivered", 3, None)),  # retried after each wait
    ((429, 200), ("delivered", 2, None)),
    ((410,), ("failed", 1, "HTTP 410 Gone")),  # refused: not retried
    ((302,), ("failed", 1, "HTTP 302 Found")),  # redirects are not followed
])
def test_each_delivery_outcome_is_recorded_on_the_job(redis_server, model, parity_audio, receiver, statuses,
                                                       outcome):
    hook = receiver(*statuses)
    settings = Settings(redis_url=redis_server.url, webhook_secret=SECRET, webhook_url_prefixes=[hook.prefix()],
                        webhook_retry_delays_s=[0.2, 0.2])
    jobs: list[Job] = []

    async def submit(store: JobStore) -> None:
        item = ItemInput(audio="a.wav", upload=Path(parity_audio[0]).read_bytes())
        jobs.append((await store.submit([item], options=JobOptions(webhook_url=hook.url())))[0])

    asyncio.run(drain_jobs(settings, model, submit))  # stopping waits for deliveries in progress
    job = asyncio.run(JobStore.from_url(redis_server.url).get(jobs[0].id))
    assert (job.webhook_status, job.webhook_attempts, job.webhook_error) == outcome
    assert len(hook.received) == outcome[1]
    assert len({headers["webhook-id"] for headers, _ in hook.received}) == 1  # one message, redelivered


def test_a_worker_that_cannot_sign_records_why_no_webhook_came(redis_server, model, parity_audio):
    jobs: list[Job] = []

    async def submit(store: JobStore) -> None:  # straight to Redis: the API would have refused it
        jobs.append((await store.submit([ItemInput(audio="a.wav", upload=Path(parity_audio[0]).read_bytes())],
                                        options=JobOptions(webhook_url="https://hooks.example.com/x")))[0])

    asyncio.run(drain_jobs(Settings(redis_url=redis_server.url), model, submit))
    job = asyncio.run(JobStore.from_url(redis_server.url).get(jobs[0].id))
    assert (job.webhook_status, job.webhook_attempts) == ("failed", 0)
    assert "BATCHASR_WEBHOOK_SECRET" in job.webhook_error


def test_submit_cli_asks_for_a_webhook(redis_server, model, parity_audio, receiver):
    hook = receiver(200)
    settings = Settings(redis_url=redis_server.url, webhook_secret=SECRET, webhook_url_prefixes=[hook.prefix()])
    with run_server(settings, model) as running:
        def submit(webhook_url: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "service.cli", "submit", "--server", running.url,
                                   "--webhook-url", webhook_url, parity_audio[0]], capture_output=True, text=True,
                                  timeout=60)
        taken = submit(hook.url())
        assert taken.returncode == 0, taken.stderr
        job = json.loads(taken.stdout)
        assert job["webhook"]["url"] == hook.url()
        _wait_for(lambda: hook.received, 60, "no webhook arrived")
        assert json.loads(hook.received[0][1])["data"]["id"] == job["id"]
        refused = submit("http://10.0.0.1/hook")
    assert refused.returncode == 2 and "not under the server's webhook URL prefixes" in refused.stderr


# --- at least once: deliveries are queued with the job's end, and survive the worker that took them ------------


async def _finished_job_with_webhook(store: JobStore, url: str) -> str:
    """A job ended by cancelling its one queued item: the script that ends it queues the webhook."""
    job, _ = await store.submit([ItemInput(audio="a.wav", upload=b"RIFF")], options=JobOptions(webhook_url=url))
    await store.cancel(job.id)
    return job.id


async def _delivery_left_by_a_killed_worker(store: JobStore, hook: Receiver, name: str) -> str:
    """A finished job whose webhook delivery worker ``name`` took, posted to ``hook`` (which must hang), and was
    killed in (no acknowledgement, no hand-back); the job's id."""
    job_id = await _finished_job_with_webhook(store, hook.url())
    doomed = WebhookWorker(store, WebhookSender(SECRET, url_prefixes=[hook.prefix()]), name, Metrics())
    assert await doomed.step(block_ms=100) == 1
    await asyncio.to_thread(_wait_for, lambda: hook.received, 10, "the first delivery never arrived")
    for task in list(doomed._deliveries):
        task.cancel()
    await doomed.sender.close()
    return job_id


def _left_by_a_killed_worker_then_drained(redis_url: str, hook: Receiver, killed: str, name: str, pause_s: float = 0.0,
                                          **options) -> tuple[Job, float, int]:
    """A delivery left by worker ``killed`` (``_delivery_left_by_a_killed_worker``), then, ``pause_s`` later, what a
    fresh worker ``name`` drains: the job after, how many deliveries that worker counted, how many stay pending."""

    async def scenario() -> tuple[Job, float]:
        store = JobStore.from_url(redis_url)
        await store.ensure_group()
        job_id = await _delivery_left_by_a_killed_worker(store, hook, killed)
        await asyncio.sleep(pause_s)
        sender, metrics = WebhookSender(SECRET, url_prefixes=[hook.prefix()]), Metrics()
        await WebhookWorker(store, sender, name, metrics, **options).drain()
        await sender.close()
        job = await store.get(job_id)
        await store.close()
        return job, _count(metrics, "delivered")

    job, delivered = asyncio.run(scenario())
    return job, delivered, redis.Redis.from_url(redis_url).xpending(WEBHOOK_STREAM, GROUP)["pending"]


def _count(metrics: Metrics, outcome: str) -> float:
    return metrics.registry.get_sample_value("batchasr_webhooks_total", {"outcome": outcome}) or 0.0


async def _deliver_the_rest(store: JobStore, hook: Receiver, job_id: str, **options: float) -> Job:
    """Deliver what is queued with a fresh worker, which must count one delivery; the job after (the store is
    closed)."""
    sender = WebhookSender(SECRET, url_prefixes=[hook.prefix()])
    metrics = Metrics()
    await WebhookWorker(store, sender, "next", metrics, **options).drain()
    assert _count(metrics, "delivered") == 1
    await sender.close()
    job = await store.get(job_id)
    await store.close()
    return job


def test_a_job_cancelled_before_any_worker_took_it_still_gets_its_webhook(redis_server, receiver):
    hook = receiver(200)

    async def scenario() -> Job:
        store = JobStore.from_url(redis_server.url)
        await store.ensure_group()
        job_id = await _finished_job_with_webhook(store, hook.url())
        return await _deliver_the_rest(store, hook, job_id)

    job = asyncio.run(scenario())
    assert (job.status, job.webhook_status, job.webhook_attempts) == (JobStatus.CANCELLED, "delivered", 1)
    assert json.loads(hook.received[0][1])["data"] == {"id": job.id, "status": "cancelled"}
    assert redis_server.client().xpending(WEBHOOK_STREAM, GROUP)["pending"] == 0


def test_a_purged_job_is_not_announced(redis_server, receiver):
    """A job deleted (purge) after it ended, before its webhook went out: the delivery is dropped, nothing is
    posted, and nothing of the job comes back."""
    hook = receiver(200)

    async def scenario() -> str:
        store = JobStore.from_url(redis_server.url)
        await store.ensure_group()
        job_id = await _finished_job_with_webhook(store, hook.url())
        await store.delete(job_id)
        sender = WebhookSender(SECRET, url_prefixes=[hook.prefix()])
        await WebhookWorker(store, sender, "next", Metrics()).drain()
        await sender.close()
        await store.close()
        return job_id

    job_id = asyncio.run(scenario())
    assert hook.received == []
    assert redis_server.client().xpending(WEBHOOK_STREAM, GROUP)["pending"] == 0
    assert not redis_server.client().keys(f"*{job_id}*")


def test_a_worker_stopping_with_redis_full_leaves_its_deliveries_pending_and_stops_cleanly(redis_server, receiver):
    """A full Redis refuses the hand-back (a transaction that adds an entry): the refusal escaped the worker's run,
    past what follows it at a stop. The delivery is left pending, for another worker to take."""
    hook = receiver(None, 200)
    client = redis_server.client()

    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url)
        await store.ensure_group()
        await _finished_job_with_webhook(store, hook.url())
        stop = asyncio.Event()
        stopping = WebhookWorker(store, WebhookSender(SECRET, url_prefixes=[hook.prefix()]), "stopping", Metrics(),
                                 stop_grace_s=0.2)
        running = asyncio.create_task(stopping.run(stop, block_ms=100))
        await asyncio.to_thread(_wait_for, lambda: hook.received, 10, "the first delivery never arrived")
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", 1)
        stop.set()
        await running  # no OutOfMemoryError
        await stopping.close()
        await store.close()

    try:
        asyncio.run(scenario())
    finally:
        client.config_set("maxmemory", 0)
    assert client.xpending(WEBHOOK_STREAM, GROUP)["pending"] == 1


def test_a_delivery_whose_worker_died_is_reclaimed_by_another(redis_server, receiver):
    hook = receiver(None, 200)  # the first delivery hangs: its worker dies meanwhile
    job, delivered, pending = _left_by_a_killed_worker_then_drained(redis_server.url, hook, "doomed", "next", 0.6,
                                                                    claim_idle_s=0.5)
    assert (job.webhook_status, job.webhook_attempts, delivered, pending) == ("delivered", 1, 1, 0)
    assert len(hook.received) == 2  # the same message twice, as at-least-once allows
    assert len({headers["webhook-id"] for headers, _ in hook.received}) == 1


def test_a_stopping_worker_hands_its_deliveries_back_at_once(redis_server, receiver):
    hook = receiver(None, 200)

    async def scenario() -> Job:
        store = JobStore.from_url(redis_server.url)
        await store.ensure_group()
        job_id = await _finished_job_with_webhook(store, hook.url())
        stop = asyncio.Event()
        metrics = Metrics()
        stopping = WebhookWorker(store, WebhookSender(SECRET, url_prefixes=[hook.prefix()]), "stopping", metrics,
                                 stop_grace_s=0.2)
        running = asyncio.create_task(stopping.run(stop, block_ms=100))
        await asyncio.to_thread(_wait_for, lambda: hook.received, 10, "the first delivery never arrived")
        stop.set()
        await running
        assert redis_server.client().xpending(WEBHOOK_STREAM, GROUP)["pending"] == 0  # handed back, not held
        assert _count(metrics, "handed_back") == 1
        await stopping.sender.close()
        return await _deliver_the_rest(store, hook, job_id)  # at once: no claim timeout to wait for

    job = asyncio.run(scenario())
    assert (job.webhook_status, job.webhook_attempts) == ("delivered", 1)
    assert len(hook.received) == 2


async def _failed_job_with_webhook(store: JobStore, url: str) -> str:
    """A job of one path item that failed: it ends, and its webhook is queued; a retry queues the item again."""
    job, _ = await store.submit([ItemInput(audio="a.wav", path="/audio/a.wav")], options=JobOptions(webhook_url=url))
    await store.start_item(job.id, 0)
    await store.finish_item(job.id, 0, "failed", item_record("a.wav", "failed", error="unreadable"), error="unreadable")
    return job.id


async def _completed_again(store: JobStore, job_id: str) -> None:
    await store.start_item(job_id, 0)
    assert await store.finish_item(job_id, 0, "completed", item_record("a.wav", "completed", text="a")) == 2


@pytest.mark.parametrize("retried", ["while the first end's webhook is sent", "before a worker took it"])
def test_a_job_retried_after_it_ended_announces_its_next_end_under_a_new_id(redis_server, receiver, retried):
    """A retry makes a job owe its webhook again. The first end's delivery, finishing after the retry, marked the
    job's webhook delivered, so the second end's was dropped unsent; one not yet taken at the retry announced the
    job in progress as finished. Both ends' webhooks had one webhook-id, which receivers deduplicate on."""
    hook = receiver(None, 200) if retried.startswith("while") else receiver(200)

    async def scenario() -> Job:
        store = JobStore.from_url(redis_server.url)
        await store.ensure_group()
        job_id = await _failed_job_with_webhook(store, hook.url())
        first = WebhookWorker(store, WebhookSender(SECRET, url_prefixes=[hook.prefix()]), "first", Metrics())
        if retried.startswith("while"):
            assert await first.step(block_ms=100) == 1
            await asyncio.to_thread(_wait_for, lambda: hook.received, 10, "the first delivery never arrived")
        assert (await store.retry_failed(job_id)).retried == 1
        hook.release.set()  # the first end's delivery finishes now, if it was under way
        await first.drain()
        await first.sender.close()
        await _completed_again(store, job_id)
        return await _deliver_the_rest(store, hook, job_id)

    job = asyncio.run(scenario())
    assert (job.status, job.ends, job.webhook_status, job.webhook_attempts) == (JobStatus.COMPLETED, 2, "delivered", 1)
    sent = [(headers["webhook-id"], json.loads(body)["data"]["status"]) for headers, body in hook.received]
    announced = [(f"msg_{job.id}_finished", "failed")] if retried.startswith("while") else []
    assert sent == [*announced, (f"msg_{job.id}_finished_2", "completed")]
    assert redis_server.client().xpending(WEBHOOK_STREAM, GROUP)["pending"] == 0


def test_the_webhook_worker_makes_its_group_on_a_fresh_redis(redis_server):
    """It starts beside the job consumer, which may not have made the consumer group yet (that race left a
    server without webhooks now and then)."""
    async def scenario() -> int:
        store = JobStore.from_url(redis_server.url)
        try:
            return await WebhookWorker(store, None, "first", Metrics()).step(block_ms=10)
        finally:
            await store.close()

    assert asyncio.run(scenario()) == 0
    assert redis_server.client().xinfo_groups(WEBHOOK_STREAM)[0]["name"] == GROUP.encode()


def test_a_delivery_redis_restarted_under_is_made_again_once_it_is_back(tmp_path, receiver):
    """Redis went away while a webhook was being posted: its outcome could not be recorded, so its entry stayed
    pending (the append-only file kept it), and the worker, riding out the restart, reclaims and delivers it."""
    from tests.redis_server import RedisServer

    hook = receiver(None, 200)  # the first post is answered only once Redis is down
    server = RedisServer(tmp_path, appendonly=True).start()

    async def scenario() -> Job:
        store = JobStore.from_url(server.url)
        await store.ensure_group()
        job_id = await _finished_job_with_webhook(store, hook.url())
        stop = asyncio.Event()
        worker = WebhookWorker(store, WebhookSender(SECRET, url_prefixes=[hook.prefix()]), "w", Metrics(),
                               claim_idle_s=0.5, reclaim_interval_s=0.2)
        running = asyncio.create_task(worker.run(stop, block_ms=100))
        await asyncio.to_thread(_wait_for, lambda: hook.received, 10, "the first delivery never arrived")
        await asyncio.to_thread(server.stop)
        hook.release.set()
        await asyncio.sleep(0.5)  # the delivery ends, and its outcome finds no Redis
        await asyncio.to_thread(server.start)
        job_key = f"batchasr:job:{job_id}"
        await asyncio.to_thread(_wait_for, lambda: server.client().hget(job_key, "webhook_status") != b"pending", 30,
                                "the delivery was not made again after the restart")
        stop.set()
        await running
        await worker.close()
        job = await store.get(job_id)
        await store.close()
        return job

    try:
        job = asyncio.run(scenario())
        assert server.client().xpending(WEBHOOK_STREAM, GROUP)["pending"] == 0
    finally:
        server.stop()
    assert (job.webhook_status, job.webhook_attempts) == ("delivered", 1)
    assert len(hook.received) == 2 and len({headers["webhook-id"] for headers, _ in hook.received}) == 1


def test_a_delivery_whose_read_reply_was_lost_as_redis_restarted_is_taken_back_once_it_is_back(tmp_path, receiver,
                                                                                                 caplog):
    """A read that Redis answered as it stopped left its delivery pending under the worker's name, unseen: it
    waited out the claim timeout (5 minutes) before anyone posted it. A worker holding its name now takes back,
    once Redis is back, the deliveries to the name that it does not have in hand."""
    from tests.redis_server import RedisServer, first_reply_lost

    hook = receiver(200)
    server = RedisServer(tmp_path, appendonly=True).start()

    async def scenario() -> Job:
        store = JobStore.from_url(server.url)
        await store.ensure_group()
        job_id = await _finished_job_with_webhook(store, hook.url())
        lost: list = []
        store.redis.xreadgroup = first_reply_lost(store.redis.xreadgroup, server, lost)
        stop = asyncio.Event()
        worker = WebhookWorker(store, WebhookSender(SECRET, url_prefixes=[hook.prefix()]), "w", Metrics(),
                               name_held=lambda: True)  # the claim timeout as shipped: 300 s
        running = asyncio.create_task(worker.run(stop, block_ms=100))
        job_key = f"batchasr:job:{job_id}"

        def delivered() -> bool:
            try:
                return server.client().hget(job_key, "webhook_status") == b"delivered"
            except redis.ConnectionError:  # the restart under way
                return False

        await asyncio.to_thread(_wait_for, delivered, 30,
                                "the delivery whose reply was lost was not made once Redis was back")
        stop.set()
        await running
        await worker.close()
        await store.close()
        return lost

    try:
        with caplog.at_level(logging.INFO, logger="service.webhook_worker"):
            lost = asyncio.run(scenario())
        assert server.client().xpending(WEBHOOK_STREAM, GROUP)["pending"] == 0
    finally:
        server.stop()
    assert lost and len(hook.received) == 1, caplog.text
    assert "took back 1 webhook deliveries delivered to this worker while Redis was away (consumer w)" in caplog.text


@pytest.mark.parametrize("name_held", [True, False])
def test_a_worker_restarted_under_its_name_takes_back_its_previous_lifes_delivery_at_once(redis_server, receiver,
                                                                                         name_held):
    """A worker killed mid-delivery and started again under its name (a container restarted in place) posts the
    delivery its previous life left at once, not after the claim timeout; one that another running instance's
    lease keeps from the name leaves it to the claim timeout, as it may be that instance's in hand."""
    hook = receiver(None, 200)  # the first delivery hangs: its worker is killed meanwhile
    job, delivered, pending = _left_by_a_killed_worker_then_drained(redis_server.url, hook, "w", "w",
                                                                    name_held=lambda: name_held)
    if name_held:
        assert (job.webhook_status, job.webhook_attempts, delivered, pending) == ("delivered", 1, 1, 0)
        assert len(hook.received) == 2 and len({headers["webhook-id"] for headers, _ in hook.received}) == 1
    else:
        assert (job.webhook_status, delivered, pending, len(hook.received)) == ("pending", 0, 1, 1)


@pytest.mark.parametrize("judged", [True, False])
def test_a_delivery_whose_worker_is_gone_is_taken_once_no_one_holds_its_name(redis_server, receiver, judged):
    """A worker killed mid-delivery and replaced under a new name (a pod rescheduled): once no running worker holds
    its name, another takes its delivery without waiting out the claim timeout (5 minutes); not while the job
    consumer beside it may not judge (``gone_after_s`` None: just connected, or not holding its own name)."""
    hook = receiver(None, 200)
    job, delivered, pending = _left_by_a_killed_worker_then_drained(  # pod-a held no name lease
        redis_server.url, hook, "pod-a", "pod-b", 0.6, gone_after_s=lambda: 0.5 if judged else None)
    if judged:
        assert (job.webhook_status, job.webhook_attempts, delivered, pending) == ("delivered", 1, 1, 0)
    else:
        assert (job.webhook_status, delivered, pending) == ("pending", 0, 1)


def test_the_job_consumers_webhook_deliveries_judge_names_only_while_it_holds_its_own(redis_server, model):
    stack = build_stack(Settings(redis_url=redis_server.url), model)

    async def scenario() -> list[tuple[bool, float | None]]:
        try:
            consumer = stack.make_consumer()
            deliveries = consumer.webhook_deliveries
            said = [(deliveries.name_held(), deliveries.gone_after_s())]
            await consumer._renew_name()
            consumer._connected_since = time.monotonic()
            said.append((deliveries.name_held(), deliveries.gone_after_s()))  # may not judge others yet
            consumer._connected_since -= consumer.options.name_lease_s
            said.append((deliveries.name_held(), deliveries.gone_after_s()))
            return said
        finally:
            await stack.stop()

    assert asyncio.run(scenario()) == [(False, None), (True, None), (True, 15.0)]


@pytest.mark.parametrize("meanwhile", ["deleted", "ended again"])
def test_a_job_deleted_or_ended_again_in_a_retry_pause_is_not_announced_after_it(redis_server, receiver, meanwhile):
    """Whether a delivery was still owed was asked once, before its first attempt: a job deleted while its webhook
    waited between attempts was announced anyway, and a job that failed, was retried and completed meanwhile had
    its earlier end's "failed" posted after its "completed", the receiver's last word on it. Each retry asks now."""
    hook = receiver(503, 200)

    async def scenario() -> tuple[str, Metrics]:
        store = JobStore.from_url(redis_server.url)
        await store.ensure_group()
        job_id = await _failed_job_with_webhook(store, hook.url())
        metrics = Metrics()
        worker = WebhookWorker(store, WebhookSender(SECRET, url_prefixes=[hook.prefix()], delays_s=(1.0,)), "w",
                               metrics)
        assert await worker.step(block_ms=100) == 1
        await asyncio.to_thread(_wait_for, lambda: hook.received, 10, "the first attempt never arrived")
        if meanwhile == "deleted":
            await store.delete(job_id)
        else:
            assert (await store.retry_failed(job_id)).retried == 1
            await _completed_again(store, job_id)
        await worker.drain()
        await worker.close()
        await store.close()
        return job_id, metrics

    job_id, metrics = asyncio.run(scenario())
    sent = [(headers["webhook-id"], json.loads(body)["data"]["status"]) for headers, body in hook.received]
    if meanwhile == "deleted":
        assert sent == [(f"msg_{job_id}_finished", "failed")]  # the first attempt's 503 alone
        assert not redis_server.client().keys(f"*{job_id}*")
    else:  # the first end's retry dropped; the second end's webhook is its own, in order
        assert sent == [(f"msg_{job_id}_finished", "failed"), (f"msg_{job_id}_finished_2", "completed")]
    assert _count(metrics, "dropped") == 1
    assert redis_server.client().xpending(WEBHOOK_STREAM, GROUP)["pending"] == 0


def test_a_delivery_is_recorded_with_redis_at_its_memory_limit(redis_server, receiver):
    """Recording the outcome was refused at maxmemory (the script lacked allow-oom, as finishing an item has it): the
    error escaped the delivery task unlogged, the entry stayed pending and was posted again at each reclaim. The
    record is three small fields and an acknowledgement, which frees memory: it is written."""
    hook = receiver(200)
    client = redis_server.client()

    async def scenario() -> Job:
        store = JobStore.from_url(redis_server.url)
        await store.ensure_group()
        job_id = await _finished_job_with_webhook(store, hook.url())
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", max(client.info("memory")["used_memory"] // 2, 1))
        try:
            await WebhookWorker(store, WebhookSender(SECRET, url_prefixes=[hook.prefix()]), "w", Metrics()).drain()
        finally:
            client.config_set("maxmemory", 0)
        job = await store.get(job_id)
        await store.close()
        return job

    job = asyncio.run(scenario())
    assert (job.webhook_status, job.webhook_attempts, len(hook.received)) == ("delivered", 1, 1)
    assert client.xpending(WEBHOOK_STREAM, GROUP)["pending"] == 0


@pytest.mark.parametrize("secret", ["whsec_" + base64.b64encode(SECRET_RAW).decode(),
                                    base64.b64encode(SECRET_RAW).decode()], ids=["whsec", "bare base64"])
def test_a_secret_is_decoded_as_receivers_libraries_decode_it(secret):
    """A secret without the whsec_ prefix was signed with as its own bytes, while Standard Webhooks' libraries
    base64-decode it: no receiver could verify a signature. Both forms sign alike now."""
    body = b'{"type": "transcription.job.completed"}'
    headers = {"webhook-id": "msg_1", "webhook-timestamp": str(int(time.time()))}
    headers["webhook-signature"] = sign(Settings(webhook_secret=secret).webhook_secret, "msg_1",
                                        int(headers["webhook-timestamp"]), body)
    Webhook(secret).verify(body, headers)  # raises where the signature does not verify


@pytest.mark.parametrize("secret", ["s3cr3tpassphrase", "whsec_c2hvcnQ=", "not base64 at all!"])
def test_a_secret_receivers_could_not_verify_with_is_refused_at_start(secret):
    """A passphrase (base64 by accident: 12 bytes), a short key, or no base64 at all: refused with how to make one,
    not found out from every receiver's failed verification."""
    with pytest.raises(ValueError, match=r"whsec_ and base64.*os\.urandom"):
        Settings(webhook_secret=secret)


def test_a_failing_receiver_does_not_hold_up_other_webhooks(redis_server, receiver):
    """A retry waited in its delivery's slot: 32 jobs pointing at a broken receiver held a worker's every slot for
    48 s (114 s if it hung), and everyone else's webhooks waited. A failed attempt now leaves the slot, its retry kept
    in Redis: with one slot, the healthy receiver's webhook goes out while the broken one's waits."""
    broken, healthy = receiver(503), receiver(200)

    async def scenario() -> tuple[Job, Job, int]:
        store = JobStore.from_url(redis_server.url)
        await store.ensure_group()
        failing = await _finished_job_with_webhook(store, broken.url())
        fine = await _finished_job_with_webhook(store, healthy.url())
        sender = WebhookSender(SECRET, url_prefixes=[broken.prefix(), healthy.prefix()], delays_s=(60.0,))
        worker = WebhookWorker(store, sender, "w", Metrics(), in_flight=1)
        for _ in range(50):
            await worker.step(block_ms=50)
            if healthy.received:
                break
        await asyncio.gather(*worker._deliveries, return_exceptions=True)
        await worker.close()
        jobs = await store.get(failing), await store.get(fine)
        scheduled = await store.scheduled_webhooks()
        assert await store.promote_webhooks() == (0, 1)  # none due: a minute away (batchasr_webhooks_waiting 1)
        await store.close()
        return *jobs, scheduled

    failing, fine, scheduled = asyncio.run(scenario())
    assert len(healthy.received) == 1 and fine.webhook_status == "delivered"
    assert len(broken.received) == 1 and scheduled == 1  # its retry waits in Redis, a minute from now
    unavailable = "HTTP 503 Service Unavailable"
    assert (failing.webhook_status, failing.webhook_attempts, failing.webhook_error) == ("pending", 1, unavailable)
    assert redis_server.client().xpending(WEBHOOK_STREAM, GROUP)["pending"] == 0  # no slot, no stream entry held


async def _announce(redis_url: str, hook: Receiver, delays_s: tuple[float, ...]) -> tuple[Job, Metrics]:
    """A job ended with a webhook to ``hook``, delivered by a worker retrying after ``delays_s`` until nothing is left
    to try; the job after, and the worker's counts."""
    store = JobStore.from_url(redis_url)
    await store.ensure_group()
    job_id = await _finished_job_with_webhook(store, hook.url())
    metrics = Metrics()
    worker = WebhookWorker(store, WebhookSender(SECRET, url_prefixes=[hook.prefix()], delays_s=delays_s), "w", metrics)
    await worker.drain()
    await worker.close()
    job = await store.get(job_id)
    await store.close()
    return job, metrics


def test_a_receiver_down_past_the_first_waits_gets_its_webhook_after_its_retry_after(redis_server, receiver):
    """All attempts fitted in 48 s, and a receiver down for a minute lost the webhook for good; its Retry-After was
    not read. The waits run to hours now (here, short ones), and a Retry-After longer than the next wait wins."""
    hook = receiver(503, 503, 503, 200, retry_after="1")
    job, metrics = asyncio.run(_announce(redis_server.url, hook, (0.1,) * 5))
    assert (job.webhook_status, job.webhook_attempts, job.webhook_error) == ("delivered", 4, None)
    assert all(later - earlier >= 0.95 for earlier, later in itertools.pairwise(hook.times)), hook.times
    assert len({headers["webhook-id"] for headers, _ in hook.received}) == 1
    assert (_count(metrics, "retried"), _count(metrics, "delivered")) == (3, 1)
    assert metrics.registry.get_sample_value("batchasr_webhooks_waiting") == 0  # as the last look found it


def test_a_webhook_fails_for_good_once_its_waits_run_out(redis_server, receiver):
    hook = receiver(503)
    job, metrics = asyncio.run(_announce(redis_server.url, hook, (0.1, 0.1)))
    unavailable = "HTTP 503 Service Unavailable"
    assert (job.webhook_status, job.webhook_attempts, job.webhook_error) == ("failed", 3, unavailable)
    assert len(hook.received) == 3 and (_count(metrics, "retried"), _count(metrics, "failed")) == (2, 1)
    assert redis_server.client().zcard("batchasr:webhooks:later") == 0


def test_submit_through_a_server_sends_the_webhook_url_as_given(redis_server, model, parity_audio, receiver, capsys):
    """batchasr submit's upload form lowercased every field, the webhook URL with them: a receiver's path or token
    (Hook?token=AbC) became another, whose 404 was never retried."""
    from service.cli import main

    hook = receiver(200)
    url = f"{hook.prefix()}Hook?token=AbC"
    settings = Settings(redis_url=redis_server.url, webhook_secret=SECRET, webhook_url_prefixes=[hook.prefix()])
    with run_server(settings, model) as running:
        assert main(["submit", "--server", running.url, "--webhook-url", url, parity_audio[0]]) == 0
        (line,) = capsys.readouterr().out.splitlines()
        job = httpx.get(f"{running.url}/v1/jobs/{json.loads(line)['id']}").json()
        assert job["webhook"]["url"] == url


def test_a_receiver_that_does_not_answer_in_time_is_recorded_as_such(redis_server, receiver):
    """A timeout's own message is empty: the job showed `TimeoutError: ` and nothing else."""
    hook = receiver(None)  # holds its answer

    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url)
        sender = WebhookSender(SECRET, url_prefixes=[hook.prefix()], timeout_s=0.5)
        try:
            job_id = await _finished_job_with_webhook(store, hook.url())
            attempt = await sender.attempt(await store.get(job_id))
            assert not attempt.delivered and attempt.error == "TimeoutError: no answer within 0.5 s"
            assert attempt.retry_in_s is not None  # tried again
        finally:
            await sender.close()
            await store.close()

    asyncio.run(scenario())
