"""Which URLs the server contacts on a job's behalf. A job names them (its audio, its completion webhook); without
rules it could make a worker fetch from, or post to, anything the worker's network reaches: a cloud metadata
service, an admin port, a database.

Two rules. Under a prefix: the URL's scheme, host and port equal a configured prefix's and its path lies under
the prefix's, compared after dot segments are resolved (percent-encoded ones too). Public only: the host is a
name or address, and every address the connection may use is a public one (not loopback, private, link-local,
shared, reserved or multicast); names are checked as they are resolved for the connection itself
(``PublicAddressResolver``), so a name re-pointed at a private address after the check is still refused.
"""

from __future__ import annotations

import functools
import ipaddress
import math
import posixpath
import re
import socket
from typing import Any

from aiohttp.abc import AbstractResolver
from aiohttp.resolver import DefaultResolver
from yarl import URL

SCHEMES = ("http", "https")
LOCAL_NAMES = ("localhost", "localhost.localdomain")


class UrlRefused(ValueError):
    """A URL the server will not contact, and why."""


class NoPublicAddress(OSError):
    """A name that resolves to no public address (raised while connecting; aiohttp wraps it)."""


def url_parts(url: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, path) of an http(s) URL as it will be requested: the path percent-decoded once and
    its dot segments resolved. UrlRefused for anything else."""
    try:
        parsed = URL(url)
    except (TypeError, ValueError) as exc:
        raise UrlRefused(f"{url}: not a valid URL ({exc})") from exc
    if parsed.scheme not in SCHEMES or not parsed.host or parsed.port is None:
        raise UrlRefused(f"{url}: only http and https URLs are taken")
    if not parsed.host.isprintable():  # a NUL byte, say: no name resolves to it, and socket calls raise ValueError
        raise UrlRefused(f"{url}: not a valid URL (a control character in its host)")
    path = parsed.path or "/"
    resolved = posixpath.normpath(path) + ("/" if path.endswith("/") and path != "/" else "")
    return parsed.scheme, parsed.host.lower(), parsed.port, resolved.replace("//", "/")


@functools.lru_cache(maxsize=256)
def _prefix_parts(prefix: str) -> tuple[str, str, int, str]:
    """A configured prefix's parts, parsed once rather than for every URL checked against it."""
    return url_parts(prefix)


def check_prefixes(prefixes: list[str]) -> list[str]:
    """Configured prefixes, each refused (UrlRefused) unless it is a well-formed http(s) URL."""
    for prefix in prefixes:
        _prefix_parts(prefix)
    return prefixes


def check_under_prefixes(url: str, prefixes: list[str], kind: str) -> None:
    """Refuse (UrlRefused) a URL that is not http(s) or not under one of ``prefixes`` (the server's ``kind``
    prefixes, as the message says)."""
    scheme, host, port, path = url_parts(url)
    if problem := _escaping_segment(path):
        raise UrlRefused(f"{url}: {problem}; refused (a server may resolve it out of the prefix)")
    for prefix in prefixes:
        p_scheme, p_host, p_port, p_path = _prefix_parts(prefix)
        directory = p_path if p_path.endswith("/") else p_path + "/"
        if (scheme, host, port) == (p_scheme, p_host, p_port) and (path == p_path or path.startswith(directory)):
            return
    raise UrlRefused(f"{url}: not under the server's {kind} prefixes; refused")


def _escaping_segment(path: str) -> str | None:
    """What in a path (decoded once, dot segments resolved) a server could still resolve as a step up: a backslash,
    raw or %5C (IIS reads it as /), a dot segment with parameters (``..;``: Tomcat, Jetty and Spring drop a
    segment's ``;`` part first) or a percent-encoding left after one decoding (``%252e%252e``, decoded twice)."""
    if "\\" in path:
        return "a backslash in its path"
    for segment in path.split("/"):
        if segment.split(";", 1)[0] in (".", ".."):
            return f"a dot segment with parameters ({segment!r})"
        if re.search(r"%(2e|2f|5c)", segment, re.IGNORECASE):
            return f"a percent-encoding encoded twice ({segment!r})"
    return None


def retry_after_s(header: str | None) -> float | None:
    """A Retry-After header's seconds (None: none, or an HTTP date, which the other host's clock would have to agree
    with ours on)."""
    try:
        seconds = float(header) if header is not None else math.nan
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


NAT64 = ipaddress.ip_network("64:ff9b::/96")  # IPv4 addresses reached through a NAT64 gateway (RFC 6052)
NOT_PUBLIC_V6 = (ipaddress.ip_network("64:ff9b:1::/48"),  # NAT64 for local use (RFC 8215)
                 ipaddress.ip_network("::/96"))  # IPv4-compatible addresses (deprecated)


def is_public_address(address: str) -> bool:
    """Whether an IP address is one on the public internet (an IPv6 address that carries an IPv4 one, mapped,
    6to4 or NAT64, as its IPv4 one: a NAT64 gateway reaches a private network's addresses as readily as others)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 zone names a local interface: not public anyway
    if isinstance(ip, ipaddress.IPv6Address):
        if any(ip in network for network in NOT_PUBLIC_V6):
            return False
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        elif ip.sixtofour is not None:
            ip = ip.sixtofour
        elif ip in NAT64:
            ip = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip.is_global and not ip.is_multicast


def legacy_ipv4(host: str) -> bool:
    """A host the C library reads as an IPv4 address but that is not one written the usual way (``2130706433``,
    ``127.1``, ``0177.0.0.1``, ``0x7f.1``, ``0``: all 127.0.0.1 or 0.0.0.0 to ``getaddrinfo``)."""
    try:
        socket.inet_aton(host)
    except OSError:
        return False
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return True
    return False


def check_public_url(url: str) -> None:
    """Refuse (UrlRefused) a URL that is not http(s), or whose host is an address that is not public or a name
    for the local machine. Other names are checked when resolved (``PublicAddressResolver``)."""
    _, host, _, _ = url_parts(url)
    bare = host.strip("[]").rstrip(".")
    if bare in LOCAL_NAMES or bare.endswith(".localhost"):
        raise UrlRefused(f"{url}: names the server itself; refused")
    try:
        public = is_public_address(bare)
    except ValueError:
        # not a name either: aiohttp releases before 3.14 take an all-digit host as an address, connect to it
        # without the resolver that checks names, and the C library reads 2130706433 as 127.0.0.1
        if legacy_ipv4(bare):
            raise UrlRefused(f"{url}: {bare} is not an IPv4 address written the usual way; refused") from None
        return  # a name
    if not public:
        raise UrlRefused(f"{url}: {bare} is not a public address; refused")


class PublicAddressResolver(AbstractResolver):
    """aiohttp's resolver with every address that is not public dropped; a name left with none fails to connect
    (NoPublicAddress, wrapped in aiohttp's ClientConnectorError). aiohttp does not resolve address literals:
    ``check_public_url`` covers those."""

    def __init__(self) -> None:
        self._inner = DefaultResolver()

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
                      ) -> list[Any]:
        resolved = await self._inner.resolve(host, port, family)
        public = [entry for entry in resolved if is_public_address(entry["host"])]
        if not public:
            raise NoPublicAddress(f"{host} resolves to no public address; refused")
        return public

    async def close(self) -> None:
        await self._inner.close()
