"""Long audio's pieces, decoded apart, stitched back into one hypothesis in the original's frames.

Pieces overlap around each cut (models.segmenter), so the words near a cut are heard twice. Where the two pieces
agree on words there (the same tokens, timed within ``SAME_WORD_FRAMES`` of each other), the earlier piece's words
are kept up to the agreed word nearest the cut and the later piece's after it: each word once, whichever side of
the cut each piece timed it on. A word given to a piece by the side of the cut its middle fell on was lost where the
earlier piece timed it just past the cut and the later just before, and doubled the other way round.

Where they agree on nothing there, a word belongs to the piece on whose side of the cut its middle lies; except
that where the later piece heard a word reaching past the cut with its middle before it (a cut-off word run
together with the next), the earlier piece keeps its own words up to that word's end; and a word the later piece
heard again, overlapping the earlier piece's last one, is kept once.

``Stitcher`` gives each piece's words out as soon as no later piece can change them (a stream's text as its pieces
finish); ``stitch`` is all of them at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from decoding.types import Hypothesis

from .segmenter import NO_CUT, Segment
from .tokenizer import Tokenizer

SAME_WORD_FRAMES = 5  # two pieces time one word up to four frames apart (each hears its own context)

Piece = tuple[Segment, Hypothesis]


@dataclass(frozen=True)
class Word:
    """A piece's word (a token, with no vocabulary to find words with): where it lies, in samples of the original,
    and its tokens, first..last of the piece's hypothesis."""

    middle: float
    end: float
    first: int
    last: int
    tokens: tuple[int, ...]


@dataclass
class _Held:
    """The last piece added: its words from ``given`` on wait for the piece after it."""

    piece: Piece
    words: list[Word]
    given: int


class Stitcher:
    """Adds a recording's pieces in order; each call gives out the words settled by then, as (piece, its words)."""

    def __init__(self, tokenizer: Tokenizer | None, frame_samples: int):
        self.tokenizer, self.frame_samples = tokenizer, frame_samples
        self._held: _Held | None = None
        self._said: Word | None = None  # the last word given out

    def add(self, piece: Piece) -> list[tuple[Piece, list[Word]]]:
        """The rest of the piece before, up to where it hands over to ``piece``, and ``piece``'s words up to its
        overlap with the piece after it."""
        segment, hyp = piece
        if _uncut(segment):  # a recording that was not cut: every token, as decoded (none lost to word-finding)
            whole = [Word(0, 0, 0, len(hyp.tokens) - 1, tuple(hyp.tokens))] if hyp.tokens else []
            self._held = _Held(piece, whole, len(whole))
            return [(piece, whole)]
        words = _words(segment, hyp, self.tokenizer, self.frame_samples)
        given: list[tuple[Piece, list[Word]]] = []
        if self._held is None:
            begin = _first_from(words, segment.cut_before)
        else:
            end, begin = self._join(self._held, segment, words)
            given.append(self._give(self._held, end))
        self._held = _Held(piece, words, begin)
        given.append(self._give(self._held, _first_from(words, _hold_from(segment), begin)))
        return given

    def finish(self) -> list[tuple[Piece, list[Word]]]:
        """The last piece's words still held."""
        if self._held is None:
            return []
        held, self._held = self._held, None
        return [self._give(held, _first_from(held.words, held.piece[0].cut_after, held.given))]

    def _give(self, held: _Held, end: int) -> tuple[Piece, list[Word]]:
        words = held.words[held.given : end]
        held.given = max(held.given, end)
        self._said = words[-1] if words else self._said
        return held.piece, words

    def _join(self, held: _Held, segment: Segment, words: list[Word]) -> tuple[int, int]:
        """Where the held piece's words end and the next piece's (``segment``'s ``words``) begin."""
        before = held.piece[0]
        cut = before.cut_after
        if segment.cut_before != cut:  # not the next piece of one stretch (skip_silence left a gap between)
            return _first_from(held.words, cut, held.given), _first_from(words, segment.cut_before)
        heard_again = words[: _first_from(words, before.end)]  # the later piece's words in the overlap
        pairs = _agreed(held.words[held.given :], heard_again, SAME_WORD_FRAMES * self.frame_samples)
        if pairs:
            i, j = min(pairs, key=lambda p: abs(held.words[held.given + p[0]].middle + words[p[1]].middle - 2 * cut))
            return held.given + i + 1, j + 1
        # nothing agreed on: by the side of the cut, the earlier piece keeping its words up to the end of a word
        # the later one heard reaching past the cut with its middle before it
        until = max([cut, *(word.end for word in words if word.middle < cut)])
        end, begin = _first_from(held.words, until, held.given), _first_from(words, cut)
        said = held.words[end - 1] if end > held.given else self._said
        while begin < len(words) and said is not None and words[begin].middle < said.end \
                and words[begin].tokens == said.tokens:
            begin += 1  # the earlier piece's last word heard again a frame later, its middle past the cut
        return end, begin


def stitch(pieces: list[Piece], tokenizer: Tokenizer | None, frame_samples: int) -> Hypothesis:
    """One hypothesis in the original's frames from pieces decoded separately (in order)."""
    if len(pieces) == 1 and _uncut(pieces[0][0]):
        return pieces[0][1]  # audio that was not cut: its hypothesis as decoded, every token kept
    out = Hypothesis(durations=[] if any(h.durations is not None for _, h in pieces) else None,
                     logprobs=[] if all(h.logprobs is not None for _, h in pieces) else None)
    stitcher = Stitcher(tokenizer, frame_samples)
    for given in [*(part for piece in pieces for part in stitcher.add(piece)), *stitcher.finish()]:
        append_words(out, *given, frame_samples)
    return out


def append_words(out: Hypothesis, piece: Piece, words: list[Word], frame_samples: int) -> None:
    """``piece``'s ``words`` appended to ``out``, in the original's frames."""
    segment, hyp = piece
    offset = segment.start // frame_samples
    for word in words:
        first, last = word.first, word.last
        out.tokens.extend(word.tokens)
        # Pieces see different context, so a word just after a cut may start a frame before the end of the word
        # kept just before it; frames stay non-decreasing by clamping.
        floor = out.frames[-1] if out.frames else 0
        out.frames.extend(max(offset + f, floor) for f in hyp.frames[first : last + 1])
        if out.durations is not None:
            out.durations.extend(hyp.durations[first : last + 1] if hyp.durations else [1] * (last - first + 1))
        if out.logprobs is not None and hyp.logprobs is not None:
            out.logprobs.extend(hyp.logprobs[first : last + 1])


def _agreed(earlier: list[Word], later: list[Word], tolerance: float) -> list[tuple[int, int]]:
    """The most pairs (i, j), in order in both, of ``earlier[i]`` and ``later[j]`` the same word: the same tokens,
    their middles within ``tolerance`` samples (a longest common subsequence; a word said twice in a row is paired
    with itself, not with its repeat)."""
    def same(a: Word, b: Word) -> bool:
        return a.tokens == b.tokens and abs(a.middle - b.middle) <= tolerance

    n, m = len(earlier), len(later)
    most = [[0] * (m + 1) for _ in range(n + 1)]  # most[i][j]: pairs among earlier[i:] and later[j:]
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            paired = most[i + 1][j + 1] + 1 if same(earlier[i], later[j]) else 0
            most[i][j] = max(most[i + 1][j], most[i][j + 1], paired)
    pairs, i, j = [], 0, 0
    while i < n and j < m:
        if same(earlier[i], later[j]) and most[i][j] == most[i + 1][j + 1] + 1:
            pairs.append((i, j))
            i, j = i + 1, j + 1
        elif most[i + 1][j] >= most[i][j + 1]:
            i += 1
        else:
            j += 1
    return pairs


def _hold_from(segment: Segment) -> float:
    """Where the piece after ``segment`` begins: ``segment``'s words from there on wait for it (none where nothing
    follows it in the same stretch)."""
    if segment.cut_after >= segment.end:
        return segment.cut_after
    return segment.cut_after - (segment.end - segment.cut_after)  # pieces overlap alike on both sides of a cut


def _first_from(words: list[Word], sample: float, at_least: int = 0) -> int:
    """The first of ``words`` (from ``at_least``) whose middle lies at or after ``sample`` (their middles are in
    order)."""
    i = at_least
    while i < len(words) and words[i].middle < sample:
        i += 1
    return i


def _uncut(segment: Segment) -> bool:
    return segment.start == 0 and segment.cut_after == NO_CUT


def _words(segment: Segment, hyp: Hypothesis, tokenizer: Tokenizer | None, frame_samples: int) -> list[Word]:
    offset = segment.start // frame_samples
    if tokenizer is not None:
        spans = [(span.first, span.last) for span in tokenizer.words(hyp.tokens)]
    else:
        spans = [(i, i) for i in range(len(hyp.tokens))]
    words = []
    for first, last in spans:
        end_frame = hyp.frames[last] + max(hyp.durations[last] if hyp.durations else 1, 1)
        start, end = (offset + hyp.frames[first]) * frame_samples, (offset + end_frame) * frame_samples
        words.append(Word((start + end) / 2, end, first, last, tuple(hyp.tokens[first : last + 1])))
    return words
