"""Read a NeMo checkpoint: a ``.nemo`` tar archive (plain or gzipped) or a directory unpacked from one.

An archive is never extracted to disk: members are read in place, and any member whose name could escape
an extraction directory (absolute, ``..``, links, devices) is refused, because other tools will unpack the
same file.
"""

from __future__ import annotations

import io
import tarfile
import zipfile
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
    tokenizer_model: bytes  # serialized SentencePiece model proto
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
    """Reads an unpacked checkpoint's files: those beside its config, never the whole tree below (``--model .`` run
    from /usr scanned every file there)."""

    def __init__(self, path: Path):
        self._root = path.resolve()
        self._folder = _checkpoint_folder(self._root)

    def names(self) -> list[str]:
        try:
            return [str(p.relative_to(self._root)) for p in self._folder.iterdir() if p.is_file()]
        except OSError as exc:
            raise CheckpointError(f"{self._folder}: cannot list the checkpoint directory ({exc})") from exc

    def read(self, name: str) -> bytes:
        target = (self._root / _member_name(name)).resolve()
        if not target.is_relative_to(self._root):
            raise CheckpointError(f"`{name}` resolves outside the checkpoint directory; refused")
        if not target.is_file():
            raise FileNotFoundError(name)
        try:
            return target.read_bytes()
        except OSError as exc:  # unreadable: one line naming it, not a traceback
            raise CheckpointError(f"{target}: cannot read the checkpoint's file ({exc})") from exc

    def close(self) -> None:
        pass


def _checkpoint_folder(root: Path) -> Path:
    """``root`` if it holds the config at its top, else its one folder that does (a .nemo unpacked with its
    leading ``./`` as a folder); else ``root``, where the config is then reported missing."""
    try:
        if (root / CONFIG_NAME).is_file():
            return root
        below = [folder for folder in root.iterdir() if folder.is_dir() and (folder / CONFIG_NAME).is_file()]
    except OSError as exc:  # a folder that cannot be read
        raise CheckpointError(f"{root}: cannot read the checkpoint directory ({exc})") from exc
    return below[0] if len(below) == 1 else root


def _find(names: list[str], basename: str) -> str | None:
    """The member called ``basename`` at the top level, else anywhere (NeMo writes them at the top)."""
    if basename in names:
        return basename
    matches = [n for n in names if PurePosixPath(n).name == basename]
    return matches[0] if len(matches) == 1 else None


def _load_state_dict(data: bytes, source: str) -> dict[str, torch.Tensor]:
    _check_zip_crcs(data, source)
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a corrupt pickle or zip
        raise CheckpointError(f"{source}: `{WEIGHTS_NAME}` is not a readable torch state dict ({exc})") from exc
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]  # a Lightning checkpoint
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{source}: `{WEIGHTS_NAME}` does not hold a flat dict of tensors")
    _check_finite(obj, source)
    return obj


def _check_zip_crcs(data: bytes, source: str) -> None:
    """torch.load reads a zip-format state dict without checking its CRCs: damaged bytes loaded as weights and
    transcribed garbage. A legacy (non-zip) file has no CRCs; torch.load judges it alone."""
    stream = io.BytesIO(data)  # shares ``data``'s buffer: no second copy of the weights
    if not zipfile.is_zipfile(stream):
        return
    try:
        with zipfile.ZipFile(stream) as archive:
            damaged = archive.testzip()
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as exc:
        raise CheckpointError(f"{source}: `{WEIGHTS_NAME}` is damaged ({exc})") from exc
    if damaged is not None:
        raise CheckpointError(f"{source}: `{WEIGHTS_NAME}` is damaged: its member `{damaged}` fails its CRC check")


def _check_finite(state_dict: dict[str, torch.Tensor], source: str) -> None:
    """NaN or inf weights make every transcript garbage (or empty): refused, naming the first such tensor."""
    for name, tensor in state_dict.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{source}: `{WEIGHTS_NAME}` holds NaN or infinite values in `{name}`")


def _tokenizer_member(raw: dict[str, Any], names: list[str], source: str) -> str:
    """The member holding the SentencePiece model: without one every transcript is empty, so none is refused."""
    tokenizer = raw.get("tokenizer")
    ref = tokenizer.get("model_path") if isinstance(tokenizer, dict) else None
    if not ref:
        raise CheckpointError(f"{source}: `{CONFIG_NAME}` names no tokenizer (tokenizer.model_path): a model "
                              "without one cannot write text")
    basename = PurePosixPath(str(ref).removeprefix("nemo:")).name
    found = _find(names, basename)
    if found is None:
        raise CheckpointError(f"{source}: tokenizer file `{basename}` (tokenizer.model_path) is not in the "
                              "checkpoint")
    return found


def _parse_config(raw: dict[str, Any], path: Path) -> ModelConfig:
    """The parsed config; its errors (which name the key) also name the file, keeping their type."""
    try:
        return parse_model_config(raw)
    except CheckpointError as exc:
        raise type(exc)(f"{path}: {exc}") from exc


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Read config, weights and tokenizer from a ``.nemo`` file or an unpacked checkpoint directory."""
    path = Path(path)
    if not path.exists():
        from .architectures import ARCHITECTURES  # imports this module: looked up only here

        hint = " (a built-in architecture: `batchasr bench --model` takes it, with random weights)" \
            if str(path) in ARCHITECTURES else ""
        raise CheckpointError(f"{path}: no such file or directory{hint}")
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
        config = _parse_config(raw, path)
        weights_name = _find(names, WEIGHTS_NAME)
        if weights_name is None:
            raise CheckpointError(f"{path}: missing weights: `{WEIGHTS_NAME}` is not in the checkpoint")
        tokenizer_model = reader.read(_tokenizer_member(raw, names, str(path)))  # checked before the weights load
        state_dict = _load_state_dict(reader.read(weights_name), str(path))
    finally:
        reader.close()
    return Checkpoint(config=config, raw_config=raw, state_dict=state_dict, tokenizer_model=tokenizer_model,
                      source=str(path))
