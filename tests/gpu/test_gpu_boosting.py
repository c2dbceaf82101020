"""Hotwords on a GPU: a boosted batch runs eagerly on the graph decoder's buffers and equals frame looping; the
graphs that run next, unboosted, are unharmed; boosted CTC gives what it gives on the CPU. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from decoding.boosting import build_boost_table
from decoding.ctc import ctc_greedy
from decoding.cuda_graphs import LabelLoopingDecoder
from decoding.frame_looping import frame_looping_greedy
from decoding.types import Hotword
from models import load_model


def _hotwords(rows: list[tuple[tuple[int, ...], ...]]) -> list[tuple[Hotword, ...]]:
    """Each row's phrases as hotwords, the first of a row with its own bonus."""
    return [tuple(Hotword(tokens, 4.0 if i == 0 else None) for i, tokens in enumerate(row)) for row in rows]


@pytest.mark.parametrize("name", ["rnnt", "tdt"])
def test_a_boosted_batch_between_graph_runs(parity_dir, name):
    model = load_model(parity_dir / f"{name}.nemo", device="cuda", dtype="float32")
    t = model.config.transducer
    generator = torch.Generator().manual_seed(0)
    encoded = torch.randn(6, 80, model.config.encoder.d_model, generator=generator).cuda()
    lengths = torch.tensor([80, 33, 0, 80, 5, 61], device="cuda")
    phrases = [((1, 2), (3,)), (), ((4, 5, 6),), (), ((1, 2),), ((7,),)]
    boost = build_boost_table(_hotwords(phrases), 2.0, encoded.device)
    decoder = LabelLoopingDecoder(model.decoder, model.joint, t.durations, t.max_symbols, cuda_graphs="auto")
    plain = decoder(encoded, lengths)  # captures
    boosted = decoder(encoded, lengths, boost)
    with torch.inference_mode():
        assert boosted == frame_looping_greedy(encoded, lengths, model.decoder, model.joint, t.durations,
                                               t.max_symbols, boost)
    assert decoder(encoded, lengths) == plain  # the graphs again, as before
    assert decoder.n_captures == 1


def test_boosted_ctc_on_the_gpu_equals_the_cpu():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 120, 9, generator=generator) * 2
    logits[..., 8] += 1.0  # mostly blank, as speech is
    log_probs, lengths = logits.log_softmax(-1), torch.tensor([120, 0, 64, 1, 97])
    phrases = _hotwords([((1, 2, 3),), (), ((4,), (5, 6)), ((1, 2),), ()])
    on_cpu = ctc_greedy(log_probs, lengths, 8, build_boost_table(phrases, 2.0, torch.device("cpu")))
    cuda = torch.device("cuda")
    assert ctc_greedy(log_probs.to(cuda), lengths.to(cuda), 8, build_boost_table(phrases, 2.0, cuda)) == on_cpu
    assert on_cpu != ctc_greedy(log_probs, lengths, 8)  # the bonus changed something
