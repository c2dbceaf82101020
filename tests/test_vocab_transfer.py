"""Warm start across tokenizers: new pieces start from the rows of the old pieces that spell them."""

from __future__ import annotations

import io

import pytest
import sentencepiece as spm
import torch

from models.training.vocab_transfer import (
    CTC_OUT,
    EMBEDDING,
    joint_output_keys,
    piece_map,
    spell_with,
    transfer_weights,
)

TEXT = ["the cat sat on the mat", "the dog sat on the log", "a cat and a dog walked in the park",
        "they walked and talked", "the mat was flat and the log was long"] * 30
N_DURATIONS = 3
JOINT_OUT = ("joint.joint_net.1.weight", "joint.joint_net.1.bias")  # a joint without dropout, as batchasr trains


def test_the_joint_output_layer_is_found_with_and_without_nemo_dropout_layer():
    for index in (1, 2):
        state = {"joint.enc.weight": torch.zeros(1), f"joint.joint_net.{index}.weight": torch.zeros(1),
                 f"joint.joint_net.{index}.bias": torch.zeros(1)}
        assert joint_output_keys(state) == (f"joint.joint_net.{index}.weight", f"joint.joint_net.{index}.bias")


def _tokenizer(vocab_size: int, tmp_path) -> bytes:
    text = tmp_path / "text.txt"
    text.write_text("\n".join(TEXT) + "\n")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(input=str(text), model_writer=model, vocab_size=vocab_size, model_type="bpe",
                                   character_coverage=1.0, bos_id=-1, eos_id=-1, minloglevel=2)
    return model.getvalue()


def _processor(proto: bytes) -> spm.SentencePieceProcessor:
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(proto)
    return sp


def test_spell_with_takes_the_longest_old_pieces_first():
    old = {"▁wa": 0, "lk": 1, "ed": 2, "▁": 3, "w": 4, "a": 5, "l": 6, "k": 7, "e": 8, "d": 9}
    assert spell_with("▁walked", old) == [0, 1, 2]
    assert spell_with("▁w", old) == [3, 4]
    with pytest.raises(ValueError, match="'z'"):
        spell_with("▁z", old)


def test_new_rows_are_the_mean_of_the_old_pieces_that_spell_them(tmp_path):
    old_proto, new_proto = _tokenizer(30, tmp_path), _tokenizer(45, tmp_path)
    old_sp, new_sp = _processor(old_proto), _processor(new_proto)
    n_old, n_new, hidden = old_sp.get_piece_size(), new_sp.get_piece_size(), 8
    gen = torch.Generator().manual_seed(0)
    state = {EMBEDDING: torch.randn(n_old + 1, hidden, generator=gen),
             JOINT_OUT[0]: torch.randn(n_old + 1 + N_DURATIONS, hidden, generator=gen),
             JOINT_OUT[1]: torch.randn(n_old + 1 + N_DURATIONS, generator=gen),
             CTC_OUT[0]: torch.randn(n_old + 1, hidden, 1, generator=gen),
             CTC_OUT[1]: torch.randn(n_old + 1, generator=gen),
             "encoder.other": torch.randn(4, 4, generator=gen)}
    out = transfer_weights(state, old_proto, new_proto, N_DURATIONS)
    assert out["encoder.other"] is state["encoder.other"]
    assert out[EMBEDDING].shape == (n_new + 1, hidden)
    assert out[JOINT_OUT[0]].shape == (n_new + 1 + N_DURATIONS, hidden)
    assert out[CTC_OUT[0]].shape == (n_new + 1, hidden, 1)
    assert torch.equal(out[JOINT_OUT[1]][n_new:], state[JOINT_OUT[1]][n_old:])  # blank and durations
    assert torch.equal(out[CTC_OUT[1]][n_new], state[CTC_OUT[1]][n_old])  # blank

    mapping = piece_map(old_proto, new_proto)
    merged = [i for i, ids in enumerate(mapping) if len(ids) > 1]
    assert merged, "the larger vocabulary should have pieces the old one spells in several"
    for i in merged:
        assert new_sp.id_to_piece(i) == "".join(old_sp.id_to_piece(j) for j in mapping[i])
        expected = state[EMBEDDING][mapping[i]].mean(dim=0)
        assert torch.allclose(out[EMBEDDING][i], expected)
    shared = new_sp.id_to_piece(n_new - 1)  # a single character: in both vocabularies
    assert torch.equal(out[CTC_OUT[0]][new_sp.piece_to_id(shared)], state[CTC_OUT[0]][old_sp.piece_to_id(shared)])


def test_a_state_whose_rows_do_not_fit_the_old_tokenizer_is_refused(tmp_path):
    old_proto = _tokenizer(30, tmp_path)
    n_old = _processor(old_proto).get_piece_size()
    state = {EMBEDDING: torch.zeros(n_old + 1, 4), JOINT_OUT[0]: torch.zeros(n_old + 2, 4),
             JOINT_OUT[1]: torch.zeros(n_old + 2), CTC_OUT[0]: torch.zeros(n_old + 1, 4, 1),
             CTC_OUT[1]: torch.zeros(n_old + 1)}
    with pytest.raises(ValueError, match=r"joint\.joint_net\.1\.weight"):
        transfer_weights(state, old_proto, old_proto, N_DURATIONS)
