"""Comparing transcripts that should be the same: everything exactly, but the scores to within their rounding;
and token scores against the search that chose the tokens (CPU and GPU tests alike: no audio file read here).

Token log-probabilities move with the batch a recording shares: padding changes the encoder's sums by a rounding
(about 1e-5), which the joint can grow to a few 1e-4 for an unsure token. Tokens, frames and words cannot move.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from decoding.types import Hypothesis

SCORE_KEYS = {"confidence", "probability", "logprob", "token_logprobs", "avg_logprob"}
SCORE_TOLERANCE = 1e-3  # absolute; or 1% of the score


def assert_same_but_scores(a: Any, b: Any, path: str = "") -> None:
    """``a == b``, where scores (``SCORE_KEYS``, as dict keys or dataclass fields) may differ by
    ``SCORE_TOLERANCE`` or 1%."""
    a, b = _plain(a), _plain(b)
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), f"{path}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            where = f"{path}.{key}"
            if key in SCORE_KEYS:
                _assert_close(a[key], b[key], where)
            else:
                assert_same_but_scores(a[key], b[key], where)
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), f"{path}: {len(a)} items != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_but_scores(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return list(value) if isinstance(value, tuple) else value


def _assert_close(a: Any, b: Any, path: str) -> None:
    if isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), f"{path}: {len(a)} scores != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_close(x, y, f"{path}[{i}]")
        return
    if a is None or b is None:
        assert a is b, f"{path}: {a!r} != {b!r}"
        return
    assert math.isclose(a, b, rel_tol=0.01, abs_tol=SCORE_TOLERANCE), f"{path}: {a} != {b}"


def replayed_logprobs(encoded: torch.Tensor, hyp: Hypothesis, prediction, joint) -> list[torch.Tensor]:
    """The joint's log-softmax over labels and blank where each token was emitted, stepping the prediction
    network one label at a time as greedy search does (``encoded`` (T, d): one row)."""
    blank = joint.vocab_size
    state = prediction.initial_state(1, encoded.device, encoded.dtype)
    previous = torch.tensor([blank], device=encoded.device)
    out = []
    for token, frame in zip(hyp.tokens, hyp.frames, strict=True):
        pred, state = prediction.step(previous, state)
        logits = joint.joint_after_projection(joint.project_encoder(encoded[frame : frame + 1]),
                                              joint.project_prediction(pred))
        out.append(torch.log_softmax(logits[0, : blank + 1].float(), dim=-1))
        previous = torch.tensor([token], device=encoded.device)
    return out


def assert_scores_are_the_searchs(encoded, hyps, logprobs, prediction, joint, atol=1e-5):
    for row, (hyp, scores) in enumerate(zip(hyps, logprobs, strict=True)):
        assert len(scores) == len(hyp.tokens)
        for token, score, dist in zip(hyp.tokens, scores, replayed_logprobs(encoded[row], hyp, prediction, joint),
                                      strict=True):
            assert int(dist.argmax()) == token  # the search's choice
            assert score == pytest.approx(float(dist[token]), abs=atol)
            assert score <= 1e-6
