"""A stretch of a local file as a job upload (``batchasr submit --manifest``).

The worker must decode the very samples that ``batchasr transcribe --manifest`` reads, so that the tokens agree.
Integer audio (PCM of 8 to 24 bits, mu-law, A-law) goes as its own frames, at its own rate and with all its
channels, in FLAC: lossless, and libsndfile reads them back as the same floats, so the worker's mixing and
resampling are ours. 16-bit audio at 16 kHz takes at most half the bytes of float32 before FLAC compresses it
(a quarter to a third of them on the test speech); 8 kHz mu-law telephony at most a quarter (about an eighth).
Anything else (float or lossy audio, media containers, rates and channels that would make FLAC the larger) goes
as the float32 samples the model hears, in a WAV at 16 kHz.
"""

from __future__ import annotations

import io
from typing import Any

from models.audio_io import AudioClip, AudioError, open_audio, read_audio

SAMPLE_RATE = 16000  # the float32 fallback: the samples the model hears
FLOAT_BYTES = 4
FLAC_MAX_CHANNELS = 8
HEADER_BYTES = 1024  # a WAV's or a FLAC's header and framing, over its samples
# a libsndfile subtype read as integers -> the FLAC subtype that keeps them exactly, and its bytes per sample
LOSSLESS_AS_FLAC = {
    "PCM_S8": ("PCM_S8", 1),
    "PCM_U8": ("PCM_S8", 1),
    "PCM_16": ("PCM_16", 2),
    "ULAW": ("PCM_16", 2),
    "ALAW": ("PCM_16", 2),
    "PCM_24": ("PCM_24", 3),
}


def _as_flac(f: Any, multichannel: bool) -> tuple[str, int] | None:
    """The FLAC subtype and bytes per sample that carry ``f``'s frames exactly, where their raw size is no more
    than the float32 fallback's; None: send float32."""
    subtype = getattr(f, "subtype", None)  # FFmpeg's reader has none: its frames are not read as integers
    if subtype not in LOSSLESS_AS_FLAC or not f.seekable() or f.channels > FLAC_MAX_CHANNELS:
        return None
    flac_subtype, width = LOSSLESS_AS_FLAC[subtype]
    fallback_channels = f.channels if multichannel else 1
    if f.samplerate * f.channels * width > SAMPLE_RATE * FLOAT_BYTES * fallback_channels:
        return None
    return flac_subtype, width


def stretch_upload_size(clip: AudioClip, multichannel: bool) -> int:
    """The most bytes the stretch's upload takes: its raw frames (FLAC only makes them smaller) and a header."""
    with open_audio(clip.path) as f:
        seconds = clip.duration_s if clip.duration_s is not None else f.frames / f.samplerate - clip.offset_s
        flac = _as_flac(f, multichannel)
        per_second = (f.samplerate * f.channels * flac[1] if flac
                      else SAMPLE_RATE * FLOAT_BYTES * (f.channels if multichannel else 1))
        return int(max(seconds, 0) * per_second) + HEADER_BYTES


def stretch_upload(clip: AudioClip, multichannel: bool) -> tuple[str, bytes, str]:
    """(file name that says which stretch, bytes, content type) of the stretch's upload."""
    import soundfile as sf

    end = "end" if clip.duration_s is None else f"{clip.offset_s + clip.duration_s:g}"
    stem = f"{clip.path.stem}@{clip.offset_s:g}-{end}"
    with open_audio(clip.path) as f:
        flac = _as_flac(f, multichannel)
        if flac is not None:
            first, count = clip.stretch.frames(f.samplerate)
            f.seek(min(first, f.frames))
            frames = f.read(-1 if count is None else count, dtype="int32", always_2d=True)
            if not len(frames):
                raise AudioError(f"{clip}: the offset lies past the end of the audio")
            body = io.BytesIO()
            sf.write(body, frames, f.samplerate, format="FLAC", subtype=flac[0])
            return f"{stem}.flac", body.getvalue(), "audio/flac"
    samples = read_audio(clip, SAMPLE_RATE, mix=not multichannel)
    body = io.BytesIO()
    sf.write(body, samples.T if multichannel else samples, SAMPLE_RATE, format="WAV", subtype="FLOAT")
    return f"{stem}.wav", body.getvalue(), "audio/wav"
