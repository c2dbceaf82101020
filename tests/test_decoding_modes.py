"""Graph-mode selection and the label-looping decoder object, as far as a machine without CUDA can check them."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from decoding import cuda_graphs
from decoding.boosting import build_boost_table
from decoding.cuda_conditional import conditional_support
from decoding.cuda_graphs import CUDA_GRAPH_OPTIONS, LabelLoopingDecoder, ModeChoice, choose_mode
from decoding.frame_looping import frame_looping_greedy
from decoding.types import Hotword
from models import load_model
from tests.test_cuda_conditional import Replayer
from tests.test_label_looping import random_batch, tiny_transducer

CPU = torch.device("cpu")



def test_decoding_imports_without_cuda_python():
    """cuda-python is optional (the GPU image has it, a CPU install need not): block it, then import."""
    code = textwrap.dedent("""
        import sys
        class NoCudaPython:
            def find_spec(self, name, path=None, target=None):
                if name == "cuda" or name.startswith("cuda."):
                    raise ImportError(f"{name} blocked")
        sys.meta_path.insert(0, NoCudaPython())
        import decoding.cuda_graphs, decoding.label_looping, models
        from decoding.cuda_conditional import _bindings
        try:
            _bindings()
        except ImportError:
            sys.exit(0)
        sys.exit(1)
    """)
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without CUDA")
def test_conditional_support_says_why_not():
    supported, reason = conditional_support()
    assert not supported and "CUDA is not available" in reason


def test_auto_and_off_run_eager_on_cpu():
    assert choose_mode("auto", CPU).mode == "eager"
    assert "cpu" in choose_mode("auto", CPU).reason
    assert choose_mode("off", CPU).mode == "eager"


@pytest.mark.parametrize("forced", ["conditional", "no_while"])
def test_forced_graph_modes_refuse_a_cpu(forced):
    with pytest.raises(ValueError, match="needs a CUDA device"):
        choose_mode(forced, CPU)


def test_unknown_option_is_refused():
    with pytest.raises(ValueError, match="unknown cuda_graphs"):
        choose_mode("always", CPU)
    with pytest.raises(ValueError, match="unknown cuda_graphs"):
        LabelLoopingDecoder(None, None, cuda_graphs="always")  # type: ignore[arg-type]
    assert CUDA_GRAPH_OPTIONS == ("auto", "conditional", "no_while", "off")


@pytest.fixture(scope="module")
def tdt_model(parity_dir):
    return load_model(parity_dir / "tdt.nemo", device="cpu", dtype="float32")


def test_decoder_object_equals_frame_looping_across_calls(tdt_model, caplog):
    rng = np.random.default_rng(0)
    decoder = LabelLoopingDecoder(tdt_model.decoder, tdt_model.joint, tdt_model.config.transducer.durations,
                                  tdt_model.config.transducer.max_symbols)
    with caplog.at_level(logging.INFO, logger="decoding.cuda_graphs"):
        for n in (3, 1, 5):  # batches of different sizes through one decoder
            waves = [rng.standard_normal(int(rng.integers(4000, 30000))).astype(np.float32) * 0.1
                     for _ in range(n)]
            batch = tdt_model.encode(waves)
            reference = frame_looping_greedy(batch.encoded, batch.lengths, tdt_model.decoder, tdt_model.joint,
                                             tdt_model.config.transducer.durations,
                                             tdt_model.config.transducer.max_symbols)
            assert decoder(batch.encoded, batch.lengths) == reference
    assert decoder.mode == "eager" and decoder.n_captures == 0
    assert [r.message for r in caplog.records].count(
        "label looping on cpu: eager mode (CUDA graphs need a CUDA device, this is cpu)") == 1


def test_asr_model_algorithms_agree(tdt_model, parity_audio):
    audio = parity_audio[:5]
    label = tdt_model.transcribe(audio, batch_size=4)
    frame = tdt_model.transcribe(audio, batch_size=4, decoder_algorithm="frame_looping")
    off = tdt_model.transcribe(audio, batch_size=4, cuda_graphs="off")
    assert [t.tokens for t in label] == [t.tokens for t in frame] == [t.tokens for t in off]
    assert [t.token_frames for t in label] == [t.token_frames for t in frame]
    assert tdt_model.label_looper("auto").mode == "eager"


def test_asr_model_refuses_unknown_options(tdt_model, parity_audio):
    with pytest.raises(ValueError, match="decoder_algorithm"):
        tdt_model.transcribe(parity_audio[:1], decoder_algorithm="beam")
    with pytest.raises(ValueError, match="cuda_graphs"):
        tdt_model.transcribe(parity_audio[:1], cuda_graphs="sometimes")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        tdt_model.transcribe(parity_audio[:1], cuda_graphs="conditional")


def _cpu_warm_up(looper, state, streams):
    """The warm-up's effect on the state (every stage run on one-frame rows), without CUDA streams."""
    state.lengths.fill_(1)
    for stage in (looper.start, looper.first_joint, looper.inner_joint, looper.close_search, looper.emit):
        stage(state)
    state.lengths.zero_()


def test_batches_with_hotwords_get_graphs_of_their_own(monkeypatch):
    """The decoder's bookkeeping in no_while mode, with replays standing in for graphs: plain and boosted batches
    each equal frame looping; the boosted graphs are captured with the first batch that boosts, and again only
    when a table outgrows the state's (or the rows outgrow it, which drops both sets)."""
    monkeypatch.setattr(cuda_graphs, "choose_mode", lambda requested, device: ModeChoice("no_while", "test"))
    monkeypatch.setattr(cuda_graphs, "capture_graph", lambda fn, stream: Replayer(fn))
    monkeypatch.setattr(cuda_graphs, "_warm_up", _cpu_warm_up)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: None)
    model = tiny_transducer(0, vocab=12, durations=(0, 1, 2, 3, 4), max_symbols=3)
    decoder = LabelLoopingDecoder(model.prediction, model.joint, model.durations, model.max_symbols)
    generator = torch.Generator().manual_seed(5)
    many = tuple(Hotword((a, b, c)) for a in range(12) for b in range(3) for c in range(2))  # > 64 nodes

    def batch(rows: int, hotwords: tuple | None) -> tuple[int, int]:
        encoded, lengths = random_batch(int(torch.randint(0, 1000, (1,), generator=generator)),
                                        [30] * (rows - 1) + [11], 30)
        boost = None if hotwords is None else build_boost_table(
            [hotwords if r % 2 else () for r in range(rows)], 4.0, CPU)
        expected = frame_looping_greedy(encoded, lengths, model.prediction, model.joint, model.durations,
                                        model.max_symbols, boost=boost)
        assert decoder(encoded, lengths, boost) == expected
        return decoder.n_captures, decoder._state.boost.shape[0] if decoder._state.boost is not None else 0

    small = (Hotword((3, 4)), Hotword((5,), 2.0))
    assert batch(4, None) == (1, 0)  # plain graphs
    assert batch(4, small) == (2, 64)  # boosted graphs, the table at its least capacity
    assert batch(3, None) == (2, 64)
    assert batch(4, small[:1]) == (2, 64)  # a smaller table fits
    assert batch(4, many) == (3, 128)  # outgrown: recaptured at the next power of two
    assert batch(2, small) == (3, 128)
    assert batch(6, small) == (4, 64)  # more rows: new buffers (and table); each set again when it is needed
    assert batch(6, None) == (5, 64)
    assert decoder.mode == "no_while"


@pytest.mark.parametrize(("requested", "chosen"), [("auto", "conditional"), ("auto", "no_while"),
                                                   ("no_while", "no_while"), ("conditional", "conditional")])
def test_a_capture_that_fails_falls_back_under_auto_and_raises_when_forced(monkeypatch, caplog, requested, chosen):
    """An op this torch (or cuDNN) cannot capture: "auto" falls back a mode at a time, down to eager, with a
    warning that says why, and decodes as frame looping does (a failed plain-graph capture used to fail the
    engine's warm-up); a forced mode raises."""

    def no_capture(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graphs, "choose_mode", lambda requested, device: ModeChoice(chosen, "test"))
    monkeypatch.setattr(cuda_graphs, "capture_graph", no_capture)
    monkeypatch.setattr(cuda_graphs, "_FullGraph", no_capture)
    monkeypatch.setattr(cuda_graphs, "_warm_up", _cpu_warm_up)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    model = tiny_transducer(1, vocab=12, durations=(0, 1, 2, 3), max_symbols=3)
    decoder = LabelLoopingDecoder(model.prediction, model.joint, model.durations, model.max_symbols, requested)
    encoded, lengths = random_batch(7, [20, 9, 14], 20)
    expected = frame_looping_greedy(encoded, lengths, model.prediction, model.joint, model.durations,
                                    model.max_symbols)
    if requested != "auto":
        with pytest.raises(RuntimeError, match="stream is capturing"):
            decoder(encoded, lengths)
        return
    with caplog.at_level(logging.WARNING, logger="decoding.cuda_graphs"):
        assert decoder(encoded, lengths) == expected
        assert decoder(encoded, lengths) == expected  # and again, eagerly, without trying to capture again
    assert decoder.mode == "eager" and decoder.n_captures == 0
    falls = [r.getMessage() for r in caplog.records if "falls back" in r.getMessage()]
    assert falls[-1].startswith("plain CUDA graph capture failed (RuntimeError: operation not permitted")
    assert len(falls) == (2 if chosen == "conditional" else 1)
