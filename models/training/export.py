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

from ..asr_model import ASRModel
from ..config import parse_model_config
from ..tokenizer import Tokenizer

TARGET = "nemo.collections.asr.models.hybrid_rnnt_ctc_bpe_models.EncDecHybridRNNTCTCBPEModel"
DURATIONS = [0, 1, 2, 3, 4]


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


def nemo_config(size: ModelSize, vocabulary: list[str], tokenizer_file: str | None = None,
                tdt_sigma: float = 0.02, ctc_weight: float = 0.3) -> dict[str, Any]:
    """A hybrid TDT-CTC config in NeMo's layout (the sections NeMo's class reads, training ones included)."""
    v = len(vocabulary)
    return {
        "target": TARGET,
        "sample_rate": 16000,
        "labels": list(vocabulary),  # copies: one shared list would be written as YAML anchors
        "tokenizer": {"dir": None, "type": "bpe",
                      "model_path": f"nemo:{tokenizer_file}" if tokenizer_file else None},
        "preprocessor": {"_target_": "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor",
                         "sample_rate": 16000, "normalize": "per_feature", "window_size": 0.025,
                         "window_stride": 0.01, "window": "hann", "features": size.n_mels, "n_fft": 512,
                         "log": True, "frame_splicing": 1, "dither": 1e-5, "pad_to": 0, "pad_value": 0.0},
        "encoder": {"_target_": "nemo.collections.asr.modules.ConformerEncoder", "feat_in": size.n_mels,
                    "feat_out": -1, "n_layers": size.n_layers, "d_model": size.d_model,
                    "subsampling": "dw_striding", "subsampling_factor": 8,
                    "subsampling_conv_channels": size.subsampling_channels, "causal_downsampling": False,
                    "ff_expansion_factor": 4, "self_attention_model": "rel_pos", "n_heads": size.n_heads,
                    "att_context_size": [-1, -1], "xscaling": True, "untie_biases": True,
                    "pos_emb_max_len": 5000, "conv_kernel_size": size.conv_kernel,
                    "conv_norm_type": "batch_norm", "conv_context_size": None, "use_bias": True,
                    "dropout": 0.0, "dropout_pre_encoder": 0.0, "dropout_emb": 0.0, "dropout_att": 0.0},
        "decoder": {"_target_": "nemo.collections.asr.modules.RNNTDecoder", "normalization_mode": None,
                    "random_state_sampling": False, "blank_as_pad": True, "vocab_size": v,
                    "prednet": {"pred_hidden": size.pred_hidden, "pred_rnn_layers": 1, "t_max": None,
                                "dropout": 0.0}},
        "joint": {"_target_": "nemo.collections.asr.modules.RNNTJoint", "log_softmax": None,
                  "preserve_memory": False, "fuse_loss_wer": False, "num_classes": v,
                  "num_extra_outputs": len(DURATIONS), "vocabulary": list(vocabulary),
                  "jointnet": {"joint_hidden": size.joint_hidden, "activation": "relu", "dropout": 0.0,
                               "encoder_hidden": size.d_model, "pred_hidden": size.pred_hidden}},
        "decoding": {"strategy": "greedy_batch", "model_type": "tdt", "durations": DURATIONS,
                     "greedy": {"max_symbols": 10}},
        "loss": {"loss_name": "tdt", "tdt_kwargs": {"durations": list(DURATIONS), "sigma": tdt_sigma, "omega": 0.0}},
        "aux_ctc": {"ctc_loss_weight": ctc_weight, "use_cer": False,
                    "decoder": {"_target_": "nemo.collections.asr.modules.ConvASRDecoder",
                                "feat_in": size.d_model, "num_classes": v, "vocabulary": list(vocabulary)},
                    "decoding": {"strategy": "greedy_batch"}},
    }


def build_model(size: ModelSize, tokenizer_proto: bytes) -> tuple[ASRModel, dict[str, Any]]:
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(tokenizer_proto)
    vocabulary = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    raw = nemo_config(size, vocabulary)
    return ASRModel(parse_model_config(raw), Tokenizer(tokenizer_proto)), raw


def save_nemo(model: ASRModel, raw_config: dict[str, Any], tokenizer_proto: bytes, path: Path) -> None:
    """Write a .nemo archive (weights float32, on CPU) atomically."""
    name = f"{hashlib.sha1(tokenizer_proto).hexdigest()[:32]}_tokenizer.model"
    config = dict(raw_config, tokenizer=dict(raw_config["tokenizer"], model_path=f"nemo:{name}"))
    state = {k: v.detach().to("cpu", torch.float32).clone() for k, v in model.state_dict().items()}
    weights = io.BytesIO()
    torch.save(state, weights)
    members = {"model_config.yaml": yaml.safe_dump(config, sort_keys=False).encode(),
               "model_weights.ckpt": weights.getvalue(), name: tokenizer_proto}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for member, data in members.items():
            info = tarfile.TarInfo(f"./{member}")
            info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
            tar.addfile(info, io.BytesIO(data))
    tmp.replace(path)
