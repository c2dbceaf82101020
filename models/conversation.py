"""A recording whose channels were transcribed apart (a call centre's stereo call: agent on one side, customer on
the other), read back as one conversation: who said what, in the order it was said.

Mixing such a call down to mono loses who spoke, and where the two talk over each other the model hears neither
clearly. Kept apart, each channel is transcribed as clean speech, and the channels' words are merged by time
into utterances: a speaker's words up to a pause or until someone else speaks.
"""

from __future__ import annotations

from dataclasses import dataclass

from .transcript import Transcript, Word

UTTERANCE_GAP_S = 1.0  # a pause this long ends an utterance even when nobody else speaks in it


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

    @property
    def duration_s(self) -> float:
        return max((t.duration_s for t in self.channels), default=0.0)

    @property
    def text(self) -> str:
        """One line per utterance, in time order, each saying its channel."""
        return "\n".join(f"{speaker_label(u.channel)} {u.text}" for u in self.utterances())

    def utterances(self, max_gap_s: float = UTTERANCE_GAP_S) -> list[Utterance]:
        """Every channel's words merged by start time (a tie goes to the lower channel) and grouped: an utterance
        ends at a pause longer than ``max_gap_s`` or where another channel's word comes between."""
        merged = sorted(((w.start_s, channel, i, w) for channel, t in enumerate(self.channels)
                         for i, w in enumerate(t.words)), key=lambda entry: entry[:3])
        groups: list[tuple[int, list[Word]]] = []
        for _, channel, _, word in merged:
            if groups and groups[-1][0] == channel and word.start_s - groups[-1][1][-1].end_s <= max_gap_s:
                groups[-1][1].append(word)
            else:
                groups.append((channel, [word]))
        return [Utterance(channel, words[0].start_s, max(w.end_s for w in words), " ".join(w.word for w in words),
                          words) for channel, words in groups]

    def timed_words(self) -> list[tuple[int, Word]]:
        """(channel, word) for every word, in time order."""
        return [(u.channel, w) for u in self.utterances() for w in u.words]


def speaker_label(channel: int) -> str:
    return f"[channel {channel}]"
