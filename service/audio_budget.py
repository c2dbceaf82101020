"""How much job audio a consumer may hold at once, in seconds, so that long items cannot exhaust its memory.

A consumer keeps enough items in flight for the batcher to choose batches from (``ConsumerOptions.prefetch``,
2,048 on a GPU). Sized for clips of seconds, that many hour-long recordings would be hundreds of GB of samples.
So items are also counted by their audio: what has been decoded counts its length, and an item still being read
counts as long as the items seen lately (one segment at first; a long one raises that at once, short ones lower
it slowly). A new item starts only while that total leaves room for it, and only so many are read at once, since
their lengths are not known before. An item longer than the whole budget still runs, alone.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

RECENT_WEIGHT = 0.2  # how fast the expected item length comes down to shorter items seen
MIN_ITEM_S = 0.1


@dataclass
class AudioBudget:
    limit_s: float  # decoded seconds a consumer may hold
    expected_item_s: float  # the length an item not yet read is counted at
    max_reading: int  # items read (fetched, decoded) at once: how far the first, unknown ones can overshoot
    held_s: float = 0.0  # decoded and not yet finished
    reading: int = 0  # started, not yet decoded
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def room(self, slots: int) -> int:
        """How many of ``slots`` free item slots may start now (``changed`` then says when to ask again)."""
        self._changed.clear()
        per_item = max(self.expected_item_s, MIN_ITEM_S)
        counted = self.held_s + self.reading * per_item
        if math.isinf(self.limit_s):  # no budget
            fits = slots
        else:
            fits = max(1, int(self.limit_s // per_item)) if counted == 0 else int((self.limit_s - counted) // per_item)
        return max(0, min(slots, self.max_reading - self.reading, fits))

    async def changed(self) -> None:
        """Returns once an item has been decoded or has finished since the last ``room``."""
        await self._changed.wait()

    def claim(self) -> AudioClaim:
        """An item starts: it counts at the expected length until ``AudioClaim.decoded``."""
        self.reading += 1
        return AudioClaim(self)

    def _seen(self, seconds: float) -> None:
        # up at once (a long item warns of more), down slowly (one short one does not undo that)
        if seconds > self.expected_item_s:
            self.expected_item_s = seconds
        else:
            self.expected_item_s += RECENT_WEIGHT * (seconds - self.expected_item_s)


class AudioClaim:
    """One item's share of the budget; ``release`` it however the item ends."""

    def __init__(self, budget: AudioBudget):
        self._budget = budget
        self._seconds: float | None = None  # None while reading
        self._released = False

    def decoded(self, seconds: float) -> None:
        budget = self._budget
        budget.reading -= 1
        budget.held_s += seconds
        budget._seen(seconds)
        budget._changed.set()
        self._seconds = seconds

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        if self._seconds is None:
            self._budget.reading -= 1
        else:
            self._budget.held_s -= self._seconds
        self._budget._changed.set()
