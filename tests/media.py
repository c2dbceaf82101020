"""Real media files for the tests: audio encoded by FFmpeg's own encoders (through PyAV) into the containers
phones, browsers and video tools write."""

from __future__ import annotations

import io
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import soxr

# name -> (muxer, audio codec, the one sample rate the codec takes, or None: the audio's own)
CONTAINERS = {
    "m4a": ("ipod", "aac", None),  # a phone's voice memo
    "alac": ("ipod", "alac", None),  # lossless, in an M4A
    "webm": ("webm", "libopus", 48000),  # a browser's MediaRecorder
    "mkv": ("matroska", "flac", None),
    "aac": ("adts", "aac", None),
    "ts": ("mpegts", "mp2", None),  # broadcast
    "amr": ("amr", "libopencore_amrnb", 8000),  # a phone call
    "3gp": ("3gp", "libopencore_amrnb", 8000),
}
LAYOUTS = {1: "mono", 2: "stereo", 6: "5.1", 8: "7.1"}  # FFmpeg's names for the channels of a file


def encode(samples: np.ndarray, name: str, rate: int = 16000, channels: int = 1, video: bool = False,
           path: Path | None = None, options: dict | None = None) -> bytes:
    """Mono ``samples`` at ``rate`` as a file of kind ``name`` (CONTAINERS), optionally with ``channels`` copies
    (or (channels, n) ``samples``: a file of those channels, LAYOUTS) and a small video track (then an MP4 with AAC,
    whatever ``name``); written to ``path`` when given (options such as ``movflags=faststart`` need a file), and
    returned."""
    muxer, codec, codec_rate = ("mp4", "aac", None) if video else CONTAINERS[name]
    planes = samples if samples.ndim == 2 else np.tile(samples[None, :], (channels, 1))
    if codec_rate and codec_rate != rate:
        planes, rate = soxr.resample(planes.T, rate, codec_rate).T, codec_rate
    planes = np.ascontiguousarray(planes, dtype=np.float32)
    target = str(path) if path else io.BytesIO()
    with av.open(target, "w", format=muxer, options=options or {}) as out:
        audio = out.add_stream(codec, rate=rate, layout=LAYOUTS[len(planes)])
        if video:
            _add_video(out, seconds=planes.shape[1] / rate)
        for start in range(0, planes.shape[1], 4096):
            # interleaved: PyAV's planar frames break from 8 channels on (models.containers)
            interleaved = np.ascontiguousarray(planes[:, start : start + 4096].T).reshape(1, -1)
            frame = av.AudioFrame.from_ndarray(interleaved, format="flt", layout=audio.layout.name)
            frame.sample_rate, frame.pts, frame.time_base = rate, start, Fraction(1, rate)
            out.mux(audio.encode(frame))
        out.mux(audio.encode())
    return path.read_bytes() if path else target.getvalue()


def video_only_mp4() -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as out:
        _add_video(out, seconds=1.0)
    return buffer.getvalue()


def _add_video(out, seconds: float) -> None:
    stream = out.add_stream("mpeg4", rate=10)
    stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
    for i in range(max(1, int(seconds * 10))):
        picture = np.full((48, 64, 3), i % 256, dtype=np.uint8)
        out.mux(stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")))
    out.mux(stream.encode())
