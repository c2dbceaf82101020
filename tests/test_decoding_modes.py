"""Graph-mode selection and the label-looping decoder object, as far as a machine without CUDA can check them."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from decoding.cuda_conditional import conditional_support
from decoding.cuda_graphs import CUDA_GRAPH_OPTIONS, LabelLoopingDecoder, choose_mode
from decoding.frame_looping import frame_looping_greedy
from models import load_model

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
