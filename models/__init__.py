"""NeMo-format FastConformer models in plain PyTorch: checkpoints, features, encoder, heads, transcription."""

from typing import Any

from .errors import CheckpointError, UnsupportedModelError
from .transcript import Transcript, Word

__all__ = ["ASRModel", "CheckpointError", "Transcript", "UnsupportedModelError", "Word", "load_model"]


def __getattr__(name: str) -> Any:
    """The model (and torch) load when first asked for: the service's front-end processes use only the
    config, the tokenizer and transcripts."""
    if name in ("ASRModel", "load_model"):
        from . import asr_model

        return getattr(asr_model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
