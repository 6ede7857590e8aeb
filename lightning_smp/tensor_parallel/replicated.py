"""Replicated parameters whose gradients are summed over the tensor-parallel group, and the modules that hold them.

A module that keeps its whole weight on every rank but sees only this rank's part of an activation computes only
this rank's part of the weight's gradient: a norm between a column- and a row-parallel layer that normalises each
head separately (Qwen3's ``q_norm`` / ``k_norm``; the plan style "replicated_with_grad_allreduce") sees only its
heads, and under sequence parallelism every norm and bias of a layer sees only its slice of the sequence. Their
gradients are summed over the group. The sum is a hook on the parameter (it runs on each backward's gradient before
accumulation, so gradient accumulation and pipeline microbatches stay exact), put on by the module's forward so that
a parameter replaced after the split (materialised, loaded) gets one too. Which parameters a module sums is its
``_summed_parameters``; `GradientSummed` sums all of its own, and any module class can be one, so its
tensor-parallel class is made per class.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from typing_extensions import override

from lightning_smp.tensor_parallel.base import TensorParallel, TensorParallelModule, WholeTensorParallelModule
from lightning_smp.tensor_parallel.comm import all_reduce_

__all__ = ["GradientSummed", "gradient_summed_class", "sum_gradients"]

_HOOKED = "_smp_gradient_hooks"  # instance entry: id(parameter) -> weak reference to it, for each hooked parameter


def sum_gradients(module: TensorParallelModule) -> None:
    """From its next forward on, sum over ``module``'s tensor-parallel group the gradient of every parameter its
    ``_summed_parameters()`` yields (idempotent: once, whatever the number of setups)."""
    if _HOOKED not in module.__dict__:
        module.__dict__[_HOOKED] = {}
        module.register_forward_pre_hook(_hook_parameters)  # a function, not a closure: copies of the module work


def _hook_parameters(module: nn.Module, args: tuple[Any, ...]) -> None:
    # at each forward, not once: a parameter replaced since (materialised, loaded) needs its own hook
    hooked: dict[int, weakref.ref[Tensor]] = module.__dict__[_HOOKED]
    for param in module._summed_parameters():
        ref = hooked.get(id(param))
        if param.requires_grad and (ref is None or ref() is not param):
            param.register_hook(functools.partial(_summed, weakref.ref(module)))
            hooked[id(param)] = weakref.ref(param)


def _summed(module: weakref.ref[TensorParallelModule], grad: Tensor) -> Tensor:
    owner = module()
    tp = owner.tp_context if owner is not None else None
    if tp is None:  # the group is gone (after teardown): nothing to sum over
        return grad
    return all_reduce_(grad.clone(memory_format=torch.contiguous_format), tp.group)  # never into a saved tensor


class GradientSummed(WholeTensorParallelModule):
    """Mixin: the module stays whole; once distributed, its parameters' gradients are summed over the group."""

    tp_sequence_role: ClassVar[str | None] = "whole"

    @override
    def _tp_distribute(self, tp: TensorParallel, shared: dict[int, nn.Parameter]) -> None:
        sum_gradients(self)
        self._tp = tp

    def _summed_parameters(self) -> Iterable[nn.Parameter]:
        return self.parameters()


@functools.cache
def gradient_summed_class(module_class: type[nn.Module]) -> type[GradientSummed]:
    """The `GradientSummed` class for modules of ``module_class`` (one per class, so class swaps stay cheap)."""
    return type(f"GradientSummed{module_class.__name__}", (GradientSummed, module_class), {})
