"""The job-wide verdicts on one step's gradients: whether any rank overflowed, and the global gradient norm.

Owns the two reductions and the one rule of what a rank adds to the norm, for every way the masters are laid out
(whole, ZeRO-1 shares, FSDP2 shards) and for plain fp32 optimizers: each value of the model's gradient counts once.
A copy whose placement names another rank along tp or pp as the one counting it (`Placement.counts_in_norm`) is
left out; a value held by n data-parallel ranks counts 1/n on each. Not owned: which grads a rank holds
(`master_shard.py`, `sharded_data_parallel.py`). The groups come from the topology at each call; both results stay
on the device: no host sync.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from lightning_smp._compat import foreach_mul_, foreach_norm
from lightning_smp.placement import placement_of

if TYPE_CHECKING:
    from lightning_smp.topology import Topology

__all__ = ["Counted", "clip_grad_norm_counted", "global_grad_norm", "norm_copies", "vote_overflow"]

Counted = tuple[Tensor, int]
"""A gradient this rank counts in the norm, with the number of data-parallel ranks holding the same values."""


def norm_copies(param: Tensor) -> int:
    """The rule of what this rank's copy of ``param`` adds to the norm: 0 where another rank's copy along tp or pp
    counts it (`Placement.counts_in_norm`); otherwise the number of data-parallel ranks holding the same local
    values: the mesh dims a DTensor (FSDP2's shard) is replicated on, 1 for a plain tensor (whose replicas
    `global_grad_norm` leaves out with ``replicated=True``)."""
    if not placement_of(param).counts_in_norm:
        return 0
    if not isinstance(param, DTensor):
        return 1
    mesh = param.device_mesh
    return math.prod(mesh.size(dim) for dim, p in enumerate(param.placements) if isinstance(p, Replicate))


def vote_overflow(found_inf: Tensor, topology: Topology | None) -> None:
    """Make ``found_inf`` (in place) the job's answer: a step overflows everywhere if it overflows anywhere
    (``topology`` None: this rank alone)."""
    if topology is not None and topology.world_size > 1:
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=topology.group("world"))


def global_grad_norm(
    counted: Sequence[Counted],
    norm_type: float,
    *,
    topology: Topology | None,
    device: torch.device,
    replicated: bool = False,
) -> Tensor:
    """The ``norm_type`` norm of the whole model's gradient from every rank's ``counted`` grads (see the module's
    rule), as a 0-dim device tensor. ``replicated``: every data-parallel replica holds every value this rank
    counts (whole masters, plain optimizers), so one replica's sum is the model's and the sum runs over the
    model-parallel group only; otherwise over the whole job. Every rank must pass the same ``replicated``."""
    axis = "mp" if replicated else "world"
    group = topology.group(axis) if topology is not None and topology.size(axis) > 1 else None
    grads = [grad for grad, _ in counted if grad.numel()]
    if math.isinf(norm_type):  # a copy changes no maximum
        local = torch.stack([g.abs().max() for g in grads]).max().float() if grads else torch.zeros((), device=device)
        if group is not None:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return local
    by_copies: dict[int, list[Tensor]] = {}
    for grad, copies in counted:
        by_copies.setdefault(1 if replicated else copies, []).append(grad)
    local = torch.zeros((), dtype=torch.float32, device=device)
    for copies, same in by_copies.items():  # one foreach kernel per weight
        powered = torch.stack(foreach_norm(same, norm_type)).float().pow(norm_type).sum()
        local = local + (powered / copies if copies > 1 else powered)
    if group is not None:
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
    return local.pow(1.0 / norm_type)


def clip_grad_norm_counted(params: list[Tensor], max_norm: float, *, topology: Topology | None) -> Tensor:
    """Clip the grads of plain (fp32, data-parallel replicated) ``params`` by the model's global norm, counting
    each value once, as `MasterWeightOptimizer.clip_master_grads` does for masters; returns that norm."""
    with_grads = [p for p in params if p.grad is not None]
    device = with_grads[0].grad.device if with_grads else torch.device("cpu")
    counted = [(p.grad, 1) for p in with_grads if norm_copies(p)]
    norm = global_grad_norm(counted, 2.0, topology=topology, device=device, replicated=True)
    if with_grads:
        foreach_mul_([p.grad for p in with_grads], torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm
