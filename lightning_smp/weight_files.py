"""State-dict files read tensor by tensor and part by part: the sources that loading takes values from.

Owns the files: a state dict saved as safetensors (one file, or the shards a ``*.safetensors.index.json`` lists, as
Hugging Face's ``save_pretrained`` writes them) or with ``torch.save`` (a plain state dict, or a Lightning
checkpoint's ``state_dict`` such as `consolidate_checkpoint` writes), memory-mapped; each tensor is a source that
reads the whole of it or only a rank's `Cut` (safetensors with ``pread``: only those bytes). It knows nothing of
models or of delayed initialisation, so both `weights.load_weights` and the Hugging Face adapter of `delayed_init`
build on it. Why safetensors' reader and not torch DCP's ``HuggingFaceStorageReader``: DCP plans one read of every
target at once, into tensors allocated beforehand, and maps whole files; here each value is read when it is
materialised, one tensor at a time, after whatever renaming and casting was recorded for it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_smp.placement import Cut

__all__ = ["SafetensorsFile", "SafetensorsTensor", "SavedTensor", "open_state_dict"]

# safetensors' dtype codes (its header's), for the dtypes torch has
_SAFETENSORS_DTYPES = {
    code: getattr(torch, name)
    for code, name in {
        "F64": "float64",
        "F32": "float32",
        "F16": "float16",
        "BF16": "bfloat16",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E5M2": "float8_e5m2",
        "I64": "int64",
        "I32": "int32",
        "I16": "int16",
        "I8": "int8",
        "U8": "uint8",
        "BOOL": "bool",
    }.items()
    if hasattr(torch, name)
}
_INDEX_SUFFIX = ".safetensors.index.json"
# What a directory may hold, in the order Hugging Face's from_pretrained looks for it.
_DIRECTORY_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


@dataclass(frozen=True, slots=True)
class SafetensorsTensor:
    """One tensor of a safetensors file; nothing is read until `read`."""

    path: str
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    code: str
    """safetensors' dtype code, e.g. ``"BF16"``."""

    def read(self, cut: Cut | None) -> Tensor:
        """The whole tensor (``cut`` None) or ``cut`` of it, as a new CPU tensor; reads only those bytes."""
        with _open_safetensors(self.path) as file:
            part = file.get_slice(self.key)
            if cut is None:
                return part[...]
            pieces = [part[index] for index in cut.indices()]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=cut.dim)


class SafetensorsFile:
    """The header of one safetensors file: its tensors' names, shapes and dtypes, and its metadata."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        with _open_safetensors(self.path) as file:
            self.metadata: dict[str, str] | None = file.metadata()
            keys = file.keys()
            self.tensors: dict[str, SafetensorsTensor] = {}
            """The file's tensors by key, in its order."""
            for key in keys:
                part = file.get_slice(key)
                code = part.get_dtype()
                if code not in _SAFETENSORS_DTYPES:
                    raise ValueError(
                        f"{self.path}: {key!r} has the dtype {code}, which this torch cannot hold; upgrade torch."
                    )
                shape = tuple(part.get_shape())
                self.tensors[key] = SafetensorsTensor(self.path, key, shape, _SAFETENSORS_DTYPES[code], code)


@dataclass(frozen=True, slots=True, eq=False)
class SavedTensor:
    """One tensor of a ``torch.save`` file loaded memory-mapped: only the pages a read touches come from disk."""

    value: Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.value.dtype

    def read(self, cut: Cut | None) -> Tensor:
        part = self.value if cut is None else cut(self.value)
        return part.clone(memory_format=torch.contiguous_format)


def open_state_dict(path: str | os.PathLike) -> dict[str, SafetensorsTensor | SavedTensor]:
    """The tensors a state-dict file (or a directory written by ``save_pretrained``) holds, by key; reads headers
    only. Safetensors (one file, or an ``*.safetensors.index.json`` and its shards) or a ``torch.save`` file (a state
    dict, or a Lightning checkpoint's ``state_dict``)."""
    path = Path(path)
    if path.is_dir():
        found = next((path / name for name in _DIRECTORY_FILES if (path / name).is_file()), None)
        if found is None:
            raise FileNotFoundError(
                f"{str(path)!r} holds none of {', '.join(_DIRECTORY_FILES)}; give the state-dict file itself, or the "
                "directory `save_pretrained` wrote."
            )
        path = found
    if not path.is_file():
        raise FileNotFoundError(f"No state-dict file at {str(path)!r}; check the path.")
    if path.name.endswith(_INDEX_SUFFIX):
        return _sharded_safetensors(path)
    if path.suffix == ".safetensors":
        return SafetensorsFile(path).tensors
    return _saved(path)


def _sharded_safetensors(index: Path) -> dict[str, SafetensorsTensor]:
    weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    files = {name: SafetensorsFile(index.parent / name) for name in sorted(set(weight_map.values()))}
    return {key: files[name].tensors[key] for key, name in weight_map.items()}


def _saved(path: Path) -> dict[str, SavedTensor]:
    content = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    state_dict = content.get("state_dict", content) if isinstance(content, Mapping) else None
    if not isinstance(state_dict, Mapping):
        raise ValueError(
            f"{str(path)!r} holds a {type(content).__name__}, not a state dict; give a file that `torch.save` wrote a "
            "state dict or a Lightning checkpoint to."
        )
    return {key: SavedTensor(value) for key, value in state_dict.items() if isinstance(value, Tensor)}


def _open_safetensors(path: str) -> Any:
    """safetensors' reader with ``pread`` (safetensors >= 0.8; no file mapping: a read adds only the bytes it
    returns to the process)."""
    try:
        from safetensors import safe_open
    except ImportError as error:
        raise ImportError(
            "Reading .safetensors files needs the safetensors package: pip install safetensors"
        ) from error
    return safe_open(path, framework="pt", backend="pread")
