"""Audio in media containers, decoded by FFmpeg through PyAV and read the way a ``soundfile.SoundFile`` is.

libsndfile reads WAV, FLAC, OGG and MP3, but not the containers much recorded audio comes in: phones' M4A
and 3GP (AAC, AMR), browsers' WebM (Opus), and the sound tracks of video files (MP4, MOV, MKV, broadcast
MPEG-TS). Those are recognised here by their first bytes, and FFmpeg is told which demuxer to use. So is MP3,
which libsndfile reads only as far as the frame count of its Xing/Info header: files joined end to end (`cat`,
common for recordings cut in parts) and files whose header a tool left stale lost what followed, silently. It is never
left to guess: some of its demuxers (HLS playlists, concat lists) open the other files and URLs an input names,
and an upload must not make the server read its own files. Nested opens are refused as well.

PyAV is imported when a container is first opened, so ``models`` still runs where it is not installed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

HEAD_BYTES = 512  # what ``container_format`` needs to see of a file
ISO_BOX_TYPES = {b"ftyp", b"moov", b"mdat", b"wide", b"free", b"skip"}  # a first box of MP4/M4A/MOV/3GP
EBML_MAGIC = b"\x1a\x45\xdf\xa3"  # Matroska and WebM
TS_PACKET = 188
# Formats whose stated duration is exact (sample tables, a muxer's Duration); the others' are estimates from
# the bit rate, not to be held against the audio
EXACT_DURATION_FORMATS = {"mov", "matroska"}
FORMAT_NAMES = {"mov": "MP4/M4A/MOV", "matroska": "Matroska/WebM", "mpegts": "MPEG-TS", "aac": "AAC (ADTS)",
                "amr": "AMR", "mp3": "MP3", "flac": "FLAC", "wav": "WAV"}
TRUNCATION_TOLERANCE_S = 0.5  # decoders may drop a partial frame or a codec's priming at the end
# An MP3 frame may take its data from up to 511 bytes of the frames before it (the bit reservoir), and its samples
# overlap the previous frame's: decoding from this many packets, and bytes, before a stretch gives the very samples
# decoding from the start does (tests/test_containers.py checks it), without decoding the hour before
MP3_WARMUP_PACKETS, MP3_WARMUP_BYTES = 8, 2048


class UnreadableContainer(ValueError):
    """A container FFmpeg cannot read, or one without audio; the message says which and why."""


def id3_tag_bytes(head: bytes) -> int:
    """How many bytes an ID3v2 tag at the start of a file takes (0: none). Taggers put them in front of ADTS
    AAC as in front of MP3."""
    if len(head) < 10 or not head.startswith(b"ID3"):
        return 0
    size = (head[6] & 0x7F) << 21 | (head[7] & 0x7F) << 14 | (head[8] & 0x7F) << 7 | (head[9] & 0x7F)  # syncsafe
    return 10 + size + (10 if head[5] & 0x10 else 0)  # header, tag, footer


def container_format(head: bytes) -> str | None:
    """FFmpeg's demuxer for a file that starts with ``head`` (its first ``HEAD_BYTES``), or None for anything
    that is not one of the containers read here (libsndfile's formats, and whatever else)."""
    if len(head) >= 8 and head[4:8] in ISO_BOX_TYPES:
        return "mov"
    if head.startswith(EBML_MAGIC):
        return "matroska"
    if head.startswith(b"#!AMR"):  # "#!AMR\n" and "#!AMR-WB\n"
        return "amr"
    if len(head) >= 2 and head[0] == 0xFF and head[1] & 0xF6 == 0xF0:  # ADTS sync word, layer 0 (MP3 is not 0)
        return "aac"
    if _mpeg_audio_frame(head):
        return "mp3"
    if len(head) > 2 * TS_PACKET and head[0] == head[TS_PACKET] == head[2 * TS_PACKET] == 0x47:
        return "mpegts"
    if _flac_of_unknown_length(head):
        return "flac"
    if _wav_of_unknown_length(head):
        return "wav"
    return None


def _mpeg_audio_frame(head: bytes) -> bool:
    """An MPEG audio frame header (MP3, or layers I and II): the 11-bit sync, then a version, layer, bit rate and
    sample rate that are not the reserved values."""
    if len(head) < 4 or head[0] != 0xFF or head[1] & 0xE0 != 0xE0:
        return False
    version, layer = head[1] >> 3 & 0b11, head[1] >> 1 & 0b11
    bitrate, rate = head[2] >> 4, head[2] >> 2 & 0b11
    return version != 0b01 and layer != 0 and bitrate != 0b1111 and rate != 0b11


def _flac_of_unknown_length(head: bytes) -> bool:
    """A FLAC whose STREAMINFO states 0 samples, "unknown" (encoders writing to a pipe): libsndfile takes that for a
    length of 2^63 - 1 frames, and its reads then fail; FFmpeg reads such a file to its end."""
    # STREAMINFO comes first: its block type 0, its 34 bytes
    if len(head) < 42 or not head.startswith(b"fLaC") or head[4] & 0x7F != 0 or head[5:8] != b"\x00\x00\x22":
        return False
    fields = int.from_bytes(head[8 + 10 : 8 + 18], "big")  # rate (20 bits), channels, depth, samples (36 bits)
    return fields >> 44 != 0 and fields & ((1 << 36) - 1) == 0


def wav_data_chunk(head: bytes) -> tuple[int, int, int] | None:
    """A RIFF/WAVE file's data chunk as its start ``head`` declares it: (offset of its first sample byte, its size,
    the format's byte rate: 0 where no fmt chunk came first); None for other formats or a chunk past ``head``."""
    if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return None
    offset, byte_rate = 12, 0
    while offset + 8 <= len(head):
        chunk_id, size = head[offset : offset + 4], int.from_bytes(head[offset + 4 : offset + 8], "little")
        if chunk_id == b"fmt " and offset + 20 <= len(head):
            byte_rate = int.from_bytes(head[offset + 16 : offset + 20], "little")
        if chunk_id == b"data":
            return offset + 8, size, byte_rate
        offset += 8 + size + (size & 1)  # chunks are padded to even sizes
    return None


def _wav_of_unknown_length(head: bytes) -> bool:
    """A RIFF/WAVE whose data chunk states 0 bytes with samples after it (older FFmpeg, writing to a pipe):
    libsndfile takes the 0 literally, FFmpeg reads to the end."""
    chunk = wav_data_chunk(head)
    return chunk is not None and chunk[1] == 0 and chunk[0] < len(head)


def _av():
    try:
        import av
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ImportError("reading MP4, M4A, WebM and other containers needs the `av` package (pip install av)"
                          ) from exc
    return av


def _reason(exc: Exception) -> str:
    """FFmpeg's words for an error, without PyAV's errno and the name of the call that failed."""
    return getattr(exc, "strerror", None) or str(exc)


def _refuse_nested_open(url: str, flags: int, options: dict) -> Any:
    raise PermissionError(f"the container refers to another file or URL ({url!r}); that is not read")


class ContainerAudio:
    """The first audio stream of a container, read in blocks of frames like a ``soundfile.SoundFile``:
    ``samplerate``, ``channels``, ``frames`` (from the container's duration where it is exact; 0 otherwise)
    and ``read(n)`` -> (at most n, channels) float32 at the stream's own rate, empty at the end.

    Samples are converted to float by FFmpeg (its sample-format conversion; no resampling). A file that ends
    well before the duration its container states is refused as truncated rather than read as shorter audio.
    """

    def __init__(self, source: str | Path | BinaryIO, format_name: str):
        av = _av()
        self.format_name = format_name
        self._file = open(source, "rb") if isinstance(source, (str, Path)) else None  # noqa: SIM115 - closed in close()
        try:
            # mode given: PyAV otherwise takes a file object's own, and a temporary file's "w+b" opened it for writing
            self._container = av.open(self._file or source, mode="r", format=format_name, metadata_errors="replace",
                                      io_open=_refuse_nested_open)
        except (av.FFmpegError, PermissionError, UnicodeError) as exc:
            self._close_file()
            raise UnreadableContainer(f"not a readable {FORMAT_NAMES[format_name]} file: {_reason(exc)}") from exc
        try:
            self._stream = self._audio_stream()
        except UnreadableContainer:
            self.close()
            raise
        self.samplerate: int = self._stream.codec_context.sample_rate
        self.channels: int = self._stream.codec_context.channels
        self.frames = self._stated_frames(format_name)
        self._blocks = self._decoded_blocks(first=0)
        self._pending: list[np.ndarray] = []
        self._buffered = 0
        self._decoded = 0
        self._decoded_packets = self._undecodable = 0  # MP3 packets that decoded and did not (``_frames_of``)

    def _audio_stream(self):
        streams = self._container.streams.audio
        if not streams:
            raise UnreadableContainer(f"the {FORMAT_NAMES[self.format_name]} file has no audio stream")
        stream = streams[0]
        if stream.codec_context is None:  # a codec this FFmpeg has no decoder for
            raise UnreadableContainer(f"the {FORMAT_NAMES[self.format_name]} file's audio codec cannot be decoded")
        if stream.codec_context.sample_rate <= 0 or stream.codec_context.channels <= 0:
            raise UnreadableContainer("the audio stream states no sample rate or no channels")
        return stream

    def _stated_frames(self, format_name: str) -> int:
        if format_name not in EXACT_DURATION_FORMATS:
            return 0
        if self._stream.duration is not None and self._stream.time_base is not None:
            seconds = float(self._stream.duration * self._stream.time_base)
        elif self._container.duration is not None:
            seconds = self._container.duration / 1_000_000  # AV_TIME_BASE
        else:
            return 0
        return max(0, round(seconds * self.samplerate))

    def skip(self, frames: int) -> None:
        """Start reading ``frames`` into the audio (before the first read). An MP3's packets well before them are
        passed over undecoded: a stretch an hour into a file took a second of decoding; the others are decoded
        and dropped."""
        assert self._decoded == self._buffered == 0, "skip before reading"
        self._blocks = self._decoded_blocks(first=frames)
        self._decoded = frames  # held, for the truncation check: the stretch starts there

    def _decoded_blocks(self, first: int) -> Iterator[np.ndarray]:
        """The stream decoded to float32 (n, channels) blocks, from its frame ``first`` on."""
        av = _av()
        # the sample format only: rate and channels stay as they are. Interleaved, not planar: PyAV finds a planar
        # frame's planes by reading its pointers up to a null one, past the end of them from 8 channels on (a 7.1
        # file crashed the process)
        to_float = av.AudioResampler(format="flt")
        warmup: deque[Any] = deque()  # the MP3 packets passed over last, decoded before the next (MP3_WARMUP_*)
        position = None  # the frame the next decoded samples start at (None: 0, or found from the first's pts)
        try:
            for packet in self._container.demux(self._stream):
                if first and self._wholly_before(packet, first):
                    warmup.append(packet)
                    while (len(warmup) > MP3_WARMUP_PACKETS
                           and sum(p.size for p in warmup) - warmup[0].size >= MP3_WARMUP_BYTES):
                        warmup.popleft()
                    continue
                for decoding in (*warmup, packet):
                    for frame in self._frames_of(decoding, av, warming=decoding is not packet):
                        self._check_format_of(frame)
                        if position is None:
                            position = self._frame_of(frame) if warmup else 0
                        for converted in to_float.resample(frame):
                            block = converted.to_ndarray().reshape(-1, self.channels)  # (1, n x channels) -> (n, ch)
                            start, position = position, position + len(block)
                            if position > first:
                                yield block[max(first - start, 0) :]
                warmup.clear()
        except (av.FFmpegError, ValueError) as exc:  # ValueError: the channel layout changed mid-stream
            if isinstance(exc, UnreadableContainer):
                raise
            raise UnreadableContainer(f"the {FORMAT_NAMES[self.format_name]} audio stops decoding: {_reason(exc)}"
                                      ) from exc

    def _wholly_before(self, packet: Any, frame: int) -> bool:
        """An MP3 packet whose samples all come before ``frame`` (by its timestamp), to pass over undecoded."""
        if self.format_name != "mp3" or packet.pts is None or not packet.duration:
            return False
        return self._frame_at(packet.pts + packet.duration) <= frame

    def _frame_of(self, decoded: Any) -> int:
        """Where a decoded frame starts in the stream's samples (the decoder's priming, dropped, not counted)."""
        return self._frame_at(decoded.pts) if decoded.pts is not None else 0

    def _frame_at(self, pts: int) -> int:
        return round((pts - (self._stream.start_time or 0)) * self._stream.time_base * self.samplerate)

    def _check_format_of(self, frame: Any) -> None:
        if frame.sample_rate != self.samplerate:
            raise UnreadableContainer(f"the sample rate changes mid-stream ({self.samplerate} Hz, then "
                                      f"{frame.sample_rate} Hz)")
        if frame.layout.nb_channels != self.channels:
            raise UnreadableContainer(f"the number of channels changes mid-stream ({self.channels}, "
                                      f"then {frame.layout.nb_channels})")

    def _frames_of(self, packet: Any, av: Any, warming: bool = False) -> list[Any]:
        """A packet's decoded frames. An MP3 frame that does not decode is passed over, as FFmpeg's own tools do:
        files joined end to end hold the next one's Info frame there, and a warm-up packet may lack the frames its
        data begins in. A file with more such than good frames is refused as damaged."""
        if self.format_name != "mp3":
            return packet.decode()
        try:
            frames = packet.decode()
        except av.InvalidDataError:
            if not warming:
                self._undecodable += 1
                if self._undecodable > self._decoded_packets:
                    raise
            return []
        self._decoded_packets += 1
        return frames

    def read(self, frames: int, dtype: str = "float32", always_2d: bool = True) -> np.ndarray:
        """Up to ``frames`` frames as (n, channels) float32 (the arguments soundfile takes, in the only form used)."""
        assert dtype == "float32" and always_2d, "containers are read as 2-D float32"
        while self._buffered < frames:
            block = next(self._blocks, None)
            if block is None:
                self._check_complete()
                break
            self._pending.append(block)
            self._buffered += len(block)
        if not self._pending:
            return np.zeros((0, self.channels), dtype=np.float32)
        joined = self._pending[0] if len(self._pending) == 1 else np.concatenate(self._pending)
        out, rest = joined[:frames], joined[frames:]
        self._pending = [rest] if len(rest) else []
        self._buffered = len(rest)
        self._decoded += len(out)
        return out

    def _check_complete(self) -> None:
        stated_s, held_s = self.frames / self.samplerate, (self._decoded + self._buffered) / self.samplerate
        if self.frames and stated_s - held_s > TRUNCATION_TOLERANCE_S:
            raise UnreadableContainer(f"the audio is truncated: its container states {stated_s:.1f} s, the file "
                                      f"holds {held_s:.1f} s")

    def close(self) -> None:
        self._container.close()
        self._close_file()

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()

    def __enter__(self) -> ContainerAudio:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
