"""A job's uploads are written into Redis a piece at a time before the job (service.job_uploads): byte for byte,
within a few pieces of memory, and nothing left behind by a submission that fails."""

from __future__ import annotations

import asyncio
import io
import json
import time
import tracemalloc

import httpx
import numpy as np
import pytest
import soundfile as sf

from service import job_uploads
from service.config import Settings
from service.job_keys import INPUTS_KEY, ITEM_STREAM, ITEM_STREAMS, UPLOAD_KEY
from service.job_types import ItemInput, JobInputError, UploadTooLarge
from service.job_uploads import STAGING_TTL_S, UploadRefused, read_upload, upload_size, write_uploads
from service.jobs import INLINE_UPLOAD_BYTES, JobStore
from service.redis_outages import REDIS_ERRORS
from service.spool import NoRoomForInput
from tests.redis_server import RedisServer
from tests.servers import run_server

UPLOADS = "batchasr:upload:*"


def _bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_uploads_of_each_kind_and_size_are_written_byte_for_byte(redis_server, tmp_path, monkeypatch):
    monkeypatch.setattr(job_uploads, "PIECE_BYTES", 1000)  # pieces and round trips small enough to count
    monkeypatch.setattr(job_uploads, "ROUND_TRIP_KEYS", 3)
    sizes = [0, 1, 999, 1000, 1001, 3005, 10]
    contents = [_bytes(n, seed) for seed, n in enumerate(sizes)]
    on_disk = tmp_path / "audio.bin"
    on_disk.write_bytes(contents[5])
    kinds = [contents[0], io.BytesIO(contents[1]), contents[2], on_disk.parent / "small.bin", contents[4], on_disk,
             io.BytesIO(contents[6])]
    kinds[3].write_bytes(contents[3])
    kinds[1].seek(1)  # an open file is read from its start, wherever it was left
    uploads = {f"batchasr:upload:job_x:{i}": upload for i, upload in enumerate(kinds)}

    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url)
        await write_uploads(store.redis, {key: (upload, upload_size(upload)) for key, upload in uploads.items()})
        await store.close()

    asyncio.run(scenario())
    client = redis_server.client()
    assert [client.get(key) for key in uploads] == contents
    assert all(STAGING_TTL_S - 10 < client.ttl(key) <= STAGING_TTL_S for key in uploads)


def test_a_jobs_uploads_take_the_input_ttl_with_the_job(redis_server, tmp_path):
    path = tmp_path / "long.bin"
    path.write_bytes(_bytes(job_uploads.PIECE_BYTES * 2 + 7))

    async def scenario() -> str:
        store = JobStore.from_url(redis_server.url, input_ttl_s=7 * 86400)
        job, _ = await store.submit([ItemInput(audio="long.bin", upload=path), ItemInput(audio="b", upload=b"abc")])
        await store.close()
        return job.id

    job_id = asyncio.run(scenario())
    client = redis_server.client()
    assert client.get(UPLOAD_KEY.format(job_id=job_id, index=0)) == path.read_bytes()
    assert client.get(UPLOAD_KEY.format(job_id=job_id, index=1)) == b"abc"
    assert all(client.ttl(UPLOAD_KEY.format(job_id=job_id, index=i)) > 7 * 86400 - 10 for i in (0, 1))


def test_a_large_upload_is_never_in_memory_whole(redis_server, tmp_path):
    """A submission held all its uploads at once (up to MAX_JOB_UPLOAD_BYTES, 1 GiB); now a few pieces."""
    path = tmp_path / "long.bin"
    path.write_bytes(_bytes(24 * 2**20))

    async def scenario() -> tuple[str, int]:
        store = JobStore.from_url(redis_server.url)
        await store.ensure_group()  # the connection and its buffers first: they are not the upload's
        tracemalloc.start()
        try:
            with path.open("rb") as file:
                job, _ = await store.submit([ItemInput(audio="long.bin", upload=file)])
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        await store.close()
        return job.id, peak

    job_id, peak = asyncio.run(scenario())
    assert peak < 3 * job_uploads.PIECE_BYTES, f"{peak / 2**20:.1f} MiB for a 24 MiB upload"
    assert redis_server.client().get(UPLOAD_KEY.format(job_id=job_id, index=0)) == path.read_bytes()


def test_a_file_that_changes_while_its_job_is_written_is_refused_by_name_and_nothing_is_left(redis_server,
                                                                                               tmp_path):
    first, second = tmp_path / "first.wav", tmp_path / "second.wav"
    first.write_bytes(_bytes(5000))
    second.write_bytes(_bytes(job_uploads.PIECE_BYTES + 5000))

    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url)
        setrange = store.redis.setrange

        async def truncated_meanwhile(*args):  # after its first piece was written
            second.write_bytes(_bytes(100))
            return await setrange(*args)

        store.redis.setrange = truncated_meanwhile
        with pytest.raises(JobInputError, match=r"second\.wav: the file changed while it was being read"):
            await store.submit([ItemInput(audio="first.wav", upload=first),
                                ItemInput(audio="second.wav", upload=second)])
        second.unlink()
        with pytest.raises(JobInputError, match=r"second\.wav: the file cannot be read"):
            await store.submit([ItemInput(audio="second.wav", upload=second)])
        await store.close()

    asyncio.run(scenario())
    client = redis_server.client()
    assert client.keys(UPLOADS) == [] and client.xlen(ITEM_STREAM) == 0


def test_a_job_redis_fails_to_write_leaves_no_upload(redis_server):
    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url)

        async def redis_gone(*args, **kwargs):
            raise ConnectionError("Redis went away")

        store._create = redis_gone
        with pytest.raises(ConnectionError):
            await store.submit([ItemInput(audio="a", upload=b"x" * 100),
                                ItemInput(audio="b", upload=_bytes(job_uploads.PIECE_BYTES + 1))])
        await store.close()

    asyncio.run(scenario())
    assert redis_server.client().keys(UPLOADS) == []


def test_an_upload_larger_than_redis_stores_is_refused_by_name(redis_server):
    """Redis keeps a value to proto-max-bulk-len (512 MiB by default, below what MAX_UPLOAD_BYTES may be set to)."""
    redis_server.client().config_set("proto-max-bulk-len", 2**20)  # its least

    async def scenario() -> None:
        store = JobStore.from_url(redis_server.url)
        with pytest.raises(UploadTooLarge, match=r"^big\.wav: 6000000 bytes is more than this Redis stores in one"):
            await store.submit([ItemInput(audio="small.wav", upload=b"x" * 1000),
                                ItemInput(audio="big.wav", upload=b"x" * 6_000_000)])
        await store.close()

    asyncio.run(scenario())
    assert redis_server.client().keys(UPLOADS) == []


def test_an_upload_larger_than_redis_stores_is_a_413_over_http(redis_server, model):
    redis_server.client().config_set("proto-max-bulk-len", 2**20)
    with run_server(Settings(redis_url=redis_server.url), model) as running:
        files = [("files", ("small.wav", b"x" * 1000, "audio/wav")),
                 ("files", ("big.wav", bytes(6_000_000), "audio/wav"))]
        refused = httpx.post(f"{running.url}/v1/jobs", files=files, timeout=60)
        assert refused.status_code == 413, refused.text
        error = refused.json()["error"]
        assert (error["code"], error["param"]) == ("audio_too_large", "files")
        assert error["message"].startswith("big.wav: 6000000 bytes is more than this Redis stores in one value")
        assert httpx.get(f"{running.url}/healthz").status_code == 200
    client = redis_server.client()
    assert client.keys(UPLOADS) == [] and client.xlen(ITEM_STREAM) == 0


def test_an_upload_left_by_redis_going_away_mid_write_expires_by_itself(tmp_path):
    """Nothing can delete it while Redis is gone: its staging TTL does, and no job names it meanwhile."""
    server = RedisServer(tmp_path, appendonly=True).start()
    try:
        async def scenario() -> None:
            store = JobStore.from_url(server.url)
            setrange = store.redis.setrange

            async def gone_after_the_first_piece(*args):
                await setrange(*args)
                server.stop()
                return await setrange(*args)

            store.redis.setrange = gone_after_the_first_piece
            with pytest.raises(REDIS_ERRORS):
                await store.submit([ItemInput(audio="long.wav", upload=_bytes(3 * job_uploads.PIECE_BYTES))])
            await store.close()

        asyncio.run(scenario())
        server.start()  # the append-only file brings back what was written
        client = server.client()
        [key] = client.keys(UPLOADS)
        assert 0 < client.ttl(key) <= STAGING_TTL_S and client.keys("batchasr:job:*") == []
        assert all(client.xlen(stream) == 0 for stream in ITEM_STREAMS.values())
    finally:
        server.stop()


def test_a_repeated_submission_writes_no_upload_again_and_racing_ones_keep_one_jobs(redis_server):
    client = redis_server.client()
    large = _bytes(job_uploads.PIECE_BYTES + 1)

    def pieces_written() -> int:
        return int(client.info("commandstats").get("cmdstat_setrange", {}).get("calls", 0))

    async def scenario() -> tuple[str, int]:
        stores = [JobStore.from_url(redis_server.url) for _ in range(6)]
        # at once, each writes its uploads before its transaction finds the key taken: the losers' are deleted
        outcomes = await asyncio.gather(*(store.submit([ItemInput(audio="a", upload=large)], "nightly")
                                          for store in stores))
        assert sum(created for _, created in outcomes) == 1 and len({job.id for job, _ in outcomes}) == 1
        before = pieces_written()
        again, created = await stores[0].submit([ItemInput(audio="a", upload=large)], "nightly")
        assert not created and again.id == outcomes[0][0].id
        for store in stores:
            await store.close()
        return again.id, pieces_written() - before

    job_id, written_again = asyncio.run(scenario())
    assert written_again == 0
    assert client.keys(UPLOADS) == [UPLOAD_KEY.format(job_id=job_id, index=0).encode()]
    assert client.hlen(INPUTS_KEY.format(job_id=job_id)) == 1


def test_a_job_form_of_long_files_is_transcribed_as_sent(redis_server, model, parity_audio, tmp_path):
    """Files past the form's memory (1 MiB) and past a piece (4 MiB) go from their temporary files into Redis."""
    clip, rate = sf.read(parity_audio[0], dtype="float32")
    speech = np.tile(np.concatenate([clip, np.zeros(rate // 2, np.float32)]), 8)
    stereo_48k = np.repeat(np.interp(np.arange(len(speech) * 3) / 3, np.arange(len(speech)), speech)[:, None], 2, 1)
    path = tmp_path / "long.wav"
    sf.write(path, stereo_48k, 48000, subtype="PCM_16")
    assert path.stat().st_size > job_uploads.PIECE_BYTES
    with run_server(Settings(redis_url=redis_server.url, max_wait_ms=20), model) as running:
        direct = httpx.post(f"{running.url}/v1/transcribe", content=path.read_bytes(),
                            headers={"content-type": "audio/wav"}, timeout=120)
        assert direct.status_code == 200, direct.text
        files = [("files", ("long.wav", path.read_bytes(), "audio/wav")),
                 ("files", ("short.wav", b"RIFF", "audio/wav"))]
        submitted = httpx.post(f"{running.url}/v1/jobs", files=files, timeout=60)
        assert submitted.status_code == 202, submitted.text
        job_url = f"{running.url}/v1/jobs/{submitted.json()['id']}"
        deadline = time.monotonic() + 60
        while httpx.get(job_url).json()["status"] in ("queued", "in_progress") and time.monotonic() < deadline:
            time.sleep(0.1)
        records = [json.loads(line) for line in httpx.get(f"{job_url}/results").text.splitlines()]
    assert records[0]["status"] == "completed" and records[0]["text"] == direct.json()["text"]
    assert records[0]["duration_s"] == pytest.approx(len(stereo_48k) / 48000, abs=0.01)
    assert records[1]["status"] == "failed"  # four bytes of a WAV header: the item's error, not the job's
    assert redis_server.client().keys(UPLOADS) == []  # freed with their results


# --- a worker reads them back --------------------------------------------------------------------------------------


def _read_back(redis_server, upload: bytes, *, before_each_piece=None) -> bytes:
    key = "batchasr:upload:job_x:0"
    redis_server.client().set(key, upload)

    async def scenario() -> bytes:
        store = JobStore.from_url(redis_server.url)
        if before_each_piece is not None:
            getrange = store.redis.getrange

            async def watched(*args):
                before_each_piece(key)
                return await getrange(*args)

            store.redis.getrange = watched
        try:
            with await read_upload(store.redis, key, len(upload)) as body:
                return body.read()
        finally:
            await store.close()

    return asyncio.run(scenario())


@pytest.mark.parametrize("size", [0, 1, 4 * 2**20 - 1, 4 * 2**20, 4 * 2**20 + 1, 9 * 2**20 + 5])
def test_an_upload_is_read_back_byte_for_byte(redis_server, size):
    upload = _bytes(size, seed=size % 7)
    assert _read_back(redis_server, upload) == upload


def test_an_upload_is_read_into_a_file_a_piece_at_a_time(redis_server):
    """Read whole, up to MAX_UPLOAD_BYTES (200 MiB) an item was in a worker's memory beside its samples."""
    upload = _bytes(24 * 2**20)
    redis_server.client().set("batchasr:upload:job_x:0", upload)

    async def scenario() -> tuple[bytes, int]:
        store = JobStore.from_url(redis_server.url)
        await store.ensure_group()  # the connection and its buffers first: they are not the upload's
        tracemalloc.start()
        try:
            body = await read_upload(store.redis, "batchasr:upload:job_x:0", len(upload))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        with body:
            read = body.read()
        await store.close()
        return read, peak

    read, peak = asyncio.run(scenario())
    assert read == upload and peak < 3 * job_uploads.PIECE_BYTES, f"{peak / 2**20:.1f} MiB held reading 24 MiB"


def test_an_upload_that_goes_while_it_is_read_is_refused(redis_server):
    pieces = []

    def purge_after_the_first(key: str) -> None:
        pieces.append(key)
        if len(pieces) == 2:
            redis_server.client().delete(key)

    with pytest.raises(UploadRefused, match=r"the upload went after 4194304 of its 9437184 bytes were read"):
        _read_back(redis_server, _bytes(9 * 2**20), before_each_piece=purge_after_the_first)


def test_a_small_upload_comes_with_its_items_start_and_a_larger_one_is_read_in_pieces(redis_server):
    """A GETRANGE a clip would cost a worker's event loop a command an item, at thousands of items a second."""
    small, large = _bytes(1000), _bytes(INLINE_UPLOAD_BYTES + 1)
    client = redis_server.client()

    def pieces_read() -> int:
        return int(client.info("commandstats").get("cmdstat_getrange", {}).get("calls", 0))

    async def scenario() -> list[tuple[int | None, bool, bytes, int]]:
        store = JobStore.from_url(redis_server.url)
        job, _ = await store.submit([ItemInput(audio="small.wav", upload=small),
                                     ItemInput(audio="large.wav", upload=large)])
        seen = []
        for index in (0, 1):
            start, before = await store.start_item(job.id, index), pieces_read()
            with await store.read_upload(start) as body:
                seen.append((start.upload_bytes, start.upload is not None, body.read(), pieces_read() - before))
        await store.close()
        return seen

    (small_size, small_inline, small_read, small_pieces), (large_size, large_inline, large_read, large_pieces) = \
        asyncio.run(scenario())
    assert (small_size, small_inline, small_read, small_pieces) == (1000, True, small, 0)
    assert (large_size, large_inline, large_read, large_pieces) == (len(large), False, large, 1)


def test_a_disk_with_no_room_for_an_upload_is_the_workers_failure(redis_server, small_disk):
    """As for a URL's body: the item is tried again later rather than failed, and nothing is left on the disk."""
    with pytest.raises(NoRoomForInput, match="no disk space left"):
        _read_back(redis_server, _bytes(2 * 2**20))
    assert list(small_disk.iterdir()) == []
