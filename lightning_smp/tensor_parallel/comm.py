"""Every collective of tensor parallelism: Megatron's four region functions, their sequence-parallel pair, and a
stand-in group under which they only shape tensors.

Megatron-style tensor parallelism (Shoeybi et al. 2019, section 3):

- ``copy_to_region`` ("f"): identity forward, all-reduce of the gradient backward. Entry of a column-parallel
  region: every rank needs the whole input, and the input's gradient is the sum of every rank's part.
- ``reduce_from_region`` ("g"): all-reduce forward, identity backward. Exit of a row-parallel region.
- ``gather_from_region``: all-gather along ``dim`` forward, keep this rank's slice backward.
- ``scatter_to_region``: keep this rank's slice of ``dim`` forward, all-gather backward.

Sequence parallelism (Korthikanti et al. 2022, section 4.2.2) replaces f and g by an all-gather and a
reduce-scatter along the sequence dim, so that what lies between a row-parallel exit and the next column-parallel
entry (norms, dropouts, residual adds) holds 1/tp of the sequence; the same bytes travel:

- ``gather_sequence`` ("g-bar" in the paper): all-gather forward, reduce-scatter of the gradient backward;
  ``gather_sequence_linear`` is it fused with the column-parallel linear that takes it, keeping the slice rather than
  the gathered input for backward (which gathers it again).
- ``reduce_scatter_sequence`` ("g-bar" backward's dual): reduce-scatter forward, all-gather backward.
- ``split_sequence``: ``scatter_to_region`` along the sequence, with the error a user can act on.

Each takes the tensor-parallel process group explicitly. They are written as autograd functions over plain tensors
rather than DTensor redistributions because the parameters stay plain tensors (see the package docstring). On CPU
tensors (gloo) the all-gathers and reduce-scatters go as point-to-point exchanges (`_exchange`), cheaper there than
gloo's own collectives; inside `collectives.native_on_cpu` (tests) as NCCL runs them, through gloo's collectives.
A `ShapeOnlyGroup` in place of the group makes every collective return a tensor of the shape it would return,
without communicating: the memory planner traces a split model on the meta device as one rank of the group.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_smp import collectives

__all__ = [
    "ShapeOnlyGroup",
    "all_reduce_",
    "copy_to_region",
    "gather_from_region",
    "gather_sequence",
    "gather_sequence_linear",
    "reduce_from_region",
    "reduce_scatter_sequence",
    "scatter_to_region",
    "split_sequence",
]

Group = Any  # dist.ProcessGroup or ShapeOnlyGroup
_DimOp = Callable[[Tensor, int, Group], Tensor]


class ShapeOnlyGroup:
    """Stands in for a process group of ``size`` ranks, as rank ``rank``, when only shapes matter (the memory
    planner's trace on the meta device): every collective of this module returns a tensor of the right shape
    without communicating."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"ShapeOnlyGroup(rank={self._rank}, size={self._size})"


def all_reduce_(tensor: Tensor, group: Group, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Tensor:
    """Reduce ``tensor`` over ``group`` in place (not differentiable); returns it."""
    if not isinstance(group, ShapeOnlyGroup):
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _all_reduce(tensor: Tensor, group: Group) -> Tensor:
    return all_reduce_(tensor.clone(memory_format=torch.contiguous_format), group)  # never into a saved tensor


def _all_gather(tensor: Tensor, dim: int, group: Group) -> Tensor:
    """Every rank's ``tensor`` concatenated along ``dim`` in rank order (contiguous)."""
    size = group.size()
    if isinstance(group, ShapeOnlyGroup):
        return torch.cat([tensor] * size, dim=dim)
    dim = dim % tensor.dim()
    tensor = tensor.contiguous()
    gathered = tensor.new_empty((size * tensor.shape[0], *tensor.shape[1:]))  # rank r's tensor is block r
    if not collectives.native(tensor.device):
        blocks = list(gathered.chunk(size))
        blocks[group.rank()].copy_(tensor)
        _exchange([tensor] * size, blocks, group)
    else:
        collectives.all_gather_single(gathered, tensor, group=group)
    if dim == 0:
        return gathered
    return torch.cat(gathered.chunk(size), dim=dim)  # one copy, in runs as long as the dims after ``dim``


def _reduce_scatter(tensor: Tensor, dim: int, group: Group) -> Tensor:
    """The sum over ``group`` of ``tensor``, of which this rank keeps its slice along ``dim`` (contiguous)."""
    size = group.size()
    _check_divisible(tensor, dim, size)
    if isinstance(group, ShapeOnlyGroup):
        return tensor.chunk(size, dim=dim)[group.rank()].contiguous()
    dim = dim % tensor.dim()
    # rank r's slice laid out as block r: a view for dim 0 of a contiguous tensor, else one copy in long runs
    stacked = tensor.contiguous() if dim == 0 else torch.cat(tensor.chunk(size, dim=dim), dim=0)
    if not collectives.native(tensor.device):
        mine = list(stacked.chunk(size))
        received = [torch.empty_like(block) for block in mine]
        received[group.rank()] = mine[group.rank()]
        _exchange(mine, received, group)
        return functools.reduce(torch.add, received)  # in rank order
    output = stacked.new_empty((stacked.shape[0] // size, *stacked.shape[1:]))
    collectives.reduce_scatter_single(output, stacked, group=group)
    return output


def _exchange(sends: list[Tensor], receives: list[Tensor], group: Group) -> None:
    """Send ``sends[r]`` to and receive ``receives[r]`` from every other rank ``r`` of ``group``, point to point.

    The all-gather and reduce-scatter of CPU tensors go this way: gloo's reduce-scatter all-reduces the whole
    tensor and keeps a slice, and on a 2-core VM both it and gloo's all-gather cost 1.5-3x the exchange of the same
    bytes (benchmarks/NOTES.md, "Step time: where it went, what was changed").
    """
    me = group.rank()
    ops = []
    for peer in range(group.size()):
        if peer != me:
            rank = dist.get_global_rank(group, peer)
            ops.append(dist.P2POp(dist.isend, sends[peer], rank, group))
            ops.append(dist.P2POp(dist.irecv, receives[peer], rank, group))
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _own_slice(tensor: Tensor, dim: int, group: Group) -> Tensor:
    size = group.size()
    _check_divisible(tensor, dim, size)
    return tensor.chunk(size, dim=dim)[group.rank()].contiguous()


def _check_divisible(tensor: Tensor, dim: int, size: int) -> None:
    if tensor.shape[dim] % size:
        raise ValueError(
            f"cannot split dim {dim} of size {tensor.shape[dim]} over {size} tensor-parallel ranks; the size must "
            f"be a multiple of {size}."
        )


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: Group) -> Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: Group) -> Tensor:
        return _all_reduce(tensor, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _AlongDim(torch.autograd.Function):
    """``forward_op`` on the tensor along ``dim`` forward, ``backward_op`` on its gradient backward (each of
    `_all_gather`, `_own_slice`, `_reduce_scatter`)."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, dim: int, group: Group, forward_op: _DimOp, backward_op: _DimOp) -> Tensor:
        ctx.dim, ctx.group, ctx.backward_op = dim, group, backward_op
        return forward_op(tensor, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return ctx.backward_op(grad, ctx.dim, ctx.group), None, None, None, None


def copy_to_region(tensor: Tensor, group: Group) -> Tensor:
    """Identity; backward all-reduces the gradient over ``group``."""
    return _CopyToRegion.apply(tensor, group)


def reduce_from_region(tensor: Tensor, group: Group) -> Tensor:
    """Sum over ``group``; backward passes the gradient through."""
    return _ReduceFromRegion.apply(tensor, group)


def gather_from_region(tensor: Tensor, group: Group, dim: int = -1) -> Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` (rank order); backward keeps this rank's slice."""
    return _AlongDim.apply(tensor, dim, group, _all_gather, _own_slice)


def scatter_to_region(tensor: Tensor, group: Group, dim: int = -1) -> Tensor:
    """This rank's slice of ``tensor`` along ``dim``; backward all-gathers the gradient."""
    return _AlongDim.apply(tensor, dim, group, _own_slice, _all_gather)


def gather_sequence(tensor: Tensor, group: Group, dim: int) -> Tensor:
    """The whole sequence from every rank's slice along ``dim``; backward reduce-scatters the gradient (the
    column-parallel entry under sequence parallelism: each rank's gradient of the whole input is partial)."""
    return _AlongDim.apply(tensor, dim, group, _all_gather, _reduce_scatter)


def reduce_scatter_sequence(tensor: Tensor, group: Group, dim: int) -> Tensor:
    """The sum over ``group``, of which this rank keeps its slice of the sequence along ``dim``; backward
    all-gathers the gradient (the row-parallel exit under sequence parallelism)."""
    return _AlongDim.apply(tensor, dim, group, _reduce_scatter, _all_gather)


class _GatheredLinear(torch.autograd.Function):
    """``F.linear`` of the sequence all-gathered from this rank's slice, keeping only the slice for backward: the
    all-gather runs again there for the weight's gradient (Korthikanti et al. 2022, section 4.2.2)."""

    @staticmethod
    def forward(ctx: Any, piece: Tensor, weight: Tensor, bias: Tensor | None, dim: int, group: Group) -> Tensor:
        ctx.save_for_backward(piece, weight)
        ctx.dim, ctx.group, ctx.has_bias = dim, group, bias is not None
        return torch.nn.functional.linear(_all_gather(piece, dim, group), weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        piece, weight = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:  # the whole input's gradient is partial on every rank: sum, keep the slice
            grad_input = _reduce_scatter(grad.matmul(weight), ctx.dim, ctx.group)
        if ctx.needs_input_grad[1]:
            whole = _all_gather(piece, ctx.dim, ctx.group)  # (..., in)
            grad_weight = grad.reshape(-1, grad.shape[-1]).t().mm(whole.reshape(-1, whole.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_input, grad_weight, grad_bias, None, None


def gather_sequence_linear(piece: Tensor, weight: Tensor, bias: Tensor | None, group: Group, dim: int) -> Tensor:
    """``F.linear(gather_sequence(piece, group, dim), weight, bias)`` that keeps ``piece`` (1/tp of the input) for
    backward instead of the whole input, and all-gathers it again there (the column-parallel entry under sequence
    parallelism)."""
    return _GatheredLinear.apply(piece, weight, bias, dim, group)


def split_sequence(tensor: Tensor, group: Group, dim: int) -> Tensor:
    """This rank's slice of the sequence along ``dim`` (where a sequence-parallel region starts); backward
    all-gathers the gradient. Raises, naming the fix, when the sequence does not split evenly."""
    size = group.size()
    if tensor.shape[dim] % size:
        raise ValueError(
            f"sequence_parallel=True splits each sequence over the {size} tensor-parallel ranks, but an activation "
            f"of shape {tuple(tensor.shape)} has sequence length {tensor.shape[dim]} (dim {dim}), not a multiple of "
            f"{size}. Pad or cut the sequences to a multiple of tensor_parallel_degree={size}, or set "
            "sequence_parallel=False."
        )
    return _AlongDim.apply(tensor, dim, group, _own_slice, _all_gather)
