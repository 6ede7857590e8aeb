"""The batch a tensor-parallel group trains on under Fabric, as smp's ``prescaled_batch=False`` defines it.

A Fabric loop calls ``model(x)`` and computes the loss itself, so there is no step to run on the group's combined
batch (the Trainer door runs its whole ``training_step`` there, `tp_batches`). Here hooks on the model do what smp
did around its distributed modules: the forward's tensors are combined over the tensor-parallel group
(`tp_batches.combine`, every rank runs the split layers on the union) and each output with one row per combined
sample is cut back to this rank's rows. The cut's backward sums the group's row gradients and divides by its size,
so every rank of the group backpropagates the same gradient of the union's mean loss, as one device would.
It owns those two hooks and the cut; not the combination (`tp_batches`) or the groups (`topology`).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, autograd, nn

from lightning_smp import tp_batches
from lightning_smp.topology import Topology

__all__ = ["train_on_group_batches"]


def train_on_group_batches(module: nn.Module, *, topology: Topology) -> None:
    """Make ``module``'s forward run on its tensor-parallel group's combined batch and return this rank's rows.

    Every tensor argument with a dim (positional or keyword) is the batch: build masks and positions inside the
    model, or set ``prescaled_batch=True`` and give a group one batch. The first forward compares the group's
    batches (`tp_batches.check_batches`, a collective over the job). The hooks look the group up through
    ``topology`` at each forward: the model keeps no group of its own."""
    combined: list[tp_batches.CombinedBatch] = []
    checked: list[bool] = []

    def combine(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not checked:
            tp_batches.check_batches((args, kwargs), topology=topology, prescaled_batch=False)
            checked.append(True)
        combined[:] = [tp_batches.combine((args, kwargs), group=topology.group("tp"))]
        return combined[0].batch

    def cut(_: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        batch = combined.pop()
        group = topology.group("tp")
        return apply_to_collection(output, Tensor, lambda tensor: _own_rows(tensor, batch, group))

    module.register_forward_pre_hook(combine, with_kwargs=True)
    module.register_forward_hook(cut, with_kwargs=True)


def _own_rows(tensor: Tensor, batch: tp_batches.CombinedBatch, group: dist.ProcessGroup) -> Tensor:
    """This rank's rows of an output over the combined batch (a tensor of another length is returned whole)."""
    if tensor.dim() == 0 or tensor.shape[0] != batch.total:
        return tensor
    if not tensor.requires_grad:
        return tensor[batch.start : batch.start + batch.size]
    return _OwnRows.apply(tensor, batch.start, batch.size, group)


class _OwnRows(autograd.Function):
    """Forward: rows ``[start, start + size)``. Backward: every rank's row gradients placed in one gradient of the
    whole output, summed over the group and divided by its size (collective over ``group``)."""

    @staticmethod
    def forward(ctx: Any, output: Tensor, start: int, size: int, group: dist.ProcessGroup) -> Tensor:
        ctx.start, ctx.total, ctx.group = start, output.shape[0], group
        return output[start : start + size].clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        whole = grad.new_zeros((ctx.total, *grad.shape[1:]))
        whole[ctx.start : ctx.start + grad.shape[0]] = grad
        dist.all_reduce(whole, group=ctx.group)
        return whole.div_(dist.get_world_size(ctx.group)), None, None, None
