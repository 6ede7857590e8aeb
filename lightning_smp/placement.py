"""A parameter's placement: its global shape, the tensor-parallel piece this rank holds, and the axes along which
another rank holds the same values (so the global gradient norm must not count this copy).

Owns that one public description: tensor parallelism and the pipeline write it, checkpoints and norm counting read
it (`placement_of`). Not owned: cutting and joining pieces (`tensor_parallel/shard.py`). Our own frozen dataclass,
not DTensor: our tensor-parallel layers run explicit collectives on plain local tensors and the fp16 optimizer
keeps flat fp32 buffers over them; DTensor parameters would change every layer's forward and that optimizer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import Tensor, nn

__all__ = [
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
