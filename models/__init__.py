"""NeMo-format FastConformer models in plain PyTorch: checkpoints, features, encoder, heads, transcription."""

from typing import Any

from .audio_io import AudioClip
from .errors import CheckpointError, UnsupportedModelError
from .transcript import Transcript, Word

__all__ = ["ASRModel", "AudioClip", "CheckpointError", "Transcript", "UnsupportedModelError", "Word", "load_model"]


def __getattr__(name: str) -> Any:
    """The model's code (and torch) loads when first asked for: a process that handles only configs,
    tokenizers and transcripts never loads it."""
    if name in ("ASRModel", "load_model"):
        from . import asr_model

        return getattr(asr_model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
