"""Warm start into a deeper encoder: a trained model's weights for a model with more conformer layers.

The new layers go on top of the encoder, each a copy of the old top layer whose four residual branches end in
zeroed projections, so that it passes its input through to its final LayerNorm unchanged. The old top layer's
final LayerNorm (the encoder's output scale and shift) moves to the new top layer, and every LayerNorm below
it becomes a plain normalisation; a LayerNorm of an already normalised vector is that vector (to float
rounding), so the grown model computes what the trained one did. Training starts from the trained model's
word error rate, not from a worse one, and the zeroed projections get gradients at once, because the copied
layers feed them real features.
"""

from __future__ import annotations

import torch
from torch import Tensor

LAYER = "encoder.layers.{}."
RESIDUAL_OUTPUTS = ("feed_forward1.linear2", "self_attn.linear_out", "conv.pointwise_conv2",
                    "feed_forward2.linear2")
FINAL_NORM = "norm_out"


def encoder_depth(weights: dict[str, Tensor]) -> int:
    layers = {int(k.split(".")[2]) for k in weights if k.startswith("encoder.layers.")}
    return max(layers) + 1 if layers else 0


def deepen(weights: dict[str, Tensor], n_layers: int) -> dict[str, Tensor]:
    """``weights`` with conformer layers added on top of the encoder up to ``n_layers``, computing the same
    function."""
    old_layers = encoder_depth(weights)
    if n_layers < old_layers:
        raise ValueError(f"cannot grow a {old_layers}-layer encoder to {n_layers} layers")
    top = LAYER.format(old_layers - 1)
    top_layer = {k[len(top):]: v for k, v in weights.items() if k.startswith(top)}
    grown = dict(weights)
    for index in range(old_layers, n_layers):
        for name, value in top_layer.items():
            zeroed = name.startswith(RESIDUAL_OUTPUTS)
            grown[LAYER.format(index) + name] = torch.zeros_like(value) if zeroed else value.clone()
    for index in range(old_layers - 1, n_layers - 1):  # every LayerNorm under the new top one: plain
        grown[LAYER.format(index) + FINAL_NORM + ".weight"] = torch.ones_like(top_layer[FINAL_NORM + ".weight"])
        grown[LAYER.format(index) + FINAL_NORM + ".bias"] = torch.zeros_like(top_layer[FINAL_NORM + ".bias"])
    return grown
