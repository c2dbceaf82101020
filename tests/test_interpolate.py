"""models.training.interpolate: weights between a stage's start and its result, the weight picked on validation."""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from models.asr_model import DEFAULT_MODEL, ASRModel
from models.checkpoint import Checkpoint, open_checkpoint
from models.training import interpolate as interpolate_tool
from models.training.export import save_nemo
from models.training.interpolate import checked_start_weights, interpolate, pick_weight

DATA = Path(__file__).parent / "data" / "default_model"
needs_default_model = pytest.mark.skipif(not DEFAULT_MODEL.exists(), reason="models/assets/default.nemo not installed")


def test_interpolate_reaches_both_ends_exactly_and_keeps_the_tuned_counters():
    gen = torch.Generator().manual_seed(0)
    start = {"w": torch.randn(4, 3, generator=gen), "bn.num_batches_tracked": torch.tensor(7)}
    tuned = {"w": torch.randn(4, 3, generator=gen), "bn.num_batches_tracked": torch.tensor(9)}
    assert torch.equal(interpolate(start, tuned, 0.0)["w"], start["w"])
    assert torch.equal(interpolate(start, tuned, 1.0)["w"], tuned["w"])
    middle = interpolate(start, tuned, 0.25)
    torch.testing.assert_close(middle["w"], 0.75 * start["w"] + 0.25 * tuned["w"])
    assert middle["bn.num_batches_tracked"].item() == 9


def test_pick_weight_takes_the_lowest_wer_and_a_tie_goes_to_the_start():
    assert pick_weight({0.3: 9.0, 0.5: 8.7, 0.7: 8.8}) == 0.5
    assert pick_weight({0.6: 8.7, 0.5: 8.7, 0.7: 8.8}) == 0.5


@needs_default_model
def test_different_tokenizers_or_architectures_are_refused():
    ckpt = open_checkpoint(DEFAULT_MODEL)
    ctc_only = replace(ckpt.config, kind="ctc", transducer=None)
    with pytest.raises(ValueError, match="different architectures"):
        checked_start_weights(ckpt, Checkpoint(ctc_only, ckpt.raw_config, ckpt.state_dict, ckpt.tokenizer_model, "x"))
    other_tokenizer = Checkpoint(ckpt.config, ckpt.raw_config, ckpt.state_dict, b"another", "other.nemo")
    with pytest.raises(ValueError, match="different tokenizers"):
        checked_start_weights(ckpt, other_tokenizer)
    fewer_weights = {k: v for k, v in ckpt.state_dict.items() if not k.startswith("ctc_decoder.")}
    with pytest.raises(ValueError, match="different weights"):
        checked_start_weights(ckpt, Checkpoint(ckpt.config, ckpt.raw_config, fewer_weights, ckpt.tokenizer_model, "x"))


def _ruined_copy(path: Path) -> Path:
    """The default model with noise as large as its weights: it hears nothing right."""
    ckpt = open_checkpoint(DEFAULT_MODEL)
    model = ASRModel.from_checkpoint(ckpt)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.startswith("preprocessor."):
                param.add_(torch.randn(param.shape, generator=gen) * param.std().nan_to_num(1.0))
    assert ckpt.tokenizer_model is not None
    save_nemo(model, ckpt.raw_config, ckpt.tokenizer_model, path)
    return path


def _validation_cache(path: Path) -> Path:
    expected = json.loads((DATA / "expected.json").read_text())
    path.mkdir()
    for name in expected:
        shutil.copy(DATA / name, path / name)
    (path / "valid.jsonl").write_text("".join(json.dumps({"audio": n, "text": t}) + "\n" for n, t in expected.items()))
    return path


@needs_default_model
@pytest.mark.parametrize("good_end", ["start", "tuned"])
def test_the_cli_writes_the_weight_with_the_lowest_validation_wer(tmp_path, monkeypatch, capsys, good_end):
    ruined = _ruined_copy(tmp_path / "ruined.nemo")
    start, tuned = (DEFAULT_MODEL, ruined) if good_end == "start" else (ruined, DEFAULT_MODEL)
    out = tmp_path / "out.nemo"
    monkeypatch.setattr(sys, "argv", ["interpolate", "--start", str(start), "--tuned", str(tuned), "--cache",
                                      str(_validation_cache(tmp_path / "cache")), "--weights", "1", "0",
                                      "--out", str(out)])
    interpolate_tool.main()

    printed = capsys.readouterr().out
    best = 0.0 if good_end == "start" else 1.0
    assert f"| {best:g} | 0.00% | 0.00% |" in printed and f"picked weight {best:g}" in printed
    written, good = open_checkpoint(out).state_dict, open_checkpoint(DEFAULT_MODEL).state_dict
    assert written.keys() == good.keys() and all(torch.equal(written[k], good[k]) for k in good)


def test_weights_outside_zero_to_one_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["interpolate", "--start", "a.nemo", "--tuned", "b.nemo", "--cache",
                                      str(tmp_path), "--weights", "1.5", "--out", str(tmp_path / "o.nemo")])
    with pytest.raises(SystemExit):
        interpolate_tool.main()
