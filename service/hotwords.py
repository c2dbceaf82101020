"""A request's or a job's hotwords: the fields they come in, and the decoder that would boost them (the check and
the tokens: models.tokenizer.hotword_tokens)."""

from __future__ import annotations

from collections.abc import Sequence

from models.config import ModelConfig

from .config import Settings


def served_decoder(settings: Settings, config: ModelConfig) -> str:
    """The head the engine decodes with: the setting's, or the model's own."""
    return config.default_decoder if settings.decoder == "auto" else settings.decoder


def split_hotwords(values: Sequence[str]) -> list[str]:
    """Phrases from fields that are comma-separated, repeated, or both."""
    return [phrase.strip() for value in values for phrase in value.split(",") if phrase.strip()]
