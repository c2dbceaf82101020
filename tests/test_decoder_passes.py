"""scripts/decoder_passes.py: label looping's passes on a batch, encoded in slices but decoded whole."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from models import load_model
from tests.conftest import load_script

SCRIPT = Path(__file__).parents[1] / "scripts" / "decoder_passes.py"


@pytest.fixture(scope="module")
def decoder_passes():
    yield load_script(SCRIPT)
    del sys.modules["decoder_passes"]


def test_slices_encode_as_one_batch_and_the_counts_follow_the_hypotheses(decoder_passes, parity_dir, parity_audio):
    model = load_model(str(parity_dir / "tdt_ctc_hybrid.nemo"), device="cpu", dtype="float32")
    waveforms = [model.load_audio(path) for path in parity_audio]
    encoded, lengths = decoder_passes.encode_in_slices(model, waveforms, 3)
    whole = model.encode(waveforms)
    assert lengths.tolist() == whole.lengths.tolist() and encoded.shape == whole.encoded.shape
    passes, tokens = decoder_passes.count_passes(model, encoded, lengths)
    expected = model.decode(whole, decoder_algorithm="frame_looping", cuda_graphs="off", scores=False)
    assert tokens == [len(h.tokens) for h in expected]
    assert passes.outer == max(tokens)


def test_the_report(decoder_passes, parity_dir, parity_audio, capsys):
    assert decoder_passes.main(["--model", str(parity_dir / "rnnt.nemo"), "--audio", *parity_audio[:4],
                                "--batch-size", "4", "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rows"] == 4 and report["outer_passes"] == report["longest_hypothesis"] > 0
    assert report["inner_per_outer"] == round(report["inner_passes"] / report["outer_passes"], 2)


def test_a_ctc_model_is_refused(decoder_passes, parity_dir):
    with pytest.raises(SystemExit):
        decoder_passes.main(["--model", str(parity_dir / "ctc.nemo"), "--batch-size", "2", "--device", "cpu"])
