"""Stereo calls transcribed mixed down to mono, or each channel apart (``multichannel``), with or without their
long quiet stretches (``skip_silence``): word error rate against what was said, and compute time, on the
embedded default model.

    python loadtest/multichannel_calls.py --calls 30 --turns 8 --overlap 1.0
    python loadtest/multichannel_calls.py --server http://127.0.0.1:8000   # through POST /v1/transcribe

Each call alternates two speakers, one a channel, saying the default model's test sentences over a faint line
noise. A turn starts between ``--overlap`` seconds before the previous one ends (talking over it) and 0.8 s after.
Mixed, the reference is every turn's words in the order the turns start; apart, each channel's turns in order.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models import load_model
from models.wer import edit_distance

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "default_model"
RATE = 16000
MAX_PAUSE_S = 0.8


@dataclass
class Call:
    audio: np.ndarray  # (2, samples)
    said: list[list[str]]  # each channel's words, in order
    said_in_order: list[str]  # every turn's words, by start


def make_call(rng: np.random.Generator, clips: list[tuple[np.ndarray, str]], turns: int, overlap_s: float,
              bleed_db: float | None = None, second_db: float = 0.0) -> Call:
    placed, start = [], 0.3
    for turn in range(turns):
        clip, text = clips[rng.integers(len(clips))]
        placed.append((turn % 2, int(start * RATE), clip, text))
        start += len(clip) / RATE + rng.uniform(-overlap_s, MAX_PAUSE_S)
    length = max(s + len(clip) for _, s, clip, _ in placed) + RATE // 2
    audio = (rng.standard_normal((2, length)) * 0.002).astype(np.float32)
    said: list[list[str]] = [[], []]
    for channel, s, clip, text in placed:
        clip = clip * 10 ** (second_db / 20) if channel == 1 else clip
        audio[channel, s : s + len(clip)] += clip
        if bleed_db is not None:  # the line's echo: each speaker heard faintly on the other channel too
            audio[1 - channel, s : s + len(clip)] += clip * 10 ** (bleed_db / 20)
        said[channel] += text.split()
    return Call(audio, said, [w for _, _, _, text in sorted(placed, key=lambda p: p[1]) for w in text.split()])


def transcribe_offline(model, calls: list[Call], multichannel: bool, skip_silence: bool, batch_size: int
                       ) -> list[list[str]]:
    """Each call's words: mixed, one list; apart, one list per channel."""
    audio = [c.audio if multichannel else c.audio.mean(axis=0) for c in calls]
    outcomes = model.transcribe(audio, batch_size=batch_size, max_segment_s=30, multichannel=multichannel,
                                skip_silence=skip_silence)
    return [[t.text.split() for t in o.channels] if multichannel else [o.text.split()] for o in outcomes]


async def transcribe_http(server: str, calls: list[Call], multichannel: bool, skip_silence: bool
                          ) -> list[list[str]]:
    """As ``transcribe_offline``, every call posted at once to the native route as 16-bit FLAC."""
    import httpx

    def flac(call: Call) -> bytes:
        buffer = io.BytesIO()
        sf.write(buffer, (call.audio if multichannel else call.audio.mean(axis=0)).T, RATE, format="FLAC")
        return buffer.getvalue()

    params = {"multichannel": str(multichannel).lower(), "skip_silence": str(skip_silence).lower()}
    async with httpx.AsyncClient(base_url=server, timeout=600) as client:
        responses = await asyncio.gather(*(client.post("/v1/transcribe", params=params, content=flac(c))
                                           for c in calls))
    bodies = [r.raise_for_status().json() for r in responses]
    return [[ch["text"].split() for ch in b["channels"]] if multichannel else [b["text"].split()] for b in bodies]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--overlap", type=float, default=1.0, help="most seconds a turn talks over the last")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server", help="send the calls to this batchasr server instead (all at once)")
    parser.add_argument("--bleed-db", type=float, help="each speaker also on the other channel, this many dB down "
                                                        "(echo on the line; e.g. -30)")
    parser.add_argument("--second-db", type=float, default=0.0,
                        help="the second speaker's level against the first's (e.g. -12: a quieter line)")
    args = parser.parse_args()
    expected = json.loads((DATA / "expected.json").read_text())
    clips = [(sf.read(DATA / name, dtype="float32")[0], text) for name, text in sorted(expected.items())]
    rng = np.random.default_rng(args.seed)
    calls = [make_call(rng, clips, args.turns, args.overlap, args.bleed_db, args.second_db) for _ in range(args.calls)]
    if args.server:
        def run(multichannel: bool, skip_silence: bool) -> list[list[str]]:
            return asyncio.run(transcribe_http(args.server, calls, multichannel, skip_silence))
    else:
        model = load_model(device="cpu")
        model.transcribe([calls[0].audio[0]])  # warm-up

        def run(multichannel: bool, skip_silence: bool) -> list[list[str]]:
            return transcribe_offline(model, calls, multichannel, skip_silence, args.batch_size)

    call_s = sum(c.audio.shape[1] for c in calls) / RATE
    words = sum(len(c.said_in_order) for c in calls)
    print(f"{args.calls} calls, {call_s:.0f} s of calls, {words} words, overlap up to {args.overlap} s, "
          f"{'over HTTP' if args.server else 'offline'}")
    print("| transcribed | WER | wall s | RTFx (call seconds) |\n|---|---|---|---|")
    for label, multichannel, skip_silence in (("mixed to mono", False, False), ("mixed, skip_silence", False, True),
                                              ("channels apart", True, False), ("apart, skip_silence", True, True)):
        started = time.perf_counter()
        heard = run(multichannel, skip_silence)
        elapsed = time.perf_counter() - started
        said = [c.said if multichannel else [c.said_in_order] for c in calls]
        edits = sum(edit_distance(ref, hyp) for refs, hyps in zip(said, heard, strict=True)
                    for ref, hyp in zip(refs, hyps, strict=True))
        print(f"| {label} | {100 * edits / words:.1f}% | {elapsed:.2f} | {call_s / elapsed:.0f} |")

if __name__ == "__main__":
    main()
