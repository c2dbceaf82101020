"""Audio files -> mono float32 waveforms at the model's rate (soundfile, or PyAV for media containers, and
soxr; imported when first needed).

``models`` must run where only torch, numpy and sentencepiece exist (the GPU image): the audio libraries
are imported here, lazily, so arrays can always be transcribed and files only when they are installed.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from .containers import (
    HEAD_BYTES,
    ContainerAudio,
    UnreadableContainer,
    container_format,
    id3_tag_bytes,
    wav_data_chunk,
)

SOUNDFILE_SUFFIXES = {".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".aif", ".aiff", ".au", ".w64", ".caf"}
CONTAINER_SUFFIXES = {".m4a", ".m4b", ".mp4", ".mov", ".3gp", ".3g2", ".webm", ".mkv", ".mka", ".ts", ".aac",
                      ".amr"}
AUDIO_SUFFIXES = SOUNDFILE_SUFFIXES | CONTAINER_SUFFIXES


def find_audio_files(paths: Iterable[str | Path]) -> list[Path]:
    """Files as given, and the audio files under directories (by suffix, recursively, sorted), through linked
    folders too; a link to nothing is listed, so that reading it reports it rather than it vanishing."""
    found: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found += sorted(p for p in _walk(path) if p.suffix.lower() in AUDIO_SUFFIXES)
        elif path.is_file():
            found.append(path)
        else:
            raise _not_a_file(path)
    return found


def _not_a_file(path: Path) -> OSError:
    """A path that is no file to read: a pipe, a device or ``-`` was reported as "no such file or directory"."""
    if path.exists():  # a FIFO, /dev/stdin on a pipe, a character device
        return OSError(f"{path}: not a regular file (reading from standard input is not supported)")
    if str(path) == "-":
        return FileNotFoundError(f"{path}: no such file (reading from standard input is not supported)")
    return FileNotFoundError(f"{path}: no such file or directory")


def _walk(root: Path) -> Iterator[Path]:
    """Every file under ``root``, following links to folders (each real folder once: a link loop ends)."""
    seen: set[str] = set()
    for folder, subfolders, files in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            subfolders.clear()
            continue
        seen.add(real)
        for name in files:
            yield Path(folder, name)


# an offset's or a duration's most seconds (about 32 years): past any recording, and still a whole number of frames
# at any sample rate (1e308 s, a finite float, made infinitely many frames: an OverflowError, not the request's error)
MAX_STRETCH_S = 1e9


def check_stretch(offset_s: float, duration_s: float | None, where: str = "") -> None:
    """ValueError unless ``offset_s`` is 0 s or more and ``duration_s`` more than 0 s (or None: to the end), each
    at most MAX_STRETCH_S."""
    if not (math.isfinite(offset_s) and 0 <= offset_s <= MAX_STRETCH_S):
        raise ValueError(f"{where}an offset is 0 s or more (at most {MAX_STRETCH_S:g} s), not {offset_s!r}")
    if duration_s is not None and not (math.isfinite(duration_s) and 0 < duration_s <= MAX_STRETCH_S):
        raise ValueError(f"{where}a duration is more than 0 s (at most {MAX_STRETCH_S:g} s), not {duration_s!r}")


@dataclass(frozen=True)
class Stretch:
    """The seconds of a recording to transcribe: from ``offset_s``, ``duration_s`` long (None: to its end). NeMo
    manifests cut long recordings into utterances this way; job items name one with ``offset`` and
    ``duration``."""

    offset_s: float = 0.0
    duration_s: float | None = None

    def __post_init__(self) -> None:
        check_stretch(self.offset_s, self.duration_s)

    @property
    def whole(self) -> bool:
        """From the start to the end: all of the recording."""
        return not self.offset_s and self.duration_s is None

    def frames(self, rate: int) -> tuple[int, int | None]:
        """The first frame and the frame count (None: to the end) at a recording's own ``rate``."""
        return (round(self.offset_s * rate),
                None if self.duration_s is None else max(1, round(self.duration_s * rate)))

    def label(self, name: str) -> str:
        """A recording's name, and the stretch of it where that is not all of it: ``call.wav [0.5 s to 2 s]``."""
        if self.whole:
            return name
        end = "end" if self.duration_s is None else f"{self.offset_s + self.duration_s:g} s"
        return f"{name} [{self.offset_s:g} s to {end}]"


WHOLE = Stretch()


@dataclass(frozen=True)
class AudioClip:
    """A stretch of an audio file (``Stretch``, with the file's path)."""

    path: Path
    offset_s: float = 0.0
    duration_s: float | None = None

    def __post_init__(self) -> None:
        check_stretch(self.offset_s, self.duration_s, f"{self.path}: ")

    @property
    def stretch(self) -> Stretch:
        return Stretch(self.offset_s, self.duration_s)

    @property
    def whole(self) -> bool:
        """The clip is all of its file."""
        return self.stretch.whole

    def __str__(self) -> str:
        return self.stretch.label(str(self.path))


# data sizes written by tools that stream WAV without seeking back: to a pipe, sox writes 0x7FFFF000, GStreamer's
# wavenc 0x7FFF0000, arecord (without -d) 0x80000000, FFmpeg 0xFFFFFFFF (older versions 0)
STREAMED_WAV_SIZES = {0, 0xFFFFFFFF, 0x7FFFF000, 0x7FFF0000, 0x80000000}
WAV_HEADER_BYTES = 1 << 16  # of a file, read to check its WAV header's claims


@dataclass(frozen=True)
class WavData:
    """A RIFF/WAVE file's data chunk, as its header declares it."""

    offset: int  # of the chunk's first sample byte
    size: int  # bytes of samples declared
    byte_rate: int

    @property
    def seconds(self) -> float:
        return self.size / self.byte_rate

    def missing_bytes(self, total_bytes: int) -> int:
        """How many of the declared bytes a file of ``total_bytes`` lacks (0: all there)."""
        return max(0, self.size - (total_bytes - self.offset))


def wav_data(head: bytes) -> WavData | None:
    """The data chunk ``head`` (a file's start) declares; None for other formats, a chunk past ``head``, or a size
    a streaming writer left unknown. libsndfile trusts the file's size over the header, so a cut-off file would
    decode as shorter audio without a word; callers say it is cut off instead."""
    chunk = wav_data_chunk(head)
    if chunk is None:
        return None
    offset, size, byte_rate = chunk
    return None if size in STREAMED_WAV_SIZES or byte_rate == 0 else WavData(offset, size, byte_rate)


def truncation_message(declared: WavData, total_bytes: int, holder: str) -> str | None:
    missing = declared.missing_bytes(total_bytes)
    if not missing:
        return None
    return (f"the audio is truncated: its header promises {declared.size} bytes of samples, the {holder} holds "
            f"{declared.size - missing}")


class AudioError(ValueError):
    """Audio that cannot be used: unreadable, empty, not finite."""


def _soundfile():
    try:
        import soundfile
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ImportError("reading audio files needs the `soundfile` package (pip install soundfile)") from exc
    return soundfile


def open_audio(source: str | Path | BinaryIO) -> Any:
    """An audio file opened for reading in blocks (``samplerate``, ``frames``, ``read(n)``, a context manager):
    media containers (MP4, M4A, WebM, ...) and MP3 through FFmpeg, recognised by their first bytes; the rest through
    libsndfile. Raises ``UnreadableContainer`` or libsndfile's errors."""
    head = _read_at(source, 0)
    format_name, tag_bytes = container_format(head), id3_tag_bytes(head)
    if tag_bytes:  # behind an ID3 tag, which FFmpeg skips: ADTS AAC or MPEG audio (else libsndfile's to try)
        after_tag = container_format(_read_at(source, tag_bytes))
        format_name = after_tag if after_tag in ("aac", "mp3") else None
    if format_name is not None:
        return ContainerAudio(source, format_name)
    return _soundfile().SoundFile(source, mode="r")  # a file object's own mode may be "w+b" (a temporary file)


def _read_at(source: str | Path | BinaryIO, offset: int) -> bytes:
    """``HEAD_BYTES`` of a file from ``offset``, leaving a file object where it was."""
    if isinstance(source, (str, Path)):
        with open(source, "rb") as f:
            f.seek(offset)
            return f.read(HEAD_BYTES)
    start = source.tell()
    source.seek(start + offset)
    head = source.read(HEAD_BYTES)
    source.seek(start)
    return head


def to_mono(samples: np.ndarray) -> np.ndarray:
    """(n,) or (n, channels) -> (n,) float32, channels averaged."""
    samples = np.asarray(samples, dtype=np.float32)
    return samples.mean(axis=1, dtype=np.float32) if samples.ndim == 2 else samples


def resample(samples: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    if from_rate == to_rate:
        return samples
    import soxr

    return soxr.resample(samples, from_rate, to_rate, quality="HQ").astype(np.float32, copy=False)


class ResampleStream:
    """``resample`` a block at a time, for audio too long to hold at its own rate: the blocks' outputs, then
    ``flush()``, joined, equal ``resample`` of the whole (soxr's stream and one-shot share one filter). Blocks are
    (n,), or (n, channels) when ``channels`` > 1."""

    def __init__(self, from_rate: int, to_rate: int, channels: int = 1):
        self._stream = None
        self._empty = np.zeros((0, channels) if channels > 1 else 0, dtype=np.float32)
        if from_rate != to_rate:
            import soxr

            self._stream = soxr.ResampleStream(from_rate, to_rate, channels, dtype="float32", quality="HQ")

    def resample(self, block: np.ndarray) -> np.ndarray:
        return block if self._stream is None else self._stream.resample_chunk(block)

    def flush(self) -> np.ndarray:
        """What the filter still holds, once the last block is in."""
        return self._empty if self._stream is None else self._stream.resample_chunk(self._empty, last=True)


def decode_blocks(f: Any, to_rate: int, block_frames: int = 1 << 20, mix: bool = True, first_frame: int = 0,
                  n_frames: int | None = None) -> Iterator[tuple[int, np.ndarray]]:
    """(frames read, that block resampled to ``to_rate``) for each block of a file from ``open_audio``, read until
    the end of its data (or ``n_frames`` from ``first_frame``, at the file's rate), then the resampler's tail (0
    frames). Blocks are mixed to mono (n,), or with ``mix=False`` keep their channels (n, channels). Joined, the
    blocks equal resampling the whole stretch at once; the file is never held at its own rate."""
    channels = 1 if mix else f.channels
    stream = ResampleStream(f.samplerate, to_rate, channels)
    _skip(f, first_frame, block_frames)
    left = math.inf if n_frames is None else n_frames
    while left > 0:
        block = f.read(int(min(block_frames, left)), dtype="float32", always_2d=True)
        if len(block) == 0:
            break
        left -= len(block)
        yield len(block), stream.resample(to_mono(block) if channels == 1 else block)
    yield 0, stream.flush()


# a file's stated length is trusted this far when room for its samples is set aside (a container may state years)
PREALLOCATE_MAX_S = 4 * 3600.0


class BlockJoiner:
    """Resampled blocks gathered as they come into one array sized from the length the file states, so that a long
    recording is held once: a list of its blocks joined at the end held it twice (1.6 GB for 3.5 hours at 16 kHz).
    Grown should the data run past the stated length (a container that states none: 0), trimmed should it end
    well short of it."""

    def __init__(self, expected: int):
        self._expected = max(expected, 0)
        self._out: np.ndarray | None = None
        self.filled = 0

    @classmethod
    def for_file(cls, f: Any, first_frame: int, n_frames: int | None, to_rate: int) -> BlockJoiner:
        """Sized for what ``f`` states from ``first_frame`` on (at most ``n_frames``; None: to its end), resampled
        to ``to_rate``; trusted up to PREALLOCATE_MAX_S."""
        stated = max(f.frames - first_frame, 0)
        if n_frames is not None:
            stated = min(stated, n_frames)
        return cls(min(_resampled_length(stated, f.samplerate, to_rate), int(PREALLOCATE_MAX_S * to_rate)))

    def add(self, block: np.ndarray) -> None:
        if self._out is None:
            self._out = np.empty((max(self._expected, len(block)), *block.shape[1:]), dtype=np.float32)
        if self.filled + len(block) > len(self._out):  # longer than stated: grow by half again at least
            grown = np.empty((max(self.filled + len(block), len(self._out) * 3 // 2), *block.shape[1:]),
                             dtype=np.float32)
            grown[: self.filled] = self._out[: self.filled]
            self._out = grown
        self._out[self.filled : self.filled + len(block)] = block
        self.filled += len(block)

    def result(self) -> np.ndarray:
        if self._out is None:
            return np.zeros(0, dtype=np.float32)
        joined = self._out[: self.filled]
        # a view keeps the whole array: a file far shorter than stated is copied, to free the rest
        return joined.copy() if len(self._out) - self.filled > len(self._out) // 8 else joined


def _resampled_length(frames: int, from_rate: int, to_rate: int) -> int:
    """About how many samples ``frames`` at ``from_rate`` make at ``to_rate`` (a few over rather than under)."""
    return math.ceil(frames * to_rate / from_rate) + 8 if frames > 0 else 0


def _skip(f: Any, frames: int, block_frames: int) -> None:
    """Move ``frames`` into the file: a seek where the file can (libsndfile), else as FFmpeg's can
    (``ContainerAudio.skip``)."""
    if frames <= 0:
        return
    if isinstance(f, ContainerAudio):
        f.skip(frames)
        return
    if getattr(f, "seekable", lambda: False)():
        target = min(frames, f.frames)
        if f.seek(target) == target:
            return
        # libsndfile's seek in a damaged MP3 can land past the frames it counts, and soundfile's reads from there
        # ask numpy for a negative length (a ValueError): read up to the stretch instead
        f.seek(0)
    while frames > 0 and len(skipped := f.read(min(block_frames, frames), dtype="float32", always_2d=True)):
        frames -= len(skipped)


# the features' float32 power spectrum overflows from samples of about 1e16 (a square wave at the Nyquist
# frequency), and larger finite samples reached the model as NaN features. Files read as floats are within 1;
# integer full scales written as floats (32,768, 2^31) are far below this
MAX_AMPLITUDE = 1e12


def sample_problem(samples: np.ndarray) -> str | None:
    """What makes ``samples`` unusable (NaN or infinite, or past ``MAX_AMPLITUDE``), or None."""
    if not samples.size:
        return None
    # the extremes alone: NaN spreads to both and infinity is one; np.abs or np.isfinite of a long recording's
    # waveform would be another copy of it
    low, high = float(samples.min()), float(samples.max())
    if not (math.isfinite(low) and math.isfinite(high)):
        return "contains NaN or infinite samples"
    if max(high, -low) > MAX_AMPLITUDE:
        return f"has samples past {MAX_AMPLITUDE:g} in magnitude"
    return None


def check_waveform(samples: np.ndarray, name: str) -> np.ndarray:
    if samples.ndim != 1:
        raise AudioError(f"{name}: expected a 1-D waveform, got shape {samples.shape}")
    if samples.size == 0:
        raise AudioError(f"{name}: audio has no samples")
    if problem := sample_problem(samples):
        raise AudioError(f"{name}: audio {problem}")
    return samples


def read_audio(source: str | Path | bytes | BinaryIO | AudioClip, sample_rate: int = 16000, mix: bool = True
               ) -> np.ndarray:
    """Decode a file (path, bytes or file object; or a clip, the stretch of a file it names), resampled to
    ``sample_rate``: mixed to mono (samples,), or with ``mix=False`` each channel apart (channels, samples)."""
    sf = _soundfile()
    clip = source if isinstance(source, AudioClip) else None
    source = clip.path if clip is not None else source
    name = str(clip or source) if isinstance(source, (str, Path)) else "audio"
    if isinstance(source, (str, Path)) and not Path(source).is_file():
        raise FileNotFoundError(f"{source}: no such audio file")
    _check_complete(source, name)
    handle = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source
    try:
        with open_audio(handle) as f:
            first, count = (clip.stretch if clip is not None else WHOLE).frames(f.samplerate)
            joined = BlockJoiner.for_file(f, first, count, sample_rate)
            for _, block in decode_blocks(f, sample_rate, mix=mix, first_frame=first, n_frames=count):
                joined.add(block)
    except (sf.LibsndfileError, UnreadableContainer, RuntimeError, TypeError) as exc:
        raise AudioError(f"{name}: cannot decode audio ({exc})") from exc
    samples = joined.result()
    if clip is not None and clip.offset_s and not len(samples):
        raise AudioError(f"{name}: the offset lies past the end of the audio")
    return check_waveform(samples, name) if mix else check_channels(channels_first(samples), name)


def declared_wav(source: str | Path | bytes | bytearray | BinaryIO) -> tuple[WavData | None, int]:
    """What a WAV's header declares of its data (``wav_data``; None for other formats) and the whole length of
    ``source`` in bytes, from its first ``WAV_HEADER_BYTES`` (a file object's from where it stands, left there)."""
    if isinstance(source, (bytes, bytearray)):
        return wav_data(bytes(source[:WAV_HEADER_BYTES])), len(source)
    if not isinstance(source, (str, Path)):
        start = source.tell()
        head = source.read(WAV_HEADER_BYTES)
        end = source.seek(0, io.SEEK_END)
        source.seek(start)
        return wav_data(head), end - start
    with open(source, "rb") as f:
        return wav_data(f.read(WAV_HEADER_BYTES)), os.fstat(f.fileno()).st_size


def _check_complete(source: str | Path | bytes | BinaryIO, name: str) -> None:
    """A WAV file or bytes holding fewer samples than its header promises is an error (a half-downloaded file)."""
    if not isinstance(source, (bytes, bytearray, str, Path)):
        return
    declared, total = declared_wav(source)
    problem = None if declared is None else truncation_message(declared, total, "file")
    if problem:
        raise AudioError(f"{name}: {problem}")


def channels_first(samples: np.ndarray) -> np.ndarray:
    """``decode_blocks``' joined blocks with their channels kept, (samples,) or (samples, channels), as one
    contiguous waveform a row: (channels, samples)."""
    # a column added, not a reshape: none of (0, -1) can be inferred for a file without samples
    return np.ascontiguousarray((samples[:, None] if samples.ndim == 1 else samples).T)


def check_channels(channels: np.ndarray, name: str) -> np.ndarray:
    """A (channels, samples) array, each row a waveform ``check_waveform`` accepts; a 1-D waveform is one row."""
    channels = channels[None] if channels.ndim == 1 else channels
    if channels.ndim != 2:
        raise AudioError(f"{name}: expected (channels, samples), got shape {channels.shape}")
    for i, row in enumerate(channels):
        check_waveform(row, f"{name} channel {i}")
    return channels
