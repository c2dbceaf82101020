"""Weight-space averaging, picked on validation: models.training.interpolate (weights between a stage's start and
its result) and models.training.average (the mean of a run's last snapshots)."""

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
from models.training import average as average_tool
from models.training import interpolate as interpolate_tool
from models.training.average import average, checked_snapshots, in_step_order
from models.training.evaluate import pick_lowest
from models.training.export import save_nemo
from models.training.interpolate import checked_start_weights, interpolate

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


def test_the_pick_is_the_lowest_wer_and_a_tie_goes_to_the_start():
    assert pick_lowest({0.3: 9.0, 0.5: 8.7, 0.7: 8.8}) == 0.5
    assert pick_lowest({0.6: 8.7, 0.5: 8.7, 0.7: 8.8}) == 0.5


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


def _ruined_copy(path: Path, sign: float = 1.0) -> Path:
    """The default model with noise as large as its weights (the same noise, negated where ``sign`` is -1): it
    hears nothing right."""
    ckpt = open_checkpoint(DEFAULT_MODEL)
    model = ASRModel.from_checkpoint(ckpt)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.startswith("preprocessor."):
                param.add_(sign * torch.randn(param.shape, generator=gen) * param.std().nan_to_num(1.0))
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


def test_average_is_the_mean_and_keeps_the_last_counters():
    gen = torch.Generator().manual_seed(0)
    snapshots = [{"w": torch.randn(4, 3, generator=gen), "bn.num_batches_tracked": torch.tensor(n)} for n in (5, 6, 7)]
    mean = average(snapshots)
    torch.testing.assert_close(mean["w"], (snapshots[0]["w"] + snapshots[1]["w"] + snapshots[2]["w"]) / 3)
    assert mean["bn.num_batches_tracked"].item() == 7
    assert torch.equal(average(snapshots[-1:])["w"], snapshots[-1]["w"])


@needs_default_model
def test_snapshots_of_other_runs_are_refused():
    ckpt = open_checkpoint(DEFAULT_MODEL)
    other_tokenizer = Checkpoint(ckpt.config, ckpt.raw_config, ckpt.state_dict, b"another", "other.nemo")
    with pytest.raises(ValueError, match="not a snapshot of the run"):
        checked_snapshots([ckpt, other_tokenizer])
    fewer_weights = {k: v for k, v in ckpt.state_dict.items() if not k.startswith("ctc_decoder.")}
    with pytest.raises(ValueError, match="different weights"):
        checked_snapshots([ckpt, Checkpoint(ckpt.config, ckpt.raw_config, fewer_weights, ckpt.tokenizer_model, "x")])


@needs_default_model
def test_the_average_cli_writes_the_mean_with_the_lowest_validation_wer(tmp_path, monkeypatch, capsys):
    # Two snapshots either side of the default model's weights: each alone hears nothing, their mean is it.
    snapshots = [_ruined_copy(tmp_path / "step-00500.nemo", +1.0), _ruined_copy(tmp_path / "step-01000.nemo", -1.0)]
    out = tmp_path / "out.nemo"
    monkeypatch.setattr(sys, "argv", ["average", "--snapshots", *map(str, reversed(snapshots)), "--cache",
                                      str(_validation_cache(tmp_path / "cache")), "--last", "2", "1",
                                      "--out", str(out)])
    average_tool.main()

    printed = capsys.readouterr().out
    assert "| 2 (step-00500 to step-01000) | 0.00% | 0.00% |" in printed and "picked the last 2" in printed
    assert "| 1 (step-01000) | 0.00% |" not in printed
    written, good = open_checkpoint(out).state_dict, open_checkpoint(DEFAULT_MODEL).state_dict
    assert written.keys() == good.keys()
    for key, value in good.items():
        torch.testing.assert_close(written[key], value.to(written[key].dtype), rtol=1e-5, atol=1e-6, msg=key)


def test_snapshots_are_averaged_in_step_order_and_other_names_refused(tmp_path, monkeypatch, capsys):
    names = ["step-100000.nemo", "step-99600.nemo", "step-01000.nemo", "step-1000200.nemo"]
    ordered = in_step_order([tmp_path / n for n in names])
    assert [p.name for p in ordered] == ["step-01000.nemo", "step-99600.nemo", "step-100000.nemo", "step-1000200.nemo"]
    monkeypatch.setattr(sys, "argv", ["average", "--snapshots", str(tmp_path / "step-99600.nemo"),
                                      str(tmp_path / "model.nemo"), "--cache", str(tmp_path), "--last", "1",
                                      "--out", str(tmp_path / "o.nemo")])
    with pytest.raises(SystemExit):
        average_tool.main()
    assert "model.nemo: not a snapshot name (step-NNNNN.nemo" in capsys.readouterr().err


def test_averaging_more_snapshots_than_there_are_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["average", "--snapshots", "a.nemo", "b.nemo", "--cache", str(tmp_path),
                                      "--last", "3", "--out", str(tmp_path / "o.nemo")])
    with pytest.raises(SystemExit):
        average_tool.main()


@pytest.mark.parametrize("tool", [average_tool, interpolate_tool])
def test_picking_on_a_test_split_is_refused(tmp_path, monkeypatch, capsys, tool):
    inputs = (["--snapshots", "a.nemo", "--last", "1"] if tool is average_tool
              else ["--start", "a.nemo", "--tuned", "b.nemo"])
    monkeypatch.setattr(sys, "argv", ["pick", *inputs, "--cache", str(tmp_path), "--valid-splits", "valid",
                                      "test_voice", "--out", str(tmp_path / "o.nemo")])
    with pytest.raises(SystemExit):
        tool.main()
    assert "invalid choice: 'test_voice'" in capsys.readouterr().err
