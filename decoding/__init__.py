"""Greedy decoding for CTC and transducers (RNN-T, TDT); pure torch, importable without the service."""

import importlib
from typing import Any

from .types import Hypothesis

__all__ = ["Hypothesis", "ctc_greedy", "frame_looping_greedy", "label_looping_greedy"]
# name -> the module that defines it
_DECODERS = {"ctc_greedy": "ctc", "frame_looping_greedy": "frame_looping", "label_looping_greedy": "label_looping"}


def __getattr__(name: str) -> Any:
    """The decoders (and torch) load when first used: a process that handles only hypotheses never loads them."""
    if name in _DECODERS:
        return getattr(importlib.import_module(f".{_DECODERS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
