"""A private redis-server on a free port for tests (real Redis, never a fake)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import redis
from redis.exceptions import ConnectionError as RedisConnectionError

from tests.ports import free_port


class RedisServer:
    def __init__(self, directory: Path, appendonly: bool = False, port: int | None = None, password: str | None = None):
        self.directory = directory
        self.appendonly = appendonly
        self.password = password
        self.port = port or free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{f':{self.password}@' if self.password else ''}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory), "--save", "",
                # a replica syncs at once, not after the 5 s Redis waits by default for others to share the transfer
                "--repl-diskless-sync-delay", "0"]
        args += ["--appendonly", "yes", "--appendfsync", "always"] if self.appendonly else ["--appendonly", "no"]
        args += ["--requirepass", self.password] if self.password else []
        self.process = _launch(args, self.client().ping, "redis-server")
        return self

    def stop(self) -> None:
        _terminate(self.process)  # SIGTERM: redis flushes its append-only file and exits
        self.process = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=self.password)


def first_reply_lost(read: Callable[..., Awaitable], server: RedisServer, lost: list) -> Callable[..., Awaitable]:
    """``read`` (an async read from ``server``) whose first reply with something in it is lost with its connection as
    Redis stops, to start again a second later: what it read stays delivered in Redis, and the reader never saw it.
    ``lost`` gets the reply."""

    async def read_losing_the_first_reply(*args, **kwargs):
        reply = await read(*args, **kwargs)
        if reply and not lost:
            lost.append(reply)
            await asyncio.to_thread(server.stop)
            asyncio.get_running_loop().call_later(1.0, server.start)
            raise RedisConnectionError("Connection closed by server.")
        return reply

    return read_losing_the_first_reply


class RepliesCut:
    """A TCP relay in front of ``server`` (on this event loop) that, while ``armed``, passes a command holding
    ``marker`` on to Redis and closes the client's connection before the reply comes back: Redis ran the command, and
    its sender never hears so. ``close_after``: Redis then stops too (``server.stop``), as a restart would."""

    def __init__(self, server: RedisServer, marker: bytes = b"EXEC", close_after: bool = False):
        self.server, self.marker, self.close_after = server, marker, close_after
        self.armed, self.cut = 0, 0
        self._relays: set[asyncio.Task] = set()

    async def start(self) -> RepliesCut:
        self._listener = await asyncio.start_server(self._relay, "127.0.0.1", free_port())
        self.port = self._listener.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def close(self) -> None:
        self._listener.close()
        for relay in self._relays:
            relay.cancel()

    async def _relay(self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter) -> None:
        self._relays.add(asyncio.current_task())
        redis_in, redis_out = await asyncio.open_connection("127.0.0.1", self.server.port)
        cutting = asyncio.Event()

        async def commands() -> None:
            while data := await client_in.read(65536):
                if self.armed and self.marker in data.upper():  # a client sends a transaction whole, and waits
                    self.armed, self.cut = self.armed - 1, self.cut + 1
                    cutting.set()
                redis_out.write(data)
                await redis_out.drain()

        async def replies() -> None:
            while data := await redis_in.read(65536):
                if cutting.is_set():  # its reply: Redis has run it
                    if self.close_after:
                        await asyncio.to_thread(self.server.stop)
                    return
                client_out.write(data)
                await client_out.drain()

        pumps = [asyncio.ensure_future(commands()), asyncio.ensure_future(replies())]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            for pump in pumps:
                pump.cancel()
            client_out.transport.abort()
            redis_out.transport.abort()
            self._relays.discard(asyncio.current_task())


class RedisSentinel:
    """A private Redis Sentinel (``redis-server --sentinel``) watching ``primary`` as ``service``, with a quorum of
    one, so that ``SENTINEL FAILOVER`` promotes a replica at once. ``replicas`` are told it as known (else it learns
    them from the primary's INFO, within 10 s)."""

    def __init__(self, directory: Path, primary: RedisServer, replicas: tuple[RedisServer, ...] = (),
                 service: str = "jobs", password: str | None = None):
        self.directory = directory
        self.primary = primary
        self.replicas = replicas
        self.service = service
        self.password = password
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    def url(self, db: int = 0) -> str:
        """A Sentinel URL for the service, with the servers' password and (if it has one) the sentinel's."""
        auth = f":{self.primary.password}@" if self.primary.password else ""
        query = f"?sentinel_password={self.password}" if self.password else ""
        return f"redis+sentinel://{auth}127.0.0.1:{self.port}/{self.service}/{db}{query}"

    def start(self) -> RedisSentinel:
        lines = [f"port {self.port}", "bind 127.0.0.1", f"dir {self.directory}",
                 f"sentinel monitor {self.service} 127.0.0.1 {self.primary.port} 1",
                 f"sentinel down-after-milliseconds {self.service} 2000",
                 f"sentinel failover-timeout {self.service} 10000"]
        lines += [f"sentinel known-replica {self.service} 127.0.0.1 {replica.port}" for replica in self.replicas]
        lines += [f"sentinel auth-pass {self.service} {self.primary.password}"] if self.primary.password else []
        lines += [f"requirepass {self.password}"] if self.password else []
        config = self.directory / "sentinel.conf"  # sentinel rewrites it as it learns the topology
        config.write_text("\n".join(lines) + "\n")
        self.process = _launch([str(config), "--sentinel"], lambda: self.primary_port() == self.primary.port,
                               "redis sentinel")
        return self

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=self.password)

    def primary_port(self) -> int:
        return int(self.client().sentinel_get_master_addr_by_name(self.service)[1])

    def fail_over(self, to: RedisServer, timeout_s: float = 30) -> None:
        """Promote ``to`` (the one replica) and wait until the sentinel names it primary and it takes writes."""
        self.client().execute_command("SENTINEL", "FAILOVER", self.service)
        deadline = time.monotonic() + timeout_s
        while self.primary_port() != to.port or to.client().info("replication")["role"] != "master":
            assert time.monotonic() < deadline, "the failover did not finish"
            time.sleep(0.1)

    def stop(self) -> None:
        _terminate(self.process)
        self.process = None


def start_replica(directory: Path, primary: RedisServer) -> RedisServer:
    """A private redis-server replicating ``primary`` (with its password), once it has synced."""
    replica = RedisServer(directory, password=primary.password).start()
    client = replica.client()
    if primary.password:
        client.config_set("masterauth", primary.password)
    client.replicaof("127.0.0.1", primary.port)
    deadline = time.monotonic() + 10
    while client.info("replication").get("master_link_status") != "up":
        assert time.monotonic() < deadline, "the replica did not sync"
        time.sleep(0.05)
    return replica


@contextmanager
def primary_and_replica(directory: Path, password: str | None = None) -> Iterator[tuple[RedisServer, RedisServer]]:
    """A private primary and its replica, in sync, in folders of ``directory``; both stopped after."""
    (directory / "primary").mkdir()
    (directory / "replica").mkdir()
    primary = RedisServer(directory / "primary", password=password).start()
    try:
        replica = start_replica(directory / "replica", primary)
        try:
            yield primary, replica
        finally:
            replica.stop()
    finally:
        primary.stop()


def _launch(args: list[str], answers: Callable[[], object], what: str) -> subprocess.Popen:
    """``redis-server args``, once ``answers()`` is true (a refused connection meanwhile: not up yet)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    process = subprocess.Popen([exe, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if answers():
                return process
        except redis.ConnectionError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not start")


def _terminate(process: subprocess.Popen | None) -> None:
    if process is not None:
        process.terminate()
        process.wait(10)
