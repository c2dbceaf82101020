"""Label looping must equal frame looping (the reference) token for token, frame for frame, duration for duration."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decoding.frame_looping import frame_looping_greedy
from decoding.label_looping import LoopPasses, label_looping_greedy
from decoding.types import Hypothesis
from models import ASRModel, load_model
from models.config import TransducerConfig
from models.heads import Joint, PredictionNetwork

DURATION_SETS = ((0, 1, 2, 3, 4), (0, 2, 5), (1, 3), (0, 1), (0, 7))
ENCODER_DIM = 6



@dataclass
class Tiny:
    prediction: PredictionNetwork
    joint: Joint
    durations: tuple[int, ...]
    max_symbols: int


def tiny_transducer(seed: int, vocab: int = 6, durations: tuple[int, ...] = (), max_symbols: int = 3,
                    blank_bias: float = 0.0, pred_layers: int = 1) -> Tiny:
    cfg = TransducerConfig(vocab_size=vocab, pred_hidden=8, pred_layers=pred_layers, joint_hidden=10,
                           durations=durations, max_symbols=max_symbols)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        prediction, joint = PredictionNetwork(cfg).eval(), Joint(cfg, ENCODER_DIM).eval()
    with torch.no_grad():
        joint.joint_net[-1].bias[vocab] += blank_bias
    return Tiny(prediction, joint, durations, max_symbols)


def random_batch(seed: int, lengths: list[int], n_frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    encoded = torch.randn(len(lengths), n_frames, ENCODER_DIM, generator=generator)
    return encoded, torch.tensor(lengths, dtype=torch.long)


def both(model: Tiny, encoded: torch.Tensor, lengths: torch.Tensor) -> tuple[list[Hypothesis], list[Hypothesis]]:
    args = (encoded, lengths, model.prediction, model.joint, model.durations, model.max_symbols)
    return frame_looping_greedy(*args), label_looping_greedy(*args)


class CountingPrediction:
    """The prediction network, counting ``step`` calls."""

    def __init__(self, inner: PredictionNetwork):
        self.inner, self.blank_id, self.calls = inner, inner.blank_id, 0

    def initial_state(self, *args):
        return self.inner.initial_state(*args)

    def step(self, labels, state):
        self.calls += 1
        return self.inner.step(labels, state)

    def select_state(self, *args):
        return self.inner.select_state(*args)


@st.composite
def decoding_cases(draw):
    n_frames = draw(st.integers(0, 12))
    lengths = draw(st.lists(st.integers(0, n_frames), min_size=1, max_size=8))
    tdt = draw(st.booleans())
    return {
        "seed": draw(st.integers(0, 2**16)),
        "vocab": draw(st.integers(2, 9)),
        "durations": draw(st.sampled_from(DURATION_SETS)) if tdt else (),
        "max_symbols": draw(st.integers(1, 4)),
        "blank_bias": draw(st.floats(-6.0, 6.0)),
        "pred_layers": draw(st.integers(1, 2)),
        "lengths": lengths,
        "n_frames": n_frames,
    }


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(decoding_cases())
def test_label_looping_equals_frame_looping(case):
    model = tiny_transducer(case["seed"], case["vocab"], case["durations"], case["max_symbols"],
                            case["blank_bias"], case["pred_layers"])
    encoded, lengths = random_batch(case["seed"], case["lengths"], case["n_frames"])
    reference, got = both(model, encoded, lengths)
    assert got == reference


def decode_counting_passes(model: Tiny, encoded: torch.Tensor, lengths: torch.Tensor) -> tuple[list[Hypothesis],
                                                                                              LoopPasses]:
    passes = LoopPasses()
    hyps = label_looping_greedy(encoded, lengths, model.prediction, model.joint, model.durations, model.max_symbols,
                                passes=passes)
    return hyps, passes


@settings(max_examples=60, deadline=None)
@given(decoding_cases())
def test_prediction_network_and_outer_loop_run_once_per_label_of_the_longest_hypothesis(case):
    model = tiny_transducer(case["seed"], case["vocab"], case["durations"], case["max_symbols"],
                            case["blank_bias"])
    encoded, lengths = random_batch(case["seed"], case["lengths"], case["n_frames"])
    counting = CountingPrediction(model.prediction)
    hyps, passes = decode_counting_passes(Tiny(counting, model.joint, model.durations, model.max_symbols),
                                          encoded, lengths)
    longest = max(len(h.tokens) for h in hyps)
    assert counting.calls == longest + 1  # +1: the start symbol
    assert passes.outer == longest


@pytest.mark.parametrize(("durations", "blank_step"), [((), 1), ((0, 2), 2)])
def test_the_inner_loop_runs_once_per_blank_step_of_the_slowest_row(durations, blank_step):
    # all blank: one search crosses every row; the first joint makes the first step, the inner loop the rest
    model = tiny_transducer(13, durations=durations, blank_bias=50.0)
    if durations:
        with torch.no_grad():
            model.joint.joint_net[-1].bias[model.joint.vocab_size + 2] += 50.0  # every blank jumps 2 frames
    encoded, lengths = random_batch(13, [3, 11, 0, 6], 11)
    hyps, passes = decode_counting_passes(model, encoded, lengths)
    assert all(h.tokens == [] for h in hyps)
    assert passes == LoopPasses(outer=0, inner=-(-11 // blank_step) - 1)


@pytest.mark.parametrize("durations", [(), (0, 1, 2)])
@pytest.mark.parametrize("max_symbols", [1, 2, 5])
def test_max_symbols_saturates_every_frame(durations, max_symbols):
    # a huge negative blank bias: every frame emits labels until max_symbols forces time on
    model = tiny_transducer(3, durations=durations, max_symbols=max_symbols, blank_bias=-50.0)
    with torch.no_grad():
        if durations:  # duration 0 for every label, so labels stay on their frame
            model.joint.joint_net[-1].bias[model.joint.vocab_size + 1] += 50.0
    encoded, lengths = random_batch(3, [5, 1, 0, 3], 5)
    reference, got = both(model, encoded, lengths)
    assert got == reference
    for hyp, length in zip(got, lengths.tolist(), strict=True):
        assert hyp.frames == [t for t in range(length) for _ in range(max_symbols)]


def test_tdt_labels_jumping_past_the_end_are_kept():
    model = tiny_transducer(5, durations=(0, 7), max_symbols=3, blank_bias=-50.0)
    with torch.no_grad():
        model.joint.joint_net[-1].bias[model.joint.vocab_size + 2] += 50.0  # every symbol jumps 7 frames
    encoded, lengths = random_batch(5, [1, 4, 9, 0], 9)
    reference, got = both(model, encoded, lengths)
    assert got == reference
    assert [h.frames for h in got] == [[0], [0], [0, 7], []]
    for hyp, length in zip(got[:3], [1, 4, 9], strict=True):
        assert hyp.frames[-1] + hyp.durations[-1] > length  # the last label's duration ends past the input


@pytest.mark.parametrize("durations", [(), (0, 1, 2, 3, 4)])
def test_zero_length_and_one_frame_inputs(durations):
    model = tiny_transducer(7, durations=durations, blank_bias=-1.0)
    for lengths, n_frames in (([0], 0), ([0, 0, 0], 0), ([0, 0], 4), ([1], 1), ([1, 0, 1], 1), ([1, 3, 0], 3)):
        encoded, lengths_t = random_batch(7, lengths, n_frames)
        reference, got = both(model, encoded, lengths_t)
        assert got == reference, (lengths, n_frames)
        assert all(h.tokens == [] for h, n in zip(got, lengths, strict=True) if n == 0)


def test_batch_invariance():
    model = tiny_transducer(11, durations=(0, 1, 2), blank_bias=0.5)
    encoded, lengths = random_batch(11, [9, 4, 7, 1, 0, 9], 9)
    together = label_looping_greedy(encoded, lengths, model.prediction, model.joint, model.durations, 3)
    for row in range(len(lengths)):
        trimmed = encoded[row : row + 1, : int(lengths[row])]
        alone = label_looping_greedy(trimmed, lengths[row : row + 1], model.prediction, model.joint,
                                     model.durations, 3)
        assert alone == together[row : row + 1]


# --- the NeMo parity fixtures ---------------------------------------------------------------------------------

@cache
def _fixture_model(path: str) -> ASRModel:
    return load_model(path, device="cpu", dtype="float32")


@pytest.mark.parametrize("name", ["rnnt", "tdt", "tdt_ctc_hybrid"])
def test_label_looping_equals_frame_looping_and_nemo_on_fixtures(parity_dir, parity_reference, parity_audio,
                                                                 name):
    from models.audio_io import read_audio

    entry = parity_reference["models"][name]
    model = _fixture_model(str(parity_dir / entry["file"]))
    transducer = model.config.transducer
    waveforms = [read_audio(path, model.sample_rate) for path in parity_audio]
    batch_sizes = (3, 10) if name == "rnnt" else (1, 3, 4, 10)  # rnnt saturates max_symbols: slow on CPU
    for batch_size in batch_sizes:
        for start in range(0, len(waveforms), batch_size):
            batch = model.encode(waveforms[start : start + batch_size])
            args = (batch.encoded, batch.lengths, model.decoder, model.joint, transducer.durations,
                    transducer.max_symbols)
            got = label_looping_greedy(*args)
            assert got == frame_looping_greedy(*args), (name, batch_size, start)
            for hyp, expected in zip(got, entry["main_bs4"][start : start + batch_size], strict=True):
                assert (hyp.tokens, hyp.frames) == (expected["tokens"], expected["frames"])


def test_cpu_prediction_step_agrees_with_the_lstm_module():
    """On CPU the step runs torch's LSTM cell layer by layer instead of nn.LSTM (oneDNN); the two must agree."""
    torch.manual_seed(0)
    net = PredictionNetwork(TransducerConfig(vocab_size=30, pred_hidden=24, pred_layers=2)).eval()
    state = net.initial_state(3, torch.device("cpu"), torch.float32)
    lstm_state = (state.h, state.c)
    with torch.inference_mode():
        for labels in ([30, 30, 30], [4, 0, 29], [7, 7, 30]):  # blank (the start) first
            labels = torch.tensor(labels)
            out, state = net.step(labels, state)
            expected, lstm_state = net.prediction.dec_rnn.lstm(net.prediction.embed(labels).unsqueeze(0), lstm_state)
            torch.testing.assert_close(out, expected.squeeze(0), rtol=0, atol=1e-6)
            torch.testing.assert_close(state.h, lstm_state[0], rtol=0, atol=1e-6)
            torch.testing.assert_close(state.c, lstm_state[1], rtol=0, atol=1e-6)
