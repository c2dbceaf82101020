"""One request's pieces through a real batcher, the test standing in for the engine thread so that it decides
when each piece finishes: the stream's text comes in order, and its failures end it with an error event."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from models import load_model
from models.transcript import Transcript
from service.batcher import Batcher, ItemResult, QueueFull, WorkItem
from service.request_transcription import transcription_events
from service.transcriber import NeverRan, TextDelta, Transcriber
from tests.conftest import long_recording
from tests.servers import parse_event


@pytest.fixture(scope="module")
def model():
    return load_model(device="cpu", dtype="float32")  # the embedded default: a real vocabulary, real words


@pytest.fixture(scope="module")
def recording(parity_audio) -> np.ndarray:
    return long_recording(parity_audio, 14)[0]


async def _queued_pieces(model, recording: np.ndarray, taken: int | None = None):
    """A request cut every ~3 s and queued; the batcher, and the first ``taken`` pieces (all by default) as the
    engine takes them, in order."""
    batcher = Batcher(max_batch_size=1, max_batch_audio_s=60, max_wait_ms=0, max_queue=100)
    transcriber = Transcriber(batcher, model.config, model.tokenizer, max_segment_s=3, segment_overlap_s=1,
                              timeout_s=60)
    queued = await transcriber.submit(recording)
    assert batcher.depth >= 4
    items: list[WorkItem] = [batcher.next_batch().items[0] for _ in range(taken or batcher.depth)]
    return batcher, queued, items


def _finish(model, item: WorkItem) -> None:
    [hyp] = model.decode(model.encode([item.waveform]))
    item.future.set_result(ItemResult(hyp, queue_s=0.0, compute_s=0.01, batch_size=1))


def test_text_comes_in_order_as_the_leading_pieces_finish(model, recording):
    async def run() -> tuple[list[TextDelta], Transcript, int]:
        _, queued, items = await _queued_pieces(model, recording)
        deltas = queued.text_deltas()
        first = asyncio.ensure_future(anext(deltas, None))
        for item in reversed(items[1:]):  # every piece but the first: nothing can be said yet
            _finish(model, item)
        await asyncio.sleep(0.05)
        assert not first.done()
        _finish(model, items[0])
        said = [await first]
        said += [delta async for delta in deltas]
        return said, (await queued.result()).transcript, len(items)

    said, transcript, n_pieces = asyncio.run(run())
    text = transcript.text
    assert len(said) > 1 and all(d.text for d in said)
    assert "".join(d.text for d in said) == text and len(text.split()) > n_pieces  # real words, every one said once
    assert [t for d in said for t in d.tokens] == transcript.tokens  # and the tokens that make them, with scores
    assert [x for d in said for x in d.logprobs] == transcript.token_logprobs
    assert [d.first_token for d in said] == [sum(len(d.tokens) for d in said[:i]) for i in range(len(said))]


def test_a_piece_that_fails_mid_stream_ends_it_with_an_error_event_and_drops_the_rest(model, recording):
    async def run() -> tuple[list[dict], Batcher]:
        batcher, queued, items = await _queued_pieces(model, recording, taken=2)
        deltas = queued.text_deltas()
        first = await asyncio.wait_for(_first_after(items[0], deltas), 30)
        items[1].future.set_exception(TimeoutError("the request's deadline passed"))
        events = [parse_event(chunk.decode()) async for chunk in transcription_events(queued, deltas, first)]
        return events, batcher

    async def _first_after(item: WorkItem, deltas):
        _finish(model, item)
        return await anext(deltas, None)

    events, batcher = asyncio.run(run())
    assert [e["type"] for e in events] == ["transcript.text.delta", "error"]
    assert events[1]["error"]["code"] == "timeout" and events[1]["error"]["type"] == "server_error"
    batcher.close()
    assert batcher.next_batch() is None  # the pieces still queued were dropped: nothing more would run



def test_a_recordings_channels_are_queued_together_or_not_at_all(model, recording):
    """Queued a channel at a time, a queue with room for the first channel's pieces took them (to run, or to be
    cancelled) before the second's were refused."""
    channels = np.stack([recording, recording[::-1].copy()])

    async def run() -> Batcher:
        batcher = Batcher(max_batch_size=1, max_batch_audio_s=60, max_wait_ms=0, max_queue=12)
        transcriber = Transcriber(batcher, model.config, model.tokenizer, max_segment_s=3, segment_overlap_s=1,
                                  timeout_s=60)
        per_channel = len(transcriber.plan(recording))
        assert per_channel <= 12 < 2 * per_channel
        with pytest.raises(QueueFull):
            await transcriber.transcribe_channels(channels)
        return batcher

    batcher = asyncio.run(run())
    assert batcher.depth == 0


def test_a_request_whose_time_ran_out_before_any_piece_ran_is_told_apart(model, recording):
    """A job item held behind other work for its whole timeout failed as any timeout, an attempt spent: three such
    waits under hours of HTTP load failed it for good. ``NeverRan`` says none of it was transcribed."""
    async def run(finished: int) -> BaseException:
        _, queued, items = await _queued_pieces(model, recording, taken=finished + 1)
        for item in items[:finished]:
            _finish(model, item)
        items[finished].future.set_exception(TimeoutError("dropped before it ran"))  # as the batcher drops one
        with pytest.raises(TimeoutError) as failed:
            await queued.result()
        queued.cancel()
        return failed.value

    assert isinstance(asyncio.run(run(0)), NeverRan)
    assert not isinstance(asyncio.run(run(1)), NeverRan)  # a piece ran: an attempt that counts
