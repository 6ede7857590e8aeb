"""Where a tensor-parallel parameter's values come from: the one definition of a shard, and its pure arithmetic.

Owns ``ShardSpec``, cutting a whole tensor into this rank's shard, putting the shards back together (in memory,
or across the group for tests and checkpoints), and, for a model planned on the meta device (delayed
initialisation), which whole tensor a shard is to be cut from once materialised. It does not decide what to
shard (``plan.py``) nor when (``parallelize.py``), nor record which piece a parameter is (its
`lightning_smp.placement.Placement`, whose ``tp_shard`` is a `TPShard`). A parameter without a ``tp_shard`` is
replicated: every rank of the tensor-parallel group holds the same whole tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_smp.placement import TPShard, placement_of

__all__ = [
    "ShardSpec",
    "gather_shards",
    "merge_shards",
    "remember_meta_whole",
    "shard_of",
    "slice_shard",
    "take_meta_whole",
]

_META_WHOLE_ATTRIBUTE = "_smp_tp_meta_whole"  # read and written only in this module


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """How a whole tensor is split, independent of the rank.

    The whole tensor is ``blocks`` equal blocks along ``dim``; each block is cut into ``parts`` equal pieces and
    rank ``r`` keeps piece ``r`` of every block, concatenated. ``blocks`` > 1 describes packed weights such as
    ``nn.MultiheadAttention.in_proj_weight`` ([q; k; v] along dim 0, ``blocks=3``): each rank keeps its heads'
    rows of q, of k and of v.
    """

    dim: int
    blocks: int = 1


def shard_of(tensor: Tensor) -> TPShard | None:
    """The shard ``tensor`` holds, or None when it is replicated (not tensor-parallel): its placement's ``tp_shard``."""
    return placement_of(tensor).tp_shard


def slice_shard(whole: Tensor, spec: ShardSpec, index: int, parts: int) -> Tensor:
    """Rank ``index``'s piece of ``whole`` (a view when ``spec.blocks == 1``, else a new tensor)."""
    size = whole.shape[spec.dim]
    if size % (spec.blocks * parts):
        raise ValueError(
            f"dim {spec.dim} of size {size} does not split into {spec.blocks} block(s) x {parts} parts; the "
            f"size must be a multiple of {spec.blocks * parts}."
        )
    blocks = whole.chunk(spec.blocks, dim=spec.dim)
    pieces = [block.chunk(parts, dim=spec.dim)[index] for block in blocks]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=spec.dim)


def remember_meta_whole(piece: Tensor, whole: Tensor) -> None:
    """Note on a shard cut from a tensor on the meta device (a model built for delayed initialisation) the whole
    tensor it comes from: the shard's value is only known once that whole is materialised and cut."""
    setattr(piece, _META_WHOLE_ATTRIBUTE, whole)


def take_meta_whole(piece: Tensor) -> Tensor | None:
    """The meta whole tensor ``piece`` was cut from (`remember_meta_whole`), or None for any other tensor; forgotten
    here, since it is asked for once, when the piece is materialised."""
    return piece.__dict__.pop(_META_WHOLE_ATTRIBUTE, None)


def merge_shards(pieces: Sequence[Tensor], spec: ShardSpec) -> Tensor:
    """The whole tensor from every rank's piece, in rank order: the inverse of `slice_shard`."""
    if spec.blocks == 1:
        return torch.cat(list(pieces), dim=spec.dim)
    per_rank_blocks = [piece.chunk(spec.blocks, dim=spec.dim) for piece in pieces]
    return torch.cat([blocks[b] for b in range(spec.blocks) for blocks in per_rank_blocks], dim=spec.dim)


def gather_shards(local: Tensor, shard: TPShard | None, group: dist.ProcessGroup) -> Tensor:
    """The whole tensor on every rank of ``group`` (the tensor-parallel group); collective.

    ``local`` is this rank's piece described by ``shard`` (None: replicated, returned as is). Meant for tests,
    checkpoints and debugging, not for the training step.
    """
    if shard is None:
        return local
    pieces = [torch.empty_like(local) for _ in range(shard.parts)]
    dist.all_gather(pieces, local.detach().contiguous(), group=group)
    return merge_shards(pieces, ShardSpec(shard.dim, shard.blocks))
