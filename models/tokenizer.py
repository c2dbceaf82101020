"""SentencePiece ids -> text, the way NeMo's BPE decoding renders them."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

import sentencepiece as spm

from decoding.types import MAX_HOTWORD_BOOST, Hotword, Hotwords

from .errors import CheckpointError

WORD_BOUNDARY = "▁"  # SentencePiece's marker at the start of a word
MAX_HOTWORDS = 100  # phrases a request may boost (decoding.boosting)
MAX_HOTWORD_CHARS = 64
_SPECIAL_PIECE = re.compile(r"^\[.*\]$|^<.*>$|^##|^▁|^\s*$")


def split_boost(hotword: str) -> tuple[str, float | None]:
    """A hotword as given -> (its text, its own bonus or None). ``acme:3`` boosts "acme" by 3 (Deepgram's and
    Riva's way of writing it); a bonus is more than 0 and at most ``MAX_HOTWORD_BOOST``, else ValueError (also for
    ``acme:inf``, ``acme:nan``, ``acme:1e9``). A colon followed by anything but a number is part of the phrase, and
    so is one between digits: ``at 10:05`` is a time, not "at 10" boosted by 5 (``model 3 :2`` boosts "model 3")."""
    phrase, colon, suffix = hotword.rpartition(":")
    try:
        boost = float(suffix) if colon and not phrase[-1:].isdigit() else None
    except ValueError:
        boost = None
    if boost is None:
        return hotword, None
    if not 0 < boost <= MAX_HOTWORD_BOOST:  # NaN fails this too
        raise ValueError(f"a hotword's own boost is more than 0 and at most {MAX_HOTWORD_BOOST:g}, not {hotword!r}")
    return phrase.rstrip(), boost


def checked_hotwords(phrases: Sequence[str]) -> list[tuple[str, float | None]]:
    """Each hotword as (its text, its own bonus or None), the checks that need no vocabulary made: ValueError for more
    than ``MAX_HOTWORDS`` different ones, an empty or over-long one, a bonus out of range (``split_boost``). Also
    made where a job is written straight into Redis (`batchasr submit --redis-url`), before anything is queued."""
    checked = []
    for given in phrases:
        phrase, boost = split_boost(given)
        if not phrase.strip() or len(phrase) > MAX_HOTWORD_CHARS:
            raise ValueError(f"a hotword is 1 to {MAX_HOTWORD_CHARS} characters, not {given!r}")
        checked.append((phrase.strip(), boost))
    different = len({phrase for phrase, _ in checked})  # a phrase given twice counts once
    if different > MAX_HOTWORDS:
        raise ValueError(f"at most {MAX_HOTWORDS} different hotwords, not {different}")
    return checked


class HotwordsUnavailable(ValueError):
    """Hotwords cannot be boosted: the model has no vocabulary to spell them with."""


def hotword_tokens(phrases: Sequence[str], tokenizer: Tokenizer | None) -> Hotwords:
    """Hotwords as the tokens the decoders boost (decoding.boosting); HotwordsUnavailable where it cannot, ValueError
    for bad ones (``Tokenizer.hotwords``). Shared by the Python API, the routes and the job worker."""
    if not phrases:
        return ()
    if tokenizer is None:
        raise HotwordsUnavailable("hotwords need the model's vocabulary, and this model has none")
    return tokenizer.hotwords(phrases)


@dataclass(frozen=True)
class WordSpan:
    """A word and the index range of its tokens: tokens[first:last + 1]."""

    text: str
    first: int
    last: int


class Tokenizer:
    def __init__(self, model_proto: bytes):
        self.model_proto = model_proto  # serialized; another process builds the same tokenizer from it
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(model_proto)
        except (RuntimeError, OSError) as exc:
            raise CheckpointError(f"tokenizer: not a SentencePiece model ({exc})") from exc
        self.vocab_size = self._sp.get_piece_size()
        self.pieces = [self._sp.id_to_piece(i) for i in range(self.vocab_size)]
        self._punctuation_re = self._punctuation_pattern(self.pieces)
        self._starts_word = [p.startswith(WORD_BOUNDARY) and not self._is_punctuation(p) for p in self.pieces]
        self._surfaces = self._plain_surfaces()

    def _plain_surfaces(self) -> list[str | None] | None:
        """Each plain piece's text inside a sentence (its boundary marker as a space); None for pieces that
        only SentencePiece itself renders (bytes, control, unknown). Word texts are joined from these, which
        costs a fraction of a decode call per word; used only if joining the whole vocabulary gives exactly
        what SentencePiece's decoder does."""
        sp = self._sp
        surfaces: list[str | None] = [
            None if sp.is_byte(i) or sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i)
            else piece.replace(WORD_BOUNDARY, " ") for i, piece in enumerate(self.pieces)]
        plain = [i for i, text in enumerate(surfaces) if text is not None]
        joined = "".join(surfaces[i] for i in plain)
        decoded = sp.decode_pieces([self.pieces[i] for i in plain])
        return surfaces if joined.strip() == decoded.strip() else None

    @staticmethod
    def _punctuation_pattern(pieces: list[str]) -> re.Pattern[str] | None:
        """NeMo removes one space before punctuation marks that occur in non-special vocabulary pieces."""
        marks = sorted({ch for piece in pieces if not _SPECIAL_PIECE.match(piece) for ch in piece
                        if unicodedata.category(ch).startswith("P")})
        if not marks:
            return None
        return re.compile(r"(\s)(" + "|".join(re.escape(m) for m in marks) + ")")

    def ids_to_text(self, ids: list[int]) -> str:
        return self._close_punctuation(self._sp.decode_pieces([self.pieces[i] for i in ids]))

    def _close_punctuation(self, text: str) -> str:
        return text if self._punctuation_re is None else self._punctuation_re.sub(r"\2", text)

    def words(self, ids: list[int]) -> list[WordSpan]:
        """Group tokens into words: a word starts at a piece beginning with the boundary marker.

        Pieces that are punctuation alone stick to the word before them, as the rendered text shows them.
        """
        spans: list[list[int]] = []  # [first, last] token index of each word
        for i, token in enumerate(ids):
            if not spans or self._starts_word[token]:
                spans.append([i, i])
            else:
                spans[-1][1] = i
        words = []
        for first, last in spans:
            text = self._word_text(ids[first : last + 1])
            if text:
                words.append(WordSpan(text=text, first=first, last=last))
        return words

    def encode(self, text: str) -> list[int]:
        """``text`` as the model's tokens (SentencePiece's segmentation, as the model was trained on)."""
        return list(self._sp.encode(text))

    def hotwords(self, phrases: Sequence[str]) -> Hotwords:
        """Hotwords (words or phrases, written as the model writes them, each with its own bonus as ``acme:3`` or
        the default) as tokens, each once (the last bonus given for it); ValueError for too many, an empty or
        over-long one, a bonus out of range (``split_boost``), or characters the vocabulary cannot spell."""
        boosts: dict[tuple[int, ...], float | None] = {}
        for (phrase, boost), given in zip(checked_hotwords(phrases), phrases, strict=True):
            tokens = self.encode(phrase)
            if not tokens:
                raise ValueError(f"a hotword is 1 to {MAX_HOTWORD_CHARS} characters, not {given!r}")
            if self._sp.unk_id() in tokens:
                # boosted, <unk> (and the bare boundary piece before it) would be pushed into every transcript
                missing = "".join(ch for ch in dict.fromkeys(phrase) if self._sp.unk_id() in self._sp.encode(ch))
                raise ValueError(f"the hotword {given!r} has characters this model never writes ({missing!r}): "
                                 "write it as the model's transcripts are written (lowercase, say)")
            boosts[tuple(tokens)] = boost
        return tuple(Hotword(tokens, boost) for tokens, boost in boosts.items())

    def token_texts(self, ids: list[int], starts_text: bool = True) -> list[str]:
        """Each token as text, its word boundary as a leading space (none before the first, when ``ids`` start
        the text): what OpenAI's ``logprobs`` list. A piece only SentencePiece renders (a byte, unknown) is given
        as the piece itself."""
        texts = []
        for i in ids:
            surface = self._surfaces[i] if self._surfaces is not None else None
            texts.append(surface if surface is not None else self.pieces[i].replace(WORD_BOUNDARY, " "))
        if texts and starts_text:
            texts[0] = texts[0].lstrip(" ")
        return texts

    def _word_text(self, ids: list[int]) -> str:
        if self._surfaces is not None:
            parts = [self._surfaces[i] for i in ids]
            if None not in parts:
                return self._close_punctuation("".join(parts)).strip()  # type: ignore[arg-type]
        return self.ids_to_text(ids).strip()

    def _is_punctuation(self, piece: str) -> bool:
        stripped = piece.lstrip(WORD_BOUNDARY)
        return bool(stripped) and all(unicodedata.category(ch).startswith("P") for ch in stripped)
