"""Replicated modules that act on a split activation: whole parameters whose gradient is summed over the group.

A norm between a column- and a row-parallel layer that normalises each head separately (Qwen3's ``q_norm`` /
``k_norm``; the plan style "replicated_with_grad_allreduce") keeps its whole weight on every rank, but each rank's
gradient covers only its own heads: the gradients are summed over the tensor-parallel group. The sum is a hook on
the parameter (it runs on each backward's gradient before accumulation, so gradient accumulation and pipeline
microbatches stay exact), put on by the module's forward so that a parameter replaced after the split gets one too.
Any module class can be such a module, so its tensor-parallel class is made per class.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from typing_extensions import override

from lightning_smp.tensor_parallel.base import TensorParallel, WholeTensorParallelModule

__all__ = ["GradientSummed", "gradient_summed_class"]

_HOOKED = "_smp_gradient_hooks"  # instance entry: id(parameter) -> weak reference to it, for each hooked parameter


class GradientSummed(WholeTensorParallelModule):
    """Mixin: the module stays whole; once distributed, its parameters' gradients are summed over the group."""

    @override
    def _tp_distribute(self, tp: TensorParallel, shared: dict[int, nn.Parameter]) -> None:
        if _HOOKED not in self.__dict__:  # once, whatever the number of setups (fit, then fit again)
            self.__dict__[_HOOKED] = {}
            self.register_forward_pre_hook(GradientSummed._hook_parameters)
        self._tp = tp

    def _hook_parameters(self, args: tuple[Any, ...]) -> None:
        # at each forward, not once: a parameter replaced since (materialised, loaded) needs its own hook
        hooked: dict[int, weakref.ref[Tensor]] = self.__dict__[_HOOKED]
        for param in self.parameters():
            ref = hooked.get(id(param))
            if param.requires_grad and (ref is None or ref() is not param):
                param.register_hook(self._summed)
                hooked[id(param)] = weakref.ref(param)

    def _summed(self, grad: Tensor) -> Tensor:
        if self._tp is None:  # the group is gone (after teardown): nothing to sum over
            return grad
        grad = grad.clone(memory_format=torch.contiguous_format)  # never reduce into a tensor autograd holds
        dist.all_reduce(grad, group=self._tp.group)
        return grad


@functools.cache
def gradient_summed_class(module_class: type[nn.Module]) -> type[GradientSummed]:
    """The `GradientSummed` class for modules of ``module_class`` (one per class, so class swaps stay cheap)."""
    return type(f"GradientSummed{module_class.__name__}", (GradientSummed, module_class), {})
