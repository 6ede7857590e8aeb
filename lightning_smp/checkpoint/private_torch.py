"""The two private names of torch that `torch_file` uses to write a ``torch.save`` file one tensor at a time.

torch offers no public way to write its archive a record at a time (``torch.save`` holds every storage until it
writes them). Checked against torch 2.13.0 by ``tests/test_torch_file.py``, which fails by name when an upgrade
changes one. (Branch ``pipeline`` gathers every private name of another library in ``lightning_smp/_compat.py``;
these two belong there once both have landed.)
"""

from __future__ import annotations

from typing import IO, Any

import torch
from torch.utils.serialization import config as serialization_config

__all__ = ["REBUILD_TENSOR", "zip_file_writer"]

REBUILD_TENSOR = torch._utils._rebuild_tensor_v3
"""``(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype)`` → a tensor viewing ``storage``:
what a ``torch.save`` file names to rebuild a tensor of any dtype from an untyped storage, and one of the functions
``torch.load(weights_only=True)`` allows (torch keeps loading files that name it)."""


def zip_file_writer(stream: IO[bytes]) -> Any:
    """torch's own writer of the ``torch.save`` zip archive (records aligned for ``mmap=True`` loads, CRC-32s,
    zip64, the version records), writing to ``stream``: ``write_record(name, data, size)`` with ``data`` a
    storage or bytes, then ``write_end_of_file()``."""
    save = serialization_config.save
    return torch._C.PyTorchFileWriter(stream, save.compute_crc32, save.storage_alignment)
