"""What decoding one upload costs the server: peak memory allocated while decoding (numpy's arrays included, as
tracemalloc counts them) and wall time, for a long recording at a given rate, channel count and format.

    python loadtest/decode_cost.py --minutes 60 --rate 48000 --channels 2 --format WAV

The audio is a tone with noise: decoding costs the same whatever is said.
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


def make_upload(minutes: float, rate: int, channels: int, format: str) -> bytes:
    """``minutes`` of 16-bit audio (FLAC and WAV), written a minute at a time to keep this script's own peak low."""
    buffer = io.BytesIO()
    rng = np.random.default_rng(0)
    with sf.SoundFile(buffer, "w", rate, channels, format=format, subtype="PCM_16") as f:
        for _ in range(int(np.ceil(minutes))):
            t = np.arange(60 * rate) / rate
            minute = 0.3 * np.sin(2 * np.pi * 440 * t)[:, None] + 0.05 * rng.standard_normal((len(t), channels))
            f.write(minute.astype(np.float32))
    return buffer.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--rate", type=int, default=48000)
    parser.add_argument("--channels", type=int, default=2)
    parser.add_argument("--format", default="WAV", choices=["WAV", "FLAC"])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    data = make_upload(args.minutes, args.rate, args.channels, args.format)
    limits = AudioLimits(max_bytes=len(data) + 1, max_duration_s=4 * 3600.0)
    for _ in range(args.repeat):
        tracemalloc.start()
        start = time.perf_counter()
        waveform = decode_audio(data, limits)
        wall_s = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        print(f"{args.minutes:g} min {args.rate} Hz x{args.channels} {args.format} ({len(data) / 2**20:.0f} MiB): "
              f"peak {peak / 2**20:.0f} MiB allocated while decoding, output {waveform.nbytes / 2**20:.0f} MiB, "
              f"{wall_s:.2f} s")
        del waveform


if __name__ == "__main__":
    main()
