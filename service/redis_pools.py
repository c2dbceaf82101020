"""The connection pool a Redis URL leads to: one server (``redis://``, ``rediss://``, ``unix://``) or the primary that
Redis Sentinel names (``redis+sentinel://``, ``rediss+sentinel://``), which the pool follows through failovers.

A Sentinel URL lists the sentinels and names the monitored service (the name in ``sentinel monitor``)::

    redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db][?sentinel_password=...]

The user and password are the Redis servers'; sentinels that ask for their own are given ``sentinel_username`` and
``sentinel_password`` (sentinels without one refuse a password). Port 26379 by default.

Any of these URLs may end ``?wait_replicas=N`` (``&wait_replicas=N``): the job store then confirms that N replicas
hold a write before it acknowledges it (a job accepted, cancelled, retried or deleted), so a failover to one of them
cannot drop it (``JobStore.wait_replicas``). Replication is otherwise asynchronous: the writes of the moments before
a failover, or of an old primary cut off from the one promoted, are gone with it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, parse_qsl, unquote, urlencode, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import ReadOnlyError

from .intervals import Periodic

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
SENTINEL_PORT = 26379
SENTINEL_TIMEOUT_S = 5.0  # a sentinel that answers no faster is passed over for the next one
PRIMARY_CHECK_S = 1.0  # how often a pool in use asks the sentinels which server is primary
WAIT_REPLICAS = "wait_replicas"  # the URL parameter the job store takes for itself (not redis-py's)


@dataclass(frozen=True)
class SentinelURL:
    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    tls: bool = False


def is_sentinel_url(url: str) -> bool:
    return urlsplit(url).scheme in SENTINEL_SCHEMES


def check_url(url: str) -> None:
    """Raise ValueError saying what is wrong with ``url`` as a Redis URL, before anything connects with it."""
    url, _ = split_wait_replicas(url)
    if is_sentinel_url(url):
        parse_sentinel_url(url)
    else:
        from redis.connection import parse_url  # the parsing the connection pool gives it

        parse_url(url)


def split_wait_replicas(url: str) -> tuple[str, int]:
    """``url`` without its ``wait_replicas`` parameter, and the number it gives (0 without one)."""
    base, _, query_string = url.partition("?")  # not urlunsplit: it writes unix:///path as unix:/path
    query = parse_qsl(query_string, keep_blank_values=True)
    values = [value for name, value in query if name == WAIT_REPLICAS]
    if not values:
        return url, 0
    if not (values[-1].isdigit() and int(values[-1]) <= 100):
        raise ValueError(f"{WAIT_REPLICAS} is the number of replicas (0 to 100) that must hold a write before it is "
                         f"acknowledged, not {values[-1]!r}")
    rest = urlencode([(name, value) for name, value in query if name != WAIT_REPLICAS])
    return base + (f"?{rest}" if rest else ""), int(values[-1])


def parse_sentinel_url(url: str) -> SentinelURL:
    parts = urlsplit(url)
    if parts.scheme not in SENTINEL_SCHEMES:
        raise ValueError(f"a Sentinel URL starts {' or '.join(s + '://' for s in SENTINEL_SCHEMES)}")
    hosts = parts.netloc.rpartition("@")[2]
    sentinels = tuple(_host_port(address) for address in hosts.split(",") if address)
    if not sentinels:
        raise ValueError("a Sentinel URL names at least one sentinel: redis+sentinel://host:26379/service")
    path = [unquote(segment) for segment in parts.path.split("/") if segment]
    if not path:
        raise ValueError("a Sentinel URL names the monitored service after the hosts: redis+sentinel://host/service")
    if len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(f"a Sentinel URL's path is /service or /service/db, not {parts.path}")
    query = {name: values[-1] for name, values in parse_qs(parts.query).items()}
    unknown = set(query) - {"sentinel_username", "sentinel_password", WAIT_REPLICAS}  # the last: the store's
    if unknown:
        raise ValueError(f"unknown Sentinel URL parameter(s): {', '.join(sorted(unknown))} "
                         f"(known: sentinel_username, sentinel_password, {WAIT_REPLICAS})")
    return SentinelURL(sentinels, path[0], int(path[1]) if len(path) == 2 else 0,
                       unquote(parts.username) if parts.username else None,
                       unquote(parts.password) if parts.password is not None else None,
                       query.get("sentinel_username"), query.get("sentinel_password"),
                       parts.scheme == "rediss+sentinel")


def _host_port(address: str) -> tuple[str, int]:
    host, port = address, ""
    if address.startswith("["):  # [IPv6]:port
        host, _, rest = address[1:].partition("]")
        port = rest.removeprefix(":")
    elif ":" in address:
        host, _, port = address.rpartition(":")
    if not host:
        raise ValueError(f"no host in sentinel address {address!r}")
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"bad port in sentinel address {address!r}")
    return host, int(port) if port else SENTINEL_PORT


class _Sentinels(Sentinel):
    """redis-py's Sentinel, but when no sentinel names a primary its error says what each one answered, by its
    address (redis-py's quotes each sentinel's client whole: a line of connection settings apiece)."""

    async def discover_master(self, service_name: str) -> tuple[str, int]:
        answers = []
        for number, sentinel in enumerate(self.sentinels):
            settings = sentinel.connection_pool.connection_kwargs
            address = f"{settings.get('host')}:{settings.get('port')}"
            try:
                masters = await sentinel.sentinel_masters()
            except (aioredis.ConnectionError, aioredis.TimeoutError) as exc:
                answers.append(f"{address}: {exc}")
                continue
            state = masters.get(service_name)
            if state and self.check_master_state(state, service_name):
                self.sentinels[0], self.sentinels[number] = sentinel, self.sentinels[0]  # asked first from now on
                return state["ip"], state["port"]
            answers.append(f"{address}: {'its primary is down' if state else 'it watches no such service'}")
        raise MasterNotFoundError(f"no sentinel names a primary for {service_name!r} ({'; '.join(answers)})")


class _BlockingSentinelPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """Sentinel's pool (connections to whichever server is primary now) with the blocking pool's wait for a free
    connection past ``max_connections``, rather than a "Too many connections" error that reads as an outage.

    redis-py asks the sentinels only as it opens a connection, so after a failover the pooled connections went on
    writing to the old primary until Sentinel got round to demoting it (seconds later), and its data was dropped
    then, jobs with it. So the primary's address is asked again every ``PRIMARY_CHECK_S`` as connections are handed
    out; a change closes those to the old one (the idle at once, those in use as they come back)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._primary_check = Periodic()

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        if self._primary_check.due(PRIMARY_CHECK_S):  # not due again during the await: one look for all callers
            # sentinels unreachable: the connections open still reach the primary; a new one fails as an outage
            with contextlib.suppress(aioredis.RedisError, OSError):
                await self.get_master_address()
        return await super().get_connection(*args, **kwargs)

    async def release(self, connection: Any) -> None:
        if self.master_address is not None and (connection.host, connection.port) != self.master_address:
            await connection.disconnect()  # it was in use as the primary moved: its next use connects to the new one
        await super().release(connection)


def connection_pool(url: str, max_connections: int, timeout: float) -> aioredis.ConnectionPool:
    """The pool for ``url``: commands beyond ``max_connections`` in use wait up to ``timeout`` for a free one; its
    connections close on READONLY and are checked as they are handed out (``_no_maintenance_notifications``).
    Sentinels are given ``SENTINEL_TIMEOUT_S``. ``url`` has no ``wait_replicas`` parameter: that is the job store's
    (``JobStore.from_url`` takes it out)."""
    options = {"socket_connect_timeout": 5, "socket_timeout": 30, "health_check_interval": 30,
               **_no_maintenance_notifications()}
    if not is_sentinel_url(url):
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=timeout,
                                                        **options)
        return _reconnect_on_read_only(pool)
    address = parse_sentinel_url(url)
    credentials = {"username": address.username, "password": address.password, "db": address.db}
    sentinel_options = {"socket_connect_timeout": SENTINEL_TIMEOUT_S, "socket_timeout": SENTINEL_TIMEOUT_S,
                        "username": address.sentinel_username, "password": address.sentinel_password,
                        "ssl": address.tls,
                        # redis-py retries a sentinel 10 times with backoff (4 s when it is down): the next is asked
                        "retry": Retry(NoBackoff(), 0)}
    sentinel = _Sentinels(address.sentinels, sentinel_kwargs=sentinel_options)
    # Sentinel's own connections already close on READONLY (and raise ConnectionError for the next to ask again)
    return _BlockingSentinelPool(address.service, sentinel, max_connections=max_connections, timeout=timeout,
                                 ssl=address.tls, **credentials, **options)


async def close_pool(pool: aioredis.ConnectionPool) -> None:
    """Close what ``pool`` opened beyond its own connections: a Sentinel pool's connections to the sentinels."""
    if isinstance(pool, SentinelConnectionPool):
        for client in pool.sentinel_manager.sentinels:
            with contextlib.suppress(Exception):
                await client.aclose()


def _no_maintenance_notifications() -> dict[str, Any]:
    """The pool option that turns off redis-py's maintenance notifications (redis-py 8 turns them on over RESP3, its
    default; earlier versions have none). With them on, the pool hands out connections without checking that Redis
    has not closed them: after a Redis restart each pooled connection failed its next command once, so 27 of a burst
    of 40 commands failed (503s), and light traffic met the rest one by one as it reached deeper into the pool."""
    config = getattr(aioredis.connection, "MaintNotificationsConfig", None)
    return {} if config is None else {"maint_notifications_config": config(enabled=False)}


class _ClosesOnReadOnly:
    """Mixed into a pool's connection class: a connection that meets READONLY closes itself before its next command.
    The address it reached serves a replica now (a failover moved the primary behind one name, as managed Redis
    services and Kubernetes Services do), and only a connection made afresh reaches the primary the name leads to now;
    redis-py keeps a connection through an error reply, so every command sent on it failed for as long as it lived."""

    _reached_a_replica = False

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)  # type: ignore[misc]
        except ReadOnlyError:
            # not closed here: a pipeline reads the replies of its other commands after this one's, and closing
            # now turned the refusal into "connection closed" (an outage called unreachable, not read-only)
            self._reached_a_replica = True
            raise

    async def send_packed_command(self, *args: Any, **kwargs: Any) -> None:
        if self._reached_a_replica:
            self._reached_a_replica = False
            await self.disconnect()  # type: ignore[attr-defined]
        await super().send_packed_command(*args, **kwargs)  # type: ignore[misc]


def _reconnect_on_read_only(pool: aioredis.ConnectionPool) -> aioredis.ConnectionPool:
    """``pool``, its connections closing on READONLY (whatever their class: TCP, TLS or a Unix socket)."""
    base = pool.connection_class
    if not issubclass(base, _ClosesOnReadOnly):
        pool.connection_class = type(base.__name__, (_ClosesOnReadOnly, base), {})
    return pool
