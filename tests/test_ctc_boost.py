"""decoding.ctc_boost: CTC's boosted frame loop on kept buffers, replayed 16 frames at a time on a GPU. Here the
graph is a stand-in that runs what it would have captured: the replay loop, the buffers' growth and reuse, and
the results against the eager loop and against walking the trees (tests/gpu runs the real graph)."""

from __future__ import annotations

import pytest
import torch

from decoding import boosting
from decoding.boosting import build_boost_table
from decoding.ctc import ctc_greedy
from decoding.ctc_boost import FRAME_QUANTUM, FRAMES_PER_REPLAY, CtcBoostLoop
from decoding.types import Hotword
from tests.test_cuda_conditional import Replayer

CPU = torch.device("cpu")
BLANK = 8
PHRASES = [(Hotword((1, 2, 3)),), (), (Hotword((4,)), Hotword((5, 6), 4.0)), (Hotword((1, 2)),), ()]


@pytest.fixture
def graph_loop(monkeypatch) -> CtcBoostLoop:
    """A loop that takes its graph path on this CPU, each graph a stand-in replaying its steps."""
    monkeypatch.setattr(CtcBoostLoop, "_graphs_on", lambda self, device: True)
    monkeypatch.setattr(CtcBoostLoop, "_capture", lambda self, state: Replayer(self._steps(state)))
    return CtcBoostLoop(BLANK)


def _batch(seed: int, rows: int, frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, frames, BLANK + 1, generator=generator) * 2
    logits[..., BLANK] += 1.0  # mostly blank, as speech is
    lengths = torch.randint(0, frames + 1, (rows,), generator=generator)
    lengths[0] = frames
    return logits.log_softmax(-1), lengths


def test_the_graph_path_equals_eager_and_captures_only_when_a_batch_outgrows_it(graph_loop, monkeypatch):
    # (rows, frames, phrases): first, smaller in every way, longer, more rows, more nodes
    batches = [(5, 40, PHRASES), (2, 17, PHRASES[2:4]), (5, 70, PHRASES), (9, 30, PHRASES + PHRASES[:4]),
               (3, 25, [tuple(Hotword((a, b)) for a in range(8) for b in range(3)), (), PHRASES[0]])]
    captures = []
    for seed, (rows, frames, phrases) in enumerate(batches):
        log_probs, lengths = _batch(seed, rows, frames)
        boost = build_boost_table(phrases, 2.0, CPU)
        got = ctc_greedy(log_probs, lengths, BLANK, boost, graph_loop)
        assert got == ctc_greedy(log_probs, lengths, BLANK, boost, CtcBoostLoop(BLANK, "off"))
        with monkeypatch.context() as walk:  # a table too large to spread: the trees are walked
            walk.setattr(boosting, "SPREAD_MAX_ENTRIES", 0)
            assert got == ctc_greedy(log_probs, lengths, BLANK, boost)
        captures.append(graph_loop.n_captures)
        rows_held, frames_held, nodes_held, _ = graph_loop._state.shape
        assert frames_held % FRAME_QUANTUM == 0 and frames_held % FRAMES_PER_REPLAY == 0
        boosted = sum(1 for row_phrases in phrases if row_phrases)  # only those rows go through the loop
        assert rows_held >= boosted and frames_held >= frames and nodes_held >= boost.shape[0]
    assert captures == [1, 1, 2, 3, 4]


def test_frames_past_a_row_and_rows_past_the_batch_take_blank(graph_loop):
    log_probs, _ = _batch(0, 3, 20)
    lengths = torch.tensor([20, 0, 5])
    boost = build_boost_table([PHRASES[0], PHRASES[0], PHRASES[2]], 2.0, CPU)
    hyps = ctc_greedy(log_probs, lengths, BLANK, boost, graph_loop)
    assert hyps[1].tokens == [] and all(f < 5 for f in hyps[2].frames)
    labels = graph_loop._state.labels[:, :20]
    assert (labels[1] == BLANK).all() and (labels[2, 5:] == BLANK).all() and (labels[0] != BLANK).any()
    ctc_greedy(log_probs[2:], lengths[:1], BLANK, build_boost_table([PHRASES[2]], 2.0, CPU), graph_loop)
    assert (graph_loop._state.labels[1:, :20] == BLANK).all()  # the rows the last batch did not fill
    no_frames = torch.ones(1, 0, dtype=torch.bool)
    assert graph_loop(log_probs[:1, :0], no_frames, boost.roots[:1], boost.spread(BLANK + 1)).shape == (1, 0)


def test_cuda_graphs_off_runs_eagerly_and_a_bad_setting_is_refused():
    log_probs, lengths = _batch(1, 2, 10)
    boost = build_boost_table(PHRASES[:2], 2.0, CPU)
    loop = CtcBoostLoop(BLANK, "off")
    ctc_greedy(log_probs, lengths, BLANK, boost, loop)
    assert loop.n_captures == 0 and loop._state is None
    assert loop.mode(CPU) == CtcBoostLoop(BLANK, "auto").mode(CPU) == "eager"  # as bench reports it
    with pytest.raises(ValueError, match="unknown cuda_graphs"):
        ctc_greedy(log_probs, lengths, BLANK, boost, CtcBoostLoop(BLANK, "sometimes"))
