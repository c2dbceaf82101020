"""How long a decode takes while another thread of the process runs Python part of the time, as the event loop
and the engine thread do: every release of the interpreter lock inside the decoder (FFmpeg, through PyAV, gives
it up several times a frame) may wait for that thread to let it go again.

    python loadtest/decode_beside_python.py [--seconds 60]

One upload of each kind, 48 kHz stereo (a tone with noise), decoded by the server's decoding function alone,
then beside a thread that runs Python for ``busy`` ms and sleeps for ``idle`` ms, over and over.
"""

from __future__ import annotations

import argparse
import io
import sys
import threading
import time
from pathlib import Path

import numpy as np
import soundfile as sf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from service.audio import AudioLimits, decode_audio
from tests.media import encode

RATE = 48000
DUTY_CYCLES_MS = ((0.2, 0.8), (1, 1), (5, 5))  # (busy, idle): a fifth busy in short bursts, then half busy


def uploads(seconds: float) -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    t = np.arange(int(seconds * RATE)) / RATE
    mono = (0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(len(t))).astype(np.float32)
    made = {}
    for format, subtype in (("WAV", "PCM_16"), ("FLAC", None)):
        buffer = io.BytesIO()
        sf.write(buffer, np.stack([mono, mono], axis=1), RATE, format=format, subtype=subtype)
        made[format] = buffer.getvalue()
    made["M4A"] = encode(mono, "m4a", rate=RATE, channels=2)
    made["WEBM"] = encode(mono, "webm", rate=RATE, channels=2)
    return made


def run_python(stop: threading.Event, busy_s: float, idle_s: float) -> None:
    while not stop.is_set():
        end = time.perf_counter() + busy_s
        while time.perf_counter() < end:
            pass
        time.sleep(idle_s)


def timed_decode(data: bytes, busy_ms: float = 0.0, idle_ms: float = 0.0) -> float:
    limits = AudioLimits(max_bytes=len(data) + 1, max_duration_s=24 * 3600.0)
    stop = threading.Event()
    other = threading.Thread(target=run_python, args=(stop, busy_ms / 1000, idle_ms / 1000))
    if busy_ms:
        other.start()
    start = time.perf_counter()
    decode_audio(data, limits)
    elapsed = time.perf_counter() - start
    stop.set()
    if busy_ms:
        other.join()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    made = uploads(args.seconds)
    print("| other thread | " + " | ".join(made) + " |")
    print("|---" * (len(made) + 1) + "|")
    print("| none | " + " | ".join(f"{timed_decode(data):.2f} s" for data in made.values()) + " |")
    for busy_ms, idle_ms in DUTY_CYCLES_MS:
        times = [timed_decode(data, busy_ms, idle_ms) for data in made.values()]
        print(f"| {busy_ms:g} ms Python, {idle_ms:g} ms idle | " + " | ".join(f"{t:.2f} s" for t in times) + " |")


if __name__ == "__main__":
    main()
