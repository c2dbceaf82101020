"""Periodic chores inside a loop that steps often (a consumer's reclaim, lag reading, pruning): each asks its
``Periodic`` whether it is due, rather than keeping and comparing a timestamp of its own."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


@dataclass
class Periodic:
    """When a chore was last done (on the monotonic clock): due at first, then once an interval has passed. The
    interval is given at each look, so a loop whose settings are replaced goes by the new ones at once."""

    last: float = -math.inf

    def due(self, interval_s: float) -> bool:
        """True, and the interval starts again now, when ``interval_s`` has passed since the chore was last done."""
        now = time.monotonic()
        if now - self.last < interval_s:
            return False
        self.last = now
        return True

    def come_due(self) -> None:
        """Due at the next look, whatever the interval (more to do, or the state it watched may have changed)."""
        self.last = -math.inf
