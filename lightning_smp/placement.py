"""A parameter's placement: its global shape, the tensor-parallel piece this rank holds, and the axes along which
another rank holds the same values (so the global gradient norm must not count this copy); and `Cut`, which
elements of a whole tensor a rank holds.

Owns that one public description: tensor parallelism and the pipeline write it, checkpoints, norm counting and
materialisation read it (`placement_of`); a `Cut` is what materialisation asks a value's source for (a file reads
only those elements). Not owned: the collectives that cut and join pieces (`tensor_parallel/shard.py`). Our own
frozen dataclass, not DTensor: our tensor-parallel layers run explicit collectives on plain local tensors and the
fp16 optimizer keeps flat fp32 buffers over them; DTensor parameters would change every layer's forward and that
optimizer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = [
    "Cut",
    "Placement",
    "TPShard",
    "mark_norm_duplicate",
    "place_tp_shard",
    "placement_of",
    "placements_kept",
    "set_placement",
]

_ATTRIBUTE = "_smp_placement"  # where a tensor carries its placement; read and written only in this module


@dataclass(frozen=True, slots=True)
class TPShard:
    """What one rank holds of a tensor-parallel parameter: piece ``index`` of ``parts`` of each of ``blocks``
    equal blocks along ``dim`` (see `lightning_smp.tensor_parallel.ShardSpec`)."""

    dim: int
    index: int
    parts: int
    blocks: int = 1


@dataclass(frozen=True, slots=True)
class Cut:
    """The elements of a whole tensor one rank holds: rectangular ``boxes`` of the whole (a ``(start, stop)`` per
    dimension), concatenated along ``dim`` in order.

    A tensor kept whole is one box covering it, a tensor-parallel shard one box (a range along its dim) or one per
    block of a packed weight (`of_shard`); sharded data parallelism keeps a range of rows of that (`rows`).
    """

    boxes: tuple[tuple[tuple[int, int], ...], ...]
    dim: int = 0

    @staticmethod
    def whole(shape: Sequence[int]) -> Cut:
        return Cut((tuple((0, size) for size in shape),))

    @staticmethod
    def of_shard(shape: Sequence[int], shard: TPShard | None) -> Cut:
        """The cut of a ``shape``-d whole that ``shard`` keeps (None: all of it)."""
        if shard is None:
            return Cut.whole(shape)
        block = shape[shard.dim] // shard.blocks
        piece = block // shard.parts
        boxes = []
        for index in range(shard.blocks):
            start = index * block + shard.index * piece
            box = [(0, size) for size in shape]
            box[shard.dim] = (start, start + piece)
            boxes.append(tuple(box))
        return Cut(tuple(boxes), shard.dim)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the cut value."""
        sizes = [stop - start for start, stop in self.boxes[0]]
        if self.dim < len(sizes):
            sizes[self.dim] = sum(box[self.dim][1] - box[self.dim][0] for box in self.boxes)
        return tuple(sizes)

    def rows(self, start: int, stop: int) -> Cut:
        """The cut of rows ``start:stop`` (dim 0) of this cut's value."""
        if self.dim != 0:  # every box spans the same rows
            return Cut(tuple(((box[0][0] + start, box[0][0] + stop), *box[1:]) for box in self.boxes), self.dim)
        kept, offset = [], 0
        for box in self.boxes:
            first, last = box[0]
            low, high = max(start - offset, 0), min(stop - offset, last - first)
            if low < high:
                kept.append(((first + low, first + high), *box[1:]))
            offset += last - first
        if not kept:  # no rows: an empty range of the first box
            first = self.boxes[0][0][0]
            kept.append(((first, first), *self.boxes[0][1:]))
        return Cut(tuple(kept), 0)

    def __call__(self, whole: Tensor) -> Tensor:
        """This cut of ``whole`` (a view when it is one box)."""
        pieces = [whole[index] for index in self.indices()]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)

    def indices(self) -> list[tuple[slice, ...]]:
        """Each box as an index of the whole (``whole[index]``)."""
        return [tuple(slice(start, stop) for start, stop in box) for box in self.boxes]


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one parameter's values live across the ranks of a run."""

    global_shape: tuple[int, ...]
    """The shape of the whole parameter, as one device holds it."""
    tp_shard: TPShard | None = None
    """The piece of it this rank holds, or None when this rank holds it whole."""
    norm_duplicate_on: frozenset[str] = frozenset()
    """The topology axes ("tp", "pp") along which another rank holds the same values and counts them in the
    global gradient norm, so this rank's copy must not (smp and Megatron call such a parameter ``shared``)."""

    @property
    def counts_in_norm(self) -> bool:
        """Whether this rank's copy counts in the global gradient norm (each value must count once)."""
        return not self.norm_duplicate_on


def placement_of(tensor: Tensor) -> Placement:
    """``tensor``'s placement; a tensor never placed is whole on this rank and counts in the norm."""
    placement = getattr(tensor, _ATTRIBUTE, None)
    return placement if placement is not None else Placement(tuple(tensor.shape))


def set_placement(tensor: Tensor, placement: Placement) -> None:
    setattr(tensor, _ATTRIBUTE, placement)


@contextmanager
def placements_kept(model: nn.Module) -> Generator[None, None, None]:
    """Give each of ``model``'s parameters, by name, the placement it had before the body ran. FSDP2's
    ``fully_shard`` makes new parameter objects, and ``Module.to``/``cpu`` on a DTensor parameter swaps its
    ``__dict__`` with the moved copy's (``torch.utils.swap_tensors``): either drops the placement."""
    placements = {name: placement_of(param) for name, param in model.named_parameters()}
    yield
    for name, param in model.named_parameters():
        set_placement(param, placements[name])


def place_tp_shard(piece: Tensor, shard: TPShard) -> None:
    """Record that ``piece`` is this rank's ``shard`` of a tensor-parallel parameter (its global shape follows)."""
    shape = list(piece.shape)
    shape[shard.dim] *= shard.parts
    set_placement(piece, dataclasses.replace(placement_of(piece), global_shape=tuple(shape), tp_shard=shard))


def mark_norm_duplicate(param: Tensor, *, axis: str) -> None:
    """Leave ``param`` out of the global gradient norm: another rank along ``axis`` holds the same values and counts
    them (a tensor-parallel-replicated parameter on tp_rank > 0, the last stage's copy of a tied embedding)."""
    placement = placement_of(param)
    set_placement(param, dataclasses.replace(placement, norm_duplicate_on=placement.norm_duplicate_on | {axis}))
