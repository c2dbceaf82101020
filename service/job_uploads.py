"""A job's uploaded audio, written into Redis a piece at a time before the job that names it (service.jobs), and
read back by the worker the same way.

The uploads went in the job's one transaction, so the process submitting it held all of them in memory at once:
up to MAX_JOB_UPLOAD_BYTES (1 GiB) for each submission. Now each is read from its file and written into a key that
only its job will name, with a short TTL; the job's transaction gives the keys the input TTL. A submission that
fails in between deletes what it wrote; one whose process dies leaves keys that expire by themselves. A worker
reads an upload into a temporary file (service.spool) and decodes it from there: read whole, up to
MAX_UPLOAD_BYTES (200 MiB) an item stayed in memory beside its samples while it was decoded.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from redis.exceptions import ResponseError

from .spool import spooled_file, write_body

Upload = bytes | Path | BinaryIO  # the audio itself, a file that holds it, or an open file (read from its start)

PIECE_BYTES = 4 * 1024 * 1024  # read and written at once; smaller uploads go whole, several in a round trip
ROUND_TRIP_KEYS = 1000  # small uploads in one round trip at most (many tiny files would otherwise make one large)
STAGING_TTL_S = 3600  # an upload whose job is not written yet: gone by itself if the process writing it dies


class UploadRefused(ValueError):
    """An upload that cannot be written: a file that could not be read, or did not hold the bytes it measured (it
    was removed or changed meanwhile), or one larger than Redis stores in a value; or, read back, one gone before
    it was read whole. ``key``: the upload's, where known; ``too_large``: it is larger than Redis stores."""

    def __init__(self, message: str, key: str | None = None, too_large: bool = False):
        super().__init__(message)
        self.key, self.too_large = key, too_large


def upload_size(upload: Upload) -> int:
    """An upload's bytes, without reading them."""
    if isinstance(upload, bytes):
        return len(upload)
    try:
        return upload.stat().st_size if isinstance(upload, Path) else upload.seek(0, io.SEEK_END)
    except OSError as exc:
        raise UploadRefused(f"the file cannot be read: {exc}") from exc


@contextlib.contextmanager
def opened(upload: Upload) -> Iterator[BinaryIO]:
    """An upload as a file at its start (one passed open is left open)."""
    if isinstance(upload, bytes):
        yield io.BytesIO(upload)  # shares the bytes until written to, which it is not
    elif isinstance(upload, Path):
        with upload.open("rb") as file:
            yield file
    else:
        upload.seek(0)
        yield upload


async def write_uploads(redis: Any, uploads: dict[str, tuple[Upload, int]]) -> None:
    """Each upload into its key (with STAGING_TTL_S), given with its size as measured (``upload_size``), at most
    about PIECE_BYTES of them in memory at once. Files are read in a thread: a form's uploads lie on disk."""
    async with redis.pipeline(transaction=False) as pipe:
        pending = 0
        for key, (upload, size) in uploads.items():
            try:
                if size > PIECE_BYTES:
                    await _write_in_pieces(redis, key, upload, size)
                    continue
                pipe.set(key, await _read_whole(upload, size), ex=STAGING_TTL_S)
            except UploadRefused as exc:
                raise UploadRefused(str(exc), key, exc.too_large) from exc
            pending += size
            if pending >= PIECE_BYTES or len(pipe) >= ROUND_TRIP_KEYS:
                await pipe.execute()
                pending = 0
        if len(pipe):
            await pipe.execute()


async def _read_whole(upload: Upload, size: int) -> bytes:
    if isinstance(upload, bytes):
        return upload
    with opened(upload) as file:
        return _exactly(await _read(file, size + 1), size)


async def _write_in_pieces(redis: Any, key: str, upload: Upload, size: int) -> None:
    # the whole length first (Redis fills it with zeros), then each piece in place: a string grown by appending
    # is reallocated, and may be copied, at each piece
    async with redis.pipeline(transaction=False) as pipe:
        pipe.setrange(key, size - 1, b"\0")
        pipe.expire(key, STAGING_TTL_S)
        try:
            await pipe.execute()
        except ResponseError as exc:  # past proto-max-bulk-len (512 MiB unless configured): nothing was written
            if "proto-max-bulk-len" not in str(exc):
                raise
            raise UploadRefused(f"{size} bytes is more than this Redis stores in one value (its proto-max-bulk-len): "
                                "submit it as a path or URL", key, too_large=True) from exc
    with opened(upload) as file:
        offset = 0
        while offset < size:
            want = min(PIECE_BYTES, size - offset)
            await redis.setrange(key, offset, _exactly(await _read(file, want), want))
            offset += want
        if await _read(file, 1):
            raise UploadRefused(f"the file grew past the {size} bytes it had while it was being read")


async def _read(file: BinaryIO, size: int) -> bytes:
    """Up to ``size`` bytes, in a thread; a file that cannot be read is the upload's error (an OSError would read
    as Redis being unreachable)."""
    try:
        return await asyncio.to_thread(file.read, size)
    except OSError as exc:
        raise UploadRefused(f"the file cannot be read: {exc}") from exc


def _exactly(data: bytes, size: int) -> bytes:
    if len(data) != size:
        raise UploadRefused(f"the file changed while it was being read (expected {size} bytes, read {len(data)})")
    return data


async def read_upload(redis: Any, key: str, size: int) -> BinaryIO:
    """An upload of ``size`` bytes, read a piece at a time into a temporary file, at its start; the caller closes
    it. ``UploadRefused`` if it is gone before it is read whole (its job purged meanwhile); a disk with no room for
    it is ``service.spool.NoRoomForInput``."""
    body = spooled_file()
    try:
        offset = 0
        while offset < size:
            piece = await redis.getrange(key, offset, min(offset + PIECE_BYTES, size) - 1)
            if not piece:
                raise UploadRefused(f"the upload went after {offset} of its {size} bytes were read (purged?)", key)
            write_body(body, piece, "an upload")
            offset += len(piece)
            del piece  # not held while the next one arrives
        body.seek(0)
        return body
    except BaseException:
        body.close()
        raise
