"""Training's checks and numerics that need no speech: manifest rows checked before a run starts, a corpus too
small for one step, the tokenizer a run gets, float16 files of weights beyond its range, CTC log-probs in float32
under bf16 autocast. Audio here is tones; the model is tiny and untrained."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from models import load_model
from models.checkpoint import open_checkpoint
from models.training.export import ModelSize, build_model, float16_keeping_bfloat16, load_sentencepiece, save_nemo
from models.training.train import (
    DEFAULT_VOCAB_SIZE,
    Batch,
    Recipe,
    compute_losses,
    epoch_batches,
    read_manifest,
    run_tokenizer,
    train,
    train_tokenizer,
)

TINY = ModelSize(d_model=32, n_layers=1, n_heads=2, conv_kernel=9, subsampling_channels=8, pred_hidden=32,
                 joint_hidden=32, n_mels=80)
GOOD_ROW = {"audio": "tone.wav", "text": "a tone", "duration_s": 1.0}


def _tone(path: Path, seconds: float = 1.0, rate: int = 16000, channels: int = 1) -> Path:
    t = np.arange(int(seconds * rate)) / rate
    wave = (0.1 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    sf.write(path, np.stack([wave] * channels, 1) if channels > 1 else wave, rate)
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A corpus directory with a tone, the tokenizer's text (random words: enough for 256 pieces) and a manifest
    of one row for each split."""
    root = tmp_path_factory.mktemp("data")
    _tone(root / "tone.wav")
    rng = random.Random(0)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 8))) for _ in range(400)]
    (root / "train_text.txt").write_text("\n".join(" ".join(rng.choices(words, k=8)) for _ in range(300)) + "\n")
    for split in ("train", "valid"):
        (root / f"{split}.jsonl").write_text(json.dumps(GOOD_ROW) + "\n")
    return root


@pytest.fixture(scope="module")
def tokenizer(data: Path) -> bytes:
    return train_tokenizer(data / "train_text.txt", 40)


@pytest.mark.parametrize(("line", "says"), [
    ("", "not JSON"),
    ("{'audio': 'tone.wav'}", "not JSON"),
    ("[1, 2]", "a JSON list, not an object"),
    (json.dumps({"audio": "tone.wav", "text": "a tone"}), "no 'duration_s'"),
    (json.dumps({**GOOD_ROW, "duration_s": "1.0"}), "'duration_s' is '1.0', not a number"),
    (json.dumps({**GOOD_ROW, "text": None}), "'text' is None, not a string"),
    (json.dumps({**GOOD_ROW, "duration_s": 0}), "not a length in seconds above 0"),
    (json.dumps({**GOOD_ROW, "audio": "gone.wav"}), "gone.wav does not exist; restore it or remove the row"),
])
def test_a_bad_manifest_row_is_refused_with_its_file_and_line(data, tmp_path, line, says):
    (tmp_path / "tone.wav").symlink_to(data / "tone.wav")
    manifest = tmp_path / "train.jsonl"
    manifest.write_text(json.dumps(GOOD_ROW) + "\n" + line + "\n")
    with pytest.raises(ValueError) as refused:
        read_manifest(tmp_path, "train")
    assert str(refused.value).startswith(f"{manifest}:2: ") and says in str(refused.value)


def _corpus(data: Path, root: Path, train_rows: list[dict]) -> Path:
    """``data`` with another training manifest."""
    root.mkdir()
    for name in ("tone.wav", "train_text.txt", "valid.jsonl"):
        (root / name).symlink_to(data / name)
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train_rows))
    return root


def test_a_missing_audio_file_stops_the_run_before_its_first_step(data, tmp_path):
    corpus = _corpus(data, tmp_path / "corpus", [GOOD_ROW] * 3 + [{**GOOD_ROW, "audio": "gone.wav"}])
    with pytest.raises(ValueError, match=r"train\.jsonl:4: the audio file .*gone\.wav does not exist"):
        train(corpus, tmp_path / "run", Recipe(vocab_size=40, max_steps=50, save_every=1), TINY,
              torch.device("cpu"), "fp32", None)
    assert not (tmp_path / "run" / "last.pt").exists()


def test_an_empty_training_manifest_is_refused_not_looped_on(data, tmp_path):
    corpus = _corpus(data, tmp_path / "corpus", [])  # as built with --n-train 0
    raised: list[BaseException] = []

    def run() -> None:
        try:
            train(corpus, tmp_path / "run", Recipe(vocab_size=40, max_steps=3), TINY, torch.device("cpu"), "fp32",
                  5.0)
        except BaseException as exc:
            raised.append(exc)

    worker = threading.Thread(target=run, daemon=True)  # an endless loop fails the test instead of hanging it
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "train() looped on an empty manifest"
    assert len(raised) == 1 and isinstance(raised[0], ValueError)
    assert str(raised[0]) == (f"{corpus / 'train.jsonl'}: the manifest has no utterances; build the corpus with "
                              "--n-train above 0 or give another --data")


def test_an_epoch_without_a_step_for_every_process_is_refused(data):
    items = read_manifest(data, "train")  # one utterance: one batch, and two processes would take one each
    manifest = data / "train.jsonl"
    assert len(epoch_batches(items, Recipe(), 0, 1, manifest)) == 1
    with pytest.raises(ValueError, match=r"1 utterance\(s\) make 1 batch\(es\) of --batch-seconds 60, fewer than "
                                         r"the 2 processes .* an epoch would have 0 steps"):
        epoch_batches(items, Recipe(), 0, 2, manifest)


def test_the_tokenizer_is_the_init_checkpoints_unless_another_size_is_asked_for(data, tokenizer, tmp_path):
    model, raw = build_model(TINY, tokenizer, tdt_sigma=0.02, ctc_weight=0.3)
    save_nemo(model, raw, tokenizer, tmp_path / "start.nemo")
    start = open_checkpoint(tmp_path / "start.nemo")

    def pieces(proto: bytes) -> int:
        return load_sentencepiece(proto).get_piece_size()

    assert Recipe().vocab_size is None
    assert run_tokenizer(data, Recipe(), start) == tokenizer  # 40 pieces, not the from-scratch default
    assert run_tokenizer(data, Recipe(vocab_size=40), start) == tokenizer
    assert pieces(run_tokenizer(data, Recipe(vocab_size=60), start)) == 60
    assert pieces(run_tokenizer(data, Recipe(), None)) == DEFAULT_VOCAB_SIZE == 256


def test_float16_files_keep_a_tensor_beyond_float16s_range_in_float32(tokenizer, tmp_path):
    model, raw = build_model(TINY, tokenizer, tdt_sigma=0.02, ctc_weight=0.3)
    with torch.no_grad():
        model.ctc_decoder.decoder_layers[0].bias[0] = 1e5  # float16's largest is 65504
    save_nemo(model, raw, tokenizer, tmp_path / "half.nemo", torch.float16)
    stored = open_checkpoint(tmp_path / "half.nemo").state_dict
    big, small = "ctc_decoder.decoder_layers.0.bias", "ctc_decoder.decoder_layers.0.weight"
    assert stored[big].dtype == torch.float32 and torch.equal(stored[big], model.state_dict()[big])
    assert stored[small].dtype == torch.float16
    loaded = load_model(tmp_path / "half.nemo", device="cpu", dtype="float32")
    assert loaded.state_dict()[big][0].item() == 1e5
    with pytest.raises(ValueError, match="up to 70000 lie beyond float16's range"):
        float16_keeping_bfloat16(torch.tensor([1.0, -70000.0]))


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="oneDNN runs no bf16 LSTM on a CPU without bf16 instructions")
def test_the_ctc_loss_takes_float32_log_probs_under_bf16_autocast(tokenizer):
    model, _ = build_model(TINY, tokenizer, tdt_sigma=0.02, ctc_weight=0.3)
    seen: list[torch.Tensor] = []
    model.ctc_decoder.register_forward_hook(lambda module, args, output: seen.append(output))
    audio = 0.1 * torch.randn(2, 16000, generator=torch.Generator().manual_seed(0))
    batch = Batch(audio, torch.tensor([16000, 12000]), torch.tensor([[3, 4, 5], [6, 7, 0]]), torch.tensor([3, 2]))
    _, ctc = compute_losses(model, batch, Recipe(), None, torch.bfloat16)
    (log_probs,) = seen
    assert log_probs.dtype == torch.float32 and ctc.dtype == torch.float32
    torch.testing.assert_close(log_probs.exp().sum(-1), torch.ones(log_probs.shape[:2]), atol=1e-5, rtol=0)
