"""The pipeline's gradient reduction after a step: tied weights over the first and last stages, and every
gradient over the data-parallel replicas.

Why here and not DDP: the schedule runs several backward passes per step, and DDP reduces at the end of each, so
the strategy leaves its wrapper out under pipeline parallelism and the engine calls this object once, at the last
step of an accumulation. It is the one seam between the engine and whatever reduces gradients: the engine hands
it this stage's parameters and nothing else. With sharded optimizer state the optimizer reduce-scatters over the
replicas instead (``over_replicas=False``). Not owned: when a step is the last of an accumulation (the strategy).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_smp._compat import foreach_copy_

if TYPE_CHECKING:
    from lightning_smp.topology import Topology

__all__ = ["StageGradientReduction"]

_BUCKET_ELEMENTS = 1 << 24


class StageGradientReduction:
    """Sums the tied parameters' gradients over the first and last stages (``topology.group("embedding")``) and,
    with ``over_replicas``, averages every gradient over ``topology.group("dp")``."""

    def __init__(self, *, topology: Topology, over_replicas: bool) -> None:
        self._topology = topology
        self._over_replicas = over_replicas and topology.dp > 1

    def __call__(self, *, tied: Sequence[nn.Parameter], trained: Sequence[nn.Parameter]) -> None:
        """Reduce in place: ``tied`` (empty on stages between the first and the last), then ``trained``."""
        tied = [p for p in tied if p.requires_grad]  # a frozen one gets no grad, as on one device
        if tied:
            for param in tied:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
            _all_reduce([p.grad for p in tied], self._topology.group("embedding"), divide_by=1)
        if self._over_replicas:
            grads = [p.grad for p in trained if p.grad is not None]
            _all_reduce(grads, self._topology.group("dp"), divide_by=self._topology.dp)


def _all_reduce(grads: list[Tensor], group: dist.ProcessGroup, *, divide_by: int) -> None:
    """Sum ``grads`` over ``group`` in place (divided by ``divide_by`` first, as DDP averages), one flat bucket
    per dtype of at most ``_BUCKET_ELEMENTS`` elements per collective."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for same in by_dtype.values():
        for bucket in _buckets(same):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            if divide_by > 1:
                flat.div_(divide_by)
            dist.all_reduce(flat, group=group)
            pieces = flat.split([g.numel() for g in bucket])
            foreach_copy_(bucket, [piece.view_as(g) for piece, g in zip(pieces, bucket, strict=True)])


def _buckets(tensors: list[Tensor]) -> list[list[Tensor]]:
    buckets: list[list[Tensor]] = [[]]
    size = 0
    for tensor in tensors:
        if buckets[-1] and size + tensor.numel() > _BUCKET_ELEMENTS:
            buckets.append([])
            size = 0
        buckets[-1].append(tensor)
        size += tensor.numel()
    return [bucket for bucket in buckets if bucket]
