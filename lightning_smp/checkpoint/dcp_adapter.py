"""The adapter to torch.distributed.checkpoint (DCP): tensor-parallel shards as chunks of the global tensor.

Owns what DCP is handed for each entry (a tensor, or this rank's chunks of a tensor-parallel one) and our save and
load planners, which look those chunks up. Not owned: which entries a checkpoint has (`saving.py`, `loading.py`)
or which piece a rank holds (`placement.py`). DCP reads any chunk layout into any other, which is
resharding; describing our shards as chunks (packed q/k/v blocks included) gets that without DTensor. The
DTensor shards of sharded data parallelism (FSDP2) go to DCP as they are, except those of a tensor-parallel piece,
whose slices become chunks of the global tensor too. Also owns the writer that reports a save's progress.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from lightning_smp.checkpoint.verification import CheckpointError
from lightning_smp.placement import TPShard
from lightning_smp.progress import Progress

__all__ = [
    "LoadPlanner",
    "ReportingWriter",
    "SavePlanner",
    "ShardChunks",
    "global_size",
    "state_target",
    "stored",
    "stored_like_param",
]


class ShardChunks:
    """This rank's shard of a tensor-parallel tensor, seen by DCP as chunks of the global tensor.

    A `TPShard` splits each of ``blocks`` equal blocks along ``dim`` into ``parts`` pieces and keeps piece
    ``index`` of every block, so the local tensor holds ``blocks`` chunks of the global one (one for a plain
    column/row split, three for a packed q/k/v weight). Under sharded data parallelism the tensor-parallel piece is
    a DTensor of which this rank holds one slice (FSDP2's rows); the chunks are then that slice's parts of the
    global tensor. DCP asks objects for their chunks through the methods DTensor implements
    (``__create_write_items__``, ``__create_chunk_list__``); our planners look the chunks up.
    """

    def __init__(self, local: Tensor, shard: TPShard) -> None:
        self.local = local
        piece_shape, data, start = local.shape, local, [0] * local.dim()
        if isinstance(local, DTensor):  # this rank's slice of the tensor-parallel piece
            (held,) = local.__create_chunk_list__()
            data, start = local.to_local(), list(held.offsets)
        size = list(piece_shape)
        size[shard.dim] *= shard.parts
        self._size = torch.Size(size)
        self._properties = TensorProperties.create_from_tensor(data)
        piece = piece_shape[shard.dim] // shard.blocks  # the piece's rows of one block
        first, count = start[shard.dim], data.shape[shard.dim]  # the rows of the piece `data` holds
        self._chunks: dict[torch.Size, Tensor] = {}
        for block in range(shard.blocks):
            begin, end = max(first, block * piece), min(first + count, (block + 1) * piece)
            if begin >= end:
                continue  # none of this block's rows are in this rank's slice (FSDP2 may give a rank none)
            offsets = list(start)
            offsets[shard.dim] = block * piece * shard.parts + shard.index * piece + (begin - block * piece)
            self._chunks[torch.Size(offsets)] = data.narrow(shard.dim, begin - first, end - begin)

    def size(self) -> torch.Size:
        return self._size

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = self._properties
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=chunk.shape),
                    properties=properties,
                    size=self._size,
                ),
            )
            for offsets, chunk in self._chunks.items()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=chunk.shape) for offsets, chunk in self._chunks.items()]

    def chunk(self, offsets: torch.Size) -> Tensor:
        return self._chunks[torch.Size(offsets)]


class SavePlanner(DefaultSavePlanner):
    """Our entries are flat already: a dict value (the random generators) is one object, not a subtree.
    ``on_tensor(nbytes)`` is called as each tensor is handed to the writer (`ReportingWriter` sets it)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.on_tensor: Callable[[int], None] = lambda nbytes: None

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, ShardChunks):
            return value.chunk(index.offset)
        return super().lookup_object(index)

    def resolve_data(self, write_item: WriteItem) -> Any:
        data = super().resolve_data(write_item)
        if isinstance(data, Tensor):
            self.on_tensor(data.numel() * data.element_size())
        return data


class ReportingWriter(FileSystemWriter):
    """DCP's file writer (fsync'ing every file) that reports this rank's progress while it writes: lines with the
    bytes done and the rate, shown on rank 0 (`lightning_smp.progress`), so a long save does not look like a hang."""

    def __init__(self, path: Any, *, what: str) -> None:
        super().__init__(path, sync_files=True)
        self._what = what

    def write_data(self, plan: SavePlan, planner: Any) -> Future[list[WriteResult]]:
        total = sum(_item_bytes(item) for item in plan.items)
        with Progress(self._what, total) as progress:
            if isinstance(planner, SavePlanner):
                planner.on_tensor = progress.advance
            return super().write_data(plan, planner)  # writes before it returns (one thread: DCP's default)


class LoadPlanner(DefaultLoadPlanner):
    """Our entries are flat already. DCP's own set-up would also replace every object it does not know (our
    chunks) by None while preparing meta-device tensors, which we never load into."""

    def __init__(self, *, allow_partial_load: bool = False) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=allow_partial_load)

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        self.original_state_dict = self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, ShardChunks):
            return value.chunk(index.offset)
        return super().lookup_tensor(index)


def _item_bytes(item: WriteItem) -> int:
    if item.tensor_data is None:
        return 0
    return item.tensor_data.chunk.sizes.numel() * item.tensor_data.properties.dtype.itemsize


def global_size(value: Any) -> torch.Size:
    return value.size() if isinstance(value, ShardChunks) else value.shape


def stored(value: Any, shard: TPShard | None) -> Any:
    """What DCP writes for one value: the tensor itself, or this rank's chunks of the global tensor."""
    if shard is None or not isinstance(value, Tensor):
        return value
    return ShardChunks(value, shard)


def stored_like_param(value: Any, param: Tensor | None, shard: TPShard | None, entry: str) -> Any:
    """What DCP writes for one optimizer state tensor: chunked as its parameter when it is shaped like it."""
    if shard is None or not isinstance(value, Tensor) or value.dim() == 0:
        return value
    if param is not None and value.shape == param.shape:
        return ShardChunks(value, shard)
    raise CheckpointError(
        f"Optimizer state {entry!r} has shape {tuple(value.shape)}, but its tensor-parallel parameter's shard has "
        f"shape {tuple(param.shape) if param is not None else '?'}: only state shaped like the parameter (Adam's "
        "moments, momentum) or scalar can be saved so that it reshards. Use such an optimizer with tensor "
        "parallelism, or leave that parameter unsharded."
    )


def state_target(info: TensorStorageMetadata, param: Tensor | None, shard: TPShard | None) -> Any:
    """Where one saved optimizer state tensor loads: this rank's chunks when it is shaped like its parameter."""
    dtype = info.properties.dtype
    if isinstance(param, DTensor) and tuple(info.size) == tuple(param.shape):
        return torch.empty_like(param, dtype=dtype)  # sharded data parallelism: DCP reads this rank's shard
    if shard is not None and param is not None and tuple(info.size) == tuple(global_size(ShardChunks(param, shard))):
        like = (
            torch.empty_like(param, dtype=dtype)
            if isinstance(param, DTensor)
            else torch.empty(param.shape, dtype=dtype)
        )
        return ShardChunks(like, shard)
    return torch.empty(info.size, dtype=dtype)
