"""models.training.depth_growth: a trained encoder grown by pass-through layers computes what it did."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from models.asr_model import DEFAULT_MODEL, ASRModel
from models.checkpoint import Checkpoint, open_checkpoint
from models.config import parse_model_config
from models.tokenizer import Tokenizer
from models.training.depth_growth import RESIDUAL_OUTPUTS, deepen, encoder_depth
from models.training.export import ModelSize, float16_keeping_bfloat16, save_nemo
from models.training.interpolate import checked_start_weights
from models.training.train import Recipe, initial_model

DATA = Path(__file__).parent / "data" / "default_model"
pytestmark = pytest.mark.skipif(not DEFAULT_MODEL.exists(), reason="models/assets/default.nemo not installed")


def _grown(ckpt: Checkpoint, n_layers: int) -> tuple[ASRModel, dict]:
    raw = copy.deepcopy(ckpt.raw_config)
    raw["encoder"]["n_layers"] = n_layers
    assert ckpt.tokenizer_model is not None
    model = ASRModel(parse_model_config(raw), Tokenizer(ckpt.tokenizer_model)).eval()
    model.load_weights(deepen(ckpt.state_dict, n_layers), f"{ckpt.source} grown")
    return model, raw


def test_the_grown_encoder_computes_what_the_trained_one_did():
    ckpt = open_checkpoint(DEFAULT_MODEL)
    depth = encoder_depth(ckpt.state_dict)
    trained = ASRModel.from_checkpoint(ckpt).eval()
    grown, _ = _grown(ckpt, depth + 2)
    assert encoder_depth(grown.state_dict()) == depth + 2
    features = torch.randn(2, 80, 600, generator=torch.Generator().manual_seed(0))
    n_frames = torch.tensor([600, 410])
    with torch.no_grad():
        before, n_before = trained.encoder(features, n_frames)
        after, n_after = grown.encoder(features, n_frames)
    assert torch.equal(n_before, n_after)
    for b, n in enumerate(n_before.tolist()):  # a LayerNorm of a normalised vector is that vector, to rounding
        torch.testing.assert_close(after[b, :n], before[b, :n], atol=1e-4, rtol=0)

    expected = json.loads((DATA / "expected.json").read_text())
    files = [str(DATA / name) for name in expected]
    for decoder in ("tdt", "ctc"):
        assert ([t.text for t in grown.transcribe(files, decoder=decoder)]
                == [t.text for t in trained.transcribe(files, decoder=decoder)])


def test_new_layers_are_copies_of_the_top_one_with_zeroed_residual_outputs():
    state = open_checkpoint(DEFAULT_MODEL).state_dict
    top = encoder_depth(state) - 1
    grown = deepen(state, top + 4)  # three new layers on the old top
    for index in (top + 1, top + 2, top + 3):
        for name, value in state.items():
            prefix = f"encoder.layers.{top}."
            if not name.startswith(prefix):
                continue
            part = name[len(prefix):]
            new = grown[f"encoder.layers.{index}.{part}"]
            if part.startswith(RESIDUAL_OUTPUTS):
                assert not new.any(), part
            elif part.startswith("norm_out.") and index != top + 3:
                assert torch.equal(new, torch.ones_like(value) if part.endswith("weight") else torch.zeros_like(value))
            else:
                assert torch.equal(new, value), part
    # the old top LayerNorm's scale and shift are the new top's; the old top's own is plain
    old_scale = state[f"encoder.layers.{top}.norm_out.weight"]
    assert torch.equal(grown[f"encoder.layers.{top + 3}.norm_out.weight"], old_scale)
    assert torch.equal(grown[f"encoder.layers.{top}.norm_out.weight"], torch.ones_like(old_scale))
    assert all(torch.equal(grown[k], v) for k, v in state.items() if not k.startswith(f"encoder.layers.{top}.norm_out"))


def test_an_encoder_is_never_shrunk_and_same_depth_is_a_copy():
    state = open_checkpoint(DEFAULT_MODEL).state_dict
    depth = encoder_depth(state)
    with pytest.raises(ValueError, match="cannot grow"):
        deepen(state, depth - 1)
    same = deepen(state, depth)
    assert same.keys() == state.keys() and all(same[k] is state[k] for k in state)


def test_interpolation_accepts_a_shallower_start_and_refuses_a_deeper_one(tmp_path):
    ckpt = open_checkpoint(DEFAULT_MODEL)
    grown, raw = _grown(ckpt, encoder_depth(ckpt.state_dict) + 1)
    assert ckpt.tokenizer_model is not None
    save_nemo(grown, raw, ckpt.tokenizer_model, tmp_path / "grown.nemo")
    deeper = open_checkpoint(tmp_path / "grown.nemo")
    checked_start_weights(ckpt, deeper)
    with pytest.raises(ValueError, match="more encoder layers"):
        checked_start_weights(deeper, ckpt)
    other_width = replace(deeper.config, encoder=replace(deeper.config.encoder, d_model=96))
    with pytest.raises(ValueError, match="different architectures"):
        checked_start_weights(ckpt, replace(deeper, config=other_width))


def test_float16_storage_halves_the_file_and_loads_to_the_rounded_weights_and_exact_features(tmp_path):
    ckpt = open_checkpoint(DEFAULT_MODEL)
    model = ASRModel.from_checkpoint(ckpt)
    with torch.no_grad():  # the shipped weights are float16 values already: make them float32 ones
        for weight in model.parameters():
            weight.add_(torch.randn_like(weight) * 1e-4)
    assert ckpt.tokenizer_model is not None
    save_nemo(model, ckpt.raw_config, ckpt.tokenizer_model, tmp_path / "full.nemo")
    save_nemo(model, ckpt.raw_config, ckpt.tokenizer_model, tmp_path / "half.nemo", torch.float16)
    assert (tmp_path / "half.nemo").stat().st_size < 0.6 * (tmp_path / "full.nemo").stat().st_size
    half = open_checkpoint(tmp_path / "half.nemo")
    assert half.state_dict["encoder.layers.0.conv.batch_norm.num_batches_tracked"].dtype == torch.int64
    loaded = ASRModel.from_checkpoint(half).state_dict()
    for name, value in model.state_dict().items():
        rounded = value.is_floating_point() and not name.startswith("preprocessor.")
        expected = float16_keeping_bfloat16(value).float() if rounded else value
        assert loaded[name].dtype == value.dtype and torch.equal(loaded[name], expected), name


def test_float16_storage_rounds_each_weight_to_the_bfloat16_its_float32_value_gives():
    torch.manual_seed(0)
    magnitudes = torch.exp(torch.empty(200_000).uniform_(-9, 4))  # 1.2e-4 to 55: float16's normal range
    weights = magnitudes * torch.randn(200_000).sign()
    assert (weights.half().bfloat16() != weights.bfloat16()).float().mean() > 0.03  # plain rounding misses
    stored = float16_keeping_bfloat16(weights)
    assert stored.dtype == torch.float16
    assert torch.equal(stored.bfloat16(), weights.bfloat16())
    assert ((stored.float() - weights).abs() <= weights.abs() * 2**-10).all()  # one float16 step at most


def test_a_warm_start_with_more_layers_starts_from_the_grown_weights():
    ckpt = open_checkpoint(DEFAULT_MODEL)
    depth = encoder_depth(ckpt.state_dict)
    assert ckpt.tokenizer_model is not None
    model, raw = initial_model(ModelSize(n_layers=depth + 2), Recipe(), ckpt.tokenizer_model, ckpt)
    assert raw["encoder"]["n_layers"] == depth + 2
    expected = deepen(ckpt.state_dict, depth + 2)
    assert all(torch.equal(value.float(), expected[name].float()) for name, value in model.state_dict().items())
