"""Replicated modules that act on a split activation: whole parameters whose gradient is summed over the group.

A norm between a column- and a row-parallel layer that normalises each head separately (Qwen3's ``q_norm`` /
``k_norm``; the plan style "replicated_with_grad_allreduce") keeps its whole weight on every rank, but each rank's
gradient covers only its own heads: the gradients are summed over the tensor-parallel group. The sum is a hook on
the parameter (it runs on each backward's gradient before accumulation, so gradient accumulation and pipeline
microbatches stay exact). Any module class can be such a module, so its tensor-parallel class is made per class.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from typing_extensions import override

from lightning_smp.tensor_parallel.base import TensorParallel, TensorParallelModule
from lightning_smp.tensor_parallel.shard import ShardSpec

__all__ = ["GradientSummed", "gradient_summed_class"]


class GradientSummed(TensorParallelModule):
    """Mixin: the module stays whole; once distributed, its parameters' gradients are summed over the group."""

    @override
    @classmethod
    def tp_shard_specs(cls, module: nn.Module) -> dict[str, ShardSpec]:
        return {}

    @override
    @classmethod
    def tp_unsplittable(cls, module: nn.Module, tp_size: int) -> str | None:
        return None

    @override
    def _tp_distribute(self, tp: TensorParallel, shared: dict[int, nn.Parameter]) -> None:
        if self._tp is None:  # a second setup (validate after fit) must not sum twice
            for param in self.parameters():
                if param.requires_grad:
                    param.register_hook(_summed_over(tp.group))
        self._tp = tp


def _summed_over(group: dist.ProcessGroup) -> Callable[[Tensor], Tensor]:
    def hook(grad: Tensor) -> Tensor:
        grad = grad.clone(memory_format=torch.contiguous_format)  # never reduce into a tensor autograd holds
        dist.all_reduce(grad, group=group)
        return grad

    return hook


@functools.cache
def gradient_summed_class(module_class: type[nn.Module]) -> type[GradientSummed]:
    """The `GradientSummed` class for modules of ``module_class`` (one per class, so class swaps stay cheap)."""
    return type(f"GradientSummed{module_class.__name__}", (GradientSummed, module_class), {})
