"""Word error rate: the edit distance between what was said and what was heard, over the words said."""

from __future__ import annotations

from collections.abc import Hashable, Sequence


def edit_distance(ref: Sequence[Hashable], hyp: Sequence[Hashable]) -> int:
    """Levenshtein distance between two sequences (words, token ids)."""
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1]


def wer(refs: Sequence[str], hyps: Sequence[str]) -> float:
    errors = sum(edit_distance(r.split(), h.split()) for r, h in zip(refs, hyps, strict=True))
    return errors / max(1, sum(len(r.split()) for r in refs))
