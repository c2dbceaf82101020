"""Token scores on a GPU (decoding.scores after the CUDA-graph search): each is the search's own log-probability,
and the same whichever graph mode found the tokens. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from models import load_model
from models.audio_io import read_audio
from tests.scores import assert_scores_are_the_searchs


@pytest.mark.parametrize("name", ["rnnt", "tdt", "tdt_ctc_hybrid"])
def test_scores_are_the_searchs_in_every_graph_mode(parity_dir, parity_audio, name):
    model = load_model(parity_dir / f"{name}.nemo", device="cuda", dtype="float32")
    batch = model.encode([read_audio(path, model.sample_rate) for path in parity_audio])
    eager = model.decode(batch, cuda_graphs="off")
    with torch.inference_mode():
        assert_scores_are_the_searchs(batch.encoded, eager, [h.logprobs for h in eager], model.decoder, model.joint,
                                      atol=1e-4)
    for mode in ("no_while", "auto"):
        assert model.decode(batch, cuda_graphs=mode) == eager, mode


def test_bf16_scores_stay_near_float32s(parity_audio):
    waves = [read_audio(path, 16000) for path in parity_audio]
    exact = load_model(device="cuda", dtype="float32").transcribe(waves)
    fast = load_model(device="cuda", dtype="bfloat16").transcribe(waves)
    for a, b in zip(exact, fast, strict=True):
        if a.tokens == b.tokens:  # bf16 may read a word otherwise; where it reads the same, it is as sure
            assert b.token_logprobs == pytest.approx(a.token_logprobs, abs=0.05)
        assert all(x <= 0 for x in b.token_logprobs)
