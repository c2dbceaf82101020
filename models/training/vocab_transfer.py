"""Warm start across tokenizers: a trained model's weights for a model with a new (larger) vocabulary.

Everything not indexed by the vocabulary (encoder, LSTM, joint hidden layers) is copied as it is. The three
tensors that are (the prediction network's embedding, the joint's output layer, the CTC head) get one row per
new piece: the mean of the old rows of the pieces that spell it, so a piece such as ``▁walked`` starts where
``▁wal`` + ``ked`` left off instead of at random. Blank and duration rows are copied. The new model then only
has to learn to tell its longer pieces apart, not to hear again.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .export import load_sentencepiece

# NeMo key -> where its blank row sits, counted from the end (embedding and CTC: last; joint: before the
# duration logits).
EMBEDDING = "decoder.prediction.embed.weight"
CTC_OUT = ("ctc_decoder.decoder_layers.0.weight", "ctc_decoder.decoder_layers.0.bias")


def spell_with(piece: str, old_pieces: dict[str, int]) -> list[int]:
    """Old piece ids that spell ``piece``, longest match first (every single character is an old piece,
    since both tokenizers cover the whole alphabet)."""
    ids, start = [], 0
    while start < len(piece):
        for end in range(len(piece), start, -1):
            if piece[start:end] in old_pieces:
                ids.append(old_pieces[piece[start:end]])
                start = end
                break
        else:
            raise ValueError(f"piece {piece!r} cannot be spelled with the old vocabulary "
                             f"({piece[start]!r} is not one of its pieces)")
    return ids


def piece_map(old_proto: bytes, new_proto: bytes) -> list[list[int]]:
    """For each new piece id, the old piece ids that spell it."""
    old, new = load_sentencepiece(old_proto), load_sentencepiece(new_proto)
    old_pieces = {old.id_to_piece(i): i for i in range(old.get_piece_size())}
    return [[old.unk_id()] if new.is_unknown(i) else spell_with(new.id_to_piece(i), old_pieces)
            for i in range(new.get_piece_size())]


def joint_output_keys(state: dict[str, Tensor]) -> tuple[str, str]:
    """The joint's output layer: the last of ``joint.joint_net`` (index 1 or 2, see ``heads.Joint``)."""
    index = max(int(k.split(".")[2]) for k in state if k.startswith("joint.joint_net."))
    return f"joint.joint_net.{index}.weight", f"joint.joint_net.{index}.bias"


def _remap_rows(old: Tensor, mapping: list[list[int]], n_old: int, n_tail: int) -> Tensor:
    """Rows [0, n_old) are tokens (remapped); the ``n_tail`` rows after them (blank, durations) are kept."""
    token_rows = torch.stack([old[ids].mean(dim=0) for ids in mapping])
    return torch.cat([token_rows, old[n_old:n_old + n_tail]])


def transfer_weights(state: dict[str, Tensor], old_proto: bytes, new_proto: bytes,
                     n_durations: int) -> dict[str, Tensor]:
    """``state`` (NeMo keys) re-indexed from the old tokenizer's pieces to the new one's."""
    mapping = piece_map(old_proto, new_proto)
    n_old = state[EMBEDDING].shape[0] - 1
    tails = {EMBEDDING: 1, **dict.fromkeys(joint_output_keys(state), 1 + n_durations), **dict.fromkeys(CTC_OUT, 1)}
    out = dict(state)
    for key, n_tail in tails.items():
        if state[key].shape[0] != n_old + n_tail:
            raise ValueError(f"{key}: {state[key].shape[0]} rows, expected {n_old} pieces + {n_tail}")
        out[key] = _remap_rows(state[key], mapping, n_old, n_tail)
    return out
