"""NeMo's reference outputs on the parity fixtures: which head decoded what, and the comparison (no service
imports: the GPU tests use it where the service's packages may be missing)."""

from __future__ import annotations


def nemo_cases(reference: dict) -> list[tuple[str, str, str]]:
    """(model name, decoder, reference key) for every head NeMo decoded."""
    cases = []
    for name, entry in reference["models"].items():
        cases.append((name, "auto", "main_bs4"))
        if "ctc_bs4" in entry:
            cases.append((name, "ctc", "ctc_bs4"))
    return cases


def assert_matches_nemo(got: dict, expected: dict, label: str) -> None:
    assert got["text"] == expected["text"], label
    if expected["tokens"] is not None:  # NeMo keeps only the text for CTC
        assert got["tokens"] == expected["tokens"], label
        assert got["token_frames"] == expected["frames"], label
