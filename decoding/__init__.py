"""Greedy decoding for CTC and transducers (RNN-T, TDT); pure torch, importable without the service."""

from typing import Any

from .types import Hypothesis

__all__ = ["Hypothesis", "ctc_greedy", "frame_looping_greedy"]


def __getattr__(name: str) -> Any:
    """The decoders load torch when first used, so ``decoding.types`` alone stays light (front-end processes)."""
    if name == "ctc_greedy":
        from .ctc import ctc_greedy

        return ctc_greedy
    if name == "frame_looping_greedy":
        from .frame_looping import frame_looping_greedy

        return frame_looping_greedy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
