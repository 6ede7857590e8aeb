"""A safetensors file written one tensor at a time: ``safetensors`` and ``from_pretrained`` read it as any other.

Owns the layout of one file: the header (every tensor's name, dtype, shape and byte range, known before any tensor
is read) and then each tensor's bytes, fetched just before they are written and freed right after. Not owned: which
tensors go in which file (`export.py`). The safetensors library's writers take every tensor of a file at once
(``save_file`` and DCP's ``HuggingFaceStorageWriter`` build the file in memory: a 5 GB shard is 5 GB of RAM, 10 GB
while it is serialised); the format is a little-endian header length, a JSON header and the raw bytes
(https://github.com/huggingface/safetensors#format), so writing it in order is short.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["DTYPE_CODES", "write_safetensors"]

DTYPE_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

_ALIGNMENT = 8  # the header is padded with spaces so that the data starts 8-byte aligned, as safetensors does


def write_safetensors(
    path: Path,
    tensors: Sequence[tuple[str, torch.Size, torch.dtype]],
    fill: Callable[[str], Tensor],
    advance: Callable[[int], None],
) -> None:
    """Write ``tensors`` (name, shape, dtype) to ``path`` in that order, each the CPU tensor ``fill(name)`` returns
    (contiguous, of that shape and dtype); ``advance(nbytes)`` after each. The file is fsync'ed."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}  # transformers checks the format
    offset = 0
    for name, shape, dtype in tensors:
        nbytes = shape.numel() * dtype.itemsize
        header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % _ALIGNMENT)
    with open(path, "wb") as stream:
        stream.write(struct.pack("<Q", len(text)))
        stream.write(text)
        for name, shape, dtype in tensors:
            tensor = fill(name)
            if tensor.shape != shape or tensor.dtype != dtype or not tensor.is_contiguous():
                raise AssertionError(f"{name}: {tuple(tensor.shape)} {tensor.dtype} for {tuple(shape)} {dtype}")
            if tensor.numel():
                stream.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
            advance(tensor.nbytes)
            del tensor
        stream.flush()
        os.fsync(stream.fileno())
