"""Uploaded bytes -> mono float32 16 kHz waveform, within the service's limits, with errors that say why.

Limits are checked before the whole file is decoded: the header's length against the duration limit,
then the decoded length block by block, so a header that lies about its length cannot make the server
allocate more than the limit allows. Blocks are mixed down and resampled as they are read: the file's own rate
and channels are never held whole (a 4-hour 48 kHz stereo upload would be 5.5 GB of float32 samples at its
rate; at 16 kHz mono it is 0.9 GB).

A multichannel request (a call centre's stereo call: agent on one side, customer on the other) keeps each
channel as a waveform of its own. The duration limit then counts every channel's seconds, so such a request holds
and costs no more than the longest mono one.
"""

from __future__ import annotations

import io
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import soundfile as sf

from models.audio_io import (
    WHOLE,
    BlockJoiner,
    Stretch,
    channels_first,
    check_waveform,
    declared_wav,
    decode_blocks,
    open_audio,
    sample_problem,
    truncation_message,
)
from models.containers import UnreadableContainer

BLOCK_FRAMES = 1 << 20  # decode in blocks of about a minute of 16 kHz audio
ACCEPTED_MEDIA_PREFIXES = ("audio/", "video/")
ACCEPTED_MEDIA_TYPES = {"", "application/octet-stream", "application/ogg", "application/mp4", "multipart/form-data"}


class DecodeStopped(Exception):
    """A decode given up part way, its ``stop`` set: no one waits for the audio any more (its job cancelled)."""


class AudioRequestError(ValueError):
    """Audio the service refuses; ``status`` is the HTTP status that says why."""

    status = 400
    code = "invalid_audio"


class AudioTooLarge(AudioRequestError):
    status = 413
    code = "audio_too_large"


class UnsupportedMediaType(AudioRequestError):
    status = 415
    code = "unsupported_media_type"


class TooManyChannels(AudioRequestError):
    code = "too_many_channels"


class UnsupportedSampleRate(AudioRequestError):
    code = "unsupported_sample_rate"


MAX_SAMPLE_RATE = 192_000  # studio recordings' highest; FLAC allows 655,350 Hz


@dataclass(frozen=True)
class AudioLimits:
    max_bytes: int
    max_duration_s: float  # of mono audio; of all channels together when they are kept apart
    sample_rate: int = 16000
    max_channels: int = 8  # channels a multichannel request may keep apart


def _media_type(content_type: str | None) -> str:
    """``audio/wav; rate=16000`` -> ``audio/wav``."""
    return (content_type or "").split(";")[0].strip().lower()


def declared_as_audio(content_type: str | None) -> bool:
    """Whether an upload's declared type allows audio (audio/*, video/*, a generic binary type, none)."""
    media = _media_type(content_type)
    return media in ACCEPTED_MEDIA_TYPES or media.startswith(ACCEPTED_MEDIA_PREFIXES)


def decode_declared_audio(upload: bytes | BinaryIO, content_type: str | None, limits: AudioLimits,
                          multichannel: bool = False, stop: threading.Event | None = None) -> np.ndarray:
    """``decode_audio``, for an upload whose type was declared by its client. A type that is not audio is a guess
    as often as not (HTTP libraries guess a file part's type from its name: a ``.ts`` recording goes as Qt's
    translation files), so the bytes decide; what is declared as something else and does not decode is refused
    as that (415), not as broken audio."""
    try:
        return decode_audio(upload, limits, multichannel, stop=stop)
    except (AudioTooLarge, TooManyChannels, UnsupportedSampleRate):  # audio over a limit, whatever declared
        raise
    except AudioRequestError as exc:
        if declared_as_audio(content_type):
            raise
        raise UnsupportedMediaType(f"unsupported media type {_media_type(content_type)!r}: send audio (WAV, FLAC, "
                                   "OGG/Opus, MP3, M4A, MP4, WebM)") from exc


def stretch_frames(stretch: Stretch, rate: int, total: int) -> tuple[int, int | None]:
    """(first frame, frame count or None: to the end) of ``stretch`` at ``rate`` in a recording of ``total`` frames
    (0: not known); an offset past the end is the request's error."""
    first, count = stretch.frames(rate)
    if total and first >= total:
        raise AudioRequestError(f"the offset ({stretch.offset_s:g} s) lies past the end of the audio "
                                f"({total / rate:.1f} s)")
    if total:  # a duration past the end (manifests round theirs up) is what the file holds
        return first, total - first if count is None else min(count, total - first)
    return first, count


def decode_audio(upload: bytes | BinaryIO, limits: AudioLimits, multichannel: bool = False,
                 stretch: Stretch = WHOLE, stop: threading.Event | None = None) -> np.ndarray:
    """Decode an upload (libsndfile's formats, or a media container through FFmpeg), resampled to
    ``limits.sample_rate``, float32: mono (samples,), or with ``multichannel`` each channel apart
    (channels, samples); of ``stretch`` only. ``upload`` is its bytes, or a file holding them from its start (a
    request's temporary file, read where it lies rather than copied into memory whole first). ``stop`` set: given
    up at the next block (``DecodeStopped``)."""
    size = len(upload) if isinstance(upload, (bytes, bytearray)) else _file_size(upload)
    if size == 0:
        raise AudioRequestError("the uploaded file is empty")
    if size > limits.max_bytes:
        raise AudioTooLarge(f"upload of {size} bytes exceeds the limit of {limits.max_bytes} bytes")
    _check_wav_header(upload, limits, stretch is WHOLE)
    return _decode(io.BytesIO(upload) if isinstance(upload, (bytes, bytearray)) else upload, limits, multichannel,
                   stretch, stop)


def _file_size(f: BinaryIO) -> int:
    f.seek(0)
    size = f.seek(0, io.SEEK_END)
    f.seek(0)
    return size


def decode_audio_file(source: Path | BinaryIO, limits: AudioLimits, multichannel: bool = False,
                      stretch: Stretch = WHOLE, stop: threading.Event | None = None) -> np.ndarray:
    """Decode a file on disk (its path, or the file opened: service.job_types.open_input_file) as it is read, never
    holding its bytes: only the duration limit applies (a job's path inputs are how recordings larger than an upload
    may come in); of ``stretch`` only; ``stop`` as ``decode_audio``'s."""
    if isinstance(source, Path):
        name, size = source.name, source.stat().st_size
    else:
        name, size = Path(str(source.name)).name, os.fstat(source.fileno()).st_size
    if size == 0:
        raise AudioRequestError(f"{name}: the file is empty")
    _check_wav_header(source, limits, stretch is WHOLE, "file")
    return _decode(source, limits, multichannel, stretch, stop)


def _decode(source: BinaryIO | Path, limits: AudioLimits, multichannel: bool, stretch: Stretch,
            stop: threading.Event | None = None) -> np.ndarray:
    try:
        with open_audio(source) as f:
            # the duration limit counts seconds, and a second costs its samples: 60 s of silence at 655,350 Hz is a
            # 142 kB FLAC whose decoding and resampling took 18 times the CPU of the same at 16 kHz
            if f.samplerate > MAX_SAMPLE_RATE:
                raise UnsupportedSampleRate(f"the audio's sample rate is {f.samplerate} Hz; at most "
                                            f"{MAX_SAMPLE_RATE} Hz is read")
            # mixed down too: every channel is decoded and a block holds them all, so a small Vorbis file of 255
            # silent channels took 255 times the memory and decoding of its mono seconds (a gigabyte a block)
            if f.channels > limits.max_channels:
                raise TooManyChannels(f"the audio has {f.channels} channels; at most {limits.max_channels} can be "
                                      + ("transcribed apart" if multichannel else "read"))
            channels = f.channels if multichannel else 1
            max_s = limits.max_duration_s / channels
            first, count = stretch_frames(stretch, f.samplerate, max(f.frames, 0))
            claimed_s = count / f.samplerate if count else 0.0
            if claimed_s > max_s:
                raise AudioTooLarge(f"audio is {claimed_s:.1f} s long (per its header); {_limit_text(max_s, channels)}")
            samples = _read_resampled(f, limits, max_s, channels, first, None if stretch is WHOLE else count, stop)
    except sf.LibsndfileError as exc:
        raise AudioRequestError(f"cannot decode audio: {exc.error_string or exc}") from exc
    except (UnreadableContainer, RuntimeError, TypeError) as exc:
        raise AudioRequestError(f"cannot decode audio: {exc}") from exc
    if samples.size == 0:
        raise AudioRequestError("the audio has no samples")
    return channels_first(samples) if multichannel else check_waveform(samples, "upload")


def _limit_text(max_s: float, channels: int) -> str:
    if channels == 1:
        return f"the limit is {max_s:.0f} s"
    return f"the limit for {channels} channels transcribed apart is {max_s:.0f} s (their seconds count together)"


def _check_wav_header(source: bytes | BinaryIO | Path, limits: AudioLimits, whole: bool = True,
                      what: str = "upload") -> None:
    """RIFF/WAVE: the data chunk's declared size against the limit and against the bytes really there; a header
    claiming hours is refused before reading further."""
    declared, total_bytes = declared_wav(source)
    if declared is None:
        return
    if whole and declared.seconds > limits.max_duration_s:  # a stretch is checked by its own length
        raise AudioTooLarge(f"audio is {declared.seconds:.1f} s long (per its header); the limit is "
                            f"{limits.max_duration_s:.0f} s")
    problem = truncation_message(declared, total_bytes, what)
    if problem:
        raise AudioRequestError(problem)


def _read_resampled(f: sf.SoundFile, limits: AudioLimits, max_s: float, channels: int, first_frame: int = 0,
                    n_frames: int | None = None, stop: threading.Event | None = None) -> np.ndarray:
    """Blocks resampled as they are read (mono, or ``channels`` apart; ``n_frames`` from ``first_frame``, or all),
    until the end of the data (not the header's claim); refused past ``max_s`` seconds, or once a block holds a
    sample that is not finite (NaN or infinity in spreads through the resampler's filter, so none is missed) or
    is past ``MAX_AMPLITUDE``."""
    max_frames = math.floor(max_s * f.samplerate)  # as a header's claim is held to it: a frame more is refused
    # no more than a frame past the limit is read: a block is counted once resampled, and at a few Hz a block of
    # BLOCK_FRAMES is hours at 16 kHz (a 300 kB Matroska file of 1 Hz FLAC stating no duration asked for 67 GB)
    n_frames = max_frames + 1 if n_frames is None else min(n_frames, max_frames + 1)
    joined, total = BlockJoiner.for_file(f, first_frame, n_frames, limits.sample_rate), 0
    for read, block in decode_blocks(f, limits.sample_rate, BLOCK_FRAMES, mix=channels == 1,
                                     first_frame=first_frame, n_frames=n_frames):
        total += read
        if total > max_frames:
            raise AudioTooLarge(f"audio is longer than allowed: {_limit_text(max_s, channels)}")
        if problem := sample_problem(block):
            raise AudioRequestError(f"the audio {problem}")
        if stop is not None and stop.is_set():  # an hour's decoding for no one, and its memory held meanwhile
            raise DecodeStopped
        joined.add(block)
    return joined.result()
