"""The pipeline's gradient reduction after a step: tied weights over the first and last stages, and every
gradient over the data-parallel replicas.

Why here and not DDP: the schedule runs several backward passes per step, and DDP reduces at the end of each, so
the strategy leaves its wrapper out under pipeline parallelism and the engine calls this object once, at the last
step of an accumulation. It is the one seam between the engine and whatever reduces gradients: the engine hands
it this stage's parameters and nothing else. Whether it reduces over the replicas is the run's `ReductionPlan`'s
to say (with sharded optimizer state the optimizer reduce-scatters instead). Not owned: when a step is the last of
an accumulation (the strategy).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from lightning_smp.reduction import ReductionPlan, all_reduce_

if TYPE_CHECKING:
    from lightning_smp.topology import Topology

__all__ = ["StageGradientReduction"]


class StageGradientReduction:
    """Sums the tied parameters' gradients over the first and last stages (``topology.group("embedding")``) and,
    where the run's `ReductionPlan` gives the replicas to the engine, averages every gradient over them."""

    def __init__(self, *, topology: Topology, plan: ReductionPlan) -> None:
        self._topology = topology
        self._plan = plan

    def __call__(self, *, tied: Sequence[nn.Parameter], trained: Sequence[nn.Parameter]) -> None:
        """Reduce in place: ``tied`` (empty on stages between the first and the last), then ``trained``."""
        tied = [p for p in tied if p.requires_grad]  # a frozen one gets no grad, as on one device
        if tied:
            for param in tied:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
            all_reduce_([p.grad for p in tied], self._topology.group("embedding"), max_bytes=self._plan.bucket_bytes)
        if self._plan.engine_reduces:
            grads = [p.grad for p in trained if p.grad is not None]
            all_reduce_(
                grads,
                self._topology.group(self._plan.axis),
                divide_by=self._plan.replicas,
                max_bytes=self._plan.bucket_bytes,
            )
