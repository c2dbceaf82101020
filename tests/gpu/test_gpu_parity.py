"""float32 on CUDA reproduces NeMo's own greedy output on the parity fixtures, token for token and frame for frame,
with TF32 switched on around it (as a program that wants it elsewhere would): the model turns it off for itself."""

from __future__ import annotations

import pytest
import torch

from models import load_model
from tests.parity import assert_matches_nemo, nemo_cases


@pytest.mark.parametrize("batch_size", (1, 4))
def test_float32_on_cuda_matches_nemo(parity_dir, parity_reference, parity_audio, batch_size):
    switches = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = [s.allow_tf32 for s in switches]
    try:
        for s in switches:
            s.allow_tf32 = True
        for name, decoder, key in nemo_cases(parity_reference):
            model = load_model(parity_dir / parity_reference["models"][name]["file"], device="cuda", dtype="float32")
            transcripts = model.transcribe(parity_audio, batch_size=batch_size, decoder=decoder)
            for audio, got, expected in zip(parity_audio, transcripts, parity_reference["models"][name][key],
                                            strict=True):
                record = {"text": got.text, "tokens": got.tokens, "token_frames": got.token_frames}
                assert_matches_nemo(record, expected, f"{name}/{decoder} bs={batch_size} {audio}")
        assert [s.allow_tf32 for s in switches] == [True, True]
    finally:
        for s, value in zip(switches, saved, strict=True):
            s.allow_tf32 = value
