r"""Train the embedded default model: hybrid TDT-CTC FastConformer on synthetic speech, mixed precision.

Recipe of the shipped model (ten stages; stages 6, 9, 10 and 12 averaged with the one before, stage 8 grown
to twelve encoder layers, the last snapshots of stages 10 and 12 averaged; about 90 + 135 + 90 + 84 + 93 + 87 +
80 + 39 + 84 + 95 min on a 2-core CPU; see its model card)::

    python -m models.training.data --cache DATA1 --n-train 24000
    python -m models.training.train --data DATA1 --out STAGE1 --max-steps 5000
    python -m models.training.data --cache DATA2 --n-train 36000
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m models.training.train --data DATA2 --out STAGE2 \
        --init-from STAGE1/model.nemo --max-steps 2900 --peak-lr 1e-3 --warmup-steps 100 --ctc-weight 0.5 \
        --concat-fraction 0.25 --concat-max-s 20 --telephone-fraction 0.15 --eval-every 500 --time-budget-s 6300
    python -m models.training.data --cache DATA3 --n-train 60000
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m models.training.train --data DATA3 --out STAGE3 \
        --init-from STAGE2/model.nemo --max-steps 2800 --peak-lr 6e-4 --warmup-steps 100 --ctc-weight 0.5 \
        --concat-fraction 0.25 --concat-max-s 20 --telephone-fraction 0.15 --eval-every 500 --time-budget-s 6000
    python -m models.training.data --cache DATA4 --n-train 100000
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m models.training.train --data DATA4 --out STAGE4 \
        --init-from STAGE3/model.nemo --max-steps 2400 --peak-lr 4e-4 --warmup-steps 100 --ctc-weight 0.5 \
        --concat-fraction 0.35 --concat-max-s 20 --telephone-fraction 0.15 --eval-every 500 --time-budget-s 5000
    python -m models.training.data --cache DATA5 --n-train 120000
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m models.training.train --data DATA5 --out STAGE5 \
        --init-from STAGE4/model.nemo --max-steps 4300 --peak-lr 3e-4 --warmup-steps 100 --ctc-weight 0.65 \
        --concat-fraction 0.35 --concat-max-s 20 --telephone-fraction 0.15 --eval-every 500 --time-budget-s 6000 \
        --precision fp32
    python -m models.training.data --cache DATA6 --n-train 120000 --train-min-count 10
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m models.training.train --data DATA6 --out STAGE6 \
        --init-from STAGE5/model.nemo --max-steps 5200 --peak-lr 2e-4 --warmup-steps 100 --ctc-weight 0.7 \
        --concat-fraction 0.35 --concat-max-s 20 --telephone-fraction 0.15 --eval-every 500 --time-budget-s 5700 \
        --precision bf16
    python -m models.training.interpolate --start STAGE5/model.nemo --tuned STAGE6/model.nemo --cache DATA6 \
        --weights 0 0.3 0.4 0.5 0.6 0.7 1 --out STAGE6/interpolated.nemo
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m models.training.train --data DATA6 --out STAGE8 \
        --init-from STAGE6/interpolated.nemo --n-layers 12 --max-steps 7000 --peak-lr 2.5e-4 --warmup-steps 200 \
        --ctc-weight 0.75 --concat-fraction 0.35 --concat-max-s 20 --telephone-fraction 0.15 --vtlp-max-warp 0.1 \
        --freeze-input-conv --eval-every 500 --time-budget-s 5500 --precision bf16
    python -m models.training.interpolate --start STAGE6/interpolated.nemo --tuned STAGE8/model.nemo --cache DATA6 \
        --weights 0 0.3 0.4 0.5 0.6 0.7 0.8 1 --out STAGE8/interpolated.nemo --store float16
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m models.training.train --data DATA6 --out STAGE9 \
        --init-from STAGE8/model.nemo --n-layers 12 --max-steps 3300 --peak-lr 1.5e-4 --warmup-steps 100 \
        --ctc-weight 0.75 --concat-fraction 0.35 --concat-max-s 20 --telephone-fraction 0.15 --vtlp-max-warp 0.1 \
        --freeze-input-conv --eval-every 500 --time-budget-s 2400 --seed 1 --precision bf16
    python -m models.training.interpolate --start STAGE8/model.nemo --tuned STAGE9/model.nemo --cache DATA6 \
        --weights 0 0.3 0.4 0.5 0.6 0.7 0.8 1 --out STAGE9/interpolated.nemo --store float16
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m models.training.train --data DATA6 --out STAGE10 \
        --init-from STAGE9/interpolated.nemo --max-steps 7000 --peak-lr 1.5e-4 --warmup-steps 200 --ctc-weight 0.8 \
        --concat-fraction 0.35 --concat-max-s 20 --telephone-fraction 0.15 --vtlp-max-warp 0.1 --freeze-input-conv \
        --eval-every 500 --snapshot-every 200 --time-budget-s 5400 --seed 2 --precision bf16
    python -m models.training.average --snapshots STAGE10/snapshots/*.nemo --cache DATA6 \
        --last 1 2 3 5 8 12 16 --out STAGE10/averaged.nemo
    python -m models.training.interpolate --start STAGE9/interpolated.nemo --tuned STAGE10/averaged.nemo \
        --cache DATA6 --weights 0 0.5 0.6 0.7 0.8 0.9 1 --out STAGE10/interpolated.nemo --store float16
    python -m models.training.data --cache DATA6 --n-train 120000 --seed 0 --train-min-count 10  # adds valid_voice
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m models.training.train --data DATA6 --out STAGE12 \
        --init-from STAGE10/interpolated.nemo --max-steps 5000 --peak-lr 1.2e-4 --warmup-steps 200 --ctc-weight 0.85 \
        --concat-fraction 0.35 --concat-max-s 20 --telephone-fraction 0.15 --vtlp-max-warp 0.1 --freeze-input-conv \
        --eval-every 500 --snapshot-every 200 --time-budget-s 6000 --seed 4 --precision bf16
    python -m models.training.average --snapshots STAGE12/snapshots/*.nemo --cache DATA6 \
        --valid-splits valid valid_voice --last 1 2 3 5 8 12 16 --out STAGE12/averaged.nemo
    python -m models.training.interpolate --start STAGE10/interpolated.nemo --tuned STAGE12/averaged.nemo \
        --cache DATA6 --valid-splits valid valid_voice --weights 0 0.5 0.6 0.7 0.8 0.9 1 \
        --out STAGE12/interpolated.nemo --store float16
    # a stopped run continues from RUN/last.pt with the same command; RUN/model.nemo is the result

Loss: (1 - w) * TDT + w * CTC (NeMo's hybrids use w = 0.3), each normalised by the number of target tokens.
AdamW, linear warm-up then cosine decay, gradient clipping. ``--concat-fraction`` joins a share of the
utterances into long samples, so the model also learns the multi-sentence windows long audio is cut into;
``--telephone-fraction`` passes a share through an 8 kHz channel; ``--vtlp-max-warp`` stretches or squeezes
each sample's mel axis, as a longer or shorter vocal tract would (``augment.py``). ``--init-from`` warm-starts
from a .nemo of the same size (its depth, unless ``--n-layers`` asks for more: the new encoder layers start as
pass-throughs on top, ``depth_growth.py``) and its tokenizer; with a ``--vocab-size`` other than that
tokenizer's, a new tokenizer is trained and the weights carried over to it (``vocab_transfer.py``). From
scratch the tokenizer has 256 pieces unless ``--vocab-size`` says otherwise. ``--snapshot-every`` also writes
the weights every so many steps, for ``average.py``.
A run resumes only with the settings that decide its batches (``--seed``, ``--batch-seconds``, the concat
options, the training manifest, the number of processes) and its model size; a run stopped on an epoch's last
batch resumes with the next epoch, so it trains the batches an uninterrupted run would have.
Mixed precision: float32 master weights; the forward pass runs under bf16 autocast (fp16 with a dynamic loss
scaler where bf16 is unsupported, float32 on CPUs without bf16 instructions); the CTC head and its
log-softmax run in float32, and the losses accumulate in float32. Under ``torchrun`` each process trains its
own batches and gradients are averaged every step (``parallel.py``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm
import torch
import torch.nn.functional as F
from torch import Tensor

from ..asr_model import ASRModel
from ..audio_io import read_audio
from ..checkpoint import Checkpoint, open_checkpoint
from .augment import spec_augment, warp_frequencies
from .data import SAMPLE_RATE, telephone_band
from .depth_growth import deepen
from .evaluate import read_waves, split_wer
from .export import ModelSize, build_model, load_sentencepiece, save_nemo
from .losses import ctc_loss, transducer_loss
from .parallel import Workers, start_workers
from .vocab_transfer import transfer_weights

DEFAULT_VOCAB_SIZE = 256  # tokenizer pieces of a run from scratch


@dataclass(frozen=True)
class Recipe:
    # Tokenizer pieces; None: --init-from's tokenizer as it is, or DEFAULT_VOCAB_SIZE pieces from scratch.
    vocab_size: int | None = None
    max_steps: int = 3000
    batch_seconds: float = 60.0  # audio per batch
    peak_lr: float = 2e-3
    warmup_steps: int = 300
    min_lr_ratio: float = 0.02
    weight_decay: float = 1e-3
    clip_norm: float = 1.0
    ctc_weight: float = 0.3
    tdt_sigma: float = 0.02
    freq_masks: int = 2
    freq_mask_width: int = 12  # mel bins
    time_masks: int = 2
    time_mask_width: int = 25  # 10 ms frames
    noise_snr_db: tuple[float, float] = (20.0, 50.0)
    # Mel axis warped by up to this factor either way (vocal tract length perturbation): new voices from
    # espeak's few. Tried against stage 7's drift on the held-out voice, no clear gain; kept in stages 8-9.
    vtlp_max_warp: float = 0.0
    # Keep the first subsampling conv (1 -> C channels, 3x3: 640 weights, long trained) as it is. Its weights'
    # gradient needs the gradient of the whole first feature map, the costliest backward of a CPU step: a
    # frozen one trains about 1.1x faster (docs/benchmarks.md).
    freeze_input_conv: bool = False
    # Share of samples heard through a telephone-band channel (down to 8 kHz and back): call-centre audio
    # arrives at 8 kHz, and a model that only ever heard full-band espeak loses most words on it.
    telephone_fraction: float = 0.0
    # Share of utterances joined (with pauses) into samples of up to concat_max_s: the service feeds the
    # model windows of up to 30 s of long audio, several sentences each, not only single short sentences.
    concat_fraction: float = 0.0
    concat_max_s: float = 24.0
    concat_gap_s: tuple[float, float] = (0.1, 0.6)
    eval_every: int = 500
    save_every: int = 100
    # Also write RUN/snapshots/step-NNNNN.nemo every this many steps (0: never): the late weights to average
    # (average.py).
    snapshot_every: int = 0
    seed: int = 0


# --- data ---------------------------------------------------------------------------------------------


@dataclass
class Item:
    audio: Path
    text: str
    duration_s: float


MANIFEST_FIELDS: dict[str, type | tuple[type, ...]] = {"audio": str, "text": str, "duration_s": (int, float)}


def read_manifest(data: Path, split: str) -> list[Item]:
    """The split's utterances, every row checked up front: a bad row or a missing file met only when its batch
    loads would stop the run there, and every resumed run at the same place."""
    path = data / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such manifest; build the corpus with python -m models.training.data "
                                "--cache DIR and give that DIR as --data")
    items = [manifest_item(data, f"{path}:{n}", line) for n, line in enumerate(path.read_text().splitlines(), 1)]
    if not items:
        raise ValueError(f"{path}: the manifest has no utterances; build the corpus with --n-train above 0 or "
                         "give another --data")
    return items


def manifest_item(data: Path, where: str, line: str) -> Item:
    """One manifest line (``where``: its file and line number) as an item, or a ValueError that says what to fix."""
    fix = 'each line is one JSON object {"audio": path under --data, "text": words, "duration_s": seconds}'
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc.msg}); {fix}") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a JSON {type(row).__name__}, not an object; {fix}")
    for field, kind in MANIFEST_FIELDS.items():
        if field not in row:
            raise ValueError(f"{where}: no {field!r}; {fix}")
        if not isinstance(row[field], kind) or isinstance(row[field], bool):
            raise ValueError(f"{where}: {field!r} is {row[field]!r}, not a {_kind_name(kind)}; {fix}")
    if not (math.isfinite(row["duration_s"]) and row["duration_s"] > 0):
        raise ValueError(f"{where}: 'duration_s' is {row['duration_s']!r}, not a length in seconds above 0; {fix}")
    audio = data / row["audio"]
    if not audio.is_file():
        raise ValueError(f"{where}: the audio file {audio} does not exist; restore it or remove the row")
    return Item(audio, row["text"], float(row["duration_s"]))


def _kind_name(kind: type | tuple[type, ...]) -> str:
    return "number" if isinstance(kind, tuple) else "string"


Sample = list[Item]  # one training sample: its utterances, spoken one after another


def join_samples(items: list[Item], recipe: Recipe, rng: random.Random) -> list[Sample]:
    """Every utterance once: most alone, ``concat_fraction`` of them joined into samples of 2 or more
    utterances up to ``concat_max_s`` long (with up to ``concat_gap_s[1]`` of pause between them)."""
    shuffled = list(items)
    rng.shuffle(shuffled)
    n_joined = int(len(shuffled) * recipe.concat_fraction)
    samples: list[Sample] = [[it] for it in shuffled[n_joined:]]
    current: Sample = []
    for item in shuffled[:n_joined]:
        if current and _seconds([*current, item], recipe.concat_gap_s[1]) > recipe.concat_max_s:
            samples.append(current)
            current = []
        current.append(item)
    if current:
        samples.append(current)
    return samples


def _seconds(sample: Sample, gap_s: float = 0.0) -> float:
    return sum(it.duration_s for it in sample) + gap_s * (len(sample) - 1)


def epoch_batches(items: list[Item], recipe: Recipe, epoch: int, world: int, manifest: Path) -> list[list[Sample]]:
    """The epoch's batches, a function of (seed, epoch) alone, so a resumed run draws them again. A step takes
    ``world`` consecutive batches, one per process: the last ``len % world`` are left out."""
    rng = random.Random(recipe.seed * 1000 + epoch)
    batches = make_batches(join_samples(items, recipe, rng), recipe.batch_seconds, rng)
    n_steps = len(batches) // world
    if n_steps == 0:  # an epoch without a step would be followed by another, forever
        raise ValueError(f"{manifest}: {len(items)} utterance(s) make {len(batches)} batch(es) of --batch-seconds "
                         f"{recipe.batch_seconds:g}, fewer than the {world} processes that take one each per step: "
                         "an epoch would have 0 steps. Add utterances, lower --batch-seconds or run fewer processes")
    return batches[: n_steps * world]


def make_batches(samples: list[Sample], batch_seconds: float, rng: random.Random) -> list[list[Sample]]:
    """Length-sorted batches of about ``batch_seconds`` of audio (little padding), in random order."""
    ordered = sorted(samples, key=lambda s: _seconds(s) + rng.random() * 0.3)
    batches, current, longest = [], [], 0.0
    for sample in ordered:
        longest = max(longest, _seconds(sample))
        if current and longest * (len(current) + 1) > batch_seconds:
            batches.append(current)
            current, longest = [], _seconds(sample)
        current.append(sample)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def train_tokenizer(text_file: Path, vocab_size: int) -> bytes:
    """SentencePiece BPE on the training text; no bos/eos (NeMo's ASR tokenizers have none)."""
    import io

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(input=str(text_file), model_writer=model, vocab_size=vocab_size,
                                   model_type="bpe", character_coverage=1.0, bos_id=-1, eos_id=-1,
                                   num_threads=2, minloglevel=2)
    return model.getvalue()


# --- model pieces used only in training -------------------------------------------------------------------


def prediction_sequence(model: ASRModel, targets: Tensor) -> Tensor:
    """Prediction network over [start, y1 .. yU] at once: (B, U) -> (B, U+1, H). Start = blank (zeros)."""
    return model.decoder.sequence(F.pad(targets, (1, 0), value=model.decoder.blank_id))


@dataclass
class Batch:
    audio: Tensor  # (B, S) float32
    n_samples: Tensor  # (B,)
    targets: Tensor  # (B, U) padded with 0
    target_lengths: Tensor  # (B,)

    def audio_seconds(self, sample_rate: int) -> float:
        return float(self.n_samples.sum()) / sample_rate


def read_sample(sample: Sample, recipe: Recipe, rng: np.random.Generator) -> np.ndarray:
    """The sample's utterances in order, a random pause of silence between each two."""
    parts: list[np.ndarray] = []
    for i, item in enumerate(sample):
        if i:
            parts.append(np.zeros(int(rng.uniform(*recipe.concat_gap_s) * SAMPLE_RATE), dtype=np.float32))
        parts.append(read_audio(item.audio, SAMPLE_RATE))  # resampled and mixed down as the service does
    return np.concatenate(parts)


def load_batch(samples: list[Sample], sp: spm.SentencePieceProcessor, recipe: Recipe, rng: np.random.Generator,
               augment: bool) -> Batch:
    waves = [read_sample(sample, recipe, rng) for sample in samples]
    if augment:  # some through a telephone channel; white noise at a random SNR: the world is not espeak
        waves = [telephone_band(w) if rng.random() < recipe.telephone_fraction else w for w in waves]
        waves = [w + rng.standard_normal(len(w)).astype(np.float32) * float(np.sqrt(np.mean(w**2) + 1e-9))
                 * 10 ** (-rng.uniform(*recipe.noise_snr_db) / 20) for w in waves]
    lengths = torch.tensor([len(w) for w in waves])
    audio = torch.zeros(len(waves), int(lengths.max()))
    for i, w in enumerate(waves):
        audio[i, : len(w)] = torch.from_numpy(w)
    ids = [sp.encode(" ".join(it.text for it in sample)) for sample in samples]
    targets = torch.zeros(len(ids), max(len(x) for x in ids), dtype=torch.long)
    for i, x in enumerate(ids):
        targets[i, : len(x)] = torch.tensor(x)
    return Batch(audio, lengths, targets, torch.tensor([len(x) for x in ids]))


def compute_losses(model: ASRModel, batch: Batch, recipe: Recipe, gen: torch.Generator | None,
                   amp_dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
    """(TDT, CTC) losses, each summed over the batch and divided by its target tokens."""
    device = model.device
    audio, n_samples = batch.audio.to(device), batch.n_samples.to(device)
    targets, target_lengths = batch.targets.to(device), batch.target_lengths.to(device)
    features, n_frames = model.preprocessor.featurizer(audio, n_samples)  # float32, no grad
    if gen is not None:
        features = warp_frequencies(features, recipe.vtlp_max_warp, gen)
        features = spec_augment(features, n_frames, recipe.freq_masks, recipe.freq_mask_width,
                                recipe.time_masks, recipe.time_mask_width, gen)
    # The subsampling convs run in float32: their bf16 backward is the slower one on CPU (docs/benchmarks.md).
    frames, enc_lengths = model.encoder.subsample(features, n_frames)
    with torch.autocast(device.type, dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
        encoded, enc_lengths = model.encoder.contextualise(frames, enc_lengths)  # (B, T, d)
        enc_proj = model.joint.project_encoder(encoded)  # (B, T, J)
        pred_proj = model.joint.pred(prediction_sequence(model, targets))  # (B, U+1, J)
        ctc_log_probs = float32_ctc_log_probs(model, encoded)  # (B, T, V+1)
        transducer = model.config.transducer
        assert transducer is not None
        tdt = transducer_loss(enc_proj, pred_proj, targets, enc_lengths, target_lengths, model.joint.joint_net,
                              transducer.vocab_size, transducer.durations, recipe.tdt_sigma)
    ctc = ctc_loss(ctc_log_probs, targets, enc_lengths, target_lengths, model.ctc_decoder.blank_id)
    n_tokens = target_lengths.sum().clamp_min(1)
    return tdt.sum() / n_tokens, ctc.sum() / n_tokens


def float32_ctc_log_probs(model: ASRModel, encoded: Tensor) -> Tensor:
    """The CTC head's log-probabilities in float32 under any autocast: CPU autocast leaves the log-softmax in bf16,
    whose probabilities per frame sum to 1 only within about 1%, and the loss adds up hundreds of frames."""
    with torch.autocast(encoded.device.type, enabled=False):
        return model.ctc_decoder(encoded.float())


def train_step(model: ASRModel, batch: Batch, recipe: Recipe, gen: torch.Generator | None,
               amp_dtype: torch.dtype | None, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
               workers: Workers) -> tuple[Tensor, Tensor, Tensor]:
    """Forward, backward, gradients averaged over the processes, clipped, one optimizer step.
    Returns (loss, TDT, CTC)."""
    tdt, ctc = compute_losses(model, batch, recipe, gen, amp_dtype)
    loss = (1 - recipe.ctc_weight) * tdt + recipe.ctc_weight * ctc
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    workers.average_gradients(model.parameters())
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip_norm)
    scaler.step(optimizer)
    scaler.update()
    return loss, tdt, ctc


def initial_model(size: ModelSize, recipe: Recipe, tokenizer_proto: bytes,
                  start: Checkpoint | None = None) -> tuple[ASRModel, dict[str, Any]]:
    """A model of ``size`` for the tokenizer, with ``start``'s weights when given (a checkpoint of the same
    size, or with fewer encoder layers: the new ones start as pass-throughs on top; if its tokenizer is another,
    the vocabulary's rows start from the old pieces that spell the new); the input conv frozen if the recipe
    says so."""
    model, raw_config = build_model(size, tokenizer_proto, tdt_sigma=recipe.tdt_sigma,
                                    ctc_weight=recipe.ctc_weight)
    if start is not None:
        if start.tokenizer_model is None:
            raise ValueError(f"{start.source}: the checkpoint has no SentencePiece tokenizer to train with")
        weights = deepen(start.state_dict, size.n_layers)
        if start.tokenizer_model != tokenizer_proto:
            assert model.config.transducer is not None
            weights = transfer_weights(weights, start.tokenizer_model, tokenizer_proto,
                                       len(model.config.transducer.durations))
        model.load_weights(weights, start.source)
    if recipe.freeze_input_conv:
        model.encoder.pre_encode.input_conv.requires_grad_(False)
    return model, raw_config


def make_optimizer(model: ASRModel, recipe: Recipe) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=recipe.peak_lr, weight_decay=recipe.weight_decay,
                             betas=(0.9, 0.98))


def learning_rate(step: int, recipe: Recipe) -> float:
    if step < recipe.warmup_steps:
        return recipe.peak_lr * (step + 1) / recipe.warmup_steps
    progress = min(1.0, (step - recipe.warmup_steps) / max(1, recipe.max_steps - recipe.warmup_steps))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return recipe.peak_lr * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * cosine)


def pick_precision(device: torch.device, requested: str) -> tuple[torch.dtype | None, bool]:
    """(autocast dtype or None, use a loss scaler).

    auto: on CUDA, bf16 where supported, else fp16 with a scaler. On a CPU, bf16 only where it has bf16
    instructions (AVX-512 BF16 or AMX); without them oneDNN emulates bf16 slower than float32 and refuses
    the LSTM outright, so auto trains in float32 there.
    """
    if requested == "fp32":
        return None, False
    if requested == "fp16":
        return torch.float16, True
    if requested == "bf16":
        return torch.bfloat16, False
    if device.type == "cpu":
        return (torch.bfloat16, False) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (None, False)
    return (torch.bfloat16, False) if torch.cuda.is_bf16_supported() else (torch.float16, True)


def validate(model: ASRModel, valid: list[Item], limit: int = 200) -> dict[str, float]:
    model.eval()
    audio = read_waves(it.audio for it in valid[:limit])
    texts = [it.text for it in valid[:limit]]
    result = {f"wer_{d}": split_wer(model, audio, texts, d) for d in ("tdt", "ctc")}
    model.train()
    return result


# --- loop ---------------------------------------------------------------------------------------------


def _progress(step: int, total: int, loss: float, tdt: float, ctc: float, sec_per_s: float, lr: float) -> None:
    done = int(30 * step / total)
    sys.stderr.write(f"\r[{'#' * done}{'.' * (30 - done)}] {step}/{total} loss {loss:.3f} (tdt {tdt:.3f} "
                     f"ctc {ctc:.3f}) {sec_per_s:.1f} audio-s/s lr {lr:.2e}   ")
    sys.stderr.flush()


def prefetched(batches: list[list[Sample]], load: Callable[[int, list[Sample]], Batch]) -> Iterator[Batch]:
    """Load batch i+1 (file reads, noise) on a second thread while batch i trains."""
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(load, 0, batches[0]) if batches else None
        for i in range(len(batches)):
            assert pending is not None
            batch = pending.result()
            if i + 1 < len(batches):
                pending = pool.submit(load, i + 1, batches[i + 1])
            yield batch


def train(data: Path, out: Path, recipe: Recipe, size: ModelSize, device: torch.device, precision: str,
          time_budget_s: float | None, init_from: Path | None = None, workers: Workers | None = None) -> None:
    workers = workers or Workers()
    say = print if workers.is_main else _quiet
    # What can be refused is refused before a tokenizer is trained or a step taken.
    manifest = data / "train.jsonl"
    train_items, valid_items = read_manifest(data, "train"), read_manifest(data, "valid")
    epoch_batches(train_items, recipe, 0, workers.world, manifest)
    settings = batch_settings(recipe, workers.world, manifest)
    last = out / "last.pt"
    state = torch.load(last, map_location=device, weights_only=False) if last.exists() else None
    if state is not None:
        check_resumable(last, state, settings, size)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(recipe.seed)
    start = open_checkpoint(init_from) if init_from is not None else None
    tokenizer_path = out / "tokenizer.model"
    if workers.is_main and not tokenizer_path.exists():
        tokenizer_path.write_bytes(run_tokenizer(data, recipe, start))
    workers.barrier()
    proto = tokenizer_path.read_bytes()
    sp = load_sentencepiece(proto)
    model, raw_config = initial_model(size, recipe, proto, start)
    if start is not None:  # warm start: its weights; optimizer and schedule anew
        changed = "" if start.tokenizer_model == proto else " (its rows carried over to the new vocabulary)"
        say(f"initialised from {start.source}{changed}", flush=True)
    model.to(device).train()
    amp_dtype, use_scaler = pick_precision(device, precision)
    optimizer = make_optimizer(model, recipe)
    scaler = torch.amp.GradScaler(device.type, enabled=use_scaler)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"{len(train_items)} training utterances ({sum(i.duration_s for i in train_items) / 3600:.1f} h); "
        f"{n_params / 1e6:.2f} M parameters; autocast {amp_dtype}, loss scaler {use_scaler}; "
        f"{workers.world} process(es)", flush=True)

    step, epoch, history = 0, 0, []
    if state is not None:  # resume
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        step, epoch, history = state["step"], state["epoch"], state["history"]
        say(f"resumed at step {step} (epoch {epoch})", flush=True)

    def save() -> None:
        tmp = last.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict(), "step": step, "epoch": epoch, "history": history,
                    "recipe": asdict(recipe), "size": asdict(size), "batch_settings": settings}, tmp)
        tmp.replace(last)

    started = time.monotonic()
    audio_s, window_start = 0.0, time.monotonic()
    stop = False
    while step < recipe.max_steps and not stop:
        # A resumed run draws the epoch's batches again and skips those already trained.
        batches = epoch_batches(train_items, recipe, epoch, workers.world, manifest)
        n_steps, done = len(batches) // workers.world, steps_done(epoch, history)
        if done >= n_steps:  # a last.pt written before the epoch moved on with its last step
            epoch += 1
            continue
        mine = batches[done * workers.world + workers.rank :: workers.world]
        loads = prefetched(mine, lambda i, items, first=step: load_batch(
            items, sp, recipe, np.random.default_rng([first + i, workers.rank]), augment=True))
        for batch in loads:
            if step >= recipe.max_steps:
                break
            gen = torch.Generator().manual_seed(recipe.seed * 7919 + step + 1_000_003 * workers.rank)
            lr = learning_rate(step, recipe)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss, tdt, ctc = train_step(model, batch, recipe, gen, amp_dtype, optimizer, scaler, workers)
            step += 1
            over_budget = time_budget_s is not None and time.monotonic() - started > time_budget_s
            batch_audio, stop = workers.sum([batch.audio_seconds(model.sample_rate), over_budget])
            audio_s += batch_audio
            history.append({"step": step, "epoch": epoch, "loss": round(loss.item(), 4)})
            done += 1
            if done == n_steps:  # the next step starts the next epoch, also after a stop here
                epoch += 1
            if workers.is_main:
                _report(step, recipe, loss, tdt, ctc, audio_s / (time.monotonic() - window_start), lr,
                        time.monotonic() - started)
                if step % recipe.eval_every == 0 or step == recipe.max_steps:
                    result = validate(model, valid_items)
                    history[-1].update(result)
                    print(f"\nstep {step} validation {result}", flush=True)
                if step % recipe.save_every == 0 or step == recipe.max_steps:
                    save()
                if recipe.snapshot_every and step % recipe.snapshot_every == 0:
                    save_nemo(model, raw_config, proto, out / "snapshots" / f"step-{step:05d}.nemo")
            if stop:
                say(f"\ntime budget reached at step {step}; rerun the same command to continue", flush=True)
                break
    if workers.is_main:
        save()
        model.eval()
        save_nemo(model, raw_config, proto, out / "model.nemo")
        print(f"\nwrote {out / 'model.nemo'}", flush=True)
    workers.barrier()


def _quiet(*args: object, **kwargs: object) -> None:
    """print() for the processes that are not the first: they stay silent."""


def _report(step: int, recipe: Recipe, loss: Tensor, tdt: Tensor, ctc: Tensor, rate: float, lr: float,
            elapsed_s: float) -> None:
    _progress(step, recipe.max_steps, loss.item(), tdt.item(), ctc.item(), rate, lr)
    if step % 50 == 0:
        print(f"\nstep {step} loss {loss.item():.3f} tdt {tdt.item():.3f} ctc {ctc.item():.3f} "
              f"{rate:.1f} audio-s/s elapsed {elapsed_s:.0f}s", flush=True)


def steps_done(epoch: int, history: list[dict]) -> int:
    """Steps of ``epoch`` already trained (from the per-step history)."""
    return sum(1 for h in history if h["epoch"] == epoch)


def run_tokenizer(data: Path, recipe: Recipe, start: Checkpoint | None) -> bytes:
    """``start``'s tokenizer unless ``recipe.vocab_size`` asks for another number of pieces; else one trained on
    the corpus text (DEFAULT_VOCAB_SIZE pieces unless asked)."""
    reuse = start.tokenizer_model if start is not None else None
    if reuse is not None and recipe.vocab_size in (None, load_sentencepiece(reuse).get_piece_size()):
        return reuse
    pieces = DEFAULT_VOCAB_SIZE if recipe.vocab_size is None else recipe.vocab_size
    return train_tokenizer(data / "train_text.txt", pieces)


# The recipe's settings that decide which utterances each step trains on.
BATCH_FIELDS = ("seed", "batch_seconds", "concat_fraction", "concat_max_s", "concat_gap_s")
PROCESSES = "processes (torchrun --nproc-per-node)"


def batch_settings(recipe: Recipe, world: int, manifest: Path) -> dict[str, Any]:
    """What decides the batches of every step, by the option that sets it; stored in last.pt, since resuming
    with others would skip or repeat utterances."""
    settings: dict[str, Any] = {_option(field): getattr(recipe, field) for field in BATCH_FIELDS}
    settings["--data"] = f"{manifest.name} sha256 {hashlib.sha256(manifest.read_bytes()).hexdigest()[:16]}"
    settings[PROCESSES] = world
    return settings


def check_resumable(last: Path, state: dict[str, Any], settings: dict[str, Any], size: ModelSize) -> None:
    """Refuse to resume a run with other batch settings or another model size, naming each and both values.
    A last.pt written before the settings were stored is checked on the recipe and size it holds."""
    recipe = state.get("recipe", {})
    stored = state.get("batch_settings") or {_option(f): recipe[f] for f in BATCH_FIELDS if f in recipe}
    stored_size = state.get("size", {})
    differ = [(name, stored[name], now) for name, now in settings.items() if name in stored and stored[name] != now]
    differ += [(_option(field), stored_size[field], now) for field, now in asdict(size).items()
               if field in stored_size and stored_size[field] != now]
    if differ:
        listed = ", ".join(f"{name} {before} (this command: {now})" for name, before, now in differ)
        raise ValueError(f"{last}: the run was trained with {listed}; resume it with the run's settings, or give "
                         "another --out to start a new run")


def _option(field: str) -> str:
    return f"--{field.replace('_', '-')}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="corpus from models.training.data")
    parser.add_argument("--out", type=Path, required=True, help="run directory: checkpoints, model.nemo")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precision", choices=["auto", "bf16", "fp16", "fp32"], default="auto")
    # One thread: on a shared 2-core machine, two OpenMP threads spin-wait on each other and each small op
    # gets ~10x slower (measured).
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--time-budget-s", type=float, default=None, help="stop (resumable) after this long")
    parser.add_argument("--init-from", type=Path, default=None,
                        help="a .nemo of the same size to start from: its weights, and its tokenizer unless "
                             "--vocab-size asks for another size (then a new one, its rows started from the old "
                             "pieces')")
    for name, value in asdict(Recipe()).items():
        if name == "vocab_size":
            parser.add_argument("--vocab-size", type=int, default=None,
                                help=f"tokenizer pieces (default: --init-from's tokenizer, or {DEFAULT_VOCAB_SIZE} "
                                     "from scratch)")
        elif isinstance(value, bool):
            parser.add_argument(_option(name), action=argparse.BooleanOptionalAction, default=value)
        elif not isinstance(value, tuple):
            parser.add_argument(_option(name), type=type(value), default=value)
    for name, value in asdict(ModelSize()).items():
        if name == "n_layers":
            parser.add_argument("--n-layers", type=int, default=None,
                                help=f"encoder depth (default: --init-from's, or {value} from scratch; more than "
                                     "--init-from's grows it)")
        else:
            parser.add_argument(_option(name), type=type(value), default=value)
    args = vars(parser.parse_args())
    torch.set_num_threads(args["threads"])
    recipe = Recipe(**{k: args[k] for k in asdict(Recipe()) if k in args})
    if args["n_layers"] is None:  # a warm start keeps its depth unless asked to grow it
        args["n_layers"] = (open_checkpoint(args["init_from"]).config.encoder.n_layers
                            if args["init_from"] is not None else ModelSize.n_layers)
    size = ModelSize(**{k: args[k] for k in asdict(ModelSize())})
    device = torch.device("cuda" if args["device"] == "auto" and torch.cuda.is_available() else
                          "cpu" if args["device"] == "auto" else args["device"])
    if device.type == "cuda" and "LOCAL_RANK" in os.environ:  # torchrun: one GPU per process
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    workers = start_workers(device)
    try:
        train(args["data"], args["out"], recipe, size, device, args["precision"], args["time_budget_s"],
              args["init_from"], workers)
    finally:
        workers.close()


if __name__ == "__main__":
    main()
