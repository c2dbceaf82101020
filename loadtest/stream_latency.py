"""How soon a streamed transcription says something: one long recording sent to a running server, with
``stream=true`` (time to the first delta, to the done event) and without (time to the answer), one after another.

    python loadtest/stream_latency.py --url http://127.0.0.1:8000 --seconds 600 [--audio-dir DIR] [--repeat 3]

The recording is the directory's clips (the project's test speech by default), each followed by half a second
of silence, repeated to ``--seconds`` and sent as FLAC. Prints one JSON object per round.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import soundfile as sf

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from models.audio_io import AudioError, read_audio  # noqa: E402

GAP_S = 0.5
RATE = 16000


def recording(audio_dir: Path, seconds: float) -> tuple[bytes, float]:
    """FLAC bytes and seconds of the clips and their gaps, repeated to at least ``seconds``."""
    try:  # at 16 kHz, mixed to mono: an 8 kHz clip written as 16 kHz would count half its seconds
        clips = [read_audio(p, RATE) for p in sorted(audio_dir.glob("*.wav"))]
    except AudioError as exc:
        raise SystemExit(str(exc)) from exc
    if not clips:
        raise SystemExit(f"no WAV files in {audio_dir}")
    gap = np.zeros(int(GAP_S * RATE), dtype=np.float32)
    parts, total = [], 0
    while total < seconds * RATE:
        clip = clips[len(parts) // 2 % len(clips)]
        parts += [clip, gap]
        total += len(clip) + len(gap)
    buffer = io.BytesIO()
    sf.write(buffer, np.concatenate(parts), RATE, format="FLAC")
    return buffer.getvalue(), total / RATE


def one_round(client: httpx.Client, url: str, audio: bytes) -> dict:
    files = {"file": ("recording.flac", audio, "audio/flac")}
    started, first_s, deltas, text = time.perf_counter(), None, [], None
    with client.stream("POST", f"{url}/v1/audio/transcriptions", files=files, data={"stream": "true"}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line.removeprefix("data: "))
            if event["type"] == "transcript.text.delta":
                first_s = first_s or time.perf_counter() - started
                deltas.append(event["delta"])
            elif event["type"] == "transcript.text.done":
                text = event["text"]
            else:
                raise RuntimeError(f"the stream failed: {event}")
    done_s = time.perf_counter() - started
    started = time.perf_counter()
    plain = client.post(f"{url}/v1/audio/transcriptions", files=files)
    plain.raise_for_status()
    return {"first_delta_s": round(first_s or done_s, 3), "done_s": round(done_s, 3), "deltas": len(deltas),
            "without_stream_s": round(time.perf_counter() - started, 3),
            "same_text": "".join(deltas) == text == plain.json()["text"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--audio-dir", type=Path, default=REPO / "tests" / "data" / "default_model")
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    audio, audio_s = recording(args.audio_dir, args.seconds)
    with httpx.Client(timeout=600) as client:
        for _ in range(args.repeat):
            print(json.dumps({"audio_s": round(audio_s, 3), **one_round(client, args.url, audio)}), flush=True)


if __name__ == "__main__":
    main()
