"""NeMo-format FastConformer models in plain PyTorch: checkpoints, features, encoder, heads, transcription."""

from .asr_model import ASRModel, load_model
from .errors import CheckpointError, UnsupportedModelError
from .transcript import Transcript, Word

__all__ = ["ASRModel", "CheckpointError", "Transcript", "UnsupportedModelError", "Word", "load_model"]
