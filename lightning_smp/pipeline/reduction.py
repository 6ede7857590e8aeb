"""The pipeline's gradient reduction: every gradient over the data-parallel replicas, bucket by bucket while the
schedule's last backwards run, and the tied weights over the first and last stages after it.

Why here and not DDP: the schedule runs several backward passes per step, and DDP reduces at the end of each, so
the strategy leaves its wrapper out under pipeline parallelism and the engine reduces once, at the last step of an
accumulation. On that step `start` hands the engine a `ReadyBuckets` over this stage's parameters (the tied ones
aside): the engine arms it around each chunk's last backward (or weight-gradient pass), so a bucket's all-reduce
starts as soon as its gradients are final while the rest of the backward runs, as DDP overlaps its buckets
(`overlap.py`). `finish` waits for them and averages what earlier steps of the accumulation left in ``.grad`` (their
sum's average is the average's sum); the tied weights' sum over the stages comes after Lightning's backward call,
then their average. Whether the engine reduces over the replicas at all is the run's `ReductionPlan`'s to say (with
sharded optimizer state the optimizer reduce-scatters instead). Not owned: when a step is the last of an
accumulation (the strategy), when a gradient is final (the engine's plan).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from lightning_smp.overlap import Launched, ReadyBuckets
from lightning_smp.reduction import ReductionPlan, all_reduce_, backward_buckets, start_all_reduce

if TYPE_CHECKING:
    from lightning_smp.topology import Topology

__all__ = ["StageGradientReduction"]


class StageGradientReduction:
    """Averages this stage's gradients over the data-parallel replicas where the run's `ReductionPlan` gives them
    to the engine (`start`, `finish`), and sums the tied parameters' gradients over the first and last stages
    (``topology.group("embedding")``, `reduce_tied`)."""

    def __init__(self, *, topology: Topology, plan: ReductionPlan) -> None:
        self._topology = topology
        self._plan = plan

    def start(self, *, trained: Sequence[nn.Parameter], tied: Sequence[nn.Parameter]) -> ReadyBuckets | None:
        """For the last step of an accumulation: the replicas' average of the step's gradients of ``trained`` but
        ``tied``, in buckets whose all-reduce starts once their gradients are final (the last parameters first:
        backward finishes them first). None where the engine does not reduce over the replicas."""
        if not self._plan.engine_reduces:
            return None
        tied_ids = {id(p) for p in tied}
        params = [p for p in trained if id(p) not in tied_ids]
        in_buckets = backward_buckets(params, max_bytes=self._plan.bucket_bytes)
        group = self._topology.group(self._plan.axis)

        def launch(index: int) -> Launched:
            grads = [p.grad for p in in_buckets[index] if p.grad is not None]
            if not grads:
                return Launched(None, lambda: None)
            return start_all_reduce(grads, group, divide_by=self._plan.replicas)

        return ReadyBuckets(in_buckets, launch)

    def finish(self, started: ReadyBuckets | None, *, earlier: Sequence[Tensor]) -> None:
        """Wait for the step's all-reduces (the step's gradients are then the replicas' average, in the tensors
        they were launched on); average ``earlier`` (gradients of the accumulation's earlier steps) too."""
        if started is None:
            return
        started.finish()
        if earlier:
            all_reduce_(
                earlier,
                self._topology.group(self._plan.axis),
                divide_by=self._plan.replicas,
                max_bytes=self._plan.bucket_bytes,
            )

    def reduce_tied(self, tied: Sequence[nn.Parameter]) -> None:
        """Sum ``tied`` (empty on stages between the first and the last) over the stages that hold them, then
        average over the replicas where the engine does."""
        tied = [p for p in tied if p.requires_grad]  # a frozen one gets no grad, as on one device
        if not tied:
            return
        for param in tied:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        grads = [p.grad for p in tied]
        all_reduce_(grads, self._topology.group("embedding"), max_bytes=self._plan.bucket_bytes)
        if self._plan.engine_reduces:
            all_reduce_(
                grads,
                self._topology.group(self._plan.axis),
                divide_by=self._plan.replicas,
                max_bytes=self._plan.bucket_bytes,
            )
