"""Locust scenarios for batchasr: interactive transcription over HTTP, and bulk jobs.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000     # web UI
    loadtest/run.sh                                                    # headless, CSV and HTML reports

Users:
- ``TranscribeUser``: short and long files on both routes (``/v1/audio/transcriptions``, also streamed, and
  ``/v1/transcribe``), and stereo calls (two clips, one a channel, with the quiet between skipped) to
  ``/v1/transcribe?multichannel=true&skip_silence=true``; every response is checked (status, JSON shape, reported
  duration; a stream's events; a call's two channels and utterances in time order; the text, where it is known).
- ``JobsUser``: submits a job of several files (sometimes twice with one ``Idempotency-Key``), polls it to a
  final status, fetches its NDJSON results and checks one row per item in submission order (and their text,
  where it is known). The job's end-to-end time is reported as request type ``JOB``.

Audio: ``LOADTEST_AUDIO_DIR`` (WAV, FLAC, OGG, MP3), else the project's ``tests/data``, else a few sentences
spoken by espeak-ng, else the NeMo parity fixtures beside the checkout. Files of ``LOADTEST_LONG_S`` seconds
or more are "long"; when there are none, long clips are made by joining short WAVs. An ``expected.json`` beside
the files (file name -> what is said, as ``tests/data/default_model`` has) makes the transcripts checked too: a
response whose words differ from it by more than ``LOADTEST_MAX_WER`` (0.1) of them fails, so one wrong word in
a short clip does. Other settings: ``LOADTEST_LONG_SHARE``, ``LOADTEST_API_KEY``, ``LOADTEST_MODEL``,
``LOADTEST_JOB_ITEMS``, ``LOADTEST_JOB_TIMEOUT_S``.

Only loopback hosts are accepted: this is for loading a server you run on this machine.
"""

from __future__ import annotations

import functools
import io
import ipaddress
import json
import logging
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import wave
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
from locust import HttpUser, between, events, task
from locust.exception import StopUser

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.wer import edit_distance

log = logging.getLogger("batchasr.loadtest")

REPO = Path(__file__).resolve().parent.parent
AUDIO_SUFFIXES = {".wav": "audio/wav", ".flac": "audio/flac", ".ogg": "audio/ogg", ".mp3": "audio/mpeg"}
LONG_S = float(os.environ.get("LOADTEST_LONG_S", "15"))
LONG_SHARE = float(os.environ.get("LOADTEST_LONG_SHARE", "0.2"))
JOINED_LONG_S = 45.0  # longer than the service's 30 s segments, so long clips exercise the split and stitch
CALL_PAUSE_S = 2.5  # the quiet between a call's two turns: long enough to be skipped
JOB_ITEMS = int(os.environ.get("LOADTEST_JOB_ITEMS", "4"))
JOB_TIMEOUT_S = float(os.environ.get("LOADTEST_JOB_TIMEOUT_S", "300"))
JOB_POLL_S = 0.5
IDEMPOTENT_RETRY_SHARE = 0.1
MAX_WER = float(os.environ.get("LOADTEST_MAX_WER", "0.1"))  # joined clips may lose a word where two meet
JOB_FINAL = {"completed", "completed_with_errors", "failed", "cancelled"}
JOB_STATUSES = JOB_FINAL | {"queued", "in_progress"}
JOB_KEYS = {"id", "status", "counts", "total_items", "created_at", "started_at", "finished_at", "audio_s", "rtfx"}
RESULT_KEYS = {"audio", "status", "text", "tokens", "words", "duration_s", "error"}
SENTENCES = (
    "the quick brown fox jumps over the lazy dog",
    "she sells sea shells by the sea shore",
    "a large batch of audio files was sent to the server this morning",
    "please call back tomorrow before noon",
    "every item in the queue finishes exactly once",
)


@dataclass(frozen=True)
class Clip:
    name: str
    data: bytes
    content_type: str
    duration_s: float | None  # None when the format's length is not known without decoding
    text: str | None = None  # what is said, when an expected.json beside the file says it
    channel_texts: tuple[str, ...] | None = None  # a call's: what each channel says


# --- audio -------------------------------------------------------------------------------------------------


def _wav_duration_s(data: bytes) -> float | None:
    try:
        with wave.open(io.BytesIO(data)) as w:
            return w.getnframes() / w.getframerate()
    except (wave.Error, EOFError):
        return None  # not PCM WAV (float WAV, FLAC, ...)


def _expected_texts(directory: Path) -> dict[str, str]:
    """File name -> what is said, from the directory's expected.json (none: empty)."""
    path = directory / "expected.json"
    if not path.is_file():
        return {}
    texts = json.loads(path.read_text())
    return {str(name): str(text) for name, text in texts.items()} if isinstance(texts, dict) else {}


def _read_clips(paths: list[Path]) -> list[Clip]:
    clips, texts = [], {}
    for path in paths:
        if path.parent not in texts:
            texts[path.parent] = _expected_texts(path.parent)
        data = path.read_bytes()
        clips.append(Clip(path.name, data, AUDIO_SUFFIXES[path.suffix.lower()], _wav_duration_s(data),
                          texts[path.parent].get(path.name)))
    return clips


def _audio_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.suffix.lower() in AUDIO_SUFFIXES)


def _espeak_clips() -> list[Clip]:
    """A few sentences spoken by espeak-ng (the embedded model was trained on such speech)."""
    if shutil.which("espeak-ng") is None:
        return []
    with tempfile.TemporaryDirectory(prefix="batchasr-loadtest-") as tmp:
        paths = []
        for i, sentence in enumerate(SENTENCES):
            path = Path(tmp) / f"espeak{i:02d}.wav"
            subprocess.run(["espeak-ng", "-w", str(path), sentence], check=True, capture_output=True, timeout=30)
            paths.append(path)
        return _read_clips(paths)


def _join_wavs(clips: list[Clip], target_s: float, name: str) -> Clip | None:
    """Short PCM WAVs of one format, repeated and joined with 0.3 s of silence up to ``target_s``."""
    params, frames, texts, total_s = None, [], [], 0.0
    for clip in clips * (1 + int(target_s)):
        with wave.open(io.BytesIO(clip.data)) as w:
            if params is None:
                params = w.getparams()
            elif (w.getnchannels(), w.getsampwidth(), w.getframerate()) != params[:3]:
                return None
            frames.append(w.readframes(w.getnframes()))
        frames.append(b"\0" * (int(0.3 * params.framerate) * params.sampwidth * params.nchannels))
        texts.append(clip.text)
        total_s += clip.duration_s + 0.3
        if total_s >= target_s:
            break
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setparams(params)
        w.writeframes(b"".join(frames))
    text = None if None in texts else " ".join(texts)
    return Clip(name, out.getvalue(), "audio/wav", _wav_duration_s(out.getvalue()), text)


def _stereo_call(first: Clip, second: Clip, name: str) -> Clip | None:
    """Two 16-bit mono WAVs of one rate as a stereo call: the first speaker on the left, then, after
    ``CALL_PAUSE_S``, the second on the right."""
    turns = []
    for clip in (first, second):
        with wave.open(io.BytesIO(clip.data)) as w:
            if w.getnchannels() != 1 or w.getsampwidth() != 2:
                return None
            turns.append((w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")))
    (rate, left), (second_rate, right) = turns
    if rate != second_rate:
        return None
    start = len(left) + int(CALL_PAUSE_S * rate)
    call = np.zeros((start + len(right), 2), dtype="<i2")
    call[: len(left), 0], call[start:, 1] = left, right
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(call.tobytes())
    said = None if first.text is None or second.text is None else (first.text, second.text)
    return Clip(name, out.getvalue(), "audio/wav", _wav_duration_s(out.getvalue()), channel_texts=said)


@functools.cache
def call_pool() -> list[Clip]:
    """Stereo calls made of the short clips (none if they are not 16-bit mono WAV)."""
    short, _ = audio_pool()
    pairs = [(a, b) for a in short for b in short if a is not b][:8]
    calls = [_stereo_call(a, b, f"call{i}.wav") for i, (a, b) in enumerate(pairs)]
    return [c for c in calls if c is not None]


def load_audio() -> list[Clip]:
    """The clips in the order of preference the module docstring gives."""
    if directory := os.environ.get("LOADTEST_AUDIO_DIR"):
        clips = _read_clips(_audio_files(Path(directory)))
        if not clips:
            raise RuntimeError(f"LOADTEST_AUDIO_DIR={directory} holds no audio ({', '.join(AUDIO_SUFFIXES)})")
        return clips
    if clips := _read_clips(_audio_files(REPO / "tests" / "data")):
        return clips
    if clips := _espeak_clips():
        return clips
    if clips := _read_clips(_audio_files(REPO.parent / "shared" / "fixtures" / "nemo-parity" / "audio")):
        return clips
    raise RuntimeError("no audio: set LOADTEST_AUDIO_DIR, or install espeak-ng")


@functools.cache
def audio_pool() -> tuple[list[Clip], list[Clip]]:
    """(short, long) clips, loaded once per process."""
    clips = load_audio()
    long = [c for c in clips if c.duration_s is not None and c.duration_s >= LONG_S]
    short = [c for c in clips if c not in long]
    joinable = [c for c in short if c.duration_s is not None]
    if not long and joinable:
        joined = [_join_wavs(random.Random(seed).sample(joinable, len(joinable)), JOINED_LONG_S, f"long{seed}.wav")
                  for seed in range(2)]
        long = [c for c in joined if c is not None]
    log.info("load test audio: %d short, %d long clips", len(short), len(long))
    return short or long, long


def pick_clip() -> tuple[str, Clip]:
    short, long = audio_pool()
    if long and random.random() < LONG_SHARE:
        return "long", random.choice(long)
    return "short", random.choice(short)


# --- checks ------------------------------------------------------------------------------------------------


def is_loopback(url: str | None) -> bool:
    host = urlsplit(url or "").hostname
    if host is None:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _no_response(response) -> bool:
    """Marks the request failed, saying why, when no answer came (connection refused or reset, timeout): locust
    gives those status 0 and no text."""
    if response.status_code:
        return False
    response.failure(f"no response: {response.error!r}")
    return True


def _words(text: str) -> list[str]:
    """Lower case, punctuation left out: a model that writes "Of North America." says what was said."""
    return re.findall(r"[\w']+", text.lower())


def _check_text(response, text: object, expected: str | None, name: str) -> bool:
    """Whether ``text`` says ``expected`` (None: not known, not checked) within MAX_WER; else marks the request
    failed: a fast wrong answer is not throughput."""
    if expected is None:
        return True
    said = _words(expected)
    errors = edit_distance(said, _words(text)) if isinstance(text, str) else len(said)
    if errors > MAX_WER * len(said):
        response.failure(f"{name}: {errors} of {len(said)} words wrong: {str(text)[:100]!r}, "
                         f"expected {expected[:100]!r}")
        return False
    return True


def _json_or_fail(response, status: int, keys: set[str]) -> dict | None:
    """The response's JSON object when it has ``status`` and every key; else marks the request failed."""
    if _no_response(response):
        return None
    if response.status_code != status:
        response.failure(f"HTTP {response.status_code} (expected {status}): {response.text[:200]}")
        return None
    try:
        body = response.json()
    except ValueError:
        response.failure(f"not JSON: {response.text[:200]}")
        return None
    if not isinstance(body, dict) or (missing := keys - body.keys()):
        response.failure(f"missing keys {sorted(missing) if isinstance(body, dict) else keys}")
        return None
    return body


def _check_duration(response, body: dict, key: str, clip: Clip) -> None:
    reported = body.get(key)
    if clip.duration_s is not None and not (isinstance(reported, int | float) and
                                            abs(reported - clip.duration_s) < 0.1):
        response.failure(f"{key}={reported!r}, but {clip.name} lasts {clip.duration_s:.3f} s")


def _check_stream(response, clip: Clip) -> None:
    """Server-sent events: text deltas, then one done event whose text they add up to (and says the clip's)."""
    if _no_response(response):
        return
    if response.status_code != 200 or not response.headers.get("content-type", "").startswith("text/event-stream"):
        response.failure(f"HTTP {response.status_code} {response.headers.get('content-type')!r}: {response.text[:200]}")
        return
    try:
        events = [json.loads(line.removeprefix("data: ")) for line in response.text.splitlines()
                  if line.startswith("data: ")]
    except ValueError:
        response.failure("an event's data is not JSON")
        return
    types = [e.get("type") for e in events]
    if not types or types[-1] != "transcript.text.done" or set(types[:-1]) - {"transcript.text.delta"}:
        response.failure(f"events {types[-5:]}: {events[-1] if events else ''}")
    elif "".join(e["delta"] for e in events[:-1]) != events[-1]["text"]:
        response.failure("the deltas do not add up to the done event's text")
    else:
        _check_text(response, events[-1]["text"], clip.text, clip.name)


def _names_known(rows: list[dict], clips: list[Clip]) -> bool:
    """Whether the rows name their audio by upload file name (then their order can be checked)."""
    return {Path(str(r["audio"])).name for r in rows} <= {c.name for c in clips}


def _check_results(response, clips: list[Clip], job: dict) -> None:
    if not response.headers.get("content-type", "").startswith("application/x-ndjson"):
        response.failure(f"content-type {response.headers.get('content-type')!r}, not application/x-ndjson")
        return
    try:
        rows = [json.loads(line) for line in response.text.splitlines() if line.strip()]
    except ValueError:
        response.failure("a results line is not JSON")
        return
    if len(rows) != len(clips):
        response.failure(f"{len(rows)} result rows for {len(clips)} items")
    elif missing := set().union(*(RESULT_KEYS - row.keys() for row in rows)):
        response.failure(f"result rows lack {sorted(missing)}")
    elif _names_known(rows, clips) and [Path(str(r["audio"])).name for r in rows] != [c.name for c in clips]:
        response.failure("results are not in submission order")
    elif job["status"] == "completed" and not all(r["status"] == "completed" and isinstance(r["text"], str)
                                                  for r in rows):
        response.failure("job completed but not every item has a completed result with text")
    elif all(_check_text(response, row["text"], clip.text, clip.name) for row, clip in zip(rows, clips, strict=True)
             if row["status"] == "completed"):
        response.success()


# --- users -------------------------------------------------------------------------------------------------


class _LoopbackUser(HttpUser):
    abstract = True
    host = "http://127.0.0.1:8000"

    def on_start(self) -> None:
        if not is_loopback(self.host):
            log.error("refusing to load %s: only loopback hosts (127.0.0.1, localhost, ::1)", self.host)
            raise StopUser
        if api_key := os.environ.get("LOADTEST_API_KEY"):
            self.client.headers["Authorization"] = f"Bearer {api_key}"


class TranscribeUser(_LoopbackUser):
    """Interactive callers: one file per request, on both routes."""

    weight = 4
    wait_time = between(0.1, 0.5)

    def _openai(self, kind: str, clip: Clip, **form: str):
        """POST the clip to the OpenAI-compatible route; the response, to check in a ``with`` block."""
        return self.client.post("/v1/audio/transcriptions", files={"file": (clip.name, clip.data, clip.content_type)},
                                data={"model": os.environ.get("LOADTEST_MODEL", "default"), **form},
                                name=f"/v1/audio/transcriptions [{'stream, ' if 'stream' in form else ''}{kind}]",
                                catch_response=True)

    @task
    def openai_transcriptions(self) -> None:
        kind, clip = pick_clip()
        with self._openai(kind, clip, response_format="verbose_json") as r:
            body = _json_or_fail(r, 200, {"text", "duration", "segments"})
            if body is not None:
                _check_duration(r, body, "duration", clip)
                _check_text(r, body["text"], clip.text, clip.name)

    @task
    def streamed_transcription(self) -> None:
        kind, clip = pick_clip()
        with self._openai(kind, clip, stream="true") as r:
            _check_stream(r, clip)

    @task
    def native_transcribe(self) -> None:
        kind, clip = pick_clip()
        with self.client.post("/v1/transcribe", data=clip.data, headers={"Content-Type": clip.content_type},
                              name=f"/v1/transcribe [{kind}]", catch_response=True) as r:
            body = _json_or_fail(r, 200, {"text", "tokens", "words", "duration_s", "queue_s", "compute_s", "rtfx"})
            if body is not None:
                _check_duration(r, body, "duration_s", clip)
                _check_text(r, body["text"], clip.text, clip.name)


    @task
    def stereo_call(self) -> None:
        calls = call_pool()
        if not calls:
            return
        clip = random.choice(calls)
        with self.client.post("/v1/transcribe?multichannel=true&skip_silence=true", data=clip.data,
                              headers={"Content-Type": clip.content_type}, name="/v1/transcribe [call]",
                              catch_response=True) as r:
            body = _json_or_fail(r, 200, {"text", "utterances", "channels", "words", "duration_s"})
            if body is None:
                return
            _check_duration(r, body, "duration_s", clip)
            starts = [u["start"] for u in body["utterances"]]
            if len(body["channels"]) != 2 or starts != sorted(starts):
                r.failure(f"expected 2 channels and utterances in time order: {json.dumps(body)[:200]}")
            elif clip.channel_texts is not None:
                for channel, said in zip(body["channels"], clip.channel_texts, strict=True):
                    if not _check_text(r, channel.get("text"), said, f"{clip.name} channel {channel.get('channel')}"):
                        break


class JobsUser(_LoopbackUser):
    """Bulk callers: submit a job, poll it to the end, fetch the results."""

    weight = 1
    wait_time = between(1, 3)

    def _submit(self, clips: list[Clip], key: str, name: str, status: int) -> dict | None:
        """POST /v1/jobs: 202 for a new job, 200 when the Idempotency-Key already made one."""
        files = [("files", (c.name, c.data, c.content_type)) for c in clips]
        with self.client.post("/v1/jobs", files=files, headers={"Idempotency-Key": key}, name=name,
                              catch_response=True) as r:
            job = _json_or_fail(r, status, JOB_KEYS)
            if job is not None and (job["status"] not in JOB_STATUSES or job["total_items"] != len(clips)):
                r.failure(f"status {job['status']!r}, total_items {job['total_items']} for {len(clips)} files")
                return None
            return job

    def _wait(self, job_id: str) -> dict | None:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while True:
            with self.client.get(f"/v1/jobs/{job_id}", name="/v1/jobs/{id}", catch_response=True) as r:
                job = _json_or_fail(r, 200, JOB_KEYS)
                if job is None or job["status"] in JOB_FINAL:
                    return job
                if time.monotonic() > deadline:
                    r.failure(f"job {job_id} still {job['status']} after {JOB_TIMEOUT_S:.0f} s")
                    self.client.delete(f"/v1/jobs/{job_id}", name="/v1/jobs/{id} [cancel]")
                    return None
            time.sleep(JOB_POLL_S)

    @task
    def bulk_job(self) -> None:
        clips = [pick_clip()[1] for _ in range(JOB_ITEMS)]
        key, started = uuid.uuid4().hex, time.perf_counter()
        job = self._submit(clips, key, "/v1/jobs", 202)
        if job is None:
            return
        if random.random() < IDEMPOTENT_RETRY_SHARE:
            again = self._submit(clips, key, "/v1/jobs [same Idempotency-Key]", 200)
            if again is not None and again["id"] != job["id"]:
                events.request.fire(request_type="CHECK", name="idempotent submit", response_time=0,
                                    response_length=0, exception=AssertionError("a retried submit made a new job"))
        final = self._wait(job["id"])
        if final is None:
            return
        with self.client.get(f"/v1/jobs/{job['id']}/results", name="/v1/jobs/{id}/results",
                             catch_response=True) as r:
            if _no_response(r):
                pass
            elif r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:200]}")
            else:
                _check_results(r, clips, final)
        failed = None if final["status"] == "completed" else RuntimeError(f"job ended {final['status']}")
        events.request.fire(request_type="JOB", name=f"job of {len(clips)} items", exception=failed,
                            response_time=(time.perf_counter() - started) * 1000, response_length=len(clips))


@events.init.add_listener
def _read_audio_first(environment, **_kwargs) -> None:
    """The audio is read before any user starts: without it every task would fail alike for the whole run, the
    reason only in the log file (run.sh sends locust's log there)."""
    try:
        audio_pool()
    except (RuntimeError, OSError) as exc:
        sys.stderr.write(f"locustfile: {exc}\n")
        sys.exit(2)


@events.test_start.add_listener
def _refuse_remote_hosts(environment, **_kwargs) -> None:
    if environment.host and not is_loopback(environment.host):
        log.error("refusing to load %s: only loopback hosts (127.0.0.1, localhost, ::1)", environment.host)
        if environment.runner is not None:
            environment.runner.quit()
