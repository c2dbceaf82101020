"""Audio in media containers (M4A, MP4 with video, WebM, Matroska, ADTS AAC, MPEG-TS, AMR, 3GP): decoded through
FFmpeg, recognised by their first bytes, within the same limits and with errors as clear as libsndfile's."""

from __future__ import annotations

import io
import json
import tracemalloc
from pathlib import Path
from tempfile import SpooledTemporaryFile

import httpx
import numpy as np
import pytest
import soundfile as sf

from models import load_model
from models.audio_io import AudioError, find_audio_files, read_audio
from models.containers import EBML_MAGIC, EXACT_DURATION_FORMATS, ContainerAudio, container_format
from service import audio
from service.audio import AudioLimits, AudioRequestError, AudioTooLarge, decode_audio, decode_audio_file
from service.config import Settings
from tests.media import CONTAINERS, encode, video_only_mp4
from tests.servers import run_server

DATA = Path(__file__).parent / "data" / "default_model"
LIMITS = AudioLimits(max_bytes=50 * 1024 * 1024, max_duration_s=60.0)
# what an encoder may add: a codec's priming or padding frames (AAC's 1024 samples at each end; AMR's 20 ms
# frames; MP2's 1152-sample frames)
PADDING_S = 0.15


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    return sf.read(DATA / "voice_000142.wav", dtype="float32")[0]


@pytest.mark.parametrize("name", sorted(CONTAINERS))
def test_each_container_decodes_to_16k_mono_of_its_length(speech, name):
    data = encode(speech, name)
    decoded = decode_audio(data, LIMITS)
    assert decoded.dtype == np.float32 and decoded.ndim == 1
    assert len(speech) / 16000 <= len(decoded) / 16000 + 0.01 <= len(speech) / 16000 + PADDING_S, name
    np.testing.assert_array_equal(decoded, read_audio(data))  # the service and the Python API read alike


@pytest.mark.parametrize("name", ["m4a", "webm", "mkv", "alac"])
def test_containers_with_edit_lists_or_lossless_audio_line_up_with_the_original(speech, name):
    decoded = decode_audio(encode(speech, name, channels=2), LIMITS)[: len(speech)]
    assert np.corrcoef(decoded, speech)[0, 1] > 0.99  # no priming delay: the same samples at the same times
    if name in ("mkv", "alac"):  # FLAC and ALAC: the 16-bit original, exactly
        np.testing.assert_array_equal(decoded, speech)


def test_the_sound_track_of_a_video_is_transcribed(speech):
    data = encode(speech, "m4a", channels=2, video=True)
    assert container_format(data[:512]) == "mov"
    decoded = decode_audio(data, LIMITS)
    assert np.corrcoef(decoded[: len(speech)], speech)[0, 1] > 0.99


@pytest.mark.parametrize(("head", "expected"), [
    (b"\x00\x00\x00\x1cftypM4A " + bytes(500), "mov"),
    (b"\x1a\x45\xdf\xa3" + bytes(500), "matroska"),
    (b"#!AMR-WB\n" + bytes(500), "amr"),
    (b"\xff\xf1\x50\x80" + bytes(500), "aac"),
    (b"\xff\xfb\x90\x64" + bytes(500), "mp3"),  # an MPEG-1 layer III frame
    (b"\xff\xf3\x88\xc4" + bytes(500), "mp3"),  # MPEG-2 layer III, as libsndfile writes 16 kHz
    (b"\xff\xfd\x90\x64" + bytes(500), "mp3"),  # layer II
    (b"\xff\xfb\xf0\x64" + bytes(500), None),  # a reserved bit rate: not a frame
    (b"\xff\xeb\x90\x64" + bytes(500), None),  # a reserved MPEG version
    (b"ID3\x04" + bytes(500), None),
    (b"RIFF\x00\x00\x00\x00WAVE" + bytes(500), None),
    (b"fLaC" + bytes(500), None),
    (b"OggS" + bytes(500), None),
    (b"#EXTM3U\n#EXTINF:1,\nfile:///etc/passwd\n", None),  # an HLS playlist: never handed to FFmpeg to probe
    (b"ffconcat version 1.0\nfile /etc/passwd\n", None),
    ((b"\x47" + bytes(187)) * 3, "mpegts"),
    (b"", None),
])
def test_containers_are_recognised_by_their_first_bytes(head, expected):
    assert container_format(head) == expected


def _id3_tagged(audio: bytes) -> bytes:
    """``audio`` behind an ID3v2.4 tag with a title and 2 kB of padding, as taggers write it."""
    frames = b"TIT2" + (6).to_bytes(4, "big") + b"\x00\x00" + b"\x03title" + bytes(2048)
    size = len(frames)
    syncsafe = bytes([(size >> 21) & 0x7F, (size >> 14) & 0x7F, (size >> 7) & 0x7F, size & 0x7F])
    return b"ID3\x04\x00\x00" + syncsafe + frames + audio


def test_adts_aac_and_mp3_behind_an_id3_tag_decode_as_without_it(speech, tmp_path):
    adts = encode(speech, "aac")
    np.testing.assert_array_equal(decode_audio(_id3_tagged(adts), LIMITS), decode_audio(adts, LIMITS))
    path = tmp_path / "tagged.aac"
    path.write_bytes(_id3_tagged(adts))
    np.testing.assert_array_equal(decode_audio_file(path, LIMITS), decode_audio(adts, LIMITS))
    mp3 = io.BytesIO()
    sf.write(mp3, speech, 16000, format="MP3")
    np.testing.assert_array_equal(decode_audio(_id3_tagged(mp3.getvalue()), LIMITS),
                                  decode_audio(mp3.getvalue(), LIMITS))


def _mp3(samples: np.ndarray) -> bytes:
    """``samples`` as an MP3 (16 kHz: MPEG-2 layer III), with the Xing header libsndfile writes."""
    out = io.BytesIO()
    sf.write(out, samples, 16000, format="MP3")
    return out.getvalue()


def test_mp3_decodes_as_libsndfile_decoded_it(speech):
    """MP3 is FFmpeg's now (below): the samples are libsndfile's to within a float's rounding, so transcripts do not
    move."""
    data = _mp3(speech)
    ours = decode_audio(data, LIMITS)
    theirs, _ = sf.read(io.BytesIO(data), dtype="float32")
    assert len(ours) == len(theirs)
    np.testing.assert_allclose(ours, theirs, atol=1e-5)


def test_mp3_files_joined_end_to_end_decode_to_their_end(speech, tmp_path):
    """libsndfile read an MP3 only as far as its Xing header's frame count: two files joined with `cat` (recordings
    cut in parts, put back together) decoded as the first alone, and a file whose count was left stale lost the
    rest. No error: the transcript was just shorter. FFmpeg reads to the end, past the second file's Info frame."""
    data = _mp3(speech)
    whole = decode_audio(data, LIMITS)
    joined = decode_audio(data + data, LIMITS)
    assert 2 * len(whole) <= len(joined) <= 2 * len(whole) + PADDING_S * 16000
    np.testing.assert_allclose(joined[: len(whole)], whole, atol=1e-5)
    # the first file's padding and the second's priming lie between the two
    assert _best_match(joined, whole, range(len(whole), len(joined) - len(whole) + 1)) > 0.99
    path = tmp_path / "joined.mp3"
    path.write_bytes(data + data)
    np.testing.assert_array_equal(read_audio(path), joined)  # the Python API and the CLI read it alike

    stale = bytearray(data)
    count_at = stale.index(b"Xing") + 8  # after the tag and its flags: the frame count, big-endian
    frames = int.from_bytes(stale[count_at : count_at + 4], "big")
    stale[count_at : count_at + 4] = (frames // 2).to_bytes(4, "big")
    decoded = decode_audio(bytes(stale), LIMITS)
    assert len(decoded) == len(whole)  # FFmpeg trims the encoder's padding where the count ends (17 ms), no more
    tail = whole[-16000:]
    assert _best_match(decoded, tail, range(len(whole) - 16000 - 800, len(whole) - 16000 + 1)) > 0.99


def _best_match(audio: np.ndarray, part: np.ndarray, starts: range) -> float:
    """How well ``part`` matches ``audio`` where it matches best, starting at one of ``starts`` (a correlation)."""
    at = max(starts, key=lambda start: np.dot(audio[start : start + len(part)], part))
    return float(np.corrcoef(audio[at : at + len(part)], part)[0, 1])


@pytest.mark.parametrize(("rate", "channels", "bitrate_mode", "compression_level"), [
    (16000, 1, "VARIABLE", 0.5), (44100, 2, "CONSTANT", 0.0), (8000, 1, "CONSTANT", 0.9), (22050, 1, "VARIABLE", 0.9)])
def test_a_stretch_of_an_mp3_has_the_samples_decoding_from_the_start_gives(rate, channels, bitrate_mode,
                                                                           compression_level, tmp_path):
    """A stretch's MP3 packets before it are passed over undecoded, but for a few decoded first (the frames its data
    and its first samples depend on): the same samples as decoding from the start, at low bit rates too, where a
    frame's data reaches back over many small frames."""
    noise = np.random.default_rng(rate).standard_normal((rate * 20, channels)).astype(np.float32) * 0.1
    path = tmp_path / "long.mp3"
    sf.write(path, noise, rate, format="MP3", bitrate_mode=bitrate_mode, compression_level=compression_level)
    with ContainerAudio(path, "mp3") as f:
        whole = f.read(rate * 60)
    for first in (1, 47, 1105, rate * 3 + 17, rate * 10, len(whole) - 100, len(whole) + 5):
        with ContainerAudio(path, "mp3") as f:
            f.skip(first)
            np.testing.assert_array_equal(f.read(rate * 60), whole[first:], err_msg=str(first))


def test_an_mp3_mostly_undecodable_is_refused(speech):
    """Frames that do not decode are passed over (a joined file's Info frame is one), but not a file with more of
    them than of good ones."""
    data = bytearray(_mp3(speech))
    first = data.index(b"\xff\xf3", 4)
    frame_bytes = data.index(b"\xff\xf3", first + 4) - first
    for start in range(first + 4 * frame_bytes, len(data) - frame_bytes, frame_bytes):  # keep the first few
        data[start + 4 : start + frame_bytes] = b"\xff" * (frame_bytes - 4)  # headers kept, contents garbage
    with pytest.raises(AudioRequestError, match="MP3 audio stops decoding"):
        decode_audio(bytes(data), LIMITS)


def test_a_playlist_naming_a_local_file_is_refused_without_reading_it(tmp_path, speech):
    """FFmpeg's HLS and concat demuxers open what a playlist names; an upload must not reach the server's files."""
    target = tmp_path / "secret.wav"
    sf.write(target, speech, 16000)
    for playlist in (f"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:3.0,\n{target}\n#EXT-X-ENDLIST\n",
                     f"ffconcat version 1.0\nfile '{target}'\n"):
        with pytest.raises(AudioRequestError, match="cannot decode audio"):
            decode_audio(playlist.encode(), LIMITS)


@pytest.mark.parametrize("name", sorted(EXACT_DURATION_FORMATS))
def test_a_container_stating_more_than_the_limit_is_refused_before_decoding(monkeypatch, speech, name):
    data = encode(np.tile(speech, 4), {"mov": "m4a", "matroska": "mkv"}[name])
    blocks_read = []
    monkeypatch.setattr(audio, "decode_blocks", lambda *a, **k: blocks_read.append(1) or iter(()))
    with pytest.raises(AudioTooLarge, match="per its header"):
        decode_audio(data, AudioLimits(max_bytes=LIMITS.max_bytes, max_duration_s=5.0))
    assert not blocks_read


@pytest.mark.parametrize("name", ["aac", "ts", "amr"])
def test_containers_with_estimated_durations_are_held_to_the_limit_as_they_decode(monkeypatch, speech, name):
    monkeypatch.setattr(audio, "BLOCK_FRAMES", 4000)
    data = encode(np.tile(speech, 4), name)
    with pytest.raises(AudioTooLarge, match="longer than allowed"):
        decode_audio(data, AudioLimits(max_bytes=LIMITS.max_bytes, max_duration_s=5.0))


def test_audio_at_a_low_rate_stating_no_length_is_read_no_further_than_the_limit():
    """A block is resampled before it is counted: 2,000 s of 100 Hz FLAC in Matroska without its Duration (a
    39 kB upload) was read whole, 128 MB at 16 kHz, to refuse 5 s of it (at 1 Hz, 67 GB for 300 kB)."""
    data = bytearray(encode(np.zeros(200_000, dtype=np.float32), "mkv", rate=100))
    at = data.index(b"\x44\x89\x88")  # Duration, an 8-byte float -> a Void element of the same 11 bytes
    data[at : at + 11] = b"\xec\x89" + bytes(9)
    tracemalloc.start()
    try:
        with pytest.raises(AudioTooLarge, match="longer than allowed"):
            decode_audio(bytes(data), AudioLimits(max_bytes=LIMITS.max_bytes, max_duration_s=5.0))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 1024 * 1024  # 5 s at 16 kHz is 320 kB of float32


def _first_half(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _unknown_codec(data: bytes, codec: bytes) -> bytes:
    """``data`` with its sample entry's codec renamed to one FFmpeg has no decoder for."""
    at = data.index(codec)
    return data[:at] + b"zzzz" + data[at + 4 :]


BAD_CONTAINERS = {  # what is wrong -> (the file, given 10 s of speech and a folder; what the error says)
    "an M4A cut before its index": (lambda long, tmp: encode(long, "m4a")[:20_000], "not a readable MP4/M4A/MOV file"),
    "an M4A cut in its samples": (lambda long, tmp: _first_half(encode(
        long, "m4a", path=tmp / "a.m4a", options={"movflags": "faststart"})), "MP4/M4A/MOV audio stops decoding"),
    "a WebM cut in half": (lambda long, tmp: _first_half(encode(long, "webm")), "truncated"),
    "a Matroska file cut in half": (lambda long, tmp: _first_half(encode(long, "mkv")), "truncated"),
    "a video without sound": (lambda long, tmp: video_only_mp4(), "has no audio stream"),
    "random bytes behind an MP4 box": (lambda long, tmp: b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 20,
                                       "not a readable MP4/M4A/MOV file"),
    "an EBML header and nothing else": (lambda long, tmp: EBML_MAGIC, "not a readable Matroska/WebM file"),
    "a codec FFmpeg cannot decode": (lambda long, tmp: _unknown_codec(encode(long, "3gp"), b"samr"),
                                     "audio codec cannot be decoded"),
    # each ADTS frame says its channels: mono, then stereo (two files joined) was a ValueError, a 500
    "AAC whose channels change mid-stream": (lambda long, tmp: encode(long, "aac") + encode(long, "aac", channels=2),
                                             "number of channels changes mid-stream"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONTAINERS))
def test_bad_containers_get_clear_errors(tmp_path, speech, case):
    make, message = BAD_CONTAINERS[case]
    data = make(np.tile(speech, 4), tmp_path)
    with pytest.raises(AudioRequestError, match=message):
        decode_audio(data, LIMITS)
    path = tmp_path / "in.bin"
    path.write_bytes(data)
    with pytest.raises(AudioRequestError, match=message):  # a job's path input: the same answer
        decode_audio_file(path, LIMITS)
    with pytest.raises(AudioError, match=message):  # and the Python API's
        read_audio(data)


@pytest.mark.parametrize("name", ["mkv", "webm"])
def test_audio_of_eight_channels_in_a_container_decodes(speech, name):
    """7.1 sound (a film's track): PyAV's planar frames of 8 channels or more read pointers past their end, and
    decoding one crashed the process."""
    channels = np.stack([np.roll(speech, 800 * c) for c in range(8)])
    data = encode(channels, name)
    apart = decode_audio(data, LIMITS, multichannel=True)
    assert apart.shape[0] == 8 and abs(apart.shape[1] - len(speech)) <= PADDING_S * 16000
    np.testing.assert_allclose(decode_audio(data, LIMITS), apart.mean(axis=0), atol=1e-6)  # mixed, then resampled
    np.testing.assert_array_equal(read_audio(data, mix=False), apart)


def test_files_on_disk_decode_as_their_bytes_do(tmp_path, speech):
    for name in ("m4a", "webm", "ts"):
        path = tmp_path / f"a.{name}"
        data = encode(speech, name, path=path)
        np.testing.assert_array_equal(decode_audio_file(path, LIMITS), decode_audio(data, LIMITS))
        np.testing.assert_array_equal(read_audio(path), decode_audio(data, LIMITS))


@pytest.mark.parametrize("name", sorted(CONTAINERS))
@pytest.mark.parametrize("in_memory", [True, False])
def test_uploads_decode_from_a_temporary_file_as_their_bytes_do(speech, name, in_memory):
    """A request's upload is decoded from the temporary file it was received into. One still in memory says its
    mode is "w+b", and PyAV, taking a file object's own mode, opened it for writing: "no audio stream"."""
    data = encode(speech, name)
    with SpooledTemporaryFile(max_size=len(data) + 1 if in_memory else 1) as upload:
        upload.write(data)
        upload.seek(0)
        np.testing.assert_array_equal(decode_audio(upload, LIMITS), decode_audio(data, LIMITS))
        upload.seek(0)
        assert upload.read() == data  # read, not written


def test_directories_are_walked_for_container_files(tmp_path, speech):
    for name in ("a.m4a", "b.webm", "c.mp4", "d.MKV", "e.txt"):
        (tmp_path / name).write_bytes(b"x")
    assert [p.name for p in find_audio_files([tmp_path])] == ["a.m4a", "b.webm", "c.mp4", "d.MKV"]


# --- over HTTP, on the embedded model (real recognition: lossy codecs must not change its text) --------------


@pytest.fixture(scope="module")
def server():
    with run_server(Settings(max_wait_ms=20), load_model(device="cpu")) as running:
        yield running


@pytest.mark.parametrize(("name", "content_type", "video"), [
    ("m4a", "audio/mp4", False), ("webm", "audio/webm", False), ("mp4", "video/mp4", True),
    ("aac", "audio/aac", False), ("mkv", "application/octet-stream", False),
])
def test_uploads_in_containers_give_the_wav_text(server, name, content_type, video):
    for path in sorted(DATA.glob("*.wav")):
        wav = path.read_bytes()
        data = encode(sf.read(io.BytesIO(wav), dtype="float32")[0], "m4a" if video else name, channels=2, video=video)
        texts = [httpx.post(f"{server.url}/v1/audio/transcriptions", files={"file": (f"x.{name}", body, kind)},
                            data={"response_format": "text"}, timeout=60)
                 for body, kind in ((wav, "audio/wav"), (data, content_type))]
        assert [t.status_code for t in texts] == [200, 200], texts[1].text
        assert texts[1].text == texts[0].text, (name, path.name)


@pytest.mark.parametrize(("name", "content_type"), [("m4a", "audio/mp4"), ("webm", "audio/webm"), ("ts", "video/mp2t")])
def test_raw_bodies_in_containers_give_the_wav_text(server, name, content_type):
    """A raw body is decoded from the file it was received into (in memory when small, as these are)."""
    wav = (DATA / "voice_000142.wav").read_bytes()
    data = encode(sf.read(io.BytesIO(wav), dtype="float32")[0], name)
    texts = [httpx.post(f"{server.url}/v1/transcribe", content=body, headers={"content-type": kind}, timeout=60)
             for body, kind in ((wav, "audio/wav"), (data, content_type))]
    assert [t.status_code for t in texts] == [200, 200], texts[1].text
    assert texts[1].json()["text"] == texts[0].json()["text"]


def test_a_bad_container_upload_is_a_400_and_the_server_stays_healthy(server, speech):
    for data, message in ((video_only_mp4(), "has no audio stream"),
                          (encode(speech, "m4a")[:5000], "not a readable MP4/M4A/MOV file")):
        response = httpx.post(f"{server.url}/v1/transcribe", files={"file": ("x.mp4", data, "video/mp4")}, timeout=60)
        assert response.status_code == 400, response.text
        assert message in response.json()["error"]["message"]
    assert httpx.get(f"{server.url}/healthz").status_code == 200


def test_the_command_line_transcribes_a_folder_of_phone_and_browser_recordings(tmp_path, capsys):
    """``batchasr transcribe`` on the embedded model: an M4A, a WebM and an MP4 video give the WAV's text."""
    from service.cli import main

    wav = DATA / "sentences_000028.wav"
    speech = sf.read(wav, dtype="float32")[0]
    for name, video in (("memo.m4a", False), ("browser.webm", False), ("clip.mp4", True)):
        encode(speech, "m4a" if video else name.split(".")[1], channels=2, video=video, path=tmp_path / name)
    assert main(["transcribe", "--format", "text", str(wav)]) == 0
    expected = capsys.readouterr().out.strip()
    assert main(["transcribe", "--format", "jsonl", str(tmp_path)]) == 0
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [Path(r["audio"]).name for r in results] == ["browser.webm", "clip.mp4", "memo.m4a"]
    assert [r["text"] for r in results] == [expected] * 3
