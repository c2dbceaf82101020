"""float32 on CPU must reproduce NeMo's own greedy output token for token, frame for frame."""

from __future__ import annotations

import json
from functools import cache

import pytest
import torch

from models import ASRModel, load_model
from service.cli import main as cli_main
from tests.parity import assert_matches_nemo, nemo_cases

BATCH_SIZES = (1, 2, 3, 4, 10)


@cache
def _model(path: str) -> ASRModel:
    return load_model(path, device="cpu", dtype="float32")


def test_nemo_is_batch_invariant_on_fixtures(parity_reference):
    for entry in parity_reference["models"].values():
        assert entry["main_bs1"] == entry["main_bs4"]


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_python_api_matches_nemo(parity_dir, parity_reference, parity_audio, batch_size):
    for name, decoder, key in nemo_cases(parity_reference):
        model = _model(str(parity_dir / parity_reference["models"][name]["file"]))
        transcripts = model.transcribe(parity_audio, batch_size=batch_size, decoder=decoder)
        for audio, got, expected in zip(parity_audio, transcripts, parity_reference["models"][name][key],
                                        strict=True):
            record = {"text": got.text, "tokens": got.tokens, "token_frames": got.token_frames}
            assert_matches_nemo(record, expected, f"{name}/{decoder} bs={batch_size} {audio}")


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_cli_jsonl_matches_nemo(parity_dir, parity_reference, parity_audio, batch_size, capsys):
    for name, decoder, key in nemo_cases(parity_reference):
        model_path = str(parity_dir / parity_reference["models"][name]["file"])
        code = cli_main(["transcribe", "--model", model_path, "--device", "cpu", "--dtype", "float32",
                         "--batch-size", str(batch_size), "--decoder", decoder, "--format", "jsonl",
                         *parity_audio])
        assert code == 0
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) == len(parity_audio)
        for audio, line, expected in zip(parity_audio, lines, parity_reference["models"][name][key],
                                         strict=True):
            record = json.loads(line)
            assert record["audio"] == audio
            assert set(record) >= {"audio", "text", "tokens", "token_frames", "duration_s"}
            assert_matches_nemo(record, expected, f"{name}/{decoder} bs={batch_size} {audio}")


@pytest.mark.parametrize("batch_size", (1, 4))
def test_reference_attention_kernel_matches_nemo_too(parity_dir, parity_reference, parity_audio, batch_size):
    """On CPU the default ("auto") is the fused sdpa kernel, which the tests above cover; NeMo's own sequence of
    operations must give NeMo's tokens as well."""
    for name, decoder, key in nemo_cases(parity_reference):
        model = load_model(parity_dir / parity_reference["models"][name]["file"], device="cpu", dtype="float32",
                           attention_kernel="reference")
        transcripts = model.transcribe(parity_audio, batch_size=batch_size, decoder=decoder)
        for audio, got, expected in zip(parity_audio, transcripts, parity_reference["models"][name][key],
                                        strict=True):
            record = {"text": got.text, "tokens": got.tokens, "token_frames": got.token_frames}
            assert_matches_nemo(record, expected, f"{name}/{decoder} reference bs={batch_size} {audio}")


def test_attention_kernels_agree_on_valid_frames(parity_dir, parity_audio):
    from models.audio_io import read_audio

    model = load_model(parity_dir / "tdt.nemo", device="cpu", dtype="float32", attention_kernel="reference")
    assert load_model(parity_dir / "tdt.nemo", device="cpu").encoder.attention_kernel == "sdpa"  # auto on CPU
    waves = [read_audio(path, model.sample_rate) for path in parity_audio[:3]]  # unequal lengths: padding
    reference = model.encode(waves)
    model.encoder.set_attention_kernel("sdpa")
    fused = model.encode(waves)
    assert model.encoder.attention_kernel == "sdpa"
    for row, n in enumerate(reference.lengths.tolist()):
        assert (fused.encoded[row, :n] - reference.encoded[row, :n]).abs().max() < 1e-4
    with pytest.raises(ValueError, match="unknown attention kernel 'flash'; choose from reference, sdpa"):
        model.encoder.set_attention_kernel("flash")


def test_subsampling_keeps_padding_out_of_valid_frames(parity_dir):
    """Whatever padded feature frames hold, valid subsampled frames are the same, and equal the utterance alone."""
    model = load_model(parity_dir / "tdt_ctc_hybrid.nemo", device="cpu", dtype="float32")
    generator = torch.Generator().manual_seed(0)
    n_mels = model.config.encoder.feat_in
    n_frames = torch.tensor([203, 97, 9])
    clean = torch.randn(3, n_mels, 203, generator=generator)
    for row, n in enumerate(n_frames.tolist()):
        clean[row, :, n:] = 0.0
    noisy = clean.clone()
    for row, n in enumerate(n_frames.tolist()):
        noisy[row, :, n:] = 1e3 * torch.randn(n_mels, 203 - n, generator=generator)
    with torch.inference_mode():
        a, lengths = model.encoder.subsample(clean, n_frames)
        b, _ = model.encoder.subsample(noisy, n_frames)
        for row, n in enumerate(lengths.tolist()):
            assert torch.equal(a[row, :n], b[row, :n])
            alone, _ = model.encoder.subsample(clean[row : row + 1, :, : n_frames[row]], n_frames[row : row + 1])
            torch.testing.assert_close(a[row, :n], alone[0, :n], rtol=1e-5, atol=1e-5)


def test_the_position_table_grows_when_nemo_grows_it(parity_dir):
    """NeMo computes the table again, on the model's device, once an input's feature frames (not its encoder
    frames) pass pos_emb_max_len: past 50 s of audio, not 400 s. On a GPU the two tables round apart."""
    model = load_model(parity_dir / "tdt.nemo", device="cpu", dtype="float32")
    table = model.encoder.pos_enc
    assert table.max_len == 5000 and table.pe.shape[1] == 2 * 5000 - 1
    model.encode([torch.zeros(16000 * 49).numpy()])
    assert table.pe.shape[1] == 2 * 5000 - 1  # 4,901 feature frames: the table as built
    model.encode([torch.zeros(16000 * 51).numpy()])
    assert table.max_len == 5101 and table.pe.shape[1] == 2 * 5101 - 1  # 5,101 feature frames, 638 encoder frames
    rebuilt = table.pe.clone()
    model.encode([torch.zeros(16000 * 20).numpy()])
    assert torch.equal(table.pe, rebuilt)  # kept, as NeMo keeps it
