"""Transducer losses against brute force: every alignment of a tiny lattice enumerated, loss and gradients."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from models.training.losses import ctc_loss, transducer_loss

V, J = 3, 5  # labels without blank (blank = V), joint hidden size


def _setup(seed: int, n_durations: int, t_lens: list[int], targets: list[list[int]]):
    gen = torch.Generator().manual_seed(seed)
    batch, n_frames, n_u = len(t_lens), max(t_lens), max(len(t) for t in targets)
    enc = torch.randn(batch, n_frames, J, generator=gen, dtype=torch.float64, requires_grad=True)
    pred = torch.randn(batch, n_u + 1, J, generator=gen, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(seed)
    joint = nn.Sequential(nn.Tanh(), nn.Linear(J, V + 1 + n_durations)).double()
    padded = torch.tensor([t + [0] * (n_u - len(t)) for t in targets])
    return enc, pred, joint, padded, torch.tensor(t_lens), torch.tensor([len(t) for t in targets])


def _brute_force(logits: Tensor, target: list[int], n_frames: int, durations: tuple[int, ...],
                 sigma: float) -> Tensor:
    """-log of the sum over every path, walked forward from (0, 0). logits: (T, U+1, V+1+D) of one sample."""
    labels = logits[..., : V + 1].log_softmax(-1) - sigma
    dur = logits[..., V + 1 :].log_softmax(-1) if durations else None
    n_u = len(target)
    paths: list[Tensor] = []

    def walk(t: int, u: int, score: Tensor) -> None:
        if not durations:  # RNN-T
            if u < n_u:
                walk(t, u + 1, score + labels[t, u, target[u]])
            if t == n_frames - 1 and u == n_u:
                paths.append(score + labels[t, u, V])
            elif t < n_frames - 1:
                walk(t + 1, u, score + labels[t, u, V])
            return
        for n, d in enumerate(durations):
            if u < n_u and t + d < n_frames:
                walk(t + d, u + 1, score + labels[t, u, target[u]] + dur[t, u, n])
            if d > 0 and t + d == n_frames and u == n_u:
                paths.append(score + labels[t, u, V] + dur[t, u, n])
            elif d > 0 and t + d < n_frames:
                walk(t + d, u, score + labels[t, u, V] + dur[t, u, n])

    walk(0, 0, logits.new_zeros(()))
    return -torch.stack(paths).logsumexp(0)


CASES = [  # (frames per sample, targets per sample)
    ([3], [[1, 2]]),
    ([4, 2], [[0, 2, 1], [1]]),
    ([1, 3], [[2], []]),
]


@pytest.mark.parametrize("durations,sigma", [((), 0.0), ((0, 1, 2), 0.0), ((0, 1, 2, 4), 0.05)])
@pytest.mark.parametrize("t_lens,targets", CASES)
@pytest.mark.parametrize("chunk_elements", [1, 1 << 20])
def test_loss_and_gradients_equal_brute_force(durations, sigma, t_lens, targets, chunk_elements):
    enc, pred, joint, padded, enc_len, tgt_len = _setup(len(t_lens) + len(durations), len(durations), t_lens,
                                                        targets)
    loss = transducer_loss(enc, pred, padded, enc_len, tgt_len, joint, V, durations, sigma, chunk_elements)
    params = [enc, pred, *joint.parameters()]
    grads = torch.autograd.grad(loss.sum(), params)

    logits = joint(enc[:, :, None] + pred[:, None])
    expected = torch.stack([_brute_force(logits[b], targets[b], t_lens[b], durations, sigma)
                            for b in range(len(t_lens))])
    expected_grads = torch.autograd.grad(expected.sum(), params)
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bf16_joint_accumulates_in_float32():
    enc, pred, joint, padded, enc_len, tgt_len = _setup(0, 3, [4, 2], [[0, 2, 1], [1]])
    joint = joint.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = transducer_loss(enc.float(), pred.float(), padded, enc_len, tgt_len, joint, V, (0, 1, 2))
    assert loss.dtype == torch.float32
    loss.sum().backward()
    assert enc.grad is not None and torch.isfinite(enc.grad).all()
    reference = transducer_loss(enc, pred, padded, enc_len, tgt_len, joint.double(), V, (0, 1, 2))
    torch.testing.assert_close(loss.double(), reference, atol=0.1, rtol=0.05)


def test_ctc_loss_is_per_sample_float32():
    log_probs = torch.randn(2, 6, V + 1).log_softmax(-1).bfloat16()
    loss = ctc_loss(log_probs, torch.tensor([[0, 1], [2, 0]]), torch.tensor([6, 4]), torch.tensor([2, 1]), V)
    assert loss.shape == (2,) and loss.dtype == torch.float32
