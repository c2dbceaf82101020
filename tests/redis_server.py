"""A private redis-server on a free port for tests (real Redis, never a fake)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis

from tests.servers import free_port


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
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory), "--save", ""]
        args += ["--appendonly", "yes", "--appendfsync", "always"] if self.appendonly else ["--appendonly", "no"]
        args += ["--requirepass", self.password] if self.password else []
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = self.client()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if client.ping():
                    return self
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()  # SIGTERM: redis flushes its append-only file and exits
            self.process.wait(10)
            self.process = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=self.password)
