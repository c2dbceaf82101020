"""Published Parakeet architectures, built from config alone with random weights (benchmarks and tests).

Each entry is the part of the model's published NeMo config that shapes the computation, in NeMo's own
layout, so it goes through the same parser as a real checkpoint. Weights are random: the models compute at
full size and speed but say nothing meaningful. A blank bias steers greedy decoding toward a realistic
label rate.
"""

from __future__ import annotations

from typing import Any

import torch

from .asr_model import ASRModel, resolve_device, resolve_dtype
from .config import parse_model_config

_DURATIONS = [0, 1, 2, 3, 4]


def _nemo_config(target: str, *, n_mels: int, d_model: int, n_layers: int, xscaling: bool, use_bias: bool,
                 vocab_size: int, pred_layers: int = 2, tdt: bool = False, ctc_only: bool = False,
                 hybrid: bool = False) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "target": f"nemo.collections.asr.models.{target}",
        "sample_rate": 16000,
        "preprocessor": {"sample_rate": 16000, "normalize": "per_feature", "window_size": 0.025,
                         "window_stride": 0.01, "window": "hann", "features": n_mels, "n_fft": 512,
                         "frame_splicing": 1, "dither": 1e-5, "pad_to": 0, "pad_value": 0.0},
        "encoder": {"feat_in": n_mels, "feat_out": -1, "n_layers": n_layers, "d_model": d_model,
                    "subsampling": "dw_striding", "subsampling_factor": 8, "subsampling_conv_channels": 256,
                    "ff_expansion_factor": 4, "self_attention_model": "rel_pos", "n_heads": 8,
                    "att_context_size": [-1, -1], "xscaling": xscaling, "untie_biases": True,
                    "pos_emb_max_len": 5000, "conv_kernel_size": 9, "conv_norm_type": "batch_norm",
                    "use_bias": use_bias},
    }
    ctc_decoder = {"_target_": "nemo.collections.asr.modules.ConvASRDecoder", "feat_in": d_model,
                   "num_classes": vocab_size}
    if ctc_only:
        cfg["decoder"] = ctc_decoder
        return cfg
    cfg["decoder"] = {"_target_": "nemo.collections.asr.modules.RNNTDecoder", "blank_as_pad": True,
                      "vocab_size": vocab_size, "prednet": {"pred_hidden": 640, "pred_rnn_layers": pred_layers}}
    cfg["joint"] = {"num_classes": vocab_size, "num_extra_outputs": len(_DURATIONS) if tdt else 0,
                    "jointnet": {"joint_hidden": 640, "activation": "relu", "encoder_hidden": d_model,
                                 "pred_hidden": 640}}
    cfg["decoding"] = {"strategy": "greedy_batch", "greedy": {"max_symbols": 10}}
    if tdt:
        cfg["decoding"].update(model_type="tdt", durations=_DURATIONS)
    if hybrid:
        cfg["aux_ctc"] = {"decoder": ctc_decoder}
    return cfg


ARCHITECTURES: dict[str, dict[str, Any]] = {
    "parakeet-tdt-0.6b-v2": _nemo_config("rnnt_bpe_models.EncDecRNNTBPEModel", n_mels=128, d_model=1024,
                                         n_layers=24, xscaling=False, use_bias=False, vocab_size=1024, tdt=True),
    "parakeet-tdt-0.6b-v3": _nemo_config("rnnt_bpe_models.EncDecRNNTBPEModel", n_mels=128, d_model=1024,
                                         n_layers=24, xscaling=False, use_bias=False, vocab_size=8192, tdt=True),
    "parakeet-rnnt-1.1b": _nemo_config("rnnt_bpe_models.EncDecRNNTBPEModel", n_mels=80, d_model=1024,
                                       n_layers=42, xscaling=True, use_bias=True, vocab_size=1024),
    "parakeet-ctc-1.1b": _nemo_config("ctc_bpe_models.EncDecCTCModelBPE", n_mels=80, d_model=1024,
                                      n_layers=42, xscaling=True, use_bias=True, vocab_size=1024, ctc_only=True),
    "parakeet-tdt_ctc-110m": _nemo_config("hybrid_rnnt_ctc_bpe_models.EncDecHybridRNNTCTCBPEModel", n_mels=80,
                                          d_model=512, n_layers=17, xscaling=False, use_bias=True,
                                          vocab_size=1024, pred_layers=1, tdt=True, hybrid=True),
}


def build_random_model(name: str, device: str | torch.device = "auto", dtype: str | torch.dtype = "auto",
                       seed: int = 0, blank_bias: float = 0.0) -> ASRModel:
    """A named architecture with random weights (see ``ARCHITECTURES``).

    ``blank_bias`` is added to the blank logit of every head, to set how often greedy decoding emits a label.
    """
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {name!r}; built-in: {', '.join(ARCHITECTURES)}")
    target_device = resolve_device(device)
    target_dtype = resolve_dtype(dtype, target_device)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = ASRModel(parse_model_config(ARCHITECTURES[name]))
        _randomize_batch_norm(model)
    finally:
        torch.random.set_rng_state(generator_state)
    with torch.no_grad():
        if model.config.transducer is not None:
            model.joint.joint_net[-1].bias[model.config.vocab_size] += blank_bias
        head = model.ctc_head
        if head is not None:
            head.decoder_layers[0].bias[head.blank_id] += blank_bias
    return model.to_precision(target_device, target_dtype)


def _randomize_batch_norm(model: ASRModel) -> None:
    """Fresh BatchNorm running stats are (0, 1); give them a spread so the encoder is not degenerate."""
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm1d):
            module.running_mean.normal_(0.0, 0.1)
            module.running_var.uniform_(0.5, 1.5)
