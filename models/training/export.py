"""The trained model as a NeMo ``.nemo`` archive: config, weights under NeMo's key names, tokenizer.

Layout (what NeMo writes and ``models.checkpoint`` reads): ``./model_config.yaml``, ``./model_weights.ckpt``
(a torch-saved state dict) and ``./<hex>_tokenizer.model``, referenced from the config as
``tokenizer.model_path: nemo:<hex>_tokenizer.model``.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sentencepiece as spm
import torch
import yaml
from torch import Tensor

from ..asr_model import ASRModel
from ..config import parse_model_config
from ..nemo_layout import TDT_DURATIONS, nemo_config
from ..tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelSize:
    d_model: int = 144
    n_layers: int = 6
    n_heads: int = 4
    conv_kernel: int = 9
    subsampling_channels: int = 64  # the 2-D convs at 1/2 and 1/4 rate dominate CPU training time
    pred_hidden: int = 160
    joint_hidden: int = 160
    n_mels: int = 80


def training_config(size: ModelSize, vocabulary: list[str], *, tdt_sigma: float,
                    ctc_weight: float) -> dict[str, Any]:
    """The hybrid TDT-CTC config NeMo's class reads, with its training sections (tokenizer, losses, labels)."""
    cfg = nemo_config("hybrid_tdt_ctc", vocab_size=len(vocabulary), vocabulary=vocabulary, n_mels=size.n_mels,
                      d_model=size.d_model, n_layers=size.n_layers, n_heads=size.n_heads,
                      conv_kernel=size.conv_kernel, subsampling_channels=size.subsampling_channels,
                      pred_hidden=size.pred_hidden, joint_hidden=size.joint_hidden)
    cfg["labels"] = list(vocabulary)
    cfg["tokenizer"] = {"dir": None, "type": "bpe", "model_path": None}  # set by save_nemo
    cfg["loss"] = {"loss_name": "tdt", "tdt_kwargs": {"durations": list(TDT_DURATIONS), "sigma": tdt_sigma,
                                                      "omega": 0.0}}
    cfg["aux_ctc"].update(ctc_loss_weight=ctc_weight, use_cer=False)
    return cfg


def load_sentencepiece(tokenizer_proto: bytes) -> spm.SentencePieceProcessor:
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(tokenizer_proto)
    return sp


def build_model(size: ModelSize, tokenizer_proto: bytes, *, tdt_sigma: float,
                ctc_weight: float) -> tuple[ASRModel, dict[str, Any]]:
    """A fresh model and its raw config; the loss settings come from the recipe (``train.Recipe``)."""
    sp = load_sentencepiece(tokenizer_proto)
    vocabulary = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    raw = training_config(size, vocabulary, tdt_sigma=tdt_sigma, ctc_weight=ctc_weight)
    return ASRModel(parse_model_config(raw), Tokenizer(tokenizer_proto)), raw


def fits_float16(weights: Tensor) -> bool:
    """Whether every finite value stays finite as float16 (magnitudes below 65520: they round to 65504 at most)."""
    return bool((weights.to(torch.float16).isfinite() | ~weights.isfinite()).all())


def float16_keeping_bfloat16(weights: Tensor) -> Tensor:
    """float32 weights as float16, each the nearest float16 that rounds to the same bfloat16 as the weight.

    Plain rounding lands exactly on a point halfway between two bfloat16s for about one weight in sixteen, and
    bf16 loading then rounds it to the even one, which may be the wrong side: the model a float16 file gives in
    bf16 would differ from the one its float32 weights give. Such a weight moves one float16 step to its own
    side instead (at most 2^-10 relative error, against 2^-11). Below float16's normal range (|w| < 2^-14)
    its steps may be too coarse to find one. Values beyond float16's range are refused: they would become inf."""
    if not fits_float16(weights):
        raise ValueError(f"weights of magnitude up to {weights.abs().max().item():g} lie beyond float16's range "
                         "(65504): keep such a tensor in float32")
    half = weights.to(torch.float16)
    wrong_side = half.to(torch.bfloat16) != weights.to(torch.bfloat16)
    half_value = half.float()
    _, exponent = torch.frexp(half_value)
    step = torch.ldexp(torch.ones_like(weights), (exponent - 11).clamp_min(-24))  # one float16 ulp at half
    nudged = (half_value + torch.sign(weights - half_value) * step).to(torch.float16)
    return torch.where(wrong_side, nudged, half)


def tokenizer_artifacts(tokenizer_proto: bytes) -> dict[str, tuple[str, bytes]]:
    """The tokenizer members NeMo's BPE models register, keyed by their ``tokenizer`` config field:
    the SentencePiece model, its ``piece<TAB>score`` listing (``tokenizer.vocab``) and ``vocab.txt`` (the pieces
    but ``<unk>`` and control pieces, one a line), as NeMo's tokenizer script writes them. NeMo refuses a
    checkpoint without ``vocab_path``; batchasr reads only the model."""
    sp = load_sentencepiece(tokenizer_proto)
    pieces = range(sp.get_piece_size())
    listing = "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in pieces)
    plain = "".join(f"{sp.id_to_piece(i)}\n" for i in pieces if not (sp.is_unknown(i) or sp.is_control(i)))
    prefix = hashlib.sha1(tokenizer_proto).hexdigest()[:32]
    return {"model_path": (f"{prefix}_tokenizer.model", tokenizer_proto),
            "spe_tokenizer_vocab": (f"{prefix}_tokenizer.vocab", listing.encode()),
            "vocab_path": (f"{prefix}_vocab.txt", plain.encode())}


def save_nemo(model: ASRModel, raw_config: dict[str, Any], tokenizer_proto: bytes, path: Path,
              weights_dtype: torch.dtype = torch.float32, compress: bool = False) -> None:
    """Write a .nemo archive (weights on CPU, floats as ``weights_dtype``) atomically. float16 halves the file
    (the loader casts to the precision asked for) and rounds a weight by at most 2^-10, never across a bfloat16
    rounding boundary (``float16_keeping_bfloat16``); a tensor with values beyond float16's range stays float32,
    as the preprocessor's buffers do (loading casts each tensor to the model's dtype). NeMo reads
    the archive too (``restore_from``). A plain tar, as NeMo writes: ``compress=True`` gzips it, which gains
    nothing on random weights and a tenth on the trained default model's float16 ones (13.5 MB to 12.2), at
    about a minute a gigabyte: every training snapshot paid it."""
    artifacts = tokenizer_artifacts(tokenizer_proto)
    tokenizer = dict(raw_config["tokenizer"], **{field: f"nemo:{name}" for field, (name, _) in artifacts.items()})
    config = dict(raw_config, tokenizer=tokenizer)

    def stored(key: str, value: Tensor) -> Tensor:
        value = value.detach().to("cpu")
        if not value.is_floating_point() or key.startswith("preprocessor."):
            return value.clone()  # the feature extractor's window and mel filters run in float32 in any precision
        if weights_dtype == torch.float16:
            if not fits_float16(value):
                return value.float().clone()  # as float16 some weights would be inf
            return float16_keeping_bfloat16(value.float())
        return value.to(weights_dtype).clone()

    state = {k: stored(k, v) for k, v in model.state_dict().items()}
    weights = io.BytesIO()
    torch.save(state, weights)
    members = {"model_config.yaml": yaml.safe_dump(config, sort_keys=False).encode(),
               "model_weights.ckpt": weights.getvalue(), **dict(artifacts.values())}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tarfile.open(tmp, "w:gz" if compress else "w") as tar:
        for member, data in members.items():
            info = tarfile.TarInfo(f"./{member}")
            info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
            tar.addfile(info, io.BytesIO(data))
    tmp.replace(path)
