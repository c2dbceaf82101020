"""A job's path inputs as a worker opens them: checked as opened, not only by name, so that a name under an input
root swapped between the check and the open (for a symlink out of the roots, or for a FIFO) is refused."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from service import job_types
from service.audio import AudioLimits, decode_audio_file
from service.job_types import JobInputError, open_input_file


@pytest.fixture
def root(tmp_path: Path, parity_audio) -> Path:
    inside = tmp_path / "root"
    (inside / "calls").mkdir(parents=True)
    (inside / "calls" / "a.wav").write_bytes(Path(parity_audio[0]).read_bytes())
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "a.wav").write_bytes(Path(parity_audio[1]).read_bytes())
    return inside


def _checked_before_the_swap(monkeypatch, swap) -> None:
    """The check by name passes as the file was; ``swap()`` runs between it and the open (the race made certain)."""
    checked = job_types.resolve_input_path

    def check_then_swap(path: str, roots: list[str]) -> Path:
        real = checked(path, roots)
        swap()
        return real

    monkeypatch.setattr(job_types, "resolve_input_path", check_then_swap)


def test_a_regular_file_under_a_root_is_opened_and_decoded(root):
    with open_input_file(str(root / "calls" / "a.wav"), [str(root)]) as file:
        assert decode_audio_file(file, AudioLimits(max_bytes=1 << 30, max_duration_s=3600)).size > 16000


def test_a_file_swapped_for_a_symlink_out_of_the_roots_after_the_check_is_refused(root, monkeypatch):
    name = root / "calls" / "a.wav"

    def swap() -> None:
        name.unlink()
        name.symlink_to(root.parent / "outside" / "a.wav")

    _checked_before_the_swap(monkeypatch, swap)
    with pytest.raises(JobInputError, match="cannot be opened"):
        open_input_file(str(name), [str(root)])


def test_a_folder_swapped_for_a_symlink_out_of_the_roots_after_the_check_is_refused(root, monkeypatch):
    """The open follows a folder on the way (O_NOFOLLOW is the last part's): where it went is checked."""

    def swap() -> None:
        os.rename(root / "calls", root.parent / "old_calls")
        (root / "calls").symlink_to(root.parent / "outside")

    _checked_before_the_swap(monkeypatch, swap)
    with pytest.raises(JobInputError, match="outside the input roots"):
        open_input_file(str(root / "calls" / "a.wav"), [str(root)])


def test_a_file_swapped_for_a_fifo_after_the_check_is_refused_without_waiting_for_a_writer(root, monkeypatch):
    name = root / "calls" / "a.wav"

    def swap() -> None:
        name.unlink()
        os.mkfifo(name)

    _checked_before_the_swap(monkeypatch, swap)
    refused: list[BaseException] = []

    def open_it() -> None:
        try:
            open_input_file(str(name), [str(root)])
        except JobInputError as exc:
            refused.append(exc)

    opener = threading.Thread(target=open_it, daemon=True)
    opener.start()
    opener.join(10)
    assert not opener.is_alive(), "the open waited for a writer"
    assert refused and "not a regular file" in str(refused[0])


def test_a_symlink_loop_is_an_input_error_not_a_crash(root):
    (root / "loop.wav").symlink_to(root / "loop.wav")
    with pytest.raises(JobInputError, match="not a usable path"):
        open_input_file(str(root / "loop.wav"), [str(root)])
