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

from decoding.boosting import build_boost_table
from decoding.types import HOTWORD_BOOST, Hotwords

from .audio_io import AudioError
from .conversation import Conversation, assemble, duplicate_channels
from .crosstalk import heard_elsewhere
from .segmenter import DEFAULT_MAX_SEGMENT_S, Segment, length_bucket_end, plan_pieces
from .silence import Elsewhere
from .stitching import stitch
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
    hotwords: Hotwords = ()  # phrases made likelier, as tokens (decoding.boosting)
    hotword_boost: float = HOTWORD_BOOST
    # fixed batch shapes: batches of one length bucket of this many seconds, padded to its end and to batch_size
    # rows, scores row by row, so bf16 results do not move with the other inputs (docs/benchmarks.md)
    length_bucket_s: float | None = None


Loaded = np.ndarray | AudioError | OSError


Outcome = Transcript | Conversation | AudioError | OSError


def transcribe_stream(model: ASRModel, audio: Iterable[AudioInput], options: OfflineOptions,
                      return_errors: bool = False) -> Iterator[Outcome]:
    """Transcripts in input order (see the module's description). An input that cannot be read raises its error
    there, or with ``return_errors`` comes out as it.

    A window holds at most WINDOW_BATCHES x ``batch_size`` inputs, and about as much audio as that many full
    batches of the longest pieces: no input of a window comes out before all of it is transcribed, and an archive
    of two-hour recordings was read 256 at a time (512 h of audio held, nothing written for hours). Without
    ``window``, the first window is read until it holds that much audio, and each next one is as many inputs as
    the last one's mean length allows."""
    most = options.window or WINDOW_BATCHES * options.batch_size
    window_s = WINDOW_BATCHES * options.batch_size * (options.max_segment_s or DEFAULT_MAX_SEGMENT_S)
    inputs = enumerate(audio)
    with ThreadPoolExecutor(options.readers, thread_name_prefix="batchasr-read") as readers:
        if options.window:
            reading = _read_window(model, readers, inputs, options.window, options.multichannel)
        else:
            reading = _first_window(model, readers, inputs, window_s, most, options)
        while reading:
            loaded = [future.result() for future in reading]
            count = options.window or _window_count(loaded, window_s, most, model.sample_rate)
            reading = _read_window(model, readers, inputs, count, options.multichannel)  # the next, meanwhile
            for outcome in _transcribe_window(model, loaded, options):
                if isinstance(outcome, Exception) and not return_errors:
                    raise outcome
                yield outcome


def _first_window(model: ASRModel, readers: ThreadPoolExecutor, inputs: Iterator[tuple[int, AudioInput]],
                  window_s: float, most: int, options: OfflineOptions) -> list[Future[Loaded]]:
    """Inputs read, ``options.readers`` at a time, until those done hold ``window_s`` of audio or ``most`` are
    read: no mean length is known yet."""
    window: list[Future[Loaded]] = []
    counted, seconds = 0, 0.0
    for index, item in inputs:
        window.append(readers.submit(_read, model, item, index, options.multichannel))
        while len(window) - counted >= options.readers:  # the readers all busy: the oldest's length, once read
            seconds += _seconds(window[counted].result(), model.sample_rate)
            counted += 1
        if len(window) >= most or seconds >= window_s:
            break
    return window


def _seconds(loaded: Loaded, sample_rate: int) -> float:
    return loaded.size / sample_rate if isinstance(loaded, np.ndarray) else 0.0


def _window_count(loaded: list[Loaded], window_s: float, most: int, sample_rate: int) -> int:
    """Inputs in the next window: as many as fit ``window_s`` at the mean length of those just read (every
    channel counted), at least one and at most ``most``."""
    seconds = [_seconds(wave, sample_rate) for wave in loaded if isinstance(wave, np.ndarray)]
    if not seconds or sum(seconds) <= 0:
        return most
    return max(1, min(most, int(window_s / (sum(seconds) / len(seconds)))))


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
    pieces: list[tuple[tuple[int, int], Segment, np.ndarray]] = []  # ((position in the window, channel), ...)
    repeats: dict[int, dict[int, int]] = {}  # position -> its channels that repeat an earlier one (not transcribed)
    for position, wave in enumerate(loaded):
        if isinstance(wave, np.ndarray):
            repeats[position] = duplicate_channels(wave) if wave.ndim == 2 else {}
            apart = [c for c in range(len(_channels(wave))) if c not in repeats[position]]
            echoes = _heard_elsewhere(model, wave, apart) if options.skip_silence else [None] * len(apart)
            for channel, echo in zip(apart, echoes, strict=True):
                samples = wave[channel] if wave.ndim == 2 else wave
                pieces += [((position, channel), segment, samples[segment.start : segment.end])
                           for segment in _plan(model, samples, options, echo)]
    hypotheses = [None] * len(pieces)
    for chunk, width, rows in _batches([len(piece[2]) for piece in pieces], options, model.sample_rate):
        silence = [np.zeros(width, dtype=np.float32)] * (rows - len(chunk))  # fixed shapes: rows decoded, dropped
        batch = model.encode([pieces[i][2] for i in chunk] + silence, pad_to=width)
        boost = build_boost_table([options.hotwords] * rows, options.hotword_boost, model.device)
        decoded = model.decode(batch, options.decoder, options.decoder_algorithm, options.cuda_graphs, boost=boost,
                               scores_per_row=options.length_bucket_s is not None)
        for i, hypothesis in zip(chunk, decoded[: len(chunk)], strict=True):
            hypotheses[i] = hypothesis
    by_input: dict[tuple[int, int], list] = {}
    for (key, segment, _), hypothesis in zip(pieces, hypotheses, strict=True):
        by_input.setdefault(key, []).append((segment, hypothesis))
    return [_outcome(model, wave, {c: by_input.get((position, c), []) for c in range(len(_channels(wave)))},
                     repeats[position]) if isinstance(wave, np.ndarray) else wave
            for position, wave in enumerate(loaded)]


def _batches(lengths: list[int], options: OfflineOptions, sample_rate: int) -> Iterator[tuple[list[int], int, int]]:
    """(piece indices, samples each row is padded to, rows) per batch: pieces of like lengths, longest first.
    With length buckets, a batch holds one bucket's pieces, padded to its end and to as many rows as that end
    allows: ``batch_size`` rows of the longest piece (``max_segment_s``, or ``DEFAULT_MAX_SEGMENT_S`` when
    inputs are taken whole) is the padded audio a batch may hold, as the service's MAX_BATCH_AUDIO_S. Without it
    a lone hour-long input was padded to ``batch_size`` hour-long rows."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    if options.length_bucket_s is None:
        for start in range(0, len(order), options.batch_size):
            chunk = order[start : start + options.batch_size]
            yield chunk, max(lengths[i] for i in chunk), len(chunk)
        return
    bucket_samples = round(options.length_bucket_s * sample_rate)
    longest = int(options.max_segment_s * sample_rate) if options.max_segment_s is not None else None
    padded_samples = options.batch_size * (longest or round(DEFAULT_MAX_SEGMENT_S * sample_rate))
    for end, members in itertools.groupby(order, key=lambda i: length_bucket_end(lengths[i], bucket_samples,
                                                                                  longest)):
        members = list(members)
        rows = max(1, min(options.batch_size, padded_samples // end))  # one shape a bucket, whatever its company
        for start in range(0, len(members), rows):
            yield members[start : start + rows], end, rows


def _outcome(model: ASRModel, wave: np.ndarray, pieces: dict[int, list], repeats: dict[int, int]
             ) -> Transcript | Conversation:
    """One input's transcript from its channels' decoded pieces; a conversation when its channels were kept apart
    (words a channel heard from another dropped: models.crosstalk; a channel repeating another left empty)."""
    stitched = {c: stitch(pieces[c], model.tokenizer, model.config.frame_samples) for c in pieces if c not in repeats}
    if wave.ndim == 2:
        return assemble(stitched, wave, repeats, model.tokenizer, model.config)
    return build_transcript(stitched[0], model.tokenizer, model.config.frame_s, len(wave) / model.sample_rate)


def _heard_elsewhere(model: ASRModel, wave: np.ndarray, apart: list[int]) -> list[Elsewhere | None]:
    """Where each channel transcribed carries the others' sound (models.crosstalk): skipped like silence."""
    if wave.ndim != 2 or len(apart) < 2:
        return [None] * len(apart)
    return list(heard_elsewhere([wave[c] for c in apart], model.sample_rate))


def _plan(model: ASRModel, wave: np.ndarray, options: OfflineOptions, elsewhere: Elsewhere | None = None
          ) -> list[Segment]:
    return plan_pieces(wave, model.sample_rate, options.max_segment_s, options.segment_overlap_s,
                       model.config.frame_samples, options.skip_silence, elsewhere)
