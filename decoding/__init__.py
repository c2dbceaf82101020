"""Greedy decoding for CTC and transducers (RNN-T, TDT); pure torch, importable without the service."""

from typing import Any

from .types import Hypothesis

__all__ = ["Hypothesis", "ctc_greedy", "frame_looping_greedy"]


def __getattr__(name: str) -> Any:
    """The decoders (and torch) load when first used: a process that handles only hypotheses never loads them."""
    if name == "ctc_greedy":
        from .ctc import ctc_greedy

        return ctc_greedy
    if name == "frame_looping_greedy":
        from .frame_looping import frame_looping_greedy

        return frame_looping_greedy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
