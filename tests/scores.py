"""Comparing transcripts that should be the same: everything exactly, but the scores to within their rounding.

Token log-probabilities move with the batch a recording shares: padding changes the encoder's sums by a rounding
(about 1e-5), which the joint can grow to a few 1e-4 for an unsure token. Tokens, frames and words cannot move.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

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
