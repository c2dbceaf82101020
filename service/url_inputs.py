"""Job items given as http(s) URLs: which URLs a server takes, and fetching them in a job consumer.

A server fetches only under the URL prefixes it is configured with (``BATCHASR_INPUT_URL_PREFIXES``): none, no
URL inputs. Otherwise a job could make it fetch from anywhere its network reaches (its own metadata service,
say). A prefix names a scheme, host, port and path; a URL is under it when all four match, its path compared
after dot segments are resolved (percent-encoded ones too), and every redirect is checked the same way.

A fetch that fails for a reason that may pass (the connection, a timeout, a body that comes slower than
``MIN_BYTES_PER_S``, HTTP 5xx, 408, 425 or 429) is tried again after a pause; should every try fail, the attempt
fails (``SourceUnavailable``) and the item is delivered again after the visibility timeout, until its attempts run
out, so that a host down for minutes fails no item. Other failures (HTTP 4xx, too large, outside the prefixes) fail
the item at once.

A body is received into a temporary file (service.spool: in memory up to its first MiB, on disk past that) and decoded
from there: the consumer fetches up to ``CONNECTIONS`` at once, and recordings of hours held whole in memory (grown
as they came, then copied) would take gigabytes each. A disk with no room for one is ``NoRoomForInput``: the item is
tried again later rather than failed.
"""

from __future__ import annotations

import asyncio
from typing import BinaryIO

import aiohttp
from yarl import URL

from .job_types import JobInputError
from .spool import spooled_file, write_body
from .url_rules import UrlRefused, check_under_prefixes, retry_after_s

RETRY_DELAYS_S = (1.0, 3.0, 9.0)  # pauses before the 2nd, 3rd and 4th tries of a fetch that may succeed later
RETRYABLE_STATUS = {408, 425, 429}
MAX_RETRY_AFTER_S = 60.0  # a host's Retry-After is waited this long at most before the next try
REDIRECT_STATUS = {301, 302, 303, 307, 308}
MAX_REDIRECTS = 5
CONNECTIONS = 64  # to the media hosts, per consumer
# the slowest body taken, on average once the first timeout has passed: a host that drips a byte just inside
# each read's timeout would otherwise hold one of the consumer's items (and its prefetch slot) for days
MIN_BYTES_PER_S = 32 * 1024


class SourceUnavailable(RuntimeError):
    """A URL's host failed every try of an attempt for reasons that may pass: the item is tried again later, in
    another attempt (``JOB_MAX_ATTEMPTS``), not failed."""


class _MayPass(Exception):
    """A fetch failure worth another try (after ``retry_after_s`` at least, where the host said so)."""

    def __init__(self, message: str, retry_after_s: float = 0.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


def check_input_url(url: str, prefixes: list[str]) -> None:
    """Refuse (JobInputError) a URL that is not http(s) or not under one of ``prefixes``."""
    if not prefixes:
        raise JobInputError("URL inputs are disabled: the server has no input URL prefixes "
                            "(BATCHASR_INPUT_URL_PREFIXES)")
    try:
        check_under_prefixes(url, prefixes, "input URL")
    except UrlRefused as exc:
        raise JobInputError(str(exc)) from exc


class UrlFetcher:
    """Fetches job audio by URL for one consumer, over one connection pool (aiohttp: a tenth of the event loop's
    CPU per fetch that httpx takes, docs/benchmarks.md). ``close`` when done."""

    def __init__(self, prefixes: list[str], max_bytes: int, timeout_s: float = 60.0,
                 retry_delays_s: tuple[float, ...] | None = None, min_bytes_per_s: float = MIN_BYTES_PER_S):
        self.prefixes = prefixes
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.min_bytes_per_s = min_bytes_per_s
        self.retry_delays_s = RETRY_DELAYS_S if retry_delays_s is None else retry_delays_s
        # connecting and each read are limited here; the whole attempt's limit grows with the body (``_get``). Not
        # aiohttp's connect: it counts the wait for one of the pool's connections, and fetches that waited behind
        # long downloads failed as connection timeouts against a healthy host
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)
        self._session: aiohttp.ClientSession | None = None  # made on the event loop, at the first fetch

    async def fetch(self, url: str) -> BinaryIO:
        """The body at ``url``, in a temporary file at its start, for the caller to close; JobInputError (the item
        fails) when it cannot be had, SourceUnavailable when it could not be had now."""
        check_input_url(url, self.prefixes)  # again here: items written to Redis directly skip the API's check
        failure: _MayPass | None = None
        for delay in (0.0, *self.retry_delays_s):
            # a host that asks for longer (429 or 503 with Retry-After: a CDN's or a bucket's rate limit) is given it
            await asyncio.sleep(max(delay, min(failure.retry_after_s, MAX_RETRY_AFTER_S)) if failure else delay)
            try:
                return await self._get(url)
            except _MayPass as exc:
                failure = exc
        tries = 1 + len(self.retry_delays_s)
        raise SourceUnavailable(f"{url}: {failure} ({tries} tries)")

    async def _get(self, url: str) -> BinaryIO:
        if self._session is None:
            # no cookies kept: one job's fetch set a cookie that the next fetch from that host sent, another key's
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CONNECTIONS),
                                                  timeout=self._timeout, cookie_jar=aiohttp.DummyCookieJar())
        began = asyncio.get_running_loop().time()
        try:
            # the attempt's deadline, held by a timer, head and redirects included: a server that drips its
            # headers (or a chunked body's framing) a byte inside each read's timeout was never stopped. It
            # moves with the body's bytes (``_read``)
            async with asyncio.timeout_at(began + self.timeout_s) as deadline:
                return await self._follow(url, deadline, began)
        except TimeoutError as exc:
            raise _MayPass(f"TimeoutError: the answer came slower than {self.min_bytes_per_s / 1024:g} KiB/s "
                           f"after {self.timeout_s:g} s") from exc

    async def _follow(self, url: str, deadline: asyncio.Timeout, began: float) -> BinaryIO:
        for _ in range(MAX_REDIRECTS + 1):
            try:
                # redirects are followed here, each one checked against the prefixes
                async with self._session.get(url, allow_redirects=False) as response:
                    if response.status in REDIRECT_STATUS and "Location" in response.headers:
                        url = _redirected(url, response)
                        check_input_url(url, self.prefixes)
                        continue
                    self._check_status(url, response)
                    return await self._read(url, response, deadline, began)
            except (aiohttp.ClientError, TimeoutError) as exc:  # refused, reset, timed out, DNS
                raise _MayPass(f"{type(exc).__name__}: {exc or 'no detail'}") from exc
        raise JobInputError(f"{url}: more than {MAX_REDIRECTS} redirects")

    @staticmethod
    def _check_status(url: str, response: aiohttp.ClientResponse) -> None:
        status = response.status
        if status >= 500 or status in RETRYABLE_STATUS:
            asked_s = retry_after_s(response.headers.get("Retry-After")) or 0.0
            raise _MayPass(f"HTTP {status} {response.reason}", asked_s)
        if status != 200:
            raise JobInputError(f"{url}: HTTP {status} {response.reason}")

    async def _read(self, url: str, response: aiohttp.ClientResponse, deadline: asyncio.Timeout, began: float
                    ) -> BinaryIO:
        declared = response.content_length
        if declared is not None and declared > self.max_bytes:
            raise JobInputError(f"{url}: {declared} bytes exceeds the upload limit of {self.max_bytes} bytes")
        body, size = spooled_file(), 0  # the caller's to close
        try:
            async for chunk in response.content.iter_any():  # what has come, as it comes
                size += len(chunk)
                if size > self.max_bytes:
                    raise JobInputError(f"{url}: more than the upload limit of {self.max_bytes} bytes")
                # a long file takes long: the time its bytes allow, at the slowest rate taken
                deadline.reschedule(began + self.timeout_s + size / self.min_bytes_per_s)
                write_body(body, chunk, url)
            body.seek(0)
            return body
        except BaseException:
            body.close()
            raise

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()




def _redirected(url: str, response: aiohttp.ClientResponse) -> str:
    """Where a redirect points; JobInputError, naming the URL, for a Location that is not a URL."""
    try:
        return str(response.url.join(URL(response.headers["Location"])))
    except ValueError as exc:
        raise JobInputError(f"{url}: redirected to {response.headers['Location']!r}, not a URL ({exc})") from exc

