"""The batch the GPU features start from: waveforms copied into their rows on the device, zeros after them."""

from __future__ import annotations

import numpy as np
import torch

from models import load_model


def test_features_on_cuda_match_cpu_for_a_ragged_batch(parity_dir):
    rng = np.random.default_rng(0)
    waves = [(rng.standard_normal(n) * 0.1).astype(np.float32) for n in (16000, 1, 0, 23457, 4000)]
    waves.append(rng.standard_normal(8000).astype(np.float64))  # not float32: converted on the way
    on_cpu = load_model(parity_dir / "tdt.nemo", device="cpu", dtype="float32")
    on_gpu = load_model(parity_dir / "tdt.nemo", device="cuda", dtype="float32")
    features_cpu, frames_cpu = on_cpu.featurize(waves)
    features_gpu, frames_gpu = on_gpu.featurize(waves)
    assert torch.equal(frames_gpu.cpu(), frames_cpu)
    for row, n in enumerate(frames_cpu.tolist()):  # padded frames hold whatever the padding value is on both
        torch.testing.assert_close(features_gpu[row, :, :n].cpu(), features_cpu[row, :, :n], atol=1e-4, rtol=1e-4)
