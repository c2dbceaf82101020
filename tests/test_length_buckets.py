"""Fixed batch shapes (``length_bucket_s``): bf16 tokens and scores that do not move with the neighbours.

In bf16 the padded length of a batch changes how its reductions round (attention's softmax sums, the
convolutions' and matrix products' blocking), and so, for small batches, does the number of rows: a piece's
encoder output, its scores and now and then a token move with whatever it is batched with. With length buckets
every batch a piece can be in has one shape, and the scores are computed row by row, so they repeat bit for
bit (docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from models import load_model
from models.audio_io import read_audio
from models.offline import OfflineOptions, _batches
from service.batcher import Batch, Batcher, WorkItem
from service.cli import main
from service.config import Settings
from service.engine import Engine
from service.metrics import Metrics
from service.staging import BatchStager
from tests.servers import run_server

NEIGHBOURS = ((), (1, 2), (3, 4, 5, 6, 7), (8, 9), (2, 5, 8, 9, 1, 3, 7))  # rounds of others sent with clip 0


def _rounds(model, clips: list[np.ndarray], length_bucket_s: float | None) -> list[dict[int, tuple]]:
    """For each round, clip 0 and the clips sent with it: each one's (tokens, token log-probabilities)."""
    batcher = Batcher(8, 1000.0, 50.0, 100, model.sample_rate, length_bucket_s=length_bucket_s)
    engine = Engine(model, batcher, Metrics())
    engine.start()
    try:
        assert engine.wait_ready(120)
        rounds = []
        for others in NEIGHBOURS:
            sent = (0, *others)
            items = [WorkItem(clips[i]) for i in sent]
            batcher.submit(items)
            results = [item.future.result(120) for item in items]
            assert {r.batch_size for r in results} == {len(sent)}  # one batch per round
            rounds.append({i: (r.hypothesis.tokens, r.hypothesis.logprobs) for i, r in zip(sent, results, strict=True)})
        return rounds
    finally:
        engine.stop(30)


@pytest.fixture(scope="module")
def bf16_model():
    return load_model(None, device="cpu", dtype="bfloat16")


@pytest.fixture(scope="module")
def clips(bf16_model, parity_audio) -> list[np.ndarray]:
    return [read_audio(path, bf16_model.sample_rate) for path in parity_audio]  # 1.2 to 3.9 s


def test_with_length_buckets_every_clip_repeats_its_tokens_and_scores_whatever_its_neighbours(bf16_model, clips):
    rounds = _rounds(bf16_model, clips, length_bucket_s=4.0)  # one bucket: every batch is 8 rows of 4 s
    for clip in range(len(clips)):
        seen = [r[clip] for r in rounds if clip in r]
        assert seen[0][0] and seen[0][1], clip  # tokens, with scores
        assert all(s == seen[0] for s in seen), clip


def test_without_them_the_scores_move(bf16_model, clips):
    """The check above can fail: batches padded to their longest piece give clip 0 other scores."""
    rounds = _rounds(bf16_model, clips, length_bucket_s=None)
    assert any(r[0][1] != rounds[0][0][1] for r in rounds)


def test_padding_rows_are_silence_of_the_batch_width():
    items = [WorkItem(np.full(5, 0.5, dtype=np.float32)), WorkItem(np.full(9, 0.25, dtype=np.float32))]
    staged = BatchStager(Batcher(4, 100.0, 0.0, 10), torch.device("cpu")).stage(Batch(items, pad_to=12, pad_rows=4))
    audio, n_samples = staged.on_current_stream()
    assert audio.shape == (4, 12) and n_samples.tolist() == [5, 9, 12, 12]
    assert not audio[0, 5:].any() and not audio[2:].any() and audio[1, :9].eq(0.25).all()


def test_through_http_a_file_gets_the_same_answer_alone_and_among_others(bf16_model, parity_audio):
    """`BATCHASR_LENGTH_BUCKET_S` reaches the server's batcher: the native endpoint's tokens, scores and word
    times for one file repeat, sent alone and sent with seven others at once."""
    settings = Settings(length_bucket_s=4.0, max_batch_size=8, max_wait_ms=100)

    def answer(response: httpx.Response) -> dict:
        assert response.status_code == 200, response.text
        body = response.json()
        return {key: body[key] for key in ("text", "tokens", "token_logprobs", "words")}

    async def together(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(f"{url}/v1/transcribe", content=Path(path).read_bytes(),
                                                      headers={"content-type": "audio/wav"})
                                          for path in parity_audio[:8]))

    with run_server(settings, bf16_model) as server:
        assert server.service.stack.batcher.fixed_shapes
        alone = answer(httpx.post(f"{server.url}/v1/transcribe", content=Path(parity_audio[0]).read_bytes(),
                                  headers={"content-type": "audio/wav"}, timeout=120))
        batches_before = server.metric("batchasr_batch_size_count")
        responses = asyncio.run(together(server.url))
        assert server.metric("batchasr_batch_size_count") - batches_before < 8  # some were batched together
    assert alone["tokens"] and answer(responses[0]) == alone


def test_offline_transcribe_with_length_buckets_repeats_a_file_whatever_the_other_inputs(bf16_model, parity_audio):
    """`transcribe(length_bucket_s=...)` and `batchasr transcribe --length-bucket-s`: the same file alone, among
    the others, and among them in another order gives the same tokens and scores in bf16."""
    lists = ([parity_audio[0]], parity_audio[:5], parity_audio[::-1])
    for bucket in (4.0, 1.0):  # one bucket for every clip; then four, with partly filled batches
        results = [bf16_model.transcribe(paths, batch_size=4, length_bucket_s=bucket) for paths in lists]
        first = [r[paths.index(parity_audio[0])] for r, paths in zip(results, lists, strict=True)]
        assert first[0].tokens and all((t.tokens, t.token_logprobs) == (first[0].tokens, first[0].token_logprobs)
                                       for t in first), bucket
    with pytest.raises(ValueError, match="length_bucket_s"):
        bf16_model.transcribe(parity_audio[:1], length_bucket_s=0)


def test_offline_without_buckets_the_scores_move(bf16_model, parity_audio):
    """The check above can fail."""
    alone = bf16_model.transcribe(parity_audio[:1], batch_size=4)[0]
    among = bf16_model.transcribe(parity_audio[::-1], batch_size=4)[-1]
    assert alone.token_logprobs != among.token_logprobs


def test_the_transcribe_command_takes_length_buckets(parity_audio, capsys):
    def first_line(*paths: str) -> dict:
        assert main(["transcribe", "--dtype", "bfloat16", "--device", "cpu", "--batch-size", "4",
                     "--length-bucket-s", "4", "--format", "jsonl", *paths]) == 0
        return json.loads(capsys.readouterr().out.splitlines()[0])

    alone, among = first_line(parity_audio[0]), first_line(*parity_audio[:6])
    assert alone["tokens"] and (alone["tokens"], alone["token_logprobs"]) == (among["tokens"], among["token_logprobs"])


def test_offline_buckets_end_at_the_longest_piece_too():
    """As the service's: 7 s buckets padded pieces of 30 s segments to 35 s, computing padding no piece fills."""
    options = OfflineOptions(batch_size=4, max_segment_s=30.0, length_bucket_s=7.0)
    lengths = [30 * 16000, 29 * 16000, 27 * 16000]
    assert [(sorted(rows), end, n) for rows, end, n in _batches(lengths, options, 16000)] == [
        ([0, 1], 30 * 16000, 4), ([2], 28 * 16000, 4)]
    whole = OfflineOptions(batch_size=4, max_segment_s=None, length_bucket_s=7.0)  # no longest piece: as before
    assert [end for _, end, _ in _batches([30 * 16000], whole, 16000)] == [35 * 16000]


def test_offline_buckets_of_long_inputs_have_fewer_rows():
    """Inputs taken whole (no max_segment_s): a lone hour-long file was padded to batch_size hour-long rows. A
    batch holds at most batch_size x 30 s of padded audio, in as many rows as a bucket's end allows: still one
    shape a bucket."""
    whole = OfflineOptions(batch_size=8, max_segment_s=None, length_bucket_s=10.0)
    hour, minute, short = 3600 * 16000, 60 * 16000, 9 * 16000
    batches = list(_batches([hour, minute, minute, minute, minute, short], whole, 16000))
    assert [(sorted(rows), end, n) for rows, end, n in batches] == [
        ([0], hour, 1), ([1, 2, 3, 4], minute, 4), ([5], 10 * 16000, 8)]
    cut = OfflineOptions(batch_size=8, max_segment_s=20.0, length_bucket_s=10.0)  # pieces of 20 s at most: full rows
    assert [n for _, _, n in _batches([20 * 16000, 15 * 16000, short], cut, 16000)] == [8, 8]
