"""Periodic chores inside a loop that steps often (a consumer's reclaim, lag reading, pruning): each asks its
``Every`` whether it is due, rather than keeping and comparing a timestamp of its own."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


@dataclass
class Every:
    """Due at first, then once ``seconds`` have passed since it last was (on the monotonic clock)."""

    seconds: float
    last: float = -math.inf

    def due(self) -> bool:
        """True, and the interval starts again now, when it is due; False otherwise."""
        now = time.monotonic()
        if now - self.last < self.seconds:
            return False
        self.last = now
        return True

    def come_due(self) -> None:
        """Due at the next look, whatever the interval (more to do, or the state it watched may have changed)."""
        self.last = -math.inf
