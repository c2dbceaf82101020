"""Read a NeMo checkpoint: a ``.nemo`` tar archive (plain or gzipped) or a directory unpacked from one.

An archive is never extracted to disk: members are read in place, and any member whose name could escape
an extraction directory (absolute, ``..``, links, devices) is refused, because other tools will unpack the
same file.
"""

from __future__ import annotations

import io
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch
import yaml

from .config import ModelConfig, parse_model_config
from .errors import CheckpointError

CONFIG_NAME = "model_config.yaml"
WEIGHTS_NAME = "model_weights.ckpt"


@dataclass
class Checkpoint:
    """What a model is built from: its parsed config, raw config, weights and tokenizer."""

    config: ModelConfig
    raw_config: dict[str, Any]
    state_dict: dict[str, torch.Tensor]
    tokenizer_model: bytes | None  # serialized SentencePiece model proto
    source: str


def _member_name(name: str) -> str:
    """``./abc`` -> ``abc``; raises for names that would escape an extraction directory."""
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or "\\" in name:
        raise CheckpointError(f"archive member `{name}` escapes the archive (absolute path or `..`); refused")
    return str(PurePosixPath(*[p for p in path.parts if p != "."])) if path.parts else ""


class _ArchiveReader:
    """Reads named members of a (possibly gzipped) tar, refusing unsafe members."""

    def __init__(self, path: Path):
        try:
            self._tar = tarfile.open(path, "r:*")  # noqa: SIM115 - kept open while members are read; close()
            members = self._tar.getmembers()
        except (tarfile.ReadError, EOFError, zlib.error, OSError) as exc:
            raise self._explain(path, exc) from exc
        self._members: dict[str, tarfile.TarInfo] = {}
        for member in members:
            name = _member_name(member.name)
            if member.issym() or member.islnk():
                raise CheckpointError(f"archive member `{member.name}` is a link; refused")
            if not (member.isfile() or member.isdir()):
                raise CheckpointError(f"archive member `{member.name}` is not a regular file; refused")
            if member.isfile():
                self._members[name] = member
        self._path = path

    @staticmethod
    def _explain(path: Path, exc: Exception) -> CheckpointError:
        said = " ".join(line.strip() for line in str(exc).splitlines())  # tarfile's: a line per compression tried
        reason = said.lower()
        if any(word in reason for word in ("truncated", "unexpected end", "empty file", "compressed file ended")):
            return CheckpointError(f"{path}: truncated archive ({said})")
        if isinstance(exc, tarfile.ReadError):
            return CheckpointError(f"{path}: not a .nemo archive (expected a tar file): {said}")
        return CheckpointError(f"{path}: corrupt archive ({said})")

    def names(self) -> list[str]:
        return list(self._members)

    def read(self, name: str) -> bytes:
        member = self._members.get(name)
        if member is None:
            raise FileNotFoundError(name)
        try:
            f = self._tar.extractfile(member)
            assert f is not None
            data = f.read()
        except (tarfile.ReadError, EOFError, zlib.error, OSError) as exc:
            raise CheckpointError(f"{self._path}: truncated or corrupt archive while reading `{name}` ({exc})") from exc
        if len(data) != member.size:
            raise CheckpointError(f"{self._path}: truncated archive: `{name}` has {len(data)} of "
                                  f"{member.size} bytes")
        return data

    def close(self) -> None:
        self._tar.close()


class _DirectoryReader:
    def __init__(self, path: Path):
        self._root = path.resolve()

    def names(self) -> list[str]:
        return [str(p.relative_to(self._root)) for p in self._root.rglob("*") if p.is_file()]

    def read(self, name: str) -> bytes:
        target = (self._root / _member_name(name)).resolve()
        if not target.is_relative_to(self._root):
            raise CheckpointError(f"`{name}` resolves outside the checkpoint directory; refused")
        if not target.is_file():
            raise FileNotFoundError(name)
        return target.read_bytes()

    def close(self) -> None:
        pass


def _find(names: list[str], basename: str) -> str | None:
    """The member called ``basename`` at the top level, else anywhere (NeMo writes them at the top)."""
    if basename in names:
        return basename
    matches = [n for n in names if PurePosixPath(n).name == basename]
    return matches[0] if len(matches) == 1 else None


def _load_state_dict(data: bytes, source: str) -> dict[str, torch.Tensor]:
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a corrupt pickle or zip
        raise CheckpointError(f"{source}: `{WEIGHTS_NAME}` is not a readable torch state dict ({exc})") from exc
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]  # a Lightning checkpoint
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{source}: `{WEIGHTS_NAME}` does not hold a flat dict of tensors")
    return obj


def _tokenizer_member(raw: dict[str, Any], names: list[str], source: str) -> str | None:
    tokenizer = raw.get("tokenizer") or {}
    ref = tokenizer.get("model_path")
    if not ref:
        return None
    basename = PurePosixPath(str(ref).removeprefix("nemo:")).name
    found = _find(names, basename)
    if found is None:
        raise CheckpointError(f"{source}: tokenizer file `{basename}` (tokenizer.model_path) is not in the "
                              "checkpoint")
    return found


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Read config, weights and tokenizer from a ``.nemo`` file or an unpacked checkpoint directory."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    reader: _ArchiveReader | _DirectoryReader
    reader = _DirectoryReader(path) if path.is_dir() else _ArchiveReader(path)
    try:
        names = reader.names()
        config_name = _find(names, CONFIG_NAME)
        if config_name is None:
            raise CheckpointError(f"{path}: `{CONFIG_NAME}` is missing from the checkpoint")
        try:
            raw = yaml.safe_load(reader.read(config_name))
        except yaml.YAMLError as exc:
            raise CheckpointError(f"{path}: `{CONFIG_NAME}` is not valid YAML ({exc})") from exc
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path}: `{CONFIG_NAME}` does not hold a mapping")
        if "model" in raw and isinstance(raw["model"], dict):
            raw = raw["model"]
        config = parse_model_config(raw)
        weights_name = _find(names, WEIGHTS_NAME)
        if weights_name is None:
            raise CheckpointError(f"{path}: missing weights: `{WEIGHTS_NAME}` is not in the checkpoint")
        state_dict = _load_state_dict(reader.read(weights_name), str(path))
        tokenizer_name = _tokenizer_member(raw, names, str(path))
        tokenizer_model = reader.read(tokenizer_name) if tokenizer_name else None
    finally:
        reader.close()
    return Checkpoint(config=config, raw_config=raw, state_dict=state_dict, tokenizer_model=tokenizer_model,
                      source=str(path))
