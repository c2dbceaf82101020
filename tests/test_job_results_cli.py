"""The results of jobs submitted earlier (by `submit` without `--wait`, or by one that was cut short): `batchasr jobs
--results`, as lines or a file per item, waited for or as they stand; and one item's through HTTP, as its record,
text or subtitles. Against a real redis-server and a real server."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.cli import main
from service.config import Settings
from service.job_clients import RedisClient, job_records
from service.jobs import JobStore
from service.output_files import RecordedNames, output_names, write_whole
from service.submit_inputs import item_input
from tests.servers import run_server

KEYS = ("key-of-team-a", "key-of-team-b")


def _cli(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "service.cli", *arguments], capture_output=True, text=True,
                          timeout=120)


def _calls(tmp_path: Path, parity_audio: list[str]) -> Path:
    """Two days of calls, one clip under the same name on both, and a file that is not audio."""
    calls = tmp_path / "calls"
    for day, clips in (("day1", parity_audio[:2]), ("day2", [parity_audio[0], parity_audio[2]])):
        (calls / day).mkdir(parents=True)
        for clip in clips:
            (calls / day / Path(clip).name).write_bytes(Path(clip).read_bytes())
    (calls / "day2" / "broken.wav").write_bytes(b"RIFF....not audio at all")
    return calls


def test_results_of_a_job_submitted_earlier_as_they_stand_then_once_it_ends(redis_server, model, parity_audio,
                                                                           expected, tmp_path):
    calls = _calls(tmp_path, parity_audio)
    submitted = _cli("submit", "--redis-url", redis_server.url, str(calls))  # no --wait: the job id, and done
    assert submitted.returncode == 0, submitted.stderr
    job = json.loads(submitted.stdout)
    order = sorted(p for p in calls.rglob("*.wav"))  # as submit walks them
    assert job["total_items"] == len(order) == 5

    # no worker yet: every item says it is queued, and the exit status that the job has not ended
    standing = _cli("jobs", "--redis-url", redis_server.url, "--results", job["id"])
    assert standing.returncode == 1, standing.stderr
    assert [json.loads(line)["status"] for line in standing.stdout.splitlines()] == ["queued"] * 5
    assert f"job {job['id']}: queued, 0 of 5 items ended (--wait waits for the rest)" in standing.stderr

    out = tmp_path / "results.jsonl"
    with run_server(Settings(redis_url=redis_server.url), model):  # its job consumer works the job
        waited = _cli("jobs", "--redis-url", redis_server.url, "--results", job["id"], "--wait", "--output", str(out))
    assert waited.returncode == 1, waited.stderr  # broken.wav failed
    assert f"job {job['id']}: completed_with_errors" in waited.stderr and "5/5 items" in waited.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [record["audio"] for record in records] == [str(p) for p in order]  # the names submitted, in item order
    for path, record in zip(order, records, strict=True):
        if path.name == "broken.wav":
            assert record["status"] == "failed" and "cannot decode audio" in record["error"]
        else:
            assert record["status"] == "completed" and record["text"] == expected[path.name]

    # a file per item: the paths as submitted, inside the folder; the failed item on stderr, with no file
    subtitles = tmp_path / "subtitles"
    files = _cli("jobs", "--redis-url", redis_server.url, "--results", job["id"], "--output-dir", str(subtitles),
                 "--format", "srt")
    assert files.returncode == 1 and "broken.wav: failed: cannot decode audio" in files.stderr
    inside = Path(*calls.parts[1:])  # the submitted paths are absolute: their root is dropped
    written = sorted(p.relative_to(subtitles / inside) for p in subtitles.rglob("*.srt"))
    assert written == sorted(p.relative_to(calls).with_suffix(".srt") for p in order if p.name != "broken.wav")
    first = subtitles / inside / "day1" / Path(parity_audio[0]).with_suffix(".srt").name
    assert first.read_text().startswith("1\n00:00:00,")
    assert expected[Path(parity_audio[0]).name].split()[0] in first.read_text()


def test_results_through_a_server_are_the_keys_own_and_names_met_again_are_numbered(redis_server, model,
                                                                                    parity_audio, expected, tmp_path):
    calls = _calls(tmp_path, parity_audio)
    (calls / "day2" / "broken.wav").unlink()
    with run_server(Settings(redis_url=redis_server.url, api_keys=list(KEYS)), model) as running:
        as_a = ("--server", running.url, "--api-key", KEYS[0])
        submitted = _cli("submit", *as_a, str(calls))
        assert submitted.returncode == 0, submitted.stderr
        job_id = json.loads(submitted.stdout)["id"]
        # uploads through a server keep their file names only: the clip of both days is one name, met twice
        out = tmp_path / "texts"
        waited = _cli("jobs", *as_a, "--results", job_id, "--wait", "--output-dir", str(out), "--format", "text")
        assert waited.returncode == 0, waited.stderr
        clip = Path(parity_audio[0])
        assert sorted(p.name for p in out.iterdir()) == sorted(
            [f"{clip.stem}.txt", f"{clip.stem}.2.txt", Path(parity_audio[1]).stem + ".txt",
             Path(parity_audio[2]).stem + ".txt"])
        assert (out / f"{clip.stem}.2.txt").read_text() == expected[clip.name] + "\n"
        # another key's job is not there for it; the jobs before it are written, and the status says so
        refused = _cli("jobs", "--server", running.url, "--api-key", KEYS[1], "--results", job_id)
        assert refused.returncode == 2 and f"{job_id}: no such job" in refused.stderr and not refused.stdout
        lines = _cli("jobs", *as_a, "--results", job_id)
        assert lines.returncode == 0, lines.stderr
        texts = [json.loads(line)["text"] for line in lines.stdout.splitlines()]
        assert texts == [expected[p.name] for p in sorted(calls.rglob("*.wav"))]
        assert httpx.get(f"{running.url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {KEYS[0]}"}
                         ).json()["status"] == "completed"


def _item(url: str, job_id: str, index: object, key: str = KEYS[0], **params: object) -> httpx.Response:
    return httpx.get(f"{url}/v1/jobs/{job_id}/results/{index}", params=params,
                     headers={"Authorization": f"Bearer {key}"}, timeout=30)


def test_one_items_result_through_http_as_its_record_text_or_subtitles(redis_server, model, parity_audio, expected):
    clip = Path(parity_audio[0])
    files = [("files", (clip.name, clip.read_bytes(), "audio/wav")),
             ("files", ("broken.wav", b"RIFF....not audio at all", "audio/wav"))]
    with run_server(Settings(redis_url=redis_server.url, api_keys=list(KEYS)), model) as running:
        auth = {"Authorization": f"Bearer {KEYS[0]}"}
        job_id = httpx.post(f"{running.url}/v1/jobs", files=files, headers=auth, timeout=60).json()["id"]
        deadline = time.monotonic() + 60
        while httpx.get(f"{running.url}/v1/jobs/{job_id}", headers=auth).json()["finished_at"] is None:
            assert time.monotonic() < deadline, "the job did not finish"
            time.sleep(0.05)
        lines = httpx.get(f"{running.url}/v1/jobs/{job_id}/results", headers=auth).text.splitlines()
        assert [_item(running.url, job_id, i).json() for i in (0, 1)] == [json.loads(line) for line in lines]
        # the lines from one on: a download cut short goes on from the lines it has
        for start, wanted in ((1, lines[1:]), (2, []), (7, [])):
            response = httpx.get(f"{running.url}/v1/jobs/{job_id}/results", params={"start": start}, headers=auth)
            assert response.status_code == 200 and response.text.splitlines() == wanted, (start, response.text)
        negative = httpx.get(f"{running.url}/v1/jobs/{job_id}/results", params={"start": -1}, headers=auth)
        assert negative.status_code == 400 and negative.json()["error"]["param"] == "start", negative.text

        text = _item(running.url, job_id, 0, response_format="text")
        assert text.headers["content-type"].startswith("text/plain") and text.text == expected[clip.name] + "\n"
        srt = _item(running.url, job_id, 0, response_format="srt", max_line_width=12)
        assert srt.headers["content-type"].startswith("application/x-subrip")
        cues = [cue.splitlines() for cue in srt.text.strip().split("\n\n")]
        assert [cue[0] for cue in cues] == [str(n) for n in range(1, len(cues) + 1)]
        assert all(" --> " in cue[1] and all(len(line) <= 12 for line in cue[2:]) for cue in cues)
        assert " ".join(line for cue in cues for line in cue[2:]) == expected[clip.name]
        vtt = _item(running.url, job_id, 0, response_format="vtt")
        assert vtt.headers["content-type"].startswith("text/vtt") and vtt.text.startswith("WEBVTT\n")

        failed = _item(running.url, job_id, 1, response_format="srt")
        assert failed.status_code == 409, failed.text
        error = failed.json()["error"]
        assert (error["code"], error["param"]) == ("item_not_completed", "index")
        assert error["message"].startswith("item 1 is failed (") and "cannot decode audio" in error["message"]
        for index, params, status, code in ((2, {}, 404, "item_not_found"), (-1, {}, 404, "item_not_found"),
                                            ("first", {}, 400, None), (0, {"response_format": "docx"}, 400,
                                                                       "invalid_parameter"),
                                            (0, {"response_format": "srt", "max_line_count": 0}, 400,
                                             "invalid_parameter")):
            refused = _item(running.url, job_id, index, **params)
            assert refused.status_code == status, (index, params, refused.text)
            assert code is None or refused.json()["error"]["code"] == code
        other = _item(running.url, job_id, 0, key=KEYS[1])
        assert other.status_code == 404 and other.json()["error"]["code"] == "job_not_found"
        assert _item(running.url, "job_nothing", 0).json()["error"]["code"] == "job_not_found"


def test_results_of_a_job_purged_while_waited_for_say_so(redis_server, parity_audio, capsys):
    async def scenario() -> int:
        from service.jobs_cli import run_results

        store = JobStore.from_url(redis_server.url)
        job, _ = await store.submit([item_input(Path(parity_audio[0]))])
        waiting = asyncio.create_task(run_results(redis_server.url, None, None, [job.id], True, sys.stdout,
                                                  poll_s=0.05))
        await asyncio.sleep(0.3)  # no worker: it waits
        await store.delete(job.id)
        code = await waiting
        await store.close()
        return code

    assert asyncio.run(scenario()) == 2
    assert "no such job (it expired or was purged)" in capsys.readouterr().err


@pytest.mark.parametrize(("options", "said"), [
    (["--wait"], "--wait: these say how --results are written, and there is no --results"),
    (["--output", "x.jsonl", "--format", "srt"], "--output, --format: these say how --results are written"),
    (["--results", "job_x", "--output", "x.jsonl", "--output-dir", "d"], "give one"),
    (["--results", "job_x", "--format", "srt"], "--format is the format of --output-dir's files"),
    (["--results", "job_x", "--output-dir", "d", "--format", "srt", "--max-line-count", "0"], "max_line_count"),
])
def test_misplaced_results_options_are_refused_before_anything_is_read(options, said, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["jobs", "--redis-url", "redis://127.0.0.1:1/0", *options]) == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()


def test_results_from_a_redis_that_answers_nothing_say_so_at_once(capsys):
    assert main(["jobs", "--redis-url", "redis://127.0.0.1:1/0", "--results", "job_x", "--wait"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach Redis" in err and "trying again" not in err


def test_recorded_names_stay_inside_the_folder_and_are_numbered_when_met_again():
    names = RecordedNames(".srt")
    given = ["a.wav", "a.wav", "/data/x/b.flac", "../../etc/cron.d/job", "https://h/x/c%20d.mp3?sig=1",
             "call.wav [0.5 s to 2 s]", "call.wav [2 s to end]", "", "./a.wav"]
    assert [str(names.name(audio)) for audio in given] == [
        "a.srt", "a.2.srt", "data/x/b.srt", "etc/cron.d/job.srt", "c d.srt", "call.srt", "call.2.srt", "item.srt",
        "a.3.srt"]


def test_urls_of_one_file_name_are_numbered_not_refused(tmp_path):
    """URLs were named by their paths' last parts, and two alike refused the run ("give them in separate runs"),
    which a list of thousands of <id>/audio.wav URLs cannot be; numbered now, as jobs --results numbers them. Two
    files of one name are still refused: a folder keeps them apart."""
    urls = ["https://cdn.example/u1/audio.wav", "https://cdn.example/u2/audio.wav", "https://cdn.example/a.wav?v=2"]
    (tmp_path / "a.wav").write_bytes(b"RIFF")
    named = output_names([*urls, str(tmp_path / "a.wav")], ".txt")  # in input order: the file after a URL of its name
    assert [str(named[key]) for key in (*urls, tmp_path / "a.wav")] == ["audio.txt", "audio.2.txt", "a.txt", "a.2.txt"]
    recorded = RecordedNames(".txt")
    assert [str(recorded.name(url)) for url in urls[:2]] == ["audio.txt", "audio.2.txt"]  # as jobs --results names
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "a.wav").write_bytes(b"RIFF")
    with pytest.raises(ValueError, match=r"would both be written as a\.txt"):
        output_names([str(tmp_path / "a.wav"), str(tmp_path / "b" / "a.wav")], ".txt")


def test_submit_names_each_result_file_as_jobs_results_names_it_in_input_order(redis_server, model, parity_audio,
                                                                             expected, tmp_path):
    """`submit --wait --output-dir` named the files it was given first and the URLs after them: a file given after
    two URLs of its name took `audio.txt` and the URLs were `audio.2.txt` and `audio.3.txt`, where `jobs --results`
    of the same jobs wrote the first URL's result as `audio.txt`: one name, another input's transcript. Both number
    in input order now."""
    site = tmp_path / "site"
    for folder, clip in (("x", parity_audio[0]), ("y", parity_audio[1])):
        (site / folder).mkdir(parents=True)
        (site / folder / "audio.wav").write_bytes(Path(clip).read_bytes())
    (tmp_path / "loc").mkdir()
    (tmp_path / "loc" / "audio.wav").write_bytes(Path(parity_audio[2]).read_bytes())

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    files = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=files.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{files.server_address[1]}/"
    try:
        with run_server(Settings(redis_url=redis_server.url, input_url_prefixes=[base]), model) as running:
            submitted = _cli("submit", "--server", running.url, "--wait", "--output-dir", str(tmp_path / "submit"),
                             "--format", "text", f"{base}x/audio.wav", f"{base}y/audio.wav",
                             str(tmp_path / "loc" / "audio.wav"))
            assert submitted.returncode == 0, submitted.stderr
            job_ids = re.findall(r"^job (\S+): \d+ items$", submitted.stderr, re.MULTILINE)
            assert len(job_ids) == 2, submitted.stderr  # URLs and files go as separate jobs
            results = _cli("jobs", "--server", running.url, "--results", *job_ids, "--output-dir",
                           str(tmp_path / "results"), "--format", "text")
            assert results.returncode == 0, results.stderr
    finally:
        files.shutdown()
        files.server_close()
    texts = [expected[Path(clip).name] + "\n" for clip in parity_audio[:3]]
    written = {p.name: p.read_text() for p in (tmp_path / "submit").iterdir()}
    assert written == dict(zip(["audio.txt", "audio.2.txt", "audio.3.txt"], texts, strict=True))
    assert {p.name: p.read_text() for p in (tmp_path / "results").iterdir()} == written


def test_a_result_reaches_the_disk_before_its_name_does(tmp_path, monkeypatch):
    """A result renamed into place before its data was flushed could be an empty file after a power cut, which
    --skip-existing takes for a finished one: the data is flushed under the temporary name, then renamed."""
    flushed: list[tuple[str, str]] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        name = os.readlink(f"/proc/self/fd/{fd}")
        flushed.append((Path(name).name, Path(name).read_text(encoding="utf-8")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    write_whole(tmp_path / "out" / "a.txt", "héllo\n")
    assert flushed == [("a.txt.partial", "héllo\n")]
    assert (tmp_path / "out" / "a.txt").read_text(encoding="utf-8") == "héllo\n"
    assert not (tmp_path / "out" / "a.txt.partial").exists()


class CutShort(RedisClient):
    """Redis's jobs, whose first results stream breaks off after two records, as a connection Redis's restart
    closes does."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.starts: list[int] = []

    async def results(self, job_id: str, start: int = 0) -> AsyncIterator[dict[str, Any]]:
        self.starts.append(start)
        given = 0
        async for record in super().results(job_id, start):
            if len(self.starts) == 1 and given == 2:
                raise ConnectionError("Connection closed by server.")
            given += 1
            yield record


def test_results_cut_short_go_on_from_the_first_not_given(redis_server, parity_audio, capsys):
    async def scenario() -> tuple[list[dict], list[dict], list[int]]:
        store = JobStore.from_url(redis_server.url)
        job, _ = await store.submit([item_input(Path(p)) for p in parity_audio[:5]])
        whole = await store.results(job.id)
        await store.close()
        client = CutShort(redis_server.url)
        try:
            async with contextlib.aclosing(job_records(client, job.id, 5)) as records:
                return [record async for record in records], whole, client.starts
        finally:
            await client.close()

    given, whole, starts = asyncio.run(scenario())
    assert given == whole and len(given) == 5
    assert starts == [0, 2]  # not from the start again
    assert "trying again" in capsys.readouterr().err


def test_the_progress_line_says_how_long_is_left_at_the_rate_since_it_was_first_drawn():
    from service.jobs_cli import Progress

    def job(completed: int, failed: int = 0) -> dict:
        return {"total_items": 100, "counts": {"completed": completed, "failed": failed, "cancelled": 0}}

    now = [1000.0]
    out = io.StringIO()
    bar = Progress(out, width=10, clock=lambda: now[0], tty=True)
    lines = []
    for seconds, state in ((0, job(40)), (30, job(55, 5)), (600, job(70, 5)), (36000, job(72, 5)),
                           (36060, job(99, 1))):
        now[0] = 1000.0 + seconds
        bar.update(state)
        lines.append(out.getvalue().split("\r")[-1])
    bar.close()
    # a job followed when 40 were done: the rate is that of the items ended since (20 in 30 s), not 40 in no time
    assert lines[0] == "[####......] 40/100 items, 0 failed, 0.0 s"
    assert lines[1] == "[######....] 60/100 items, 5 failed, 30.0 s, about 60 s left"
    assert lines[2] == "[#######...] 75/100 items, 5 failed, 600.0 s, about 7 min left"
    assert lines[3] == "[#######...] 77/100 items, 5 failed, 36000.0 s, about 6.2 h left"
    # nothing left once every item has ended, drawn over all of the longer line before
    assert lines[4] == "[##########] 100/100 items, 1 failed, 36060.0 s".ljust(len(lines[3]))
    assert out.getvalue().endswith("\n")


def test_the_progress_is_a_line_every_half_minute_where_stderr_is_a_log():
    from service.jobs_cli import Progress

    now = [0.0]
    out = io.StringIO()  # no terminal
    bar = Progress(out, width=4, clock=lambda: now[0])
    for seconds, completed in ((0, 0), (1, 0), (2, 1), (31, 1), (32, 2), (33, 4)):
        now[0] = seconds
        bar.update({"total_items": 4, "counts": {"completed": completed, "failed": 0, "cancelled": 0}})
    bar.close()
    assert "\r" not in out.getvalue()
    assert out.getvalue().splitlines() == [
        "[....] 0/4 items, 0 failed, 0.0 s", "[#...] 1/4 items, 0 failed, 31.0 s, about 2 min left",
        "[####] 4/4 items, 0 failed, 33.0 s"]
