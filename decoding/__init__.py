"""Greedy decoding for CTC and transducers (RNN-T, TDT); pure torch, importable without the service."""

from .ctc import ctc_greedy
from .frame_looping import frame_looping_greedy
from .types import Hypothesis

__all__ = ["Hypothesis", "ctc_greedy", "frame_looping_greedy"]
