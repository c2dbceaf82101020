"""A request's or a job's hotwords as the fields bring them (the check and the tokens:
models.tokenizer.hotword_tokens)."""

from __future__ import annotations

from collections.abc import Sequence


def split_hotwords(values: Sequence[str]) -> list[str]:
    """Phrases from fields that are comma-separated, repeated, or both."""
    return [phrase.strip() for value in values for phrase in value.split(",") if phrase.strip()]
