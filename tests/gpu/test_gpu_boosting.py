"""Hotwords on a GPU: a boosted batch runs in graphs of its own on the graph decoder's buffers and equals frame
looping; the graphs that run next, unboosted, are unharmed and not captured again; boosted CTC gives what it gives
on the CPU. Skipped without CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decoding.boosting import build_boost_table
from decoding.ctc import ctc_greedy
from decoding.ctc_boost import CtcBoostLoop
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
    assert decoder.n_captures == 2  # one set of graphs for each setting
    assert decoder(encoded, lengths) == plain  # the unboosted graphs again, as before
    assert decoder.n_captures == 2


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
    # the model's loop: its CUDA graph, kept for smaller batches, captured again for a larger one
    loop = CtcBoostLoop(8, "auto")
    for rows in (slice(0, 5), slice(2, 4), slice(0, 5)):
        boost = build_boost_table(phrases[rows], 2.0, cuda)
        got = ctc_greedy(log_probs[rows].to(cuda, torch.bfloat16), lengths[rows].to(cuda), 8, boost, loop)
        assert got == ctc_greedy(log_probs[rows].to(torch.bfloat16), lengths[rows], 8,
                                 build_boost_table(phrases[rows], 2.0, torch.device("cpu")))
    assert loop.n_captures == 1
    longer = torch.cat([log_probs, log_probs], dim=1).to(cuda)
    ctc_greedy(longer, lengths.to(cuda) * 2, 8, build_boost_table(phrases, 2.0, cuda), loop)
    assert loop.n_captures == 2
    # what bench reports for boosted CTC: the plain graph it replays, not "eager"
    assert (loop.mode(cuda), CtcBoostLoop(8, "off").mode(cuda), loop.mode(torch.device("cpu"))) == \
        ("no_while", "eager", "eager")


def test_the_engine_warm_up_sizes_the_ctc_hotword_loop_for_its_widest_batch(parity_dir):
    """A CTC model's hotword frame loop keeps its own buffers: warm-up sizes them, so a full batch of requests
    that all boost hotwords replays the graph it captured rather than capturing another."""
    from service.bench import synthetic_speech
    from tests.gpu.warm_engine import warm_engine

    model = load_model(parity_dir / "ctc.nemo", device="cuda", dtype="float32")
    rows, segment_s = 24, 12.0
    with warm_engine(model, rows, segment_s) as engine:
        loop = model.ctc_boost_loop()
        captures = loop.n_captures
        wave = synthetic_speech(segment_s, np.random.default_rng(3))
        engine._compute(lambda: model.featurize([wave] * rows), [len(wave)] * rows, [(Hotword((5, 6)),)] * rows)
        assert loop.n_captures == captures >= 1
