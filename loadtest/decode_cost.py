"""What decoding one upload costs the server: peak memory allocated while decoding (numpy's arrays included, as
tracemalloc counts them) and wall time, for a long recording at a given rate, channel count and format.

    python loadtest/decode_cost.py --minutes 60 --rate 48000 --channels 2 --format WAV

WAV and FLAC are libsndfile's to decode; M4A (AAC), WEBM (Opus, always 48 kHz) and MKV (FLAC in Matroska)
FFmpeg's, through PyAV. The audio is a tone with noise: decoding costs the same whatever is said.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import soundfile as sf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from service.audio import AudioLimits, decode_audio

CONTAINERS = {"M4A": "m4a", "WEBM": "webm", "MKV": "mkv"}  # --format -> tests.media's names


def make_upload(minutes: float, rate: int, channels: int, format: str) -> bytes:
    """``minutes`` of audio: 16-bit WAV and FLAC written a minute at a time (to keep this script's own peak low),
    or a container encoded by FFmpeg."""
    rng = np.random.default_rng(0)
    total, per_minute = round(minutes * 60 * rate), 60 * rate
    t = np.arange(per_minute) / rate
    # whole minutes, then the rest: not a whole minute more than --minutes says (0.5 used to make 1)
    minutes_of_audio = ((0.3 * np.sin(2 * np.pi * 440 * t[: min(per_minute, total - start)])[:, None]
                         + 0.05 * rng.standard_normal((min(per_minute, total - start), channels))).astype(np.float32)
                        for start in range(0, total, per_minute))
    if format in CONTAINERS:
        from tests.media import encode

        mono = np.concatenate([minute[:, 0] for minute in minutes_of_audio])
        return encode(mono, CONTAINERS[format], rate=rate, channels=channels)
    buffer = io.BytesIO()
    with sf.SoundFile(buffer, "w", rate, channels, format=format, subtype="PCM_16") as f:
        for minute in minutes_of_audio:
            f.write(minute)
    return buffer.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--rate", type=int, default=48000)
    parser.add_argument("--channels", type=int, default=2)
    parser.add_argument("--format", default="WAV", choices=["WAV", "FLAC", *CONTAINERS])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    data = make_upload(args.minutes, args.rate, args.channels, args.format)
    limits = AudioLimits(max_bytes=len(data) + 1, max_duration_s=4 * 3600.0)
    for _ in range(args.repeat):
        start = time.perf_counter()
        decode_audio(data, limits)
        plain_s = time.perf_counter() - start
        tracemalloc.start()  # tracing slows every allocation (the more, the smaller): timed on its own above
        start = time.perf_counter()
        waveform = decode_audio(data, limits)
        traced_s = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        print(f"{args.minutes:g} min {args.rate} Hz x{args.channels} {args.format} ({len(data) / 2**20:.0f} MiB): "
              f"peak {peak / 2**20:.0f} MiB allocated while decoding, output {waveform.nbytes / 2**20:.0f} MiB, "
              f"{plain_s:.2f} s ({traced_s:.2f} s traced)")
        del waveform

if __name__ == "__main__":
    main()
