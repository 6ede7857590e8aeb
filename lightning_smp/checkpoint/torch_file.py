"""A ``torch.save`` file written one tensor at a time: `torch.load` reads it as any other.

Owns the pickling of an object whose tensors are not in memory yet (meta-device stand-ins) and the writing of
their bytes one by one, each fetched just before it is written and freed right after. Not owned: where the bytes
come from (the caller's ``fill``). ``torch.save`` pickles the object, then writes every storage it met, so it
needs them all in memory at once; at 70B parameters that is 280 GB of fp32. The archive here is torch's own (its
zip writer, the same records in the same order), and every tensor is stored as ``torch.save`` stores a tensor of
any dtype: an untyped storage rebuilt with its dtype, shape and strides.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_smp.checkpoint import private_torch

__all__ = ["write_torch_file"]

_PICKLE_PROTOCOL = 2  # torch.save's default


def write_torch_file(path: Path, obj: Any, fill: Callable[[Tensor], Tensor], advance: Callable[[int], None]) -> None:
    """``torch.save(obj, path)``, where each meta-device tensor in ``obj`` is written as the CPU tensor ``fill``
    returns for it (same shape and dtype), one at a time; ``advance(nbytes)`` after each tensor is written.

    Other tensors in ``obj`` (small ones: a callback's best score) are written as they are. The file is flushed
    and fsync'ed; making it appear atomically is the caller's (write to a temporary name, then rename).
    """
    pickled = io.BytesIO()
    pickler = _Pickler(pickled)
    pickler.dump(obj)
    with open(path, "wb") as stream:
        writer = private_torch.zip_file_writer(stream)
        try:
            for name, value in (
                ("data.pkl", pickled.getvalue()),
                (".format_version", "1"),
                (".storage_alignment", str(torch.utils.serialization.config.save.storage_alignment)),
                ("byteorder", sys.byteorder),
            ):
                writer.write_record(name, value, len(value))
            del pickled
            for key, tensor in enumerate(pickler.tensors):
                data = fill(tensor) if tensor.is_meta else tensor
                if data.shape != tensor.shape or data.dtype != tensor.dtype:
                    raise AssertionError(f"{tuple(data.shape)} {data.dtype} for {tuple(tensor.shape)} {tensor.dtype}")
                data = data.contiguous()
                writer.write_record(f"data/{key}", data.untyped_storage(), data.nbytes)
                advance(data.nbytes)
                del data
            writer.write_end_of_file()
        finally:
            del writer  # its destructor ends an unfinished archive: while the stream is still open
        stream.flush()
        os.fsync(stream.fileno())


class _Pickler(pickle.Pickler):
    """Pickles every plain tensor as a reference to a storage record written after the pickle (torch's format)."""

    def __init__(self, stream: io.BytesIO) -> None:
        super().__init__(stream, protocol=_PICKLE_PROTOCOL)
        self.tensors: list[Tensor] = []  # in the order of their storage records' keys

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is not Tensor:
            return NotImplemented  # nn.Parameter reduces to its .data, a plain tensor, which comes back here
        tensor = obj if obj.is_meta else obj.detach().cpu().contiguous()  # a stand-in is filled by identity
        storage = _Storage(len(self.tensors), tensor)
        self.tensors.append(tensor)
        shape = tuple(tensor.shape)
        arguments = (storage, 0, shape, _contiguous_strides(shape), obj.requires_grad, OrderedDict(), tensor.dtype)
        return private_torch.REBUILD_TENSOR, arguments

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            return ("storage", torch.UntypedStorage, str(obj.key), "cpu", obj.nbytes)
        if isinstance(obj, torch.TypedStorage | torch.UntypedStorage):
            raise TypeError(
                "lightning_smp writes plain tensors one at a time; a tensor subclass in the checkpoint pickles its "
                f"storage directly ({type(obj).__name__}). Replace it by a plain tensor in the checkpoint before "
                "saving."
            )
        return None


class _Storage:
    """A storage record of the archive: ``data/<key>``, ``nbytes`` long."""

    def __init__(self, key: int, tensor: Tensor) -> None:
        self.key = key
        self.nbytes = tensor.numel() * tensor.element_size()


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
