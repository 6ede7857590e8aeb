"""The batches of a tensor-parallel group, as smp's ``prescaled_batch`` defines them.

smp counts every tensor-parallel rank as data parallel (its dp group is rdp x tp). With ``prescaled_batch=False``,
smp's default, each rank reads its own batch (a sampler over ``smp.dp_rank()`` / ``smp.dp_size()``) and the group
combines them: here every tensor of the batch is all-gathered over the tensor-parallel group and concatenated on
dim 0 in tp-rank order, so each rank of the group runs the step on the union (split layers need the same input on
every rank of their group), which is one device's step on the union; `CombinedBatch.own` cuts what a step returns
for the combined samples back to this rank's. smp paid the same: it gathered the inputs of its distributed modules
over the group and split their outputs back; here the layers kept whole run on the union too. With
``prescaled_batch=True`` the ranks of a group read the same batch (a sampler over ``smp.rdp_rank()`` /
``smp.rdp_size()``) and nothing moves. `check_batches` compares the first batch of a loop across every group and
raises, naming ``prescaled_batch``, when they disagree with the setting.

It owns the combination and the check; not the sampler (the strategy's ``distributed_sampler_kwargs``) or the
process groups (`topology`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_smp.topology import Topology, rank_groups

__all__ = ["CombinedBatch", "check_batches", "combine", "sampler_axis"]

_MAX_DIMS = 8  # dims of a batch tensor described in the per-step shape exchange


def sampler_axis(prescaled_batch: bool) -> str:
    """The topology axis whose ranks each read their own share of the data: smp's dp (data x tensor parallel
    ranks) when each rank reads its own batch, the true replicas (smp's rdp) when a tensor-parallel group reads
    one."""
    return "dp" if prescaled_batch else "dp_tp"


@dataclass(frozen=True, slots=True)
class CombinedBatch:
    """A tensor-parallel group's batches as one, and where this rank's samples are in it."""

    batch: Any
    """The batch with every tensor (with a dim) the concatenation of the group's, in tp-rank order."""
    start: int
    """Index of this rank's first sample in the combined batch."""
    size: int
    """Number of this rank's samples."""
    total: int
    """Number of samples of the combined batch."""

    def own(self, output: Any) -> Any:
        """``output`` of a step on the combined batch with every tensor whose dim 0 counts its samples cut to this
        rank's samples (a loss, or any tensor of another length, is returned whole)."""

        def cut(tensor: Tensor) -> Tensor:
            if tensor.dim() == 0 or tensor.shape[0] != self.total:
                return tensor
            return tensor[self.start : self.start + self.size]

        return apply_to_collection(output, Tensor, cut)


def combine(batch: Any, *, group: dist.ProcessGroup) -> CombinedBatch:
    """The batches of ``group``'s ranks as one (collective over ``group``; every rank passes a batch with the same
    tensors, which may differ in dim 0). Tensors without a dim and other values stay this rank's."""
    tensors = _tensors(batch)
    if not tensors:
        return CombinedBatch(batch, 0, 0, 0)
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    shapes = _exchange_shapes(tensors, group)  # (ranks, tensors, dims); sync: the sizes decide the buffers
    gathered = iter([_gather(tensor, shapes[:, index], index, group) for index, tensor in enumerate(tensors)])
    sizes = [int(shapes[rank, 0, 1]) for rank in range(ranks)]
    combined = apply_to_collection(batch, Tensor, lambda t: next(gathered) if t.dim() > 0 else t)
    return CombinedBatch(combined, sum(sizes[:me]), sizes[me], sum(sizes))


def check_batches(batch: Any, *, topology: Topology, prescaled_batch: bool) -> None:
    """Compare this first batch of a loop across the ranks of every tensor-parallel group (a collective over the
    whole job, so that every rank raises together): with ``prescaled_batch=True`` they must be equal, else a
    ``ValueError`` naming the setting; with False, equal batches warn (each sample would count tp times)."""
    mine = _fingerprint(batch)
    everyone: list[Any] = [None] * topology.world_size
    dist.all_gather_object(everyone, mine)  # sync: once per loop
    groups = rank_groups(topology.order, dp=topology.dp, pp=topology.pp, tp=topology.tp, cp=topology.cp)["tp"]
    for ranks in groups:
        prints = [everyone[rank] for rank in ranks]
        if prescaled_batch:
            differing = next((rank for rank, p in zip(ranks, prints, strict=True) if p != prints[0]), None)
            if differing is not None:
                raise ValueError(
                    f"prescaled_batch=True, but the tensor-parallel ranks {ranks} received different batches (rank "
                    f"{differing}'s {_describe(prints, ranks.index(differing))}); with prescaled_batch=True the "
                    "ranks of a tensor-parallel group must read the same batch. Shard the data by smp.rdp_rank() / "
                    "smp.rdp_size() (Lightning's own sampler does), or set prescaled_batch=False (smp's default) to "
                    "let every rank read its own batch and the group train on their union."
                )
        elif any(p[0] != prints[0][0] for p in prints):
            raise ValueError(
                f"prescaled_batch=False combines the batches of the tensor-parallel ranks {ranks}, but they hold "
                f"different tensors ({prints[0][0]} against {next(p[0] for p in prints if p[0] != prints[0][0])}; "
                "dtype and shape after dim 0 per tensor). Give every rank batches of the same structure (pad "
                "sequences to one length), or set prescaled_batch=True with one batch per tensor-parallel group."
            )
        elif prints[0][0] and all(p == prints[0] for p in prints):
            rank_zero_warn(
                f"prescaled_batch=False, but the tensor-parallel ranks {ranks} received the same batch, so the batch "
                f"they train on holds each sample {len(ranks)} times (the mean loss is the same, the step does "
                f"{len(ranks)} times the work). Shard the data by smp.dp_rank() / smp.dp_size() (Lightning's own "
                "sampler does), or set prescaled_batch=True if a tensor-parallel group is meant to read one batch."
            )
            return


def _tensors(batch: Any) -> list[Tensor]:
    """The tensors with a dim in ``batch``, in `apply_to_collection`'s order."""
    found: list[Tensor] = []
    apply_to_collection(batch, Tensor, lambda t: found.append(t) if t.dim() > 0 else None)
    return found


def _exchange_shapes(tensors: Sequence[Tensor], group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's shapes of ``tensors``, (ranks, len(tensors), 1 + _MAX_DIMS): ndim, then the dims (-1 padded)."""
    table = torch.full((len(tensors), 1 + _MAX_DIMS), -1, dtype=torch.int64)
    for index, tensor in enumerate(tensors):
        if tensor.dim() > _MAX_DIMS:
            raise ValueError(
                f"a batch tensor has {tensor.dim()} dims; prescaled_batch=False combines tensors of at most "
                f"{_MAX_DIMS}: reshape it, or set prescaled_batch=True and read one batch per tensor-parallel group."
            )
        table[index, 0] = tensor.dim()
        table[index, 1 : 1 + tensor.dim()] = torch.tensor(tensor.shape)
    local = table.to(tensors[0].device)
    everyone = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, local, group=group)
    return torch.stack(everyone).cpu()  # sync: the shapes size the gather below


def _gather(tensor: Tensor, shapes: Tensor, index: int, group: dist.ProcessGroup) -> Tensor:
    """The group's ``tensor`` concatenated on dim 0; ``shapes`` holds each rank's shape row of it."""
    trailing = {tuple(row[2 : 1 + int(row[0])].tolist()) for row in shapes}
    if len(trailing) > 1 or len({int(row[0]) for row in shapes}) > 1:
        raise ValueError(
            f"prescaled_batch=False combines the tensor-parallel ranks' batches on dim 0, but batch tensor {index} "
            f"has other shapes after dim 0 on other ranks ({sorted(trailing)}). Pad it to one length on every rank "
            "(e.g. padding='max_length' in the tokenizer), or set prescaled_batch=True with one batch per group."
        )
    sizes = [int(row[1]) for row in shapes]
    wire = tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor  # gloo gathers no bools
    longest = max(sizes)
    if wire.shape[0] < longest:
        wire = torch.cat([wire, wire.new_zeros((longest - wire.shape[0], *wire.shape[1:]))])
    parts = [torch.empty_like(wire) for _ in sizes]
    dist.all_gather(parts, wire.contiguous(), group=group)
    whole = torch.cat([part[:size] for part, size in zip(parts, sizes, strict=True)])
    return whole.view(torch.bool) if tensor.dtype == torch.bool else whole


def _fingerprint(batch: Any) -> tuple[tuple[tuple[str, tuple[int, ...]], ...], tuple[float, ...]]:
    """What tells batches apart, cheaply: each tensor's dtype and shape after dim 0, then each one's dim 0, sum and
    position-weighted sum (so that the same samples in another order differ too)."""
    tensors = _tensors(batch)
    structure = tuple((str(t.dtype), tuple(t.shape[1:])) for t in tensors)
    values: list[Tensor] = []
    for tensor in tensors:
        flat = tensor.detach().reshape(-1).double()
        weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.float64).remainder_(1009).add_(1)
        values += [torch.tensor(float(tensor.shape[0]), device=flat.device), flat.sum(), (flat * weights).sum()]
    numbers = tuple(torch.stack(values).tolist()) if values else ()  # sync: once per loop
    return structure, numbers


def _describe(prints: Sequence[Any], index: int) -> str:
    """How rank ``index``'s fingerprint differs from the first rank's, in words."""
    first, other = prints[0], prints[index]
    if first[0] != other[0]:
        return f"tensors {other[0]} against {first[0]}"
    sizes = [int(n) for n in other[1][0::3]], [int(n) for n in first[1][0::3]]
    if sizes[0] != sizes[1]:
        return f"batch sizes {sizes[0]} against {sizes[1]}"
    return "values differ from the first rank's"
