"""The four autograd-aware collectives of Megatron-style tensor parallelism (Shoeybi et al. 2019, section 3).

- ``copy_to_region`` ("f"): identity forward, all-reduce of the gradient backward. Entry of a column-parallel
  region: every rank needs the whole input, and the input's gradient is the sum of every rank's part.
- ``reduce_from_region`` ("g"): all-reduce forward, identity backward. Exit of a row-parallel region.
- ``gather_from_region``: all-gather along ``dim`` forward, keep this rank's slice backward.
- ``scatter_to_region``: keep this rank's slice of ``dim`` forward, all-gather backward.

Each takes the tensor-parallel process group explicitly. They are written as autograd functions over plain
tensors rather than DTensor redistributions because the parameters stay plain tensors (see the package docstring).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["copy_to_region", "gather_from_region", "reduce_from_region", "scatter_to_region"]


def _all_reduce(tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
    tensor = tensor.clone(memory_format=torch.contiguous_format)  # never reduce into a tensor autograd holds
    dist.all_reduce(tensor, group=group)
    return tensor


def _all_gather(tensor: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    pieces = [torch.empty_like(tensor, memory_format=torch.contiguous_format) for _ in range(group.size())]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return torch.cat(pieces, dim=dim)


def _own_slice(tensor: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    size = group.size()
    if tensor.shape[dim] % size:
        raise ValueError(
            f"cannot split dim {dim} of size {tensor.shape[dim]} over {size} tensor-parallel ranks; the size must "
            f"be a multiple of {size}."
        )
    return tensor.chunk(size, dim=dim)[group.rank()].contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
        return _all_reduce(tensor, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return _all_gather(tensor, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _own_slice(grad, ctx.dim, ctx.group), None, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return _own_slice(tensor, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _all_gather(grad, ctx.dim, ctx.group), None, None


def copy_to_region(tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Identity; backward all-reduces the gradient over ``group``."""
    return _CopyToRegion.apply(tensor, group)


def reduce_from_region(tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Sum over ``group``; backward passes the gradient through."""
    return _ReduceFromRegion.apply(tensor, group)


def gather_from_region(tensor: Tensor, group: dist.ProcessGroup, dim: int = -1) -> Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` (rank order); backward keeps this rank's slice."""
    return _GatherFromRegion.apply(tensor, dim, group)


def scatter_to_region(tensor: Tensor, group: dist.ProcessGroup, dim: int = -1) -> Tensor:
    """This rank's slice of ``tensor`` along ``dim``; backward all-gathers the gradient."""
    return _ScatterToRegion.apply(tensor, dim, group)
