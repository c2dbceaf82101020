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
from .nemo_layout import nemo_config

ARCHITECTURES: dict[str, dict[str, Any]] = {
    "parakeet-tdt-0.6b-v2": nemo_config("tdt", n_mels=128, d_model=1024, n_layers=24, xscaling=False,
                                        use_bias=False, vocab_size=1024, pred_layers=2),
    "parakeet-tdt-0.6b-v3": nemo_config("tdt", n_mels=128, d_model=1024, n_layers=24, xscaling=False,
                                        use_bias=False, vocab_size=8192, pred_layers=2),
    "parakeet-rnnt-1.1b": nemo_config("rnnt", n_mels=80, d_model=1024, n_layers=42, vocab_size=1024,
                                      pred_layers=2),
    "parakeet-ctc-1.1b": nemo_config("ctc", n_mels=80, d_model=1024, n_layers=42, vocab_size=1024),
    "parakeet-tdt_ctc-110m": nemo_config("hybrid_tdt_ctc", n_mels=80, d_model=512, n_layers=17, xscaling=False,
                                         vocab_size=1024),
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
        _centre_subsampling(model)
    finally:
        torch.random.set_rng_state(generator_state)
    with torch.no_grad():
        if model.config.transducer is not None:
            model.joint.joint_net[-1].bias[model.config.vocab_size] += blank_bias
        head = model.ctc_head
        if head is not None:
            head.decoder_layers[0].bias[head.blank_id] += blank_bias
    return model.to_precision(target_device, target_dtype)


@torch.no_grad()
def _centre_subsampling(model: ASRModel, n_frames: int = 800) -> None:
    """Remove the constant part of the subsampling's output, and scale what varies to unit spread.

    Random convolutions after ReLUs put a large constant vector on every frame (about six times what the input
    moves); the conformer layers keep little else, and every frame ends up with nearly the same output (its
    spread over time is about 3% of its size), so greedy decoding would take the same decision on every frame:
    all labels or none. Measured on normal noise, which is what per-feature normalised log-mels look like.
    """
    encoder = model.encoder
    features = torch.randn(1, encoder.cfg.feat_in, n_frames)
    frames, _ = encoder.pre_encode(features.transpose(1, 2), torch.tensor([n_frames]))
    mean, spread = frames[0].mean(dim=0), (frames[0] - frames[0].mean(dim=0)).std()
    out = encoder.pre_encode.out
    out.bias.sub_(mean).div_(spread)
    out.weight.div_(spread)


def _randomize_batch_norm(model: ASRModel) -> None:
    """Fresh BatchNorm running stats are (0, 1); give them a spread so the encoder is not degenerate."""
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm1d):
            module.running_mean.normal_(0.0, 0.1)
            module.running_var.uniform_(0.5, 1.5)
