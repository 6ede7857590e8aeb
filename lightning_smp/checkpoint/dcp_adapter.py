"""The adapter to torch.distributed.checkpoint (DCP): what a rank holds of a tensor as chunks of the global tensor.

Owns what DCP is handed for each entry (a tensor, or this rank's chunks of it: a tensor-parallel shard, a ZeRO-1
replica's flat piece of a master or of its optimizer state, or both) and our save and load planners, which look
those chunks up. Not owned: which entries a checkpoint has (`saving.py`, `loading.py`), which piece a rank holds
(`placement.py`, `master_shard.py`). DCP reads any chunk layout into any other, which is resharding; describing
our pieces as chunks (packed q/k/v blocks, flat ranges included) gets that without DTensor and without a rank ever
gathering a whole tensor. The DTensor shards of sharded data parallelism (FSDP2) go to DCP as they are, except those
of a tensor-parallel piece, whose slices become chunks of the global tensor too. Also owns the writer that reports a
save's progress.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
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
from lightning_smp.master_shard import FlatPiece
from lightning_smp.placement import TPShard
from lightning_smp.progress import Progress

__all__ = [
    "Chunks",
    "LoadPlanner",
    "ReportingWriter",
    "SavePlanner",
    "flat_range_boxes",
    "global_size",
    "state_target",
    "stored",
    "stored_like_param",
]


class Chunks:
    """What this rank holds of a tensor, seen by DCP as chunks of the global tensor (views into ``local``).

    ``local`` is a tensor-parallel shard (a `TPShard` keeps piece ``index`` of ``parts`` of each of ``blocks`` equal
    blocks along ``dim``: one chunk for a plain column/row split, three for a packed q/k/v weight; under sharded data
    parallelism the piece is a DTensor of which this rank holds one slice, FSDP2's rows, and the chunks are that
    slice's parts), or a ZeRO-1 replica's `FlatPiece` of a tensor (up to one chunk per dim: a flat range of a
    row-major tensor is a partial row, whole rows, a partial row), or a flat piece of a tensor-parallel shard. DCP
    asks objects for their chunks through the methods DTensor implements (``__create_write_items__``,
    ``__create_chunk_list__``); our planners look the chunks up. A rank holding nothing of a tensor has no chunks.
    """

    def __init__(self, local: Tensor | FlatPiece, size: torch.Size, chunks: dict[torch.Size, Tensor]) -> None:
        self.local = local
        self._size = size
        self._chunks = chunks
        held = local.flat if isinstance(local, FlatPiece) else local
        self._properties = TensorProperties.create_from_tensor(held.to_local() if isinstance(held, DTensor) else held)

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

    def copied(self, copy: Callable[[Tensor], Tensor]) -> Chunks:
        """The same chunks, each replaced by ``copy(chunk)`` (an asynchronous save's snapshot in host memory)."""
        snapshot = Chunks.__new__(Chunks)
        snapshot.local, snapshot._size, snapshot._properties = None, self._size, self._properties
        snapshot._chunks = {offsets: copy(chunk) for offsets, chunk in self._chunks.items()}
        return snapshot


class SavePlanner(DefaultSavePlanner):
    """Our entries are flat already: a dict value (the random generators) is one object, not a subtree.
    ``on_tensor(nbytes)`` is called as each tensor is handed to the writer (`ReportingWriter` sets it)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.on_tensor: Callable[[int], None] = lambda nbytes: None

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, Chunks):
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
        if isinstance(value, Chunks):
            return value.chunk(index.offset)
        return super().lookup_tensor(index)


def _item_bytes(item: WriteItem) -> int:
    if item.tensor_data is None:
        return 0
    return item.tensor_data.chunk.sizes.numel() * item.tensor_data.properties.dtype.itemsize


def global_size(value: Any) -> torch.Size:
    return value.size() if isinstance(value, Chunks) else value.shape


def stored(value: Any, shard: TPShard | None) -> Any:
    """What DCP writes (or reads into) for one value: the tensor itself, or this rank's chunks of the global tensor
    (a tensor-parallel shard, a `FlatPiece`, or both)."""
    if isinstance(value, FlatPiece):
        boxes = flat_range_boxes(value.shape, value.start, value.flat.numel())
        return _chunks(value, [(o, value.flat[at : at + math.prod(s)].view(s)) for o, s, at in boxes], shard)
    if shard is None or not isinstance(value, Tensor):
        return value
    if isinstance(value, DTensor):  # sdp x tp: this rank's slice (FSDP2's rows) of the tensor-parallel piece
        (held,) = value.__create_chunk_list__()
        return _chunks(value, [(torch.Size(held.offsets), value.to_local())], shard)
    return _chunks(value, [(torch.Size([0] * value.dim()), value)], shard)


def stored_like_param(value: Any, param: Tensor | None, shard: TPShard | None, entry: str) -> Any:
    """What DCP writes for one optimizer state tensor: chunked as its parameter when it is shaped like it."""
    if isinstance(value, FlatPiece):
        return stored(value, shard)
    if shard is None or not isinstance(value, Tensor) or value.dim() == 0:
        return value
    if param is not None and value.shape == param.shape:
        return stored(value, shard)
    raise CheckpointError(
        f"Optimizer state {entry!r} has shape {tuple(value.shape)}, but its tensor-parallel parameter's shard has "
        f"shape {tuple(param.shape) if param is not None else '?'}: only state shaped like the parameter (Adam's "
        "moments, momentum) or scalar can be saved so that it reshards. Use such an optimizer with tensor "
        "parallelism, or leave that parameter unsharded."
    )


def state_target(
    info: TensorStorageMetadata,
    param: Tensor | None,
    shard: TPShard | None,
    empty_part: Callable[[torch.dtype], Tensor | FlatPiece | None],
) -> Any:
    """Where one saved optimizer state tensor loads: when it is shaped like its parameter, what this rank holds of
    it (``empty_part(dtype)``: an empty tensor shaped like the parameter, a DTensor shard, or a `FlatPiece`), as
    chunks; None when this rank holds none of it (nothing to read); otherwise the whole saved tensor."""
    dtype = info.properties.dtype
    if isinstance(param, DTensor) and shard is None:  # sharded data parallelism: DCP reads this rank's shard
        like_param = tuple(info.size) == tuple(param.shape)
    else:  # under sdp x tp, this rank's slice of the tensor-parallel piece as chunks of the global tensor
        like_param = param is not None and tuple(info.size) == tuple(global_size(stored(param, shard)))
    if not like_param:
        return torch.empty(info.size, dtype=dtype)
    part = empty_part(dtype)
    return None if part is None else stored(part, shard)


def flat_range_boxes(shape: torch.Size, start: int, length: int) -> list[tuple[torch.Size, torch.Size, int]]:
    """Elements [start, start + length) of a row-major tensor of ``shape`` as boxes (offsets, sizes, where the box
    starts in the range): each box is contiguous, so it is a view of the flat range. Pure.

    Example: shape (3, 4), elements [2, 11) are row 0's columns 2..3, rows 1, row 2's columns 0..2::

        [((0, 2), (1, 2), 0), ((1, 0), (1, 4), 2), ((2, 0), (1, 3), 6)]
    """
    return [(torch.Size(o), torch.Size(s), at - start) for o, s, at in _boxes(tuple(shape), start, start + length)]


def _boxes(shape: tuple[int, ...], start: int, end: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """(offsets, sizes, first element) of the boxes covering [start, end) of ``shape``, in order."""
    if start >= end:
        return
    if not shape:
        yield (), (), start
        return
    inner = math.prod(shape[1:])
    first_full, end_full = -(-start // inner), end // inner  # the whole rows [first_full, end_full)
    if first_full > end_full:  # inside one row
        row = start // inner
        for offsets, sizes, at in _boxes(shape[1:], start - row * inner, end - row * inner):
            yield (row, *offsets), (1, *sizes), at + row * inner
        return
    if start < first_full * inner:  # the end of the row before the whole ones
        row = first_full - 1
        for offsets, sizes, at in _boxes(shape[1:], start - row * inner, inner):
            yield (row, *offsets), (1, *sizes), at + row * inner
    if first_full < end_full:
        yield (first_full, *[0] * (len(shape) - 1)), (end_full - first_full, *shape[1:]), first_full * inner
    if end_full * inner < end:  # the start of the row after them
        for offsets, sizes, at in _boxes(shape[1:], 0, end - end_full * inner):
            yield (end_full, *offsets), (1, *sizes), at + end_full * inner


def _chunks(local: Tensor | FlatPiece, views: list[tuple[torch.Size, Tensor]], shard: TPShard | None) -> Chunks:
    """``local``'s boxes (their offsets in the tensor this rank holds, and a view of each) as chunks of the global
    tensor: under tensor parallelism each box's rows move to their block's place along ``shard.dim``."""
    shape = local.shape
    if shard is None:
        return Chunks(local, torch.Size(shape), dict(views))
    size = list(shape)
    size[shard.dim] *= shard.parts
    block = shape[shard.dim] // shard.blocks  # this rank's rows of one block
    chunks = {}
    for offsets, view in views:
        lo, hi = offsets[shard.dim], offsets[shard.dim] + view.shape[shard.dim]
        for b in range(lo // block, -(-hi // block)):  # the blocks this box crosses
            begin, stop = max(lo, b * block), min(hi, (b + 1) * block)
            place = list(offsets)
            place[shard.dim] = (b * shard.parts + shard.index) * block + begin - b * block
            chunks[torch.Size(place)] = view.narrow(shard.dim, begin - lo, stop - begin)
    return Chunks(local, torch.Size(size), chunks)
