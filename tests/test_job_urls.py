"""Job items by URL against a real media site: which URLs a server takes, fetching with redirects, retries and
limits, each failure failing only its item, and bodies kept on disk."""

from __future__ import annotations

import asyncio
import functools
import json
import subprocess
import sys
import threading
import time
import tracemalloc
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import httpx
import numpy as np
import pytest

from service import url_inputs
from service.config import Settings
from service.job_types import JobInputError
from service.spool import NoRoomForInput
from service.url_inputs import check_input_url
from tests.ports import free_port
from tests.servers import run_server, wait_job


class AudioSite:
    """A real HTTP server with the parity clips under /clips/, and the ways a media host misbehaves: /clips/flaky/
    answers 503 twice per clip first, /clips/moved/ redirects back into /clips/, /clips/away redirects off the
    allowed prefix, /clips/huge streams more than the upload limit without saying its length, /clips/drip/ and
    /clips/drip-chunked/ send a clip a byte every 50 ms (with its length, and without), and /private/ holds a clip
    outside the prefix."""

    def __init__(self, parity_audio: list[str], huge_bytes: int):
        self.clips = {Path(p).name: Path(p).read_bytes() for p in parity_audio}
        self.requests: dict[str, int] = {}
        site = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                site.requests[self.path] = site.requests.get(self.path, 0) + 1
                name = self.path.rsplit("/", 1)[-1]
                if self.path.startswith("/clips/flaky/") and site.requests[self.path] <= 2:
                    self._send(503, b"busy")
                elif self.path.startswith("/clips/moved/"):
                    self._redirect(f"/clips/{name}")
                elif self.path == "/clips/away":
                    self._redirect(f"http://127.0.0.1:{site.port}/private/{next(iter(site.clips))}")
                elif self.path == "/clips/huge":
                    self.send_response(200)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    chunk = b"\0" * 65536
                    for _ in range(huge_bytes // len(chunk) + 1):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.write(b"0\r\n\r\n")
                elif self.path.startswith("/clips/drip") and name in site.clips:
                    self._drip(site.clips[name], chunked=self.path.startswith("/clips/drip-chunked/"))
                elif self.path.startswith(("/clips/", "/private/")) and name in site.clips:
                    self._send(200, site.clips[name])
                else:
                    self._send(404, b"no such clip")

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _drip(self, body: bytes, chunked: bool) -> None:
                self.send_response(200)
                self.send_header(*(("Transfer-Encoding", "chunked") if chunked else ("Content-Length", str(len(body)))))
                self.end_headers()
                try:
                    for byte in body:
                        self.wfile.write(b"1\r\n%c\r\n" % byte if chunked else bytes([byte]))
                        self.wfile.flush()
                        time.sleep(0.05)
                except OSError:  # the client gave up
                    pass

            def _redirect(self, location: str) -> None:
                self.send_response(302)
                self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_which_urls_a_server_takes():
    prefixes = ["https://bucket.example.com/audio/", "http://127.0.0.1:8900/clips"]
    taken = ["https://bucket.example.com/audio/a.wav", "https://BUCKET.example.com:443/audio/x/y.flac?sig=1",
             "http://127.0.0.1:8900/clips/a.wav", "http://127.0.0.1:8900/clips",
             "https://bucket.example.com/audio/50%2525%20off.wav"]  # a key "50%25 off.wav": one encoding left
    refused = ["https://bucket.example.com/audio/../secret", "https://bucket.example.com/audio/%2e%2e/secret",
               # a server that decodes twice, or drops a segment's ;parameters (Tomcat, Jetty), steps out
               "https://bucket.example.com/audio/%252e%252e/x", "https://bucket.example.com/audio/..;/secret",
               "https://bucket.example.com.evil.com/audio/a.wav", "http://bucket.example.com/audio/a.wav",
               "https://bucket.example.com:8443/audio/a.wav", "http://127.0.0.1:8900/clipsX/a.wav",
               "file:///etc/passwd", "ftp://bucket.example.com/audio/a", "not a url"]
    for url in taken:
        check_input_url(url, prefixes)
    for url in refused:
        with pytest.raises(JobInputError):
            check_input_url(url, prefixes)
    with pytest.raises(JobInputError, match="BATCHASR_INPUT_URL_PREFIXES"):
        check_input_url(taken[0], [])


def test_url_items_are_fetched_and_each_failure_fails_only_its_item(redis_server, model, parity_audio, expected,
                                                                      monkeypatch):
    monkeypatch.setattr(url_inputs, "RETRY_DELAYS_S", (0.05, 0.1, 0.2))
    limit = 2 * 1024 * 1024
    site = AudioSite(parity_audio, limit)
    dead = f"http://127.0.0.1:{free_port()}/"  # nothing listens there
    names = sorted(site.clips)
    # a host down past an attempt's tries: the item comes back after the visibility timeout, until its attempts end
    settings = Settings(redis_url=redis_server.url, input_url_prefixes=[f"{site.url}/clips/", dead],
                        max_upload_bytes=limit, job_visibility_timeout_s=1, job_max_attempts=2)
    items = {f"{site.url}/clips/{names[0]}": "completed", f"{site.url}/clips/moved/{names[1]}": "completed",
             f"{site.url}/clips/flaky/{names[2]}": "completed", f"{site.url}/clips/missing.wav": "HTTP 404",
             f"{site.url}/clips/huge": "upload limit", f"{site.url}/clips/away": "not under",
             f"{dead}a.wav": "ClientConnectorError"}
    try:
        with run_server(settings, model) as running:
            submitted = httpx.post(f"{running.url}/v1/jobs", json={"items": [{"url": u} for u in items]}, timeout=30)
            assert submitted.status_code == 202, submitted.text
            job_id = submitted.json()["id"]
            job = wait_job(running.url, job_id, 60)
            results = httpx.get(f"{running.url}/v1/jobs/{job_id}/results").text
            lines = [json.loads(line) for line in results.splitlines()]
    finally:
        site.close()
    assert job["status"] == "completed_with_errors" and job["counts"]["failed"] == 4
    for (url, outcome), line in zip(items.items(), lines, strict=True):
        assert line["audio"] == url
        if outcome == "completed":
            assert line["status"] == "completed" and line["text"] == expected[url.rsplit("/", 1)[-1]]
        else:
            assert line["status"] == "failed" and outcome in line["error"], (url, line["error"])
    assert site.requests[f"/clips/flaky/{names[2]}"] == 3  # two 503s, then the clip
    # refused connections are tried again, in two attempts, then given up
    assert lines[-1]["error"].startswith("gave up after 2 attempts: ") and "(4 tries)" in lines[-1]["error"]
    assert not any(path.startswith("/private/") for path in site.requests)  # the redirect off the prefix: not taken


def test_a_url_whose_body_drips_is_given_up_and_tried_again(parity_audio):
    site = AudioSite(parity_audio, 0)
    name = sorted(site.clips)[0]
    fetcher = url_inputs.UrlFetcher([f"{site.url}/clips/"], 1 << 20, timeout_s=0.5, retry_delays_s=(0.0,),
                                    min_bytes_per_s=100)

    async def fetch(url: str) -> bytes:
        with await fetcher.fetch(url) as body:
            return body.read()

    async def fetch_all() -> list[bytes | Exception]:
        try:
            return await asyncio.gather(*(fetch(f"{site.url}/clips/{path}{name}")
                                          for path in ("", "drip/", "drip-chunked/")), return_exceptions=True)
        finally:
            await fetcher.close()

    try:
        began = time.monotonic()
        whole, dripped, dripped_chunked = asyncio.run(fetch_all())
        took = time.monotonic() - began
    finally:
        site.close()
    assert whole == site.clips[name]  # a body that comes quickly is taken whatever its size
    for failure in (dripped, dripped_chunked):  # 20 bytes a second, below 100: each try stops within a second
        assert isinstance(failure, url_inputs.SourceUnavailable) and "slower than" in str(failure)
        assert "(2 tries)" in str(failure)
        assert not isinstance(failure, (OSError, ValueError))  # the worker's to retry, not the item's failure
    assert took < 5


@pytest.fixture
def file_site(tmp_path):
    """A real HTTP server for the files of a folder; yields (folder, base URL)."""
    folder = tmp_path / "site"
    folder.mkdir()
    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield folder, f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def _fetch(url: str, prefix: str) -> bytes:
    fetcher = url_inputs.UrlFetcher([prefix], 1 << 30, retry_delays_s=())

    async def fetch() -> bytes:
        try:
            with await fetcher.fetch(url) as body:
                return body.read(64)  # a head: what it holds whole is measured, not what this test reads of it
        finally:
            await fetcher.close()

    return asyncio.run(fetch())


def test_a_fetched_body_waits_in_a_temporary_file_not_in_memory(file_site):
    """A URL's body grew in a bytearray, then was copied to bytes: three times its size in memory at once, for each
    of the consumer's 64 fetches."""
    folder, base = file_site
    recording = np.random.default_rng(5).bytes(24 << 20)
    (folder / "long.flac").write_bytes(recording)
    tracemalloc.start()
    try:
        head = _fetch(base + "long.flac", base)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert head == recording[:64]
    assert peak < 4 << 20, f"{peak / 2**20:.1f} MiB held fetching 24 MiB"


def test_a_fetch_with_no_disk_left_is_the_workers_failure_not_the_items(file_site, small_disk):
    """Failed as the item's (JobInputError, or an OSError: failed at once), a full disk would lose every item
    fetched meanwhile; NoRoomForInput is retried like any failure of the worker's."""
    folder, base = file_site
    (folder / "long.flac").write_bytes(bytes(2 << 20))  # past the 1.5 MiB disk
    with pytest.raises(NoRoomForInput, match="no disk space left"):
        _fetch(base + "long.flac", base)
    assert not isinstance(NoRoomForInput("x"), (OSError, ValueError, JobInputError))
    assert list(small_disk.iterdir()) == []  # the part received is gone


def test_url_items_are_checked_when_submitted(redis_server, model):
    with run_server(Settings(redis_url=redis_server.url, input_url_prefixes=["http://media.example/clips/"]),
                    model) as running:
        def submit(*items):
            return httpx.post(f"{running.url}/v1/jobs", json={"items": list(items)}, timeout=30)

        outside = submit({"url": "http://media.example/clips/a.wav"}, {"url": "http://media.example/private/b.wav"})
        assert outside.status_code == 400 and "not under" in outside.json()["error"]["message"]
        for bad in ({}, {"url": "http://media.example/clips/a.wav", "path": "/tmp/a.wav"}):
            refused = submit(bad)
            assert refused.status_code == 400 and "either a `path` or a `url`" in refused.json()["error"]["message"]
        assert submit({"url": "file:///etc/passwd"}).status_code == 400
    with run_server(Settings(redis_url=redis_server.url), model) as running:
        disabled = httpx.post(f"{running.url}/v1/jobs", json={"items": [{"url": "http://media.example/a.wav"}]})
        assert disabled.status_code == 400 and "BATCHASR_INPUT_URL_PREFIXES" in disabled.json()["error"]["message"]


def test_submit_cli_takes_a_list_of_urls(redis_server, model, parity_audio, expected, tmp_path):
    site = AudioSite(parity_audio, 1 << 20)
    urls = [f"{site.url}/clips/{name}" for name in sorted(site.clips)[:3]]
    listing = tmp_path / "urls.txt"
    listing.write_text("# three clips\n" + "\n".join(urls) + "\n\n")
    settings = Settings(redis_url=redis_server.url, input_url_prefixes=[f"{site.url}/clips/"])
    try:
        with run_server(settings, model) as running:
            def submit(*args):
                return subprocess.run([sys.executable, "-m", "service.cli", "submit", *args], capture_output=True,
                                      text=True, timeout=120)

            for target in (["--server", running.url], ["--redis-url", redis_server.url]):
                out = tmp_path / "results.jsonl"
                result = submit(*target, "--wait", "--output", str(out), "--url-list", str(listing))
                assert result.returncode == 0, result.stderr
                lines = [json.loads(line) for line in out.read_text().splitlines()]
                assert [r["audio"] for r in lines] == urls
                assert [r["text"] for r in lines] == [expected[u.rsplit("/", 1)[-1]] for u in urls]
            out = tmp_path / "mixed.jsonl"  # a URL and a file: two jobs, results in input order
            mixed = submit("--server", running.url, "--wait", "--output", str(out), urls[0], parity_audio[0])
            assert mixed.returncode == 0 and mixed.stderr.count(": 1 items") == 2, mixed.stderr
            lines = [json.loads(line) for line in out.read_text().splitlines()]
            assert [r["audio"] for r in lines] == [urls[0], parity_audio[0]]
            assert [r["text"] for r in lines] == [expected[urls[0].rsplit("/", 1)[-1]],
                                                  expected[Path(parity_audio[0]).name]]
            refused = submit("--server", running.url, f"{site.url}/private/a.wav")
            assert refused.returncode == 2 and "not under" in refused.stderr
    finally:
        site.close()


class _Dripping(BaseHTTPRequestHandler):
    """Answers with a status line and headers a byte every 0.2 s, each inside any read's timeout."""

    def do_GET(self):
        for byte in b"HTTP/1.1 200 OK\r\nContent-Type: audio/wav\r\nX-Padding: " + b"a" * 200:
            self.wfile.write(bytes([byte]))
            self.wfile.flush()
            time.sleep(0.2)

    def log_message(self, *args):
        pass


class _Cookies(BaseHTTPRequestHandler):
    """Sets a cookie on every answer, and keeps the Cookie header each request came with."""

    seen: ClassVar[list[str | None]] = []

    def do_GET(self):
        _Cookies.seen.append(self.headers.get("Cookie"))
        self.send_response(200)
        self.send_header("Set-Cookie", f"session=secret-of{self.path.replace('/', '-')}; Path=/")
        self.send_header("Content-Length", "4")
        self.end_headers()
        self.wfile.write(b"RIFF")

    def log_message(self, *args):
        pass


def _serving(handler: type[BaseHTTPRequestHandler]) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_server_that_drips_its_headers_is_given_up_on(tmp_path):
    """Only connecting and each read had a limit, and the body's rate was checked as its bytes came: a server
    that sent its headers a byte inside each read's timeout held the fetch, and its item, for good."""
    server = _serving(_Dripping)
    url = f"http://127.0.0.1:{server.server_address[1]}/a.wav"

    async def fetch() -> float:
        fetcher = url_inputs.UrlFetcher([url], 1 << 20, timeout_s=1.0, retry_delays_s=())
        started = time.monotonic()
        try:
            with pytest.raises(url_inputs.SourceUnavailable, match="came slower than"):
                await fetcher.fetch(url)
            return time.monotonic() - started
        finally:
            await fetcher.close()

    try:
        assert asyncio.run(fetch()) < 3
    finally:
        server.shutdown()


def test_a_cookie_one_fetch_was_given_is_not_sent_with_the_next():
    """The consumer's one HTTP session kept cookies: one job's fetch was given a cookie that the next fetch from
    that host sent, another key's job's."""
    server = _serving(_Cookies)
    prefix = f"http://127.0.0.1:{server.server_address[1]}/"
    _Cookies.seen.clear()

    async def fetch_two() -> None:
        fetcher = url_inputs.UrlFetcher([prefix], 1 << 20, timeout_s=5.0, retry_delays_s=())
        try:
            for name in ("tenant-a.wav", "tenant-b.wav"):
                (await fetcher.fetch(prefix + name)).close()
        finally:
            await fetcher.close()

    try:
        asyncio.run(fetch_two())
    finally:
        server.shutdown()
    assert _Cookies.seen == [None, None]


class _RateLimited(BaseHTTPRequestHandler):
    """429 with Retry-After: 1 the first time, then the body; keeps when each request came."""

    times: ClassVar[list[float]] = []

    def do_GET(self):
        _RateLimited.times.append(time.monotonic())
        if len(_RateLimited.times) == 1:
            self.send_response(429)
            self.send_header("Retry-After", "1")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", "4")
        self.end_headers()
        self.wfile.write(b"RIFF")

    def log_message(self, *args):
        pass


def test_a_hosts_retry_after_is_waited_before_the_next_try():
    """A 429 or 503 with Retry-After (a CDN's or a bucket's rate limit) was tried again on the fetch's own
    schedule, a tenth of a second later here, and failed the item after four quick tries."""
    server = _serving(_RateLimited)
    prefix = f"http://127.0.0.1:{server.server_address[1]}/"
    _RateLimited.times.clear()

    async def fetch() -> bytes:
        fetcher = url_inputs.UrlFetcher([prefix], 1 << 20, timeout_s=5.0, retry_delays_s=(0.1,))
        try:
            body = await fetcher.fetch(prefix + "a.wav")
            return body.read()
        finally:
            await fetcher.close()

    try:
        assert asyncio.run(fetch()) == b"RIFF"
    finally:
        server.shutdown()
    assert _RateLimited.times[1] - _RateLimited.times[0] >= 0.95
