"""One request's path through the engine: split long audio, queue the pieces, await them, stitch.

Shared by the HTTP routes and the bulk-job consumer; neither touches the batcher or the model directly.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from decoding.types import Hotwords, Hypothesis
from models.config import ModelConfig
from models.conversation import Conversation, assemble, duplicate_channels
from models.crosstalk import heard_elsewhere
from models.segmenter import Segment, plan_pieces
from models.silence import Elsewhere
from models.stitching import Stitcher, Word, stitch
from models.tokenizer import Tokenizer
from models.transcript import Transcript, build_transcript, rounded

from .audio import AudioTooLarge
from .batcher import ItemResult, Priority, WorkItem, queue_limit


@dataclass(frozen=True)
class RequestResult:
    transcript: Transcript
    queue_s: float  # longest wait of any of its pieces
    compute_s: float  # engine time attributed to it
    n_segments: int

    @property
    def audio_s(self) -> float:
        return self.transcript.duration_s

    @property
    def rtfx(self) -> float:
        return self.audio_s / self.compute_s if self.compute_s > 0 else 0.0


@dataclass(frozen=True)
class TextDelta:
    """What a stream says next: the text the transcript grew by, and the tokens that made it."""

    text: str
    tokens: list[int]
    logprobs: list[float] | None  # theirs, as the transcript keeps them (None without scores)
    first_token: int  # where its tokens start in the transcript's


@dataclass(frozen=True)
class ConversationResult:
    """A recording's channels, transcribed apart."""

    conversation: Conversation
    queue_s: float
    compute_s: float
    n_segments: int

    @property
    def audio_s(self) -> float:
        return self.conversation.transcribed_s

    @property
    def rtfx(self) -> float:
        return self.audio_s / self.compute_s if self.compute_s > 0 else 0.0


class WorkQueue(Protocol):
    """Where pieces go: the engine's batcher, or a front-end process's link to the engine process."""

    def submit(self, items: list[WorkItem]) -> None:
        """Queue all or none; ``QueueFull`` is raised here or set on every item's future."""


class NeverRan(TimeoutError):
    """A request's time ran out before any of its pieces was transcribed: it waited behind other work the whole
    time (a job item behind HTTP requests and more urgent jobs), which says nothing against the audio."""


class TooManyPieces(AudioTooLarge):
    """Audio cut into more pieces than the queue ever holds: it would be told the queue is full (429) for ever."""


class _Spoken:
    """A stream's text so far, and the delta each batch of words given out by a ``Stitcher`` adds to it."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.logprobs: list[float] | None = []
        self.shown, self.told = "", 0  # the text said so far, and how many tokens it holds

    def add(self, given: list[tuple[tuple[Segment, Hypothesis], list[Word]]]) -> TextDelta | None:
        for (_, hyp), words in given:
            if hyp.logprobs is None:
                self.logprobs = None
            for word in words:
                self.tokens += word.tokens
                if self.logprobs is not None and hyp.logprobs is not None:
                    self.logprobs += hyp.logprobs[word.first : word.last + 1]  # in place: not copied per piece
        text = self.tokenizer.ids_to_text(self.tokens)
        if not (len(text) > len(self.shown) and text.startswith(self.shown)):
            return None
        delta = TextDelta(text[len(self.shown) :], self.tokens[self.told :], None if self.logprobs is None else
                          [rounded(x) for x in self.logprobs[self.told :]], first_token=self.told)
        self.shown, self.told = text, len(self.tokens)
        return delta


class Transcriber:
    def __init__(self, queue: WorkQueue, config: ModelConfig, tokenizer: Tokenizer | None, max_segment_s: float,
                 segment_overlap_s: float, timeout_s: float, max_pieces: int | None = None,
                 bulk_timeout_s: float | None = None):
        self.queue = queue
        self.max_pieces = max_pieces  # the queue's size: a request of more pieces never fits
        self.config = config
        self.tokenizer = tokenizer
        self.max_segment_s = max_segment_s
        self.segment_overlap_s = segment_overlap_s
        self.timeout_s = timeout_s  # a request's, whose client waits
        # a job item's (its attempt is given up then, and tried again): it waits behind every request, and a
        # recording of hours may take longer than a client would wait on a slow device
        self.bulk_timeout_s = timeout_s if bulk_timeout_s is None else bulk_timeout_s
        self.sample_rate = config.features.sample_rate
        self.frame_samples = config.frame_samples

    def plan(self, waveform: np.ndarray, skip_silence: bool = False, elsewhere: Elsewhere | None = None
             ) -> list[Segment]:
        """Where ``transcribe`` cuts ``waveform`` into pieces (leaving out its long quiet stretches with
        ``skip_silence``, and what ``elsewhere`` says is another channel's: models.silence)."""
        return plan_pieces(waveform, self.sample_rate, self.max_segment_s, self.segment_overlap_s, self.frame_samples,
                           skip_silence, elsewhere)

    async def submit(self, waveform: np.ndarray, priority: Priority = Priority.INTERACTIVE, skip_silence: bool = False,
                     elsewhere: Elsewhere | None = None, hotwords: Hotwords = (), owner: str = "") -> QueuedRequest:
        """Cut ``waveform`` and queue its pieces (raises ``QueueFull``, or ``TooManyPieces`` for audio that never
        fits the queue), each boosting ``hotwords`` (as tokens) and taking ``owner``'s turns (batcher.WorkItem).
        The caller must ``cancel`` the request when it is done with it: that drops pieces still queued."""
        segments = await self._segments(waveform, skip_silence, elsewhere)
        self._check_fits(len(segments), priority)
        request = self._request(waveform, segments, priority, hotwords, owner)
        self._queue([request])
        return request

    async def _segments(self, waveform: np.ndarray, skip_silence: bool, elsewhere: Elsewhere | None
                        ) -> list[Segment]:
        if skip_silence or len(waveform) > self.max_segment_s * self.sample_rate:  # reads every sample: off the loop
            return await asyncio.to_thread(self.plan, waveform, skip_silence, elsewhere)
        return self.plan(waveform)

    def _check_fits(self, n_pieces: int, priority: Priority) -> None:
        limit = None if self.max_pieces is None else queue_limit(self.max_pieces, priority)
        if limit is not None and n_pieces > limit:
            raise TooManyPieces(f"the audio makes {n_pieces} pieces to transcribe, more than the queue ever "
                                f"holds ({limit}): send it in parts")

    def _request(self, waveform: np.ndarray, segments: list[Segment], priority: Priority, hotwords: Hotwords,
                 owner: str) -> QueuedRequest:
        """``waveform``'s pieces, not queued yet."""
        timeout_s = self.timeout_s if priority == Priority.INTERACTIVE else self.bulk_timeout_s
        items = [WorkItem(waveform[s.start : s.end], priority, timeout_s, hotwords, counted_samples=s.own_samples,
                          owner=owner) for s in segments]
        return QueuedRequest(self, len(waveform), segments, items, asyncio.get_running_loop().time() + timeout_s)

    def _queue(self, requests: list[QueuedRequest]) -> None:
        """Every piece of ``requests`` in one submission: all are queued or none (``QueueFull``)."""
        items = [item for request in requests for item in request.items]
        if items:  # none for a silent recording whose silence is skipped
            self.queue.submit(items)

    async def transcribe(self, waveform: np.ndarray, priority: Priority = Priority.INTERACTIVE,
                         skip_silence: bool = False, hotwords: Hotwords = (), owner: str = "") -> RequestResult:
        """Queue (raises ``QueueFull``), await every piece, stitch. Cancelling this cancels queued pieces."""
        request = await self.submit(waveform, priority, skip_silence, hotwords=hotwords, owner=owner)
        try:
            return await request.result()
        finally:
            request.cancel()

    async def transcribe_channels(self, channels: np.ndarray, priority: Priority = Priority.INTERACTIVE,
                                  skip_silence: bool = False, hotwords: Hotwords = (), owner: str = ""
                                  ) -> ConversationResult:
        """Each row of ``channels`` (channels, samples) transcribed apart, their pieces queued together so they
        share batches; all are queued or none (``QueueFull``), and cancelling this cancels them all. Words a
        channel heard from another are dropped (models.crosstalk); a channel that repeats another is not
        transcribed, and is left empty."""
        repeats = await asyncio.to_thread(duplicate_channels, channels)  # reads every sample: off the event loop
        apart = [c for c in range(len(channels)) if c not in repeats]
        echoes: list[Elsewhere | None] = [None] * len(apart)
        if skip_silence and len(apart) > 1:  # each channel's echo of the others is skipped like silence
            echoes = list(await asyncio.to_thread(heard_elsewhere, [channels[c] for c in apart], self.sample_rate))
        plans = [await self._segments(channels[c], skip_silence, echo) for c, echo in zip(apart, echoes, strict=True)]
        self._check_fits(sum(map(len, plans)), priority)  # the channels' pieces together: each alone may fit
        requests = [self._request(channels[c], segments, priority, hotwords, owner)
                    for c, segments in zip(apart, plans, strict=True)]
        self._queue(requests)  # together: a full queue refuses the recording, not its last channels
        try:
            stitched = [await request.stitched() for request in requests]
        finally:
            for request in requests:
                request.cancel()
        conversation = await asyncio.to_thread(  # a level and an envelope per word: off the event loop
            assemble, {c: hyp for c, (hyp, _) in zip(apart, stitched, strict=True)}, channels, repeats,
            self.tokenizer, self.config)
        pieces = [piece for _, channel_pieces in stitched for piece in channel_pieces]
        return ConversationResult(conversation, queue_s=max((p.queue_s for p in pieces), default=0.0),
                                  compute_s=sum(p.compute_s for p in pieces), n_segments=len(pieces))


class QueuedRequest:
    """One request's pieces in the queue: await them all (``result``), or their text as the leading pieces finish
    (``text_deltas``). Every wait ends at the request's deadline with ``TimeoutError``."""

    def __init__(self, transcriber: Transcriber, n_samples: int, segments: list[Segment], items: list[WorkItem],
                 deadline: float):
        self._transcriber = transcriber
        self._n_samples = n_samples
        self._segments = segments
        self.items = items
        self._deadline = deadline  # event-loop time

    async def result(self) -> RequestResult:
        """Every piece's hypothesis, stitched into the request's transcript."""
        return self.finish(*await self.stitched())

    async def stitched(self) -> tuple[Hypothesis, list[ItemResult]]:
        """Every piece's result, and their hypotheses stitched into one in the recording's frames."""
        gathered = asyncio.gather(*(asyncio.wrap_future(item.future) for item in self.items))
        gathered.add_done_callback(lambda f: f.cancelled() or f.exception())  # a drop is not an error to log
        try:
            results: list[ItemResult] = await asyncio.wait_for(gathered, self._remaining_s())
        except TimeoutError as exc:  # the batcher dropped a piece unrun, or the whole wait ran out
            if not any(item.future.done() and not item.future.cancelled() and item.future.exception() is None
                       for item in self.items):
                raise NeverRan(str(exc)) from exc
            raise
        t = self._transcriber
        hyp = stitch(list(zip(self._segments, (r.hypothesis for r in results), strict=True)), t.tokenizer,
                     t.frame_samples)
        return hyp, results

    def finish(self, hyp: Hypothesis, results: list[ItemResult]) -> RequestResult:
        """The request's transcript of its stitched hypothesis, and the pieces' times."""
        t = self._transcriber
        transcript = build_transcript(hyp, t.tokenizer, t.config.frame_s, self._n_samples / t.sample_rate)
        return RequestResult(transcript=transcript, queue_s=max((r.queue_s for r in results), default=0.0),
                             compute_s=sum(r.compute_s for r in results), n_segments=len(self._segments))

    async def text_deltas(self) -> AsyncIterator[TextDelta]:
        """The transcript's text in order, a delta each time the pieces finished so far from the start lengthen
        it; together the deltas are the text (and tokens) ``result`` returns, which is ready once they end.

        A piece's words are known when it finishes, but for those in its overlap with the piece after it, which
        the two are joined by (models.stitching): those come when that piece has finished too. The text of a run
        of whole words starts the text of any longer run, so nothing said is retracted.
        """
        t = self._transcriber
        if t.tokenizer is None:  # no vocabulary: no text
            await self.stitched()
            return
        stitcher = Stitcher(t.tokenizer, t.frame_samples)
        spoken = _Spoken(t.tokenizer)
        for segment, item in zip(self._segments, self.items, strict=True):
            result: ItemResult = await asyncio.wait_for(asyncio.wrap_future(item.future), self._remaining_s())
            if delta := spoken.add(stitcher.add((segment, result.hypothesis))):
                yield delta
        if delta := spoken.add(stitcher.finish()):
            yield delta

    def cancel(self) -> None:
        """Drop the pieces still queued (a no-op for those done)."""
        for item in self.items:
            item.future.cancel()

    def _remaining_s(self) -> float:
        return max(0.0, self._deadline - asyncio.get_running_loop().time())
