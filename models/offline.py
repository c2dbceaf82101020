"""Offline transcription of any number of inputs, of any length, in bounded memory (``ASRModel.transcribe_iter``).

Inputs are read a window at a time, by a few threads, the next window while this one is transcribed. Inputs
longer than ``max_segment_s`` are cut at quiet points and stitched back as the service does it
(models.segmenter), so an hour-long file costs what thirty-second pieces cost rather than attention over an
hour. A window's pieces are sorted by length into batches (little padding), and transcripts come out in input
order as each window finishes. An input that cannot be read can come out as its error, in its place, so that
one bad file does not end a run over thousands.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .audio_io import AudioError
from .conversation import Conversation
from .crosstalk import drop_crosstalk
from .segmenter import Segment, plan_pieces, stitch
from .transcript import Transcript, build_transcript

if TYPE_CHECKING:
    from .asr_model import ASRModel, AudioInput

WINDOW_BATCHES = 16  # inputs read at once, in batches: as many as the service's batcher chooses among
READERS = 4  # threads reading (decoding, resampling) files; libsndfile and soxr run outside the GIL


@dataclass(frozen=True)
class OfflineOptions:
    batch_size: int = 16
    decoder: str = "auto"
    decoder_algorithm: str = "label_looping"
    cuda_graphs: str = "auto"
    max_segment_s: float | None = None  # None: every input whole, as NeMo's transcribe takes it
    segment_overlap_s: float = 2.0
    window: int | None = None  # inputs read at once (None: WINDOW_BATCHES batches)
    readers: int = READERS
    multichannel: bool = False  # each channel transcribed apart: a Conversation per input
    skip_silence: bool = False  # long quiet stretches left out (models.silence)


Loaded = np.ndarray | AudioError | OSError


Outcome = Transcript | Conversation | AudioError | OSError


def transcribe_stream(model: ASRModel, audio: Iterable[AudioInput], options: OfflineOptions,
                      return_errors: bool = False) -> Iterator[Outcome]:
    """Transcripts in input order (see the module's description). An input that cannot be read raises its error
    there, or with ``return_errors`` comes out as it."""
    window = options.window or WINDOW_BATCHES * options.batch_size
    inputs = enumerate(audio)
    with ThreadPoolExecutor(options.readers, thread_name_prefix="batchasr-read") as readers:
        reading = _read_window(model, readers, inputs, window, options.multichannel)
        while reading:
            loaded = [future.result() for future in reading]
            reading = _read_window(model, readers, inputs, window, options.multichannel)  # the next, meanwhile
            for outcome in _transcribe_window(model, loaded, options):
                if isinstance(outcome, Exception) and not return_errors:
                    raise outcome
                yield outcome


def _read_window(model: ASRModel, readers: ThreadPoolExecutor, inputs: Iterator[tuple[int, AudioInput]],
                 window: int, multichannel: bool) -> list[Future[Loaded]]:
    return [readers.submit(_read, model, item, index, multichannel)
            for index, item in itertools.islice(inputs, window)]


def _read(model: ASRModel, item: AudioInput, index: int, multichannel: bool) -> Loaded:
    try:
        return model.load_audio(item, index, multichannel)
    except (AudioError, OSError) as exc:
        return exc


def _channels(wave: np.ndarray) -> list[np.ndarray]:
    """A loaded input's waveforms: itself, or (channels kept apart) each row."""
    return list(wave) if wave.ndim == 2 else [wave]


def _transcribe_window(model: ASRModel, loaded: list[Loaded], options: OfflineOptions) -> list[Outcome]:
    """Every readable input of the window (each of its channels, when they are kept apart) cut into pieces, the
    pieces decoded in batches of like lengths, and each input's pieces stitched back; errors in their inputs'
    places."""
    frame_samples = model.config.frame_samples
    pieces: list[tuple[tuple[int, int], Segment, np.ndarray]] = []  # ((position in the window, channel), ...)
    for position, wave in enumerate(loaded):
        if isinstance(wave, np.ndarray):
            for channel, samples in enumerate(_channels(wave)):
                for segment in _plan(model, samples, options):
                    pieces.append(((position, channel), segment, samples[segment.start : segment.end]))
    hypotheses = [None] * len(pieces)
    order = sorted(range(len(pieces)), key=lambda i: len(pieces[i][2]), reverse=True)
    for start in range(0, len(order), options.batch_size):
        chunk = order[start : start + options.batch_size]
        batch = model.encode([pieces[i][2] for i in chunk])
        decoded = model.decode(batch, options.decoder, options.decoder_algorithm, options.cuda_graphs)
        for i, hypothesis in zip(chunk, decoded, strict=True):
            hypotheses[i] = hypothesis
    by_input: dict[tuple[int, int], list] = {}
    for (key, segment, _), hypothesis in zip(pieces, hypotheses, strict=True):
        by_input.setdefault(key, []).append((segment, hypothesis))
    out: list[Outcome] = []
    for position, wave in enumerate(loaded):
        if not isinstance(wave, np.ndarray):
            out.append(wave)
            continue
        channels = _channels(wave)
        hypotheses = [stitch(by_input.get((position, channel), []), model.tokenizer, frame_samples)
                      for channel in range(len(channels))]
        if wave.ndim == 2:  # words a channel heard from another are dropped (models.crosstalk)
            hypotheses = drop_crosstalk(hypotheses, channels, model.tokenizer, frame_samples, model.sample_rate)
        transcripts = [build_transcript(hyp, model.tokenizer, model.config.frame_s, len(samples) / model.sample_rate)
                       for hyp, samples in zip(hypotheses, channels, strict=True)]
        out.append(Conversation(transcripts) if wave.ndim == 2 else transcripts[0])
    return out


def _plan(model: ASRModel, wave: np.ndarray, options: OfflineOptions) -> list[Segment]:
    return plan_pieces(wave, model.sample_rate, options.max_segment_s, options.segment_overlap_s,
                       model.config.frame_samples, options.skip_silence)
