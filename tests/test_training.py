"""The training recipe end to end on a tiny corpus: it learns, checkpoints, resumes, warm-starts and exports.

A real (if tiny) run: espeak-ng speech, a SentencePiece tokenizer trained on the corpus text, the hybrid
TDT-CTC losses, AdamW, precision picked as on a user's machine, and a .nemo that the user-facing loader reads.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import soundfile as sf
import torch

from models import load_model
from models.checkpoint import open_checkpoint
from models.training.data import SAMPLE_RATE, Utterance, synthesize, telephone_band
from models.training.export import ModelSize
from models.training.parallel import Workers
from models.training.train import (
    Item,
    Recipe,
    batch_settings,
    check_resumable,
    join_samples,
    load_batch,
    pick_precision,
    train,
)
from tests.ports import free_port

pytestmark = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng not installed")

SENTENCES = ["the cat sat on the mat", "a dog ran in the park", "the sun is bright today",
             "we read a book at night", "she sings a song for him", "they walk to the old town"]
TINY = ModelSize(d_model=32, n_layers=1, n_heads=2, conv_kernel=9, subsampling_channels=8, pred_hidden=32,
                 joint_hidden=32, n_mels=80)


def _recipe(max_steps: int, concat_fraction: float = 0.0) -> Recipe:
    return Recipe(vocab_size=40, max_steps=max_steps, batch_seconds=8.0, peak_lr=3e-3, warmup_steps=2,
                  eval_every=1000, save_every=5, freq_masks=0, time_masks=0, noise_snr_db=(60.0, 60.0),
                  concat_fraction=concat_fraction, concat_max_s=5.0)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    (root / "train").mkdir()
    rows = []
    for i, text in enumerate(SENTENCES):
        audio = synthesize(Utterance(text, "en-us+m1", 170, 50))
        sf.write(root / "train" / f"{i}.wav", audio, SAMPLE_RATE, subtype="PCM_16")
        rows.append({"audio": f"train/{i}.wav", "text": text, "duration_s": len(audio) / SAMPLE_RATE})
    manifest = "".join(json.dumps(r) + "\n" for r in rows)
    (root / "train.jsonl").write_text(manifest)
    (root / "valid.jsonl").write_text(manifest)
    # The tokenizer needs more text than six sentences to find 40 pieces.
    (root / "train_text.txt").write_text("\n".join(SENTENCES * 20) + "\n")
    return root


def _losses(run: Path) -> list[float]:
    return [h["loss"] for h in torch.load(run / "last.pt", weights_only=False)["history"]]


def test_learns_checkpoints_and_exports(corpus, tmp_path):
    run = tmp_path / "run"
    train(corpus, run, replace(_recipe(30), snapshot_every=10), TINY, torch.device("cpu"), "auto", None)
    losses = _losses(run)
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.85 * sum(losses[:5]) / 5  # it is learning the six sentences
    snapshots = sorted(p.name for p in (run / "snapshots").iterdir())
    assert snapshots == ["step-00010.nemo", "step-00020.nemo", "step-00030.nemo"]
    final = open_checkpoint(run / "model.nemo").state_dict
    first, last = (open_checkpoint(run / "snapshots" / name).state_dict for name in (snapshots[0], snapshots[-1]))
    assert all(torch.equal(final[k], last[k]) for k in final)
    head = "ctc_decoder.decoder_layers.0.weight"
    assert not torch.equal(first[head], final[head])
    model = load_model(run / "model.nemo", device="cpu")
    assert model.config.kind == "hybrid"
    assert len(model.transcribe([str(corpus / "train" / "0.wav")])) == 1


def _trained(run: Path) -> tuple[list[tuple[int, int, float]], dict[str, torch.Tensor]]:
    """(step, epoch, loss) of every step of a run, and its weights."""
    state = torch.load(run / "last.pt", weights_only=False)
    return [(h["step"], h["epoch"], h["loss"]) for h in state["history"]], state["model"]


def test_resume_continues_where_it_stopped(corpus, tmp_path):
    augmented = replace(_recipe(5), concat_fraction=0.5, vtlp_max_warp=0.1)  # and the training step warps voices
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(corpus, straight, augmented, TINY, torch.device("cpu"), "fp32", None)
    steps, weights = _trained(straight)
    epochs = [epoch for _, epoch, _ in steps]
    end_of_first_epoch = epochs.index(1)  # steps of epoch 0
    assert end_of_first_epoch >= 2 and epochs[-1] >= 1
    # Stopped by the time budget after every step up to the first epoch's last batch, then run to the end.
    for _ in range(end_of_first_epoch):
        train(corpus, resumed, augmented, TINY, torch.device("cpu"), "fp32", 0.0)
    stopped = torch.load(resumed / "last.pt", weights_only=False)
    assert (stopped["step"], stopped["epoch"]) == (end_of_first_epoch, 1)  # the next step starts epoch 1
    torch.save({**stopped, "epoch": 0}, resumed / "last.pt")  # as a last.pt from before the fix has it
    train(corpus, resumed, augmented, TINY, torch.device("cpu"), "fp32", None)
    resumed_steps, resumed_weights = _trained(resumed)
    assert resumed_steps == steps  # the same batches, epoch by epoch, and the same losses
    assert all(torch.equal(resumed_weights[k], weights[k]) for k in weights)
    train(corpus, resumed, replace(augmented, max_steps=7), TINY, torch.device("cpu"), "fp32", None)
    assert [h["step"] for h in torch.load(resumed / "last.pt", weights_only=False)["history"]] == list(range(1, 8))


def test_resuming_with_other_batches_is_refused(corpus, tmp_path):
    run = tmp_path / "run"
    train(corpus, run, _recipe(1), TINY, torch.device("cpu"), "fp32", None)
    for changed, says in (({"seed": 1}, "--seed 0 (this command: 1)"),
                          ({"batch_seconds": 4.0}, "--batch-seconds 8.0 (this command: 4.0)")):
        with pytest.raises(ValueError, match=re.escape(f"last.pt: the run was trained with {says};")):
            train(corpus, run, replace(_recipe(2), **changed), TINY, torch.device("cpu"), "fp32", None)
    with pytest.raises(ValueError, match=r"--d-model 32 \(this command: 48\)"):
        train(corpus, run, _recipe(2), replace(TINY, d_model=48), torch.device("cpu"), "fp32", None)
    other = tmp_path / "other"
    shutil.copytree(corpus, other, symlinks=True)
    (other / "train.jsonl").write_text("".join((corpus / "train.jsonl").read_text().splitlines(True)[1:]))
    with pytest.raises(ValueError, match=r"--data train\.jsonl sha256 \w+ \(this command: train\.jsonl sha256"):
        train(other, run, _recipe(2), TINY, torch.device("cpu"), "fp32", None)
    state = torch.load(run / "last.pt", weights_only=False)
    with pytest.raises(ValueError, match=r"processes \(torchrun --nproc-per-node\) 1 \(this command: 2\)"):
        check_resumable(run / "last.pt", state, batch_settings(_recipe(2), 2, corpus / "train.jsonl"), TINY)
    train(corpus, run, _recipe(2), TINY, torch.device("cpu"), "fp32", None)  # more steps: the same batches
    assert torch.load(run / "last.pt", weights_only=False)["step"] == 2


def test_init_from_starts_with_that_models_weights_and_tokenizer(corpus, tmp_path):
    first = tmp_path / "first"
    train(corpus, first, _recipe(3), TINY, torch.device("cpu"), "auto", None)
    second = tmp_path / "second"
    train(corpus, second, _recipe(0), TINY, torch.device("cpu"), "auto", None, init_from=first / "model.nemo")
    before, after = open_checkpoint(first / "model.nemo"), open_checkpoint(second / "model.nemo")
    assert after.tokenizer_model == before.tokenizer_model
    assert after.state_dict.keys() == before.state_dict.keys()
    for key, value in before.state_dict.items():
        assert torch.equal(after.state_dict[key], value), key


def test_the_cli_warm_start_keeps_its_depth_and_tokenizer_unless_asked_to_change(corpus, tmp_path):
    first = tmp_path / "first"
    train(corpus, first, _recipe(0), replace(TINY, n_layers=3), torch.device("cpu"), "auto", None)
    start = open_checkpoint(first / "model.nemo")
    size = [f"--{k.replace('_', '-')}={v}" for k, v in asdict(TINY).items() if k != "n_layers"]
    # No --vocab-size: the start's 40 pieces, not a new tokenizer of the from-scratch default's 256.
    for grow, depth in (([], 3), (["--n-layers", "4"], 4)):
        run = tmp_path / f"run{depth}"
        command = [sys.executable, "-m", "models.training.train", "--data", str(corpus), "--out", str(run),
                   "--init-from", str(first / "model.nemo"), "--max-steps", "0", *size, *grow]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        grown = open_checkpoint(run / "model.nemo")
        assert grown.config.encoder.n_layers == depth
        assert grown.tokenizer_model == start.tokenizer_model and grown.config.vocab_size == 40


def test_a_frozen_input_conv_keeps_its_weights_while_the_rest_trains(corpus, tmp_path):
    first = tmp_path / "first"
    train(corpus, first, _recipe(3), TINY, torch.device("cpu"), "auto", None)
    second = tmp_path / "second"
    train(corpus, second, replace(_recipe(3), freeze_input_conv=True), TINY, torch.device("cpu"), "auto", None,
          init_from=first / "model.nemo")
    before = open_checkpoint(first / "model.nemo").state_dict
    after = open_checkpoint(second / "model.nemo").state_dict
    for key in ("encoder.pre_encode.conv.0.weight", "encoder.pre_encode.conv.0.bias"):
        assert torch.equal(after[key], before[key]), key
    trained = ("encoder.pre_encode.conv.2.weight", "encoder.pre_encode.out.weight",
               "ctc_decoder.decoder_layers.0.weight")
    for key in trained:
        assert not torch.equal(after[key], before[key]), key


def test_init_from_with_a_larger_vocabulary_keeps_what_it_heard(corpus, tmp_path):
    first = tmp_path / "first"
    train(corpus, first, _recipe(3), TINY, torch.device("cpu"), "auto", None)
    second = tmp_path / "second"
    train(corpus, second, replace(_recipe(0), vocab_size=60), TINY, torch.device("cpu"), "auto", None,
          init_from=first / "model.nemo")
    before, after = open_checkpoint(first / "model.nemo"), open_checkpoint(second / "model.nemo")
    assert after.config.vocab_size == 60 and before.config.vocab_size == 40
    rows = {"decoder.prediction.embed.weight", "joint.joint_net.1.weight", "joint.joint_net.1.bias",
            "ctc_decoder.decoder_layers.0.weight", "ctc_decoder.decoder_layers.0.bias"}
    for key, value in before.state_dict.items():
        if key not in rows:
            assert torch.equal(after.state_dict[key], value), key
    old, new = spm.SentencePieceProcessor(), spm.SentencePieceProcessor()
    old.LoadFromSerializedProto(before.tokenizer_model)
    new.LoadFromSerializedProto(after.tokenizer_model)
    ctc_old, ctc_new = (c.state_dict["ctc_decoder.decoder_layers.0.bias"] for c in (before, after))
    for piece in ("▁the", "t", "a"):  # pieces in both vocabularies keep their rows
        assert ctc_new[new.piece_to_id(piece)] == ctc_old[old.piece_to_id(piece)], piece
    assert ctc_new[-1] == ctc_old[-1]  # blank


def test_cpu_precision_is_one_the_cpu_runs():
    amp_dtype, scaler = pick_precision(torch.device("cpu"), "auto")
    assert not scaler
    # bf16 only where oneDNN has bf16 instructions for it; otherwise float32 (no autocast).
    assert amp_dtype is (torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else None)
    assert pick_precision(torch.device("cpu"), "fp32") == (None, False)


def test_joined_samples_use_every_utterance_once_within_the_length_limit():
    items = [Item(Path(f"{i}.wav"), f"w{i}", 1.0 + (i % 5) * 0.5) for i in range(200)]
    recipe = Recipe(concat_fraction=0.4, concat_max_s=8.0, concat_gap_s=(0.1, 0.5))
    samples = join_samples(items, recipe, random.Random(0))
    assert sorted(it.text for s in samples for it in s) == sorted(it.text for it in items)
    joined = [s for s in samples if len(s) > 1]
    assert sum(len(s) for s in joined) >= 0.35 * len(items)
    assert all(sum(it.duration_s for it in s) + 0.5 * (len(s) - 1) <= 8.0 for s in joined)


def test_a_joined_sample_is_its_utterances_in_order_with_pauses(corpus):
    items = [Item(corpus / "train" / f"{i}.wav", SENTENCES[i], 0.0) for i in (0, 1)]
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(spm_proto(corpus))
    recipe = Recipe(concat_gap_s=(0.2, 0.2))
    batch = load_batch([items, items[:1]], sp, recipe, np.random.default_rng(0), augment=False)
    lengths = [sf.info(it.audio).frames for it in items]
    assert batch.n_samples.tolist() == [lengths[0] + int(0.2 * SAMPLE_RATE) + lengths[1], lengths[0]]
    first = batch.targets[0, : batch.target_lengths[0]].tolist()
    assert sp.decode(first) == f"{SENTENCES[0]} {SENTENCES[1]}"


def test_a_batch_hears_every_file_at_16_khz_in_mono(corpus, tmp_path):
    wave, rate = sf.read(corpus / "train" / "0.wav", dtype="float32")
    wave = wave[: len(wave) // 2 * 2]
    seconds = len(wave) / rate
    sf.write(tmp_path / "8k.wav", wave[::2], rate // 2)  # the same speech at 8 kHz
    sf.write(tmp_path / "stereo.wav", np.stack([wave, 0.5 * wave], 1), rate)
    items = [Item(tmp_path / name, SENTENCES[0], seconds) for name in ("8k.wav", "stereo.wav")]
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(spm_proto(corpus))
    batch = load_batch([items[:1], items[1:]], sp, Recipe(), np.random.default_rng(0), augment=False)
    assert batch.n_samples.tolist() == [len(wave), len(wave)]
    np.testing.assert_allclose(batch.audio[1].numpy(), 0.75 * wave, atol=1e-4)  # the channels' mean


def test_telephone_band_keeps_speech_below_4khz_and_removes_the_rest():
    rng = np.random.default_rng(0)
    t = np.arange(SAMPLE_RATE) / SAMPLE_RATE
    low, high = np.sin(2 * np.pi * 1000 * t), np.sin(2 * np.pi * 6000 * t)
    wave = (0.3 * low + 0.3 * high + 0.01 * rng.standard_normal(len(t))).astype(np.float32)
    narrow = telephone_band(wave)
    assert narrow.dtype == np.float32 and abs(len(narrow) - len(wave)) <= 1
    spectrum = np.abs(np.fft.rfft(narrow[: SAMPLE_RATE - 1]))
    bin_hz = SAMPLE_RATE / (SAMPLE_RATE - 1)
    assert spectrum[int(6000 / bin_hz) - 5: int(6000 / bin_hz) + 5].max() < 0.01 * spectrum.max()
    assert spectrum[int(1000 / bin_hz) - 5: int(1000 / bin_hz) + 5].max() == pytest.approx(spectrum.max())


def spm_proto(corpus: Path) -> bytes:
    from models.training.train import train_tokenizer

    return train_tokenizer(corpus / "train_text.txt", 40)


def _average_in_process(rank: int, init_file: str, results) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
        params[0].grad = torch.full((3,), float(rank + 1))
        if rank == 1:  # a parameter unused on one process: its missing gradient counts as zeros
            params[1].grad = torch.full((2, 2), 4.0)
        Workers(rank, 2).average_gradients(params)
        results[rank] = (params[0].grad.tolist(), params[1].grad.tolist(), Workers(rank, 2).sum([rank, 1.0]))
    finally:
        torch.distributed.destroy_process_group()


def test_processes_average_their_gradients(tmp_path):
    ctx = torch.multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        procs = [ctx.Process(target=_average_in_process, args=(r, str(tmp_path / "init"), results))
                 for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert [p.exitcode for p in procs] == [0, 0]
        for rank in range(2):
            assert results[rank] == ([1.5] * 3, [[2.0, 2.0], [2.0, 2.0]], [1.0, 2.0])


def test_two_process_run_under_torchrun(corpus, tmp_path):
    run = tmp_path / "run"
    size = [f"--{k.replace('_', '-')}={v}" for k, v in asdict(TINY).items()]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), "-m", "models.training.train", "--data", str(corpus), "--out", str(run),
               "--max-steps", "3", "--batch-seconds", "4", "--vocab-size", "40", "--eval-every", "1000",
               "--threads", "1", "--freeze-input-conv", *size]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 process(es)" in done.stdout
    state = torch.load(run / "last.pt", weights_only=False)
    assert state["step"] == 3 and len(state["history"]) == 3
    assert state["recipe"]["freeze_input_conv"] is True
    assert load_model(run / "model.nemo", device="cpu").config.kind == "hybrid"
