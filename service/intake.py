"""How many bytes of uploads a process reads and decodes at once (or, for a job, holds until Redis has them).

The body limit bounds one upload (service.body_limit), and the decode pool how many are decoded at once; this
bounds the bytes let in together: the uploads being decoded, whose samples grow with them (an upload is decoded
from its temporary file, not first copied into memory), and a job's on their way to Redis, which without it a
hundred clients sending 200 MB each would have the process hold at once (20 GB). A request waits for room before
it reads its upload, which meanwhile stays in its temporary file: every body is received whole into one before
its route runs (service.body_buffer), so a client that sends slowly, or stops, holds no room while it does.
Requests are let in first come, first served, so a large upload is not passed over for ever by smaller ones; one
larger than the whole budget goes in alone.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager


class IntakeBudget:
    def __init__(self, limit_bytes: int, on_admit: Callable[[float], None] | None = None):
        self.limit = limit_bytes
        self.held = 0
        self.peak = 0  # the most held at once (tests and benchmarks read it)
        self.on_admit = on_admit  # told how long each request waited for room (batchasr_intake_wait_seconds)
        self._waiting: deque[tuple[int, asyncio.Future[None]]] = deque()

    @asynccontextmanager
    async def hold(self, n_bytes: int) -> AsyncIterator[None]:
        """Wait until ``n_bytes`` fit (in turn), hold them for the block, then give them back."""
        n = max(0, min(n_bytes, self.limit))
        admitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((n, admitted))
        self._admit()
        started = time.perf_counter()
        try:
            await admitted
        except asyncio.CancelledError:
            if admitted.done() and not admitted.cancelled():  # let in just as it was cancelled
                self._release(n)
            else:  # it may have been first in line: those behind it may fit now
                self._admit()
            raise
        if self.on_admit is not None:
            self.on_admit(time.perf_counter() - started)
        try:
            yield
        finally:
            self._release(n)

    def _release(self, n: int) -> None:
        self.held -= n
        self._admit()

    def _admit(self) -> None:
        while self._waiting:
            n, admitted = self._waiting[0]
            if admitted.cancelled():  # its request went away while waiting
                self._waiting.popleft()
                continue
            if self.held + n > self.limit:
                return
            self._waiting.popleft()
            self.held += n
            self.peak = max(self.peak, self.held)
            admitted.set_result(None)
