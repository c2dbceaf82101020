"""A request's or a job's hotwords, checked and turned into the model's tokens (decoding.boosting boosts them)."""

from __future__ import annotations

from collections.abc import Sequence

from models.config import ModelConfig
from models.tokenizer import Tokenizer

from .config import Settings


class HotwordsUnavailable(ValueError):
    """This server cannot boost hotwords: it decodes with CTC, or its model has no vocabulary."""


def served_decoder(settings: Settings, config: ModelConfig) -> str:
    """The head the engine decodes with: the setting's, or the model's own."""
    return config.default_decoder if settings.decoder == "auto" else settings.decoder


def split_hotwords(values: Sequence[str]) -> list[str]:
    """Phrases from fields that are comma-separated, repeated, or both."""
    return [phrase.strip() for value in values for phrase in value.split(",") if phrase.strip()]


def hotword_tokens(phrases: Sequence[str], tokenizer: Tokenizer | None, decoder: str) -> tuple[tuple[int, ...], ...]:
    """``phrases`` as tokens; HotwordsUnavailable where they cannot be boosted, ValueError for bad ones."""
    if not phrases:
        return ()
    if decoder == "ctc" or tokenizer is None:
        raise HotwordsUnavailable(f"hotwords need a transducer decoder and a vocabulary; this server decodes with "
                                  f"{decoder}")
    return tokenizer.hotwords(phrases)
