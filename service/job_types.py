"""What a bulk job is: its priorities and states, its items' inputs, the options a submission takes, a job as
read back and an item's result record, and the errors of taking one. Storage is service.jobs'."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, BinaryIO

from models.audio_io import Stretch
from models.transcript import rounded

from .job_uploads import Upload

ANONYMOUS = "anonymous"  # the owner of jobs submitted without an API key (no keys set, or straight into Redis)


class JobPriority(str, Enum):
    """Which streams a job's items go on (with its owner: service.job_keys.item_stream). Workers read the high
    ones first, then normal, then low: a small urgent job is not queued behind a backfill of thousands of hours."""

    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"


class JobStatus(str, Enum):
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    COMPLETED_WITH_ERRORS = "completed_with_errors"
    FAILED = "failed"
    CANCELLED = "cancelled"


ITEM_STATES = ("queued", "in_progress", "completed", "failed", "cancelled")
FINAL_ITEM_STATES = ("completed", "failed", "cancelled")


class JobNotFound(KeyError):
    pass


class JobInputError(ValueError):
    """An input that cannot be taken (no items, a path outside the input roots, a URL outside the input URL
    prefixes or that cannot be fetched, too large)."""


class UploadTooLarge(JobInputError):
    """An upload past the upload limit, or larger than Redis stores in one value (HTTP: 413)."""


class IdempotencyKeyReused(JobInputError):
    """An idempotency key sent again with another request than the one that made its job (other items or options):
    a client's bug, most likely a key reused for a new job, which would otherwise get the old job's results."""

    def __init__(self, job_id: str):
        self.job_id = job_id
        super().__init__(f"this Idempotency-Key was first sent with another request (other items or options), which "
                         f"made job {job_id}: send a new key for a new job")


MAX_QUEUED_ITEMS_HEADER = "X-Max-Queued-Items"  # on a 413 for a job past the limit: the limit, to split it by


class TooManyQueued(Exception):
    """A job that would take its owner past the items it may have queued or in progress at once
    (``JobStore.max_queued_items``; HTTP: 429, or 413 for a job that could never fit)."""

    def __init__(self, queued: int, limit: int, items: int):
        self.queued, self.limit, self.items = queued, limit, items
        super().__init__(self._reason())

    @property
    def never_fits(self) -> bool:
        return self.items > self.limit

    def _reason(self) -> str:
        if self.never_fits:
            return (f"a job of {self.items} items is more than the {self.limit} a key may have queued at once "
                    "(BATCHASR_JOB_MAX_QUEUED_ITEMS): submit it as smaller jobs")
        return (f"{self.queued} of this key's items are queued or in progress, and {self.items} more would pass the "
                f"{self.limit} a key may have at once (BATCHASR_JOB_MAX_QUEUED_ITEMS): submit it once some have "
                "finished")


class NoRoomToRetry(TooManyQueued):
    """A retry that queued none of the job's ``items`` failed items: its owner has as many queued or in progress
    as it may (HTTP: 429). Never 413: a retry queues as many as there is room for, and the rest at the next."""

    @property
    def never_fits(self) -> bool:
        return False

    def _reason(self) -> str:
        return (f"{self.queued} of this key's items are queued or in progress, and a key may have {self.limit} at "
                f"once (BATCHASR_JOB_MAX_QUEUED_ITEMS): none of the job's {self.items} failed items were queued "
                "again; retry once some have finished")


@dataclass(frozen=True)
class ItemInput:
    """One item's audio: exactly one of a path, a URL, or the bytes themselves."""

    audio: str  # what the submitter called it (file name, path or URL)
    path: str | None = None  # a file under the input roots
    url: str | None = None  # an http(s) URL under the input URL prefixes
    upload: Upload | None = None  # the audio itself, or a file holding it (read when the job is submitted)
    stretch: Stretch | None = None  # a path's or URL's: the seconds of it to transcribe (a NeMo manifest's)

    def __post_init__(self) -> None:
        if sum(source is not None for source in (self.path, self.url, self.upload)) != 1:
            raise JobInputError(f"{self.audio}: an item needs exactly one of a path, a URL or uploaded audio")


@dataclass(frozen=True)
class JobOptions:
    """What a submission asks for besides its items."""

    webhook_url: str | None = None  # POSTed to when the job finishes (service.webhooks)
    priority: JobPriority = JobPriority.NORMAL  # workers take high before normal, normal before low
    multichannel: bool = False  # each channel of every item transcribed apart (models.conversation)
    skip_silence: bool = False  # long quiet stretches left out (models.silence)
    owner: str = ANONYMOUS  # who may see the job (service.http.owner_of: a hash of the submitter's API key)
    channel_names: tuple[str, ...] = ()  # with multichannel: the speakers, one a channel in order
    hotwords: tuple[str, ...] = ()  # words and phrases made likelier (decoding.boosting)


@dataclass
class ItemStart:
    """What a consumer learns when it starts an item: its state, deliveries so far, and (in progress) its input
    record, its upload's size (None once expired, or for a path or URL input) and, up to INLINE_UPLOAD_BYTES, the
    upload itself (a larger one: ``read_upload``), let go once decoded. "cancelling": its job was cancelled, and
    the record holds only its ``audio``."""
    state: str
    attempts: int
    record: dict[str, Any] = field(default_factory=dict)
    upload_bytes: int | None = None
    upload: bytes | None = None
    cancels: int = 0  # its job's cancels when it started: a later one stops it (service.job_worker)


@dataclass
class Job:
    id: str
    status: JobStatus
    total_items: int
    counts: dict[str, int]
    created_at: float
    started_at: float | None
    finished_at: float | None
    audio_s: float
    compute_s: float
    priority: JobPriority = JobPriority.NORMAL
    tokens: int = 0  # scored tokens of the items completed
    logprob_sum: float = 0.0  # the sum of their log-probabilities
    multichannel: bool = False
    skip_silence: bool = False
    owner: str = ANONYMOUS
    channel_names: tuple[str, ...] = ()
    hotwords: tuple[str, ...] = ()
    webhook_url: str | None = None
    webhook_status: str | None = None  # pending | delivered | failed, when the job has a webhook
    webhook_attempts: int = 0
    webhook_error: str | None = None
    ends: int = 0  # how many times it has ended: once, and again after each retry of its failed items
    fingerprint: str = ""  # the submission's (``submission_fingerprint``); "" for jobs written before it was kept
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rtfx(self) -> float:
        return self.audio_s / self.compute_s if self.compute_s > 0 else 0.0

    @property
    def avg_logprob(self) -> float | None:
        """The mean token log-probability over the items completed so far: a falling one while a job runs says its
        audio is harder than expected (noisy, another language) before anyone reads a result."""
        return rounded(self.logprob_sum / self.tokens) if self.tokens else None

    @property
    def finished(self) -> bool:
        return self.finished_at is not None

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "object": "transcription.job", "status": self.status.value,
                "priority": self.priority.value, "multichannel": self.multichannel,
                "skip_silence": self.skip_silence, **({"channel_names": list(self.channel_names)}
                                                      if self.channel_names else {}),
                **({"hotwords": list(self.hotwords)} if self.hotwords else {}),
                "total_items": self.total_items, "counts": self.counts,
                "created_at": self.created_at,
                "started_at": self.started_at, "finished_at": self.finished_at, "audio_s": round(self.audio_s, 3),
                "compute_s": round(self.compute_s, 3), "rtfx": round(self.rtfx, 2), "avg_logprob": self.avg_logprob,
                **self._webhook_dict()}

    def _webhook_dict(self) -> dict[str, Any]:
        if not self.webhook_url:
            return {}
        return {"webhook": {"url": self.webhook_url, "status": self.webhook_status or "pending",
                            "attempts": self.webhook_attempts, "error": self.webhook_error}}


@dataclass(frozen=True)
class Retried:
    """What retrying a job's failed items did (``JobStore.retry_failed``)."""

    job: Job  # as it is after
    retried: int  # queued again
    unretried: int  # failed uploads, left as they were: their audio went with their failure
    deferred: int = 0  # left failed for now: the owner's queued-items limit had no room for them

    def to_dict(self) -> dict[str, Any]:
        """The answer of the HTTP route and `batchasr jobs --retry` alike."""
        return {**self.job.to_dict(), "retried_items": self.retried, "unretried_items": self.unretried,
                "deferred_items": self.deferred}


def resolve_input_path(path: str, roots: list[str]) -> Path:
    """The real path of ``path`` if it lies under one of ``roots`` (symlinks followed); else JobInputError."""
    if not roots:
        raise JobInputError("path inputs are disabled: the server has no input roots (BATCHASR_INPUT_ROOTS)")
    try:
        real = Path(path).resolve()
        under_roots = _under_roots(real, roots)
        found = under_roots and real.is_file()
    except (ValueError, OSError, RuntimeError) as exc:  # a NUL byte, a name too long, a symlink loop (RuntimeError
        # before Python 3.13): the client's error, not the server's
        raise JobInputError(f"{path!r}: not a usable path ({exc})") from exc
    if not under_roots:
        raise JobInputError(f"{path}: outside the input roots; refused")
    if not found:
        raise JobInputError(f"{path}: no such file under the input roots")
    return real


def open_input_file(path: str, roots: list[str]) -> BinaryIO:
    """``path`` opened for reading, checked by name (``resolve_input_path``) and again as opened: a regular file,
    under the roots. Checked by name alone, a name under a root swapped between the check and the open for a symlink
    to a file outside the roots had that file transcribed for the client, and one to a FIFO blocked a decode thread
    until something wrote to it."""
    real = resolve_input_path(path, roots)
    try:
        file = open(real, "rb", opener=_open_not_following)  # noqa: SIM115 (the caller's to close)
    except OSError as exc:  # a symlink swapped in (ELOOP), or the file gone
        raise JobInputError(f"{path}: cannot be opened ({exc.strerror})") from exc
    try:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise JobInputError(f"{path}: not a regular file")
        opened = _opened_path(file)  # a folder on the way swapped for a symlink: where the open really went
        if opened is not None and not _under_roots(opened, roots):
            raise JobInputError(f"{path}: outside the input roots; refused")
    except BaseException:
        file.close()
        raise
    return file


def _under_roots(real: Path, roots: list[str]) -> bool:
    return any(real.is_relative_to(Path(root).resolve()) for root in roots)


def _open_not_following(name: str, flags: int) -> int:
    # a symlink as the last part is refused (ELOOP); a FIFO's open does not wait for a writer (reading a regular
    # file is the same with O_NONBLOCK)
    return os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK)


def _opened_path(file: BinaryIO) -> Path | None:
    """Where an open file lies, as Linux's /proc tells it (None where it cannot)."""
    try:
        return Path(os.readlink(f"/proc/self/fd/{file.fileno()}"))
    except OSError:
        return None


def job_from_fields(job_id: str, h: dict[str, str]) -> Job:
    """A job from its hash's fields, as text."""

    def opt(name: str) -> float | None:
        return float(h[name]) if h.get(name) else None

    return Job(id=job_id, status=JobStatus(h["status"]), total_items=int(h["total"]),
               counts={s: int(h.get(f"n_{s}", 0)) for s in ITEM_STATES}, created_at=float(h["created_at"]),
               started_at=opt("started_at"), finished_at=opt("finished_at"), audio_s=float(h["audio_s"]),
               compute_s=float(h["compute_s"]), priority=JobPriority(h.get("priority") or "normal"),
               tokens=int(h.get("tokens", 0)), logprob_sum=float(h.get("logprob_sum", 0)),
               multichannel=h.get("multichannel") == "1", skip_silence=h.get("skip_silence") == "1",
               owner=h.get("owner") or ANONYMOUS, channel_names=tuple(json.loads(h.get("channel_names") or "[]")),
               hotwords=tuple(json.loads(h.get("hotwords") or "[]")),
               webhook_url=h.get("webhook_url") or None,
               webhook_status=h.get("webhook_status") or None, webhook_attempts=int(h.get("webhook_attempts", 0)),
               webhook_error=h.get("webhook_error") or None, ends=int(h.get("ends", 0)),
               fingerprint=h.get("fingerprint", ""))


def submission_fingerprint(items: list[ItemInput], options: JobOptions, upload_sizes: Mapping[int, int]) -> str:
    """What a submission asked for, hashed: each item's name, source and stretch (an upload by its size, by item
    index in ``upload_sizes``: its bytes are not read again to be hashed) and the options. A retry under the same
    idempotency key must match it. The owner is left out: a key is its owner's already."""
    described = [[item.audio, item.path, item.url, upload_sizes.get(index),
                  [item.stretch.offset_s, item.stretch.duration_s] if item.stretch is not None else None]
                 for index, item in enumerate(items)]
    asked = [options.webhook_url, options.priority.value, options.multichannel, options.skip_silence,
             list(options.channel_names), list(options.hotwords)]
    return hashlib.sha256(json.dumps([described, asked]).encode()).hexdigest()[:32]


def deleted_job(job_id: str) -> dict[str, Any]:
    """What purging a job answers (the HTTP route and `batchasr jobs --purge` alike, through a server or Redis)."""
    return {"id": job_id, "object": "transcription.job.deleted", "deleted": True}


def item_record(audio: str | None, status: str, text: str | None = None, tokens: list[int] | None = None,
                words: list[dict[str, Any]] | None = None, duration_s: float | None = None,
                error: str | None = None, token_logprobs: list[float] | None = None,
                avg_logprob: float | None = None, **conversation: Any) -> dict[str, Any]:
    """One line of a job's results (the same keys whatever the outcome; a multichannel item's result adds its
    ``utterances`` and ``channels``, as ``formats.to_record`` writes them)."""
    return {"audio": audio, "status": status, "text": text, "tokens": tokens, "token_logprobs": token_logprobs,
            "avg_logprob": avg_logprob, "words": words, "duration_s": duration_s, "error": error, **conversation}
