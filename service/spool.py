"""Where bodies wait before they are decoded: request bodies (service.body_buffer) and the bodies of job items
fetched by URL (service.url_inputs), each in a temporary file held in memory up to ``SPOOL_MEMORY_BYTES`` and
on disk past that, in the folder ``TMPDIR`` names."""

from __future__ import annotations

import errno
from tempfile import SpooledTemporaryFile

SPOOL_MEMORY_BYTES = 1 << 20  # as Starlette spools a multipart file: larger bodies wait on disk
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})  # the disk full, or the user's quota used


def spooled_file() -> SpooledTemporaryFile:
    """A new, empty file for a body; the caller closes it."""
    return SpooledTemporaryFile(max_size=SPOOL_MEMORY_BYTES)


def disk_full(exc: OSError) -> bool:
    """Whether a write failed for want of room, which other bodies' finishing gives back."""
    return exc.errno in DISK_FULL
