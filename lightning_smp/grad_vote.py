"""The job-wide verdicts on one step's gradients: whether any rank overflowed, and the global gradient norm.

Owns the two reductions and the process groups they run over, chosen from the topology in one place
(`GradientVote.for_run`), so that every rank skips the same steps and clips by the unsharded model's norm. Not
owned: which grads a rank passes (`optimizer.py`, `master_shard.py`: each value counted once, see
`placement.Placement.counts_in_norm`). Both results stay on the device: no host sync.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_smp._compat import foreach_mul_, foreach_norm
from lightning_smp.placement import placement_of

if TYPE_CHECKING:
    from lightning_smp.topology import Topology

__all__ = ["GradientVote", "clip_grad_norm_counted", "global_grad_norm"]


class GradientVote:
    """The groups over which ``found_inf`` is max-reduced and grad norms are summed; ``None``: this rank alone.

    Args:
        overflow_group: every rank whose step must be skipped together (the whole job).
        norm_group: the ranks holding different gradient values of one model: the model-parallel ranks, and the
            data-parallel ranks too when each holds a share of the gradients (sharded optimizer state).
    """

    def __init__(
        self, *, overflow_group: dist.ProcessGroup | None = None, norm_group: dist.ProcessGroup | None = None
    ) -> None:
        self._overflow_group = overflow_group
        self._norm_group = norm_group

    @classmethod
    def for_run(cls, topology: Topology | None, *, sharded_over_dp: bool) -> GradientVote:
        """The vote of a run laid out as ``topology`` (``None``: one process)."""
        if topology is None:
            return cls()
        norm_axis = "world" if sharded_over_dp else "mp"
        return cls(
            overflow_group=topology.group("world") if topology.world_size > 1 else None,
            norm_group=topology.group(norm_axis) if topology.size(norm_axis) > 1 else None,
        )

    def overflow(self, found_inf: Tensor) -> None:
        """Make ``found_inf`` (in place) the job's answer: a step overflows everywhere if it overflows anywhere."""
        if _group_size(self._overflow_group) > 1:
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self._overflow_group)

    def norm(self, grads: list[Tensor], norm_type: float, *, device: torch.device) -> Tensor:
        """The global ``norm_type`` norm of ``grads`` (this rank's counted grads) over the norm group."""
        return global_grad_norm(grads, norm_type, group=self._norm_group, device=device)

    def forget(self) -> None:
        """Drop the groups (destroyed at interpreter exit); later votes count this rank alone."""
        self._overflow_group = self._norm_group = None


def global_grad_norm(
    grads: list[Tensor], norm_type: float, *, group: dist.ProcessGroup | None, device: torch.device
) -> Tensor:
    """The ``norm_type`` norm of ``grads`` over every rank of ``group`` (each rank passing the grads it counts;
    ``None``: this rank alone), as a 0-dim device tensor: no host sync."""
    if not grads:
        local = torch.zeros((), device=device)
    elif math.isinf(norm_type):
        local = torch.stack([g.abs().max() for g in grads]).max()
    else:
        local = torch.linalg.vector_norm(torch.stack(foreach_norm(grads, norm_type)), norm_type)
    if _group_size(group) <= 1:
        return local
    if math.isinf(norm_type):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return local
    powered = local.pow(norm_type)
    dist.all_reduce(powered, op=dist.ReduceOp.SUM, group=group)
    return powered.pow(1.0 / norm_type)


def clip_grad_norm_counted(params: list[Tensor], max_norm: float, *, group: dist.ProcessGroup | None) -> Tensor:
    """Clip the grads of plain (fp32) ``params`` by their global norm over ``group``, counting each value once (a
    parameter whose placement is a norm duplicate does not count), as `MasterWeightOptimizer.clip_master_grads`
    does for masters."""
    with_grads = [p for p in params if p.grad is not None]
    grads = [p.grad for p in with_grads]
    device = grads[0].device if grads else torch.device("cpu")
    norm = global_grad_norm(
        [p.grad for p in with_grads if placement_of(p).counts_in_norm], 2.0, group=group, device=device
    )
    if grads:
        foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


def _group_size(group: dist.ProcessGroup | None) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)
