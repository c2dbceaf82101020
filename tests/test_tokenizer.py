"""Word texts joined from piece surfaces must equal SentencePiece's own decoding of each word's pieces."""

from __future__ import annotations

import io
import unicodedata

import pytest
import sentencepiece as spm
from hypothesis import given, settings
from hypothesis import strategies as st

from models import load_model
from models.tokenizer import WORD_BOUNDARY, Tokenizer, WordSpan

DEFAULT_MODEL = "models/assets/default.nemo"


def words_by_decoding(tokenizer: Tokenizer, ids: list[int]) -> list[WordSpan]:
    """The reference: spans at boundary markers (lone punctuation sticks to the word before), each word's text
    from one SentencePiece decode call."""
    spans: list[list[int]] = []
    for i, token in enumerate(ids):
        piece = tokenizer.pieces[token]
        mark = piece.lstrip(WORD_BOUNDARY)
        punctuation = bool(mark) and all(unicodedata.category(ch).startswith("P") for ch in mark)
        if not spans or (piece.startswith(WORD_BOUNDARY) and not punctuation):
            spans.append([i, i])
        else:
            spans[-1][1] = i
    words = [WordSpan(tokenizer.ids_to_text(ids[first : last + 1]).strip(), first, last) for first, last in spans]
    return [w for w in words if w.text]


def byte_fallback_tokenizer() -> Tokenizer:
    """A small model with byte pieces, control pieces and punctuation, whose byte pieces only the decoder
    renders."""
    sentences = [f"item {i}, costs {i * 3} euros ; naïve café déjà vu ? yes ! " + (chr(0x4E00 + i) if i < 40 else "")
                 for i in range(400)]  # the rare characters fall outside the coverage: bytes spell them
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_writer=model, vocab_size=320,
                                   model_type="bpe", byte_fallback=True, character_coverage=0.98, minloglevel=2)
    return Tokenizer(model.getvalue())


@pytest.fixture(scope="module", params=["default", "hybrid", "byte_fallback"])
def tokenizer(request) -> Tokenizer:
    if request.param == "default":
        return load_model(DEFAULT_MODEL, device="cpu").tokenizer
    if request.param == "hybrid":
        return load_model(request.getfixturevalue("parity_dir") / "tdt_ctc_hybrid.nemo", device="cpu").tokenizer
    return byte_fallback_tokenizer()


def test_the_fast_path_is_taken_for_plain_vocabularies(tokenizer):
    assert tokenizer._surfaces is not None  # otherwise the comparison below tests only the slow path
    assert any(s is None for s in tokenizer._surfaces)  # <unk> at least goes through SentencePiece


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_words_equal_sentencepiece_decoding(tokenizer, data):
    plain = [i for i, surface in enumerate(tokenizer._surfaces) if surface is not None]
    any_piece = st.integers(0, tokenizer.vocab_size - 1)  # bytes, <unk>: words SentencePiece has to spell
    ids = data.draw(st.lists(st.one_of(st.sampled_from(plain), st.sampled_from(plain), any_piece), max_size=40))
    assert tokenizer.words(ids) == words_by_decoding(tokenizer, ids)


def test_words_from_encoded_text_match_the_text(tokenizer):
    text = "the cat sat on the mat and then it left"
    ids = tokenizer._sp.encode(text)
    assert tokenizer.words(ids) == words_by_decoding(tokenizer, ids)
    assert " ".join(w.text for w in tokenizer.words(ids)) == tokenizer.ids_to_text(ids).strip()


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_the_text_of_leading_words_starts_the_whole_text(tokenizer, data):
    """What a stream relies on: the text of the words finished so far is never changed by the words after."""
    plain = [i for i, surface in enumerate(tokenizer._surfaces) if surface is not None]
    any_piece = st.integers(0, tokenizer.vocab_size - 1)
    ids = data.draw(st.lists(st.one_of(st.sampled_from(plain), st.sampled_from(plain), any_piece), max_size=40))
    whole = tokenizer.ids_to_text(ids)
    for word in tokenizer.words(ids):
        assert whole.startswith(tokenizer.ids_to_text(ids[: word.first]))
