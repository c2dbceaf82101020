"""Where bodies wait before they are decoded: request bodies (service.body_buffer) and the bodies of job items,
fetched by URL (service.url_inputs) or read from Redis (service.job_uploads), each in a temporary file held in
memory up to ``SPOOL_MEMORY_BYTES`` and on disk past that, in the folder ``TMPDIR`` names."""

from __future__ import annotations

import errno
from tempfile import SpooledTemporaryFile
from typing import BinaryIO

SPOOL_MEMORY_BYTES = 1 << 20  # as Starlette spools a multipart file: larger bodies wait on disk
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})  # the disk full, or the user's quota used


def spooled_file() -> SpooledTemporaryFile:
    """A new, empty file for a body; the caller closes it."""
    return SpooledTemporaryFile(max_size=SPOOL_MEMORY_BYTES)


def disk_full(exc: OSError) -> bool:
    """Whether a write failed for want of room, which other bodies' finishing gives back."""
    return exc.errno in DISK_FULL


class NoRoomForInput(RuntimeError):
    """No disk left for a job item's body: a failure of the worker's, not the item's (tried again later)."""


def write_body(body: BinaryIO, chunk: bytes, name: str) -> None:
    """A chunk into a job item's body (the page cache takes it: no wait worth a thread), or ``NoRoomForInput``."""
    try:
        body.write(chunk)
    except OSError as exc:
        if disk_full(exc):
            raise NoRoomForInput(f"{name}: no disk space left for its body ({exc.strerror})") from exc
        raise
