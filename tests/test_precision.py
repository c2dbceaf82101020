"""bf16 / fp16 weights run end to end on CPU; features stay float32."""

from __future__ import annotations

import difflib

import pytest
import torch

from models import load_model


def _token_agreement(a: list[int], b: list[int]) -> tuple[int, int]:
    matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    return sum(block.size for block in matcher.get_matching_blocks()), max(len(a), len(b))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_end_to_end(parity_dir, parity_reference, parity_audio, dtype):
    same = total = 0
    for entry in parity_reference["models"].values():
        model = load_model(parity_dir / entry["file"], device="cpu", dtype=dtype)
        assert model.dtype == getattr(torch, dtype)
        assert model.preprocessor.featurizer.fb.dtype == torch.float32  # features stay float32
        reference = load_model(parity_dir / entry["file"], device="cpu", dtype="float32")
        for got, ref in zip(model.transcribe(parity_audio), reference.transcribe(parity_audio), strict=True):
            assert all(0 <= f < 1000 for f in got.token_frames)
            s, t = _token_agreement(got.tokens, ref.tokens)
            same, total = same + s, total + t
    # Random-weight fixtures sit near decision boundaries, yet half precision must mostly agree.
    assert same / total > 0.9, f"{dtype}: only {same}/{total} tokens agree with float32"


def test_float32_on_cuda_runs_without_tf32_and_leaves_the_switches_as_found():
    from models.asr_model import exact_float32

    switches = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = [s.allow_tf32 for s in switches]
    try:
        for s in switches:
            s.allow_tf32 = True  # as a program that wants TF32 elsewhere sets them
        with exact_float32(False):
            assert [s.allow_tf32 for s in switches] == [True, True]
        with pytest.raises(RuntimeError, match="inside"), exact_float32():
            assert [s.allow_tf32 for s in switches] == [False, False]
            raise RuntimeError("inside")
        assert [s.allow_tf32 for s in switches] == [True, True]
    finally:
        for s, value in zip(switches, saved, strict=True):
            s.allow_tf32 = value
