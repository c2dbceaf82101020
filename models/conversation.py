"""A recording whose channels were transcribed apart (a call centre's stereo call: agent on one side, customer on
the other), read back as one conversation: who said what, in the order it was said.

Mixing such a call down to mono loses who spoke, and where the two talk over each other the model hears neither
clearly. Kept apart, each channel is transcribed as clean speech, and the channels' words are merged by time
into utterances: a speaker's words up to a pause, or to a pause in which someone else speaks.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from decoding.types import Hypothesis

from .config import ModelConfig
from .crosstalk import drop_crosstalk
from .tokenizer import Tokenizer
from .transcript import Transcript, Word, build_transcript, mean_logprob

UTTERANCE_GAP_S = 1.0  # a pause this long ends an utterance even when nobody else speaks in it
# a pause this long in which another channel begins a word is a turn, and ends the utterance; words between words
# said without one are talked over (two people at once), and each speaker's utterance goes on
TURN_GAP_S = 0.3
# a channel repeats an earlier one when the two correlate this closely (either sign), at a lag of up to SAME_LAGS
# samples: the same signal at another level, inverted, or a sample or two late ("stereo" files that are mono twice
# over, through a mixer or a codec). Two people on two lines never come near it; a line's bleed into the other does
# not either, the other line's own speech beside it
SAME_CORRELATION = 0.99
SAME_LAGS = 4
SPEAKER_NAME = re.compile(r"[\w][\w .'-]{0,39}")  # "agent", "Customer 2", "o'brien": no brackets or markup


@dataclass(frozen=True)
class Utterance:
    channel: int  # 0-based, in the file's channel order
    start_s: float
    end_s: float
    text: str
    words: list[Word]


@dataclass
class Conversation:
    channels: list[Transcript]  # one per channel, in the file's order
    # channel -> the earlier channel it repeats (a mono recording stored as stereo): not transcribed, left empty
    duplicates: dict[int, int] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)  # the speakers by channel ("agent", "customer"); may be fewer

    def speaker(self, channel: int) -> str:
        """Who speaks on ``channel``: its name, else "channel N"."""
        return self.names[channel] if channel < len(self.names) else f"channel {channel}"

    @property
    def duration_s(self) -> float:
        return max((t.duration_s for t in self.channels), default=0.0)

    @property
    def transcribed_s(self) -> float:
        """Every channel's seconds that was transcribed (not those repeating another): what RTFx counts."""
        return sum(t.duration_s for c, t in enumerate(self.channels) if c not in self.duplicates)

    @property
    def token_logprobs(self) -> list[float]:
        """Every channel's token scores, channel by channel (empty without scores)."""
        return [x for t in self.channels for x in t.token_logprobs or []]

    @property
    def avg_logprob(self) -> float | None:
        """The mean log-probability of every channel's tokens: None without tokens or scores."""
        return mean_logprob(self.token_logprobs)

    @property
    def text(self) -> str:
        """One line per utterance, in time order, each saying who speaks: ``[agent] how can i help``."""
        return "\n".join(f"[{self.speaker(u.channel)}] {u.text}" for u in self.utterances())

    def utterances(self, max_gap_s: float = UTTERANCE_GAP_S, turn_gap_s: float = TURN_GAP_S) -> list[Utterance]:
        """Each channel's words grouped, in order of their first word's start (a tie goes to the lower channel): a
        channel's utterance ends at a pause longer than ``max_gap_s``, or at one of ``turn_gap_s`` or more in which
        another channel begins a word (a turn). Cut wherever another channel's word came between, two people
        talking at once read as a word of each in turn; their utterances overlap in time instead."""
        groups: list[tuple[int, list[Word]]] = []
        open_words: dict[int, list[Word]] = {}  # each channel's utterance under way
        latest_start: dict[int, float] = {}  # each channel's last word's start so far
        for channel, word in self.timed_words():
            words = open_words.get(channel)
            if words is not None:
                pause_from, pause = words[-1].end_s, word.start_s - words[-1].end_s
                others_spoke = any(start > pause_from for c, start in latest_start.items() if c != channel)
                if pause > max_gap_s or (pause >= turn_gap_s and others_spoke):
                    words = None
            if words is None:
                words = open_words[channel] = []
                groups.append((channel, words))
            words.append(word)
            latest_start[channel] = word.start_s
        return [Utterance(channel, words[0].start_s, max(w.end_s for w in words), " ".join(w.word for w in words),
                          words) for channel, words in groups]

    def timed_words(self) -> list[tuple[int, Word]]:
        """(channel, word) for every word, by start time (a tie goes to the lower channel)."""
        merged = sorted(((w.start_s, channel, i, w) for channel, t in enumerate(self.channels)
                         for i, w in enumerate(t.words)), key=lambda entry: entry[:3])
        return [(channel, word) for _, channel, _, word in merged]


def assemble(hypotheses: dict[int, Hypothesis], channels: Sequence[np.ndarray], duplicates: dict[int, int],
             tokenizer: Tokenizer | None, config: ModelConfig) -> Conversation:
    """A recording's conversation from the stitched hypotheses of the channels transcribed (``hypotheses``, by
    channel; the others repeat an earlier channel and are left empty), less the words a channel heard from
    another (models.crosstalk). Shared by the Python API and the service."""
    apart = sorted(hypotheses)
    kept = dict(zip(apart, drop_crosstalk([hypotheses[c] for c in apart], [channels[c] for c in apart], tokenizer,
                                          config.frame_samples, config.features.sample_rate), strict=True))
    return Conversation([build_transcript(kept.get(c, Hypothesis()), tokenizer, config.frame_s,
                                          len(samples) / config.features.sample_rate)
                         for c, samples in enumerate(channels)], duplicates)


def parse_names(text: str | list[str]) -> list[str]:
    """Speaker names in channel order from ``agent,customer`` (or a list of them, each checked whole: joined and
    split again, ``["Smith, John", "agent"]`` named channel 1 "John"); ValueError for an empty one or one with other
    characters than letters, digits, spaces and ``.'-_`` (names go into subtitles and WebVTT voice tags)."""
    given = text.split(",") if isinstance(text, str) else text
    names = [name.strip() if isinstance(name, str) else name for name in given]
    for name in names:
        if not isinstance(name, str) or not SPEAKER_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not a speaker name: 1 to 40 letters, digits, spaces or .'-_, one a channel "
                             "in order, comma-separated")
    return names


def duplicate_channels(channels: np.ndarray) -> dict[int, int]:
    """Each channel that repeats an earlier one (``SAME_CORRELATION``: "stereo" files that are mono twice over are
    common; one at half the level, inverted or a sample late had every word twice), and the first channel it
    repeats."""
    duplicates: dict[int, int] = {}
    for i in range(1, len(channels)):
        for j in range(i):
            if j not in duplicates and _repeats(channels[i], channels[j]):
                duplicates[i] = j
                break
    return duplicates


def _repeats(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` is ``b`` again, at any level or sign, up to ``SAME_LAGS`` samples apart (two silent channels
    repeat each other; silence and sound do not)."""
    energy_a, energy_b = _dot(a, a), _dot(b, b)
    if energy_a == 0 or energy_b == 0:
        return energy_a == energy_b
    bound = SAME_CORRELATION * math.sqrt(energy_a * energy_b)
    for lag in sorted(range(-SAME_LAGS, SAME_LAGS + 1), key=abs):  # in step first: the common case
        x, y = (a[lag:], b[: len(b) - lag]) if lag >= 0 else (a[:lag], b[-lag:])
        if abs(_dot(x, y)) >= bound:
            return True
    return False


def _dot(x: np.ndarray, y: np.ndarray, block: int = 1 << 20) -> float:
    """``x · y`` in float64, a block at a time: hours of audio make no copy of their size."""
    return sum(float(np.dot(x[start : start + block].astype(np.float64), y[start : start + block]))
               for start in range(0, min(len(x), len(y)), block))
