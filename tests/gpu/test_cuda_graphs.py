"""CUDA graph modes of label looping: each equals eager exactly; conditional nodes really run; capture reuse.

Skipped without CUDA (tests/gpu/conftest.py); scripts/gpu_check.sh runs these on a GPU machine.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest
import torch

from decoding.boosting import build_boost_table
from decoding.cuda_conditional import SWITCH, conditional_support
from decoding.cuda_graphs import LabelLoopingDecoder
from decoding.frame_looping import frame_looping_greedy
from decoding.types import Hotword
from models import ASRModel, load_model
from service.bench import synthetic_audio

GRAPH_MODES = ("no_while", "conditional")
FIXTURES = ("rnnt", "tdt", "tdt_ctc_hybrid")
SHAPES = ((1, 1), (1, 40), (3, 17), (8, 64), (16, 150))  # (rows, frames)


def _require(mode: str) -> None:
    if mode == "conditional":
        supported, why = conditional_support(torch.device("cuda"))
        if not supported:
            pytest.skip(f"conditional nodes unavailable: {why}")


@cache
def _fixture_model(path: str) -> ASRModel:
    return load_model(path, device="cuda", dtype="float32")


@pytest.fixture
def fixture_model(parity_dir, request) -> ASRModel:
    return _fixture_model(str(parity_dir / f"{request.param}.nemo"))


def _decoder(model: ASRModel, mode: str) -> LabelLoopingDecoder:
    t = model.config.transducer
    return LabelLoopingDecoder(model.decoder, model.joint, t.durations, t.max_symbols, cuda_graphs=mode)


def _inputs(model: ASRModel, seed: int, rows: int, frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random encoder output (a label/blank mix on these models) with ragged lengths, one row full, one empty."""
    generator = torch.Generator().manual_seed(seed)
    encoded = torch.randn(rows, frames, model.config.encoder.d_model, generator=generator)
    lengths = torch.randint(0, frames + 1, (rows,), generator=generator)
    lengths[0] = frames
    if rows > 2:
        lengths[-1] = 0
    return encoded.to("cuda", model.dtype), lengths.to("cuda")


@pytest.mark.parametrize("fixture_model", FIXTURES, indirect=True)
@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_graph_modes_equal_eager(fixture_model, mode):
    _require(mode)
    graphs, eager = _decoder(fixture_model, mode), _decoder(fixture_model, "off")
    for seed, (rows, frames) in enumerate(SHAPES):
        encoded, lengths = _inputs(fixture_model, seed, rows, frames)
        assert graphs(encoded, lengths) == eager(encoded, lengths), (mode, rows, frames)
    assert graphs.mode == mode and eager.mode == "eager"


@pytest.mark.parametrize("fixture_model", ["rnnt", "tdt"], indirect=True)
@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_graphs_with_hotwords_equal_eager_and_frame_looping(fixture_model, mode):
    """Batches with hotwords replay graphs of their own; plain and boosted batches interleave."""
    _require(mode)
    graphs, eager = _decoder(fixture_model, mode), _decoder(fixture_model, "off")
    t = fixture_model.config.transducer
    for seed, (rows, frames) in enumerate(SHAPES):
        encoded, lengths = _inputs(fixture_model, seed, rows, frames)
        generator = torch.Generator().manual_seed(seed)
        phrases = tuple(Hotword(tuple(torch.randint(0, fixture_model.joint.vocab_size, (n,),
                                                    generator=generator).tolist())) for n in (1, 2, 3))
        boost = build_boost_table([phrases if row % 2 == 0 else () for row in range(rows)], 6.0,
                                  torch.device("cuda"))
        got = graphs(encoded, lengths, boost)
        assert got == eager(encoded, lengths, boost), (mode, rows, frames)
        assert got == frame_looping_greedy(encoded, lengths, fixture_model.decoder, fixture_model.joint,
                                           t.durations, t.max_symbols, boost=boost), (mode, rows, frames)
        assert graphs(encoded, lengths) == eager(encoded, lengths), (mode, rows, frames)
    assert graphs.mode == mode


@pytest.mark.parametrize("fixture_model", ["tdt"], indirect=True)
def test_auto_takes_plain_graphs_unless_opted_in_to_conditional_nodes(fixture_model, monkeypatch):
    """Conditional nodes are opt-in for "auto" (BATCHASR_CONDITIONAL_NODES=1): their capture has crashed a process."""
    monkeypatch.delenv(SWITCH, raising=False)
    encoded, lengths = _inputs(fixture_model, 0, 4, 50)
    expected = _decoder(fixture_model, "off")(encoded, lengths)
    decoder = _decoder(fixture_model, "auto")
    assert decoder(encoded, lengths) == expected and decoder.mode == "no_while"
    _require("conditional")
    monkeypatch.setenv(SWITCH, "1")
    decoder = _decoder(fixture_model, "auto")
    hyps = decoder(encoded, lengths)
    assert decoder.mode == "conditional" and decoder.n_captures == 1
    assert hyps == expected
    fixture_model.__dict__.pop("_label_loopers", None)  # the cached model's, made by earlier tests without the switch
    assert fixture_model.transcribe(synthetic_audio(3, seed=0))  # the model's own default path runs too
    assert fixture_model.label_looper("auto").mode == "conditional"


@pytest.mark.parametrize("fixture_model", ["rnnt"], indirect=True)
@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_recapture_only_when_rows_or_frames_grow(fixture_model, mode):
    _require(mode)
    decoder, eager = _decoder(fixture_model, mode), _decoder(fixture_model, "off")
    steps = [  # (rows, frames, captures so far)
        (4, 50, 1),
        (2, 30, 1),  # smaller: reuse
        (4, 64, 1),  # frames round up to 64
        (8, 30, 2),  # more rows
        (8, 65, 3),  # more frames: 128
        (3, 100, 3),  # fewer rows, frames within 128
        (3, 129, 4),  # more frames: 192, rows stay at the running maximum
        (8, 192, 4),
    ]
    for seed, (rows, frames, captures) in enumerate(steps):
        encoded, lengths = _inputs(fixture_model, seed, rows, frames)
        assert decoder(encoded, lengths) == eager(encoded, lengths), (rows, frames)
        assert decoder.n_captures == captures, (rows, frames)
    assert decoder.capacity == (8, 192)


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_two_models_on_one_device_do_not_interfere(parity_dir, mode):
    _require(mode)
    models = [_fixture_model(str(parity_dir / f"{name}.nemo")) for name in ("rnnt", "tdt")]
    decoders = [_decoder(m, mode) for m in models]
    inputs = [[_inputs(m, seed, 6, 40 + 10 * seed) for seed in range(3)] for m in models]
    expected = [[_decoder(m, "off")(*x) for x in xs] for m, xs in zip(models, inputs, strict=True)]
    for round_ in range(2):  # interleave the two models' replays
        for seed in range(3):
            for which in (0, 1):
                got = decoders[which](*inputs[which][seed])
                assert got == expected[which][seed], (round_, seed, which)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_a_model_on_the_second_gpu_decodes_while_the_first_is_current(parity_dir, mode):
    """The thread's current device stays cuda:0 (the engine thread's, bench's): capture, the condition kernel's
    launch and the graph's pool must all be on the model's own device."""
    _require(mode)
    model = load_model(str(parity_dir / "tdt.nemo"), device="cuda:1", dtype="float32")
    encoded, lengths = (x.to("cuda:1") for x in _inputs(model, 2, 6, 48))
    torch.cuda.set_device(0)
    expected = _decoder(model, "off")(encoded, lengths)
    decoder = _decoder(model, mode)
    assert decoder(encoded, lengths) == expected and decoder(encoded, lengths) == expected
    assert decoder.mode == mode and torch.cuda.current_device() == 0


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_replays_leave_other_tensors_alone(parity_dir, mode):
    """Body temporaries must not live in memory the allocator hands to others (PyTorch #114320)."""
    _require(mode)
    model = _fixture_model(str(parity_dir / "tdt.nemo"))
    decoder = _decoder(model, mode)
    encoded, lengths = _inputs(model, 1, 16, 120)
    first = decoder(encoded, lengths)
    torch.cuda.synchronize()
    others = [torch.randn(n, device="cuda") for n in (16 * 128, 16 * 133, 16 * 640, 2**16, 2**20)]
    saved = [o.clone() for o in others]
    for _ in range(3):
        assert decoder(encoded, lengths) == first
    torch.cuda.synchronize()
    assert all(torch.equal(o, s) for o, s in zip(others, saved, strict=True))


@pytest.mark.parametrize("fixture_model", ["tdt", "rnnt"], indirect=True)
def test_label_looping_equals_frame_looping_on_cuda(fixture_model):
    t = fixture_model.config.transducer
    for seed, (rows, frames) in enumerate(SHAPES):
        encoded, lengths = _inputs(fixture_model, seed, rows, frames)
        reference = frame_looping_greedy(encoded, lengths, fixture_model.decoder, fixture_model.joint,
                                         t.durations, t.max_symbols)
        assert _decoder(fixture_model, "auto")(encoded, lengths) == reference, (rows, frames)


@cache
def _full_size_tdt() -> ASRModel:
    from models.architectures import build_random_model

    # no blank bias: random weights then emit about one token per 2 to 3 frames, a mix of blanks and labels
    return build_random_model("parakeet-tdt-0.6b-v2", device="cuda", dtype="bfloat16")


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_full_size_tdt_in_bf16(mode):
    _require(mode)
    model = _full_size_tdt()
    graphs, eager = _decoder(model, mode), _decoder(model, "off")
    for seed, (rows, frames) in enumerate(((1, 90), (32, 200), (128, 120))):
        encoded, lengths = _inputs(model, seed, rows, frames)
        got = graphs(encoded, lengths)
        assert got == eager(encoded, lengths), (rows, frames)
        assert sum(len(h.tokens) for h in got) > 0


def test_the_engine_warm_up_captures_for_the_largest_batch_it_can_be_given(parity_dir):
    """After warm-up a batch of the widest or longest shape the batcher can form decodes without a recapture."""
    from service.bench import synthetic_speech
    from tests.gpu.warm_engine import warm_engine

    model = load_model(parity_dir / "tdt.nemo", device="cuda", dtype="float32")
    rows, segment_s = 24, 12.0
    with warm_engine(model, rows, segment_s) as engine:
        looper = model.label_looper()
        captures = looper.n_captures
        assert looper.capacity[0] >= rows and looper.capacity[1] * model.config.frame_s >= segment_s
        wave = synthetic_speech(segment_s, np.random.default_rng(3))
        engine.run([wave] * rows)
        assert looper.n_captures == captures
        boosted = [(Hotword((5, 6)),), *[()] * (rows - 1)]  # the boosting graphs were captured too
        engine._compute(lambda: model.featurize([wave] * rows), [len(wave)] * rows, boosted)
        assert looper.n_captures == captures


def test_a_capture_that_fails_leaves_the_thread_on_its_own_stream_for_the_next():
    """A capture whose end raises (here: a host read inside it) must not leave the thread capturing's stream, nor
    its allocations routed to the failed graph's pool: the fallback after it (another mode) runs on the thread."""
    from decoding.cuda_graphs import capture_graph

    x = torch.ones(4, device="cuda")
    before = torch.cuda.current_stream()
    with pytest.raises(RuntimeError):
        capture_graph(lambda: (x * 2).sum().item(), torch.cuda.Stream())
    assert torch.cuda.current_stream() == before
    y = x + 1  # allocated from the general pool again, and freed to it
    graph = capture_graph(lambda: x.mul_(3), torch.cuda.Stream())
    graph.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [3.0] * 4 and y.tolist() == [2.0] * 4
