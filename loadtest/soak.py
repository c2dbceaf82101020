"""Soak test: does a server under a steady mixed load for a long while keep its memory, file descriptors,
threads, temporary files and Redis keys bounded?

    python loadtest/soak.py [--duration-s 600] [--sample-s 15] [--concurrency 4] [--result-ttl-s 30]
        [--warmup-s 20] [--seed 0] [--out FILE]

Starts `batchasr serve` on the embedded model with a private redis-server (the server's own job consumer takes
the jobs), sends a warm-up, waits for idle and samples, then for ``--duration-s`` keeps ``--concurrency`` HTTP
clients and one job client busy: both transcription routes in every response format, streams, raw and multipart
bodies, a minute-long upload (spooled to disk), clients that leave mid-request or mid-upload, corrupt and
too-large audio, and bulk jobs (polled to their end and their results fetched; some with a bad item, some
cancelled, some purged). Every ``--sample-s`` it reads the server's RSS, open fds and threads (/proc), its
temporary files (fds into its TMPDIR and files left there), Redis's keys and memory, and /metrics' queue depth.
After the load: idle again, ``--result-ttl-s`` (the jobs' JOB_RESULT_TTL_S) waited out, a last sample. Prints one
JSON object (also to --out) and exits 1 when a leak shows (see ``leaks``) or an answer was not the one expected.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import httpx
import numpy as np
import soundfile as sf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadtest.http_bench import SAMPLE_RATE, Clip, _clip, client_session, file_clips, free_port, start_server
from loadtest.overload import AUDIO_DIR, scrape
from models.asr_model import DEFAULT_MODEL
from tests.redis_server import RedisServer
from tests.servers import parse_event

MAX_UPLOAD_BYTES = 4 << 20  # the long clip (about 2 MB) fits, and spools to disk past 1 MiB; too_large does not
FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
FINAL_JOB = ("completed", "completed_with_errors", "failed", "cancelled")
# what each kind of request may get: an HTTP status, "disconnected" (the client left first) or a job's end
EXPECTED = {"openai": {"200"}, "stream": {"200"}, "raw": {"200"}, "multipart": {"200"}, "long_upload": {"200"},
            "disconnect": {"200", "disconnected"}, "disconnect_upload": {"disconnected"}, "corrupt": {"400"},
            "too_large": {"413"}, "job": {"completed"}, "job_bad_item": {"completed_with_errors"},
            "job_cancelled": {"cancelled", "completed"}, "job_purged": {"purged"}}
HTTP_WEIGHTS = {"openai": 5, "stream": 2, "raw": 4, "multipart": 2, "long_upload": 1, "disconnect": 2,
                "disconnect_upload": 1, "corrupt": 1, "too_large": 1}
JOB_KEYS = ("batchasr:job:*", "batchasr:upload:*", "batchasr:idempotency:*", "batchasr:owner:*")
JOB_PREFETCH = 4  # items the server's consumer holds: a job of more has items left queued to cancel
LIMITS = {"fds": 16, "threads": 8}  # growth from idle to idle that counts as a leak: pools settle well under it


def long_clip(clips: list[Clip], seconds: float = 60.0) -> Clip:
    """The clips end to end to ``seconds``: cut into pieces by the server, and spooled to disk as it arrives."""
    wave = np.concatenate([c.waveform for c in clips] * int(seconds // sum(c.duration_s for c in clips) + 1))
    buffer = io.BytesIO()
    sf.write(buffer, wave[:int(seconds * SAMPLE_RATE)], SAMPLE_RATE, subtype="PCM_16", format="WAV")
    return _clip("long.wav", buffer.getvalue())


def text_of(kind: str, fmt: str, body: str) -> str:
    """The transcript in an answer, as words: subtitles' cue lines joined."""
    if kind == "stream":
        return parse_event(body.strip().split("\n\n")[-1])["text"]
    if fmt in ("srt", "vtt"):
        return " ".join(line for line in body.splitlines()
                        if line and "-->" not in line and not line.isdigit() and line != "WEBVTT")
    return body if fmt == "text" else json.loads(body)["text"]


class Soak:
    def __init__(self, url: str, clips: list[Clip], expected: dict[str, str], seed: int):
        self.url, self.clips, self.expected = url, clips, expected
        self.long = long_clip(clips)
        self.rng = random.Random(seed)
        self.answers: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self.unexpected: list[str] = []  # the first few, to read
        self.requests = 0

    def count(self, kind: str, outcome: str) -> None:
        self.requests += 1
        self.answers[kind][outcome] += 1
        if outcome not in EXPECTED[kind] and len(self.unexpected) < 20:
            self.unexpected.append(f"{kind}: {outcome}")

    async def http_client(self, http: aiohttp.ClientSession, until: float) -> None:
        kinds, weights = list(HTTP_WEIGHTS), list(HTTP_WEIGHTS.values())
        while time.monotonic() < until:
            kind = self.rng.choices(kinds, weights)[0]
            try:
                outcome = await getattr(self, kind)(http, self.rng.choice(self.clips))
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                outcome = f"error {type(exc).__name__}"
            self.count(kind, outcome)

    async def _post(self, http: aiohttp.ClientSession, kind: str, clip: Clip, path: str, fmt: str = "json",
                    **kwargs) -> str:
        async with http.post(f"{self.url}{path}", **kwargs) as response:
            body = await response.text()
        if response.status != 200 or clip.name not in self.expected:
            return str(response.status)
        said = " ".join(text_of(kind, fmt, body).split())
        return "200" if said == self.expected[clip.name] else f"200 but {said!r}"

    def _form(self, clip: Clip, body: bytes | None = None, **fields: str) -> aiohttp.FormData:
        form = aiohttp.FormData(fields)
        form.add_field("file", clip.body if body is None else body, filename=clip.name, content_type="audio/wav")
        return form

    async def openai(self, http, clip: Clip) -> str:
        fmt = self.rng.choice(FORMATS)
        return await self._post(http, "openai", clip, "/v1/audio/transcriptions", fmt,
                                data=self._form(clip, model="whisper-1", response_format=fmt))

    async def stream(self, http, clip: Clip) -> str:
        return await self._post(http, "stream", clip, "/v1/audio/transcriptions",
                                data=self._form(clip, stream="true"))

    async def raw(self, http, clip: Clip) -> str:
        return await self._post(http, "raw", clip, "/v1/transcribe", data=clip.body,
                                headers={"content-type": "audio/wav"})

    async def multipart(self, http, clip: Clip) -> str:
        return await self._post(http, "multipart", clip, "/v1/transcribe", data=self._form(clip))

    async def long_upload(self, http, _clip: Clip) -> str:
        return await self._post(http, "long_upload", self.long, "/v1/transcribe", data=self.long.body,
                                headers={"content-type": "audio/wav"})

    async def disconnect(self, http, clip: Clip) -> str:
        """A client that gives up after a moment: while its request waits, is transcribed or streams."""
        request = self.rng.choice([self.raw, self.stream])(http, clip)
        try:
            return await asyncio.wait_for(request, self.rng.uniform(0.01, 1.0))
        except TimeoutError:
            return "disconnected"

    async def disconnect_upload(self, http, clip: Clip) -> str:
        """A client that sends half its upload and leaves."""
        async def half_then_stall():
            yield clip.body[:len(clip.body) // 2]
            await asyncio.sleep(3600)
        try:
            await asyncio.wait_for(self._post(http, "raw", clip, "/v1/transcribe", data=half_then_stall(),
                                              headers={"content-type": "audio/wav"}), 0.3)
        except TimeoutError:
            return "disconnected"
        return "answered"

    async def corrupt(self, http, clip: Clip) -> str:
        body = self.rng.choice([self.rng.randbytes(len(clip.body)), clip.body[:len(clip.body) // 2]])
        return await self._post(http, "corrupt", clip, "/v1/transcribe", data=body,
                                headers={"content-type": "audio/wav"})

    async def too_large(self, http, clip: Clip) -> str:
        data = self._form(clip, bytes(MAX_UPLOAD_BYTES + 1)) if self.rng.random() < 0.5 else bytes(MAX_UPLOAD_BYTES + 1)
        return await self._post(http, "too_large", clip, "/v1/transcribe", data=data,
                                headers=None if isinstance(data, aiohttp.FormData) else {"content-type": "audio/wav"})

    async def job_client(self, http: aiohttp.ClientSession, until: float) -> None:
        while time.monotonic() < until:
            kind = self.rng.choices(["job", "job_bad_item", "job_cancelled", "job_purged"], [6, 2, 1, 1])[0]
            try:
                outcome = await self.job(http, kind)
            except (aiohttp.ClientError, OSError, TimeoutError, RuntimeError) as exc:
                outcome = f"error {type(exc).__name__}: {exc}"[:200]
            self.count(kind, outcome)

    async def job(self, http: aiohttp.ClientSession, kind: str) -> str:
        """Submit 1-3 clips (12 to cancel, more than the consumer takes at once; a corrupt one more for
        job_bad_item), then poll, cancel or purge; fetch its results."""
        picked = self.rng.choices(self.clips, k=12 if kind == "job_cancelled" else self.rng.randint(1, 3))
        form = aiohttp.FormData()
        for clip in picked:
            form.add_field("files", clip.body, filename=clip.name, content_type="audio/wav")
        if kind == "job_bad_item":
            form.add_field("files", self.rng.randbytes(20_000), filename="bad.wav", content_type="audio/wav")
        headers = {"Idempotency-Key": f"soak-{self.rng.getrandbits(64):x}"} if self.rng.random() < 0.3 else {}
        async with http.post(f"{self.url}/v1/jobs", data=form, headers=headers) as response:
            if response.status != 202:
                return f"submit {response.status}"
            job = await response.json()
        jobs_url = f"{self.url}/v1/jobs/{job['id']}"
        if kind in ("job_cancelled", "job_purged"):
            async with http.delete(jobs_url, params={"purge": "true"} if kind == "job_purged" else {}) as response:
                await response.read()
        if kind == "job_purged":
            async with http.get(jobs_url) as response:
                return "purged" if response.status == 404 else f"after purge {response.status}"
        deadline = time.monotonic() + 300
        while job["status"] not in FINAL_JOB and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            async with http.get(jobs_url) as response:
                job = await response.json()
        async with http.get(f"{jobs_url}/results") as response:
            lines = (await response.text()).splitlines()
        items = len(picked) + (kind == "job_bad_item")
        return job["status"] if len(lines) == items else f"{job['status']} with {len(lines)} of {items} results"


def sample(server_pid: int, spool: Path, redis, url: str, soak: Soak, started: float) -> dict:
    proc = Path(f"/proc/{server_pid}")
    status = dict(line.split(":", 1) for line in (proc / "status").read_text().splitlines())
    fds = list((proc / "fd").iterdir())
    spooled = sum(1 for fd in fds if _target(fd).startswith(str(spool)))
    return {"t_s": round(time.monotonic() - started, 1), "requests": soak.requests,
            "rss_mib": round(int(status["VmRSS"].split()[0]) / 1024, 1), "fds": len(fds),
            "threads": int(status["Threads"]), "spool_fds": spooled, "spool_files": len(list(spool.iterdir())),
            "redis_keys": redis.dbsize(), "redis_used_mib": round(redis.info("memory")["used_memory"] / 2**20, 2),
            "queue_depth": scrape(url).get("batchasr_queue_depth")}


def _target(fd: Path) -> str:
    try:
        return os.readlink(fd)
    except OSError:  # closed between the listing and the read
        return ""


def rss_slope(samples: list[dict]) -> float | None:
    """RSS growth over the load's second half, in MiB per 1000 requests (least squares)."""
    half = samples[len(samples) // 2:]
    if len(half) < 2 or half[-1]["requests"] == half[0]["requests"]:
        return None
    return round(1000 * statistics.linear_regression([s["requests"] for s in half],
                                                     [s["rss_mib"] for s in half]).slope, 3)


def server_answers(url: str) -> dict[str, int]:
    """The server's own count of its answers, by status code."""
    codes: Counter[str] = Counter()
    for series, value in scrape(url).items():
        if series.startswith("batchasr_requests_total{") and 'code="' in series:
            codes[series.split('code="')[1].split('"')[0]] += int(value)
    return dict(sorted(codes.items()))


async def load(soak: Soak, seconds: float, concurrency: int, on_sample=None, sample_s: float = 0.0) -> None:
    until = time.monotonic() + seconds
    async with client_session() as http:
        clients = [soak.http_client(http, until) for _ in range(concurrency)] + [soak.job_client(http, until)]
        tasks = [asyncio.ensure_future(c) for c in clients]
        while on_sample and not all(t.done() for t in tasks):
            await asyncio.wait(tasks, timeout=sample_s)
            await asyncio.to_thread(on_sample)
        await asyncio.gather(*tasks)


def wait_idle(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while scrape(url).get("batchasr_queue_depth", 0) > 0 and time.monotonic() < deadline:
        time.sleep(0.5)


def rss_grows(load_samples: list[dict], slope: float | None, max_slope: float) -> bool:
    """A steady climb, not a step: the slope is high and the last quarter never comes back down to the second's
    highest (a batch larger than any before lifts RSS once, and the allocator keeps it)."""
    quarter = len(load_samples) // 4
    if slope is None or slope <= max_slope or quarter < 2:  # too few samples to tell
        return False
    rss = [s["rss_mib"] for s in load_samples]
    return min(rss[-quarter:]) > max(rss[quarter:2 * quarter])


def judge(start: dict, end: dict, leftover: dict[str, int], rss_leak: bool, slope: float | None) -> list[str]:
    leaks = [f"{what}: {start[what]} at idle before the load, {end[what]} after" for what, limit in LIMITS.items()
             if end[what] - start[what] > limit]
    if end["spool_fds"] or end["spool_files"]:
        leaks.append(f"temporary files left at idle: {end['spool_fds']} open, {end['spool_files']} in the directory")
    leaks += [f"redis: {n} keys {pattern} left after the results' TTL" for pattern, n in leftover.items() if n]
    if rss_leak:
        leaks.append(f"rss grows {slope} MiB per 1000 requests over the second half")
    return leaks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--sample-s", type=float, default=15.0)
    parser.add_argument("--warmup-s", type=float, default=20.0)
    parser.add_argument("--concurrency", type=int, default=4, help="HTTP clients (beside one job client)")
    parser.add_argument("--result-ttl-s", type=int, default=30, help="the server's JOB_RESULT_TTL_S")
    parser.add_argument("--max-rss-slope", type=float, default=5.0, help="MiB per 1000 requests that is a leak")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    clips = file_clips(AUDIO_DIR, 3)
    expected = json.loads((AUDIO_DIR / "expected.json").read_text())
    workdir = Path(tempfile.mkdtemp(prefix="soak-"))
    spool = workdir / "spool"
    spool.mkdir()
    redis_server = RedisServer(workdir).start()
    port = free_port()
    os.environ.update(TMPDIR=str(spool), BATCHASR_JOB_RESULT_TTL_S=str(args.result_ttl_s),
                      BATCHASR_JOB_INPUT_TTL_S="600",  # start_server passes the environment on
                      BATCHASR_JOB_PREFETCH=str(JOB_PREFETCH))
    server = start_server(str(DEFAULT_MODEL), port, redis_server.url, 0, MAX_UPLOAD_BYTES,
                          SimpleNamespace(batch_size=32, device="cpu", dtype="float32", attention_kernel="auto"),
                          workdir / "serve.log")
    url, redis = f"http://127.0.0.1:{port}", redis_server.client()
    soak = Soak(url, clips, expected, args.seed)
    samples: list[dict] = []
    started = time.monotonic()

    def take() -> dict:
        samples.append(sample(server.pid, spool, redis, url, soak, started))
        return samples[-1]
    try:
        asyncio.run(load(soak, args.warmup_s, args.concurrency))  # pools, connections and caches filled
        wait_idle(url)
        start = take()
        warm_requests = soak.requests
        asyncio.run(load(soak, args.duration_s, args.concurrency, take, args.sample_s))
        wait_idle(url)
        time.sleep(args.result_ttl_s + 1)  # every job finished before now: its keys are due
        httpx.get(f"{url}/v1/jobs", params={"limit": 100}, timeout=60)  # drops expired jobs from the owner's list
        leftover = {p: sum(1 for _ in redis.scan_iter(p)) for p in JOB_KEYS}
        kept = sorted(key.decode() for key in redis.scan_iter(count=1000))[:20]  # the streams, by design
        end = take()
        server_codes = server_answers(url)
    finally:
        server.terminate()
        server.wait(60)
        redis_server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    load_samples = samples[1:-1]
    slope = rss_slope(load_samples)
    leaks = judge(start, end, leftover, rss_grows(load_samples, slope, args.max_rss_slope), slope)
    if five_hundreds := {code: n for code, n in server_codes.items() if code.startswith("5")}:
        soak.unexpected.append(f"the server answered {five_hundreds}")  # none is provoked
    middle = samples[len(samples) // 2]
    report = {
        "duration_s": args.duration_s, "concurrency": args.concurrency, "result_ttl_s": args.result_ttl_s,
        "warmup_requests": warm_requests, "requests": soak.requests - warm_requests,
        "answers": {k: dict(v) for k, v in sorted(soak.answers.items())},  # the warm-up's too
        "unexpected": soak.unexpected, "server_answers": server_codes,
        "rss_mib": {"start": start["rss_mib"], "middle": middle["rss_mib"], "end": end["rss_mib"],
                    "max": max(s["rss_mib"] for s in samples)},
        "rss_slope_mib_per_1000_requests": slope,
        "fds": [start["fds"], end["fds"]], "threads": [start["threads"], end["threads"]],
        "redis_keys": [start["redis_keys"], end["redis_keys"]], "redis_keys_left_after_ttl": leftover,
        "redis_keys_at_end": kept,
        "leaks": leaks, "samples": samples,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 1 if leaks or soak.unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
