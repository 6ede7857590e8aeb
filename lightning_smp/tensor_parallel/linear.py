"""Column- and row-parallel ``nn.Linear`` (Megatron's ColumnParallelLinear / RowParallelLinear), their variants
for the plan styles of Hugging Face transformers (gathered output, packed [gate; up] weights), and smp's
``DistributedLinear``. Each is an ``nn.Linear`` built whole and split by `parallelize`.

A column-parallel layer keeps rows of the weight (output features): whole input in, this rank's output features
out. A row-parallel layer keeps columns (input features): this rank's input features in, partial sums all-reduced
to the whole output, then the (replicated) bias. Column then row, with an elementwise function between, needs
one all-reduce forward and one backward.
"""

from __future__ import annotations

from typing import ClassVar

import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from lightning_smp.tensor_parallel.base import TensorParallelModule
from lightning_smp.tensor_parallel.comm import gather_from_region, scatter_to_region
from lightning_smp.tensor_parallel.shard import ShardSpec

__all__ = [
    "ColumnParallelLinear",
    "DistributedLinear",
    "GatheredColumnParallelLinear",
    "PackedColumnParallelLinear",
    "RowParallelLinear",
]


class ColumnParallelLinear(TensorParallelModule, nn.Linear):
    """``nn.Linear`` split along its output features.

    Args: as ``nn.Linear``, plus ``gather_output``: all-gather the output to the whole ``out_features`` (default
    False: each rank returns its ``out_features / tp`` slice, to feed a `RowParallelLinear` or a vocab-parallel
    loss).
    """

    tp_sequence_role: ClassVar[str | None] = "column"

    gather_output: bool = False

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, *, gather_output: bool = False, **factory
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, **factory)
        self.gather_output = gather_output

    @override
    @classmethod
    def tp_shard_specs(cls, module: nn.Module) -> dict[str, ShardSpec]:
        specs = {"weight": ShardSpec(0)}
        if module.bias is not None:
            specs["bias"] = ShardSpec(0)
        return specs

    @override
    @classmethod
    def tp_unsplittable(cls, module: nn.Module, tp_size: int) -> str | None:
        if module.out_features % tp_size:
            return f"out_features={module.out_features} is not divisible by tensor_parallel_degree={tp_size}"
        return None

    @override
    def forward(self, input: Tensor) -> Tensor:
        if self._tp is None:
            return F.linear(input, self.weight, self.bias)
        output = self._tp.column_linear(input, self.weight, self.bias)  # (..., out/tp)
        return gather_from_region(output, self._tp.group) if self.gather_output else output

    @override
    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp={self._tp.size if self._tp else 1}, gather_output={self.gather_output}"


class GatheredColumnParallelLinear(ColumnParallelLinear):
    """A `ColumnParallelLinear` whose output is all-gathered: whole input in, whole output out (the plan style
    "colwise_gather_output", e.g. a language-model head whose logits a whole-vocabulary loss reads)."""

    tp_sequence_role: ClassVar[str | None] = None

    gather_output: bool = True

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **factory) -> None:
        super().__init__(in_features, out_features, bias=bias, gather_output=True, **factory)


class PackedColumnParallelLinear(ColumnParallelLinear):
    """A `ColumnParallelLinear` over two weights packed along the output features, ``[gate; up]``: each rank keeps
    its rows of each, so its output is ``[gate_r, up_r]`` and the model's own ``chunk(2, dim=-1)`` still finds
    gate and up (the plan style "packed_colwise", a fused gate_up projection)."""

    @override
    @classmethod
    def tp_shard_specs(cls, module: nn.Module) -> dict[str, ShardSpec]:
        return {name: ShardSpec(0, blocks=2) for name in super().tp_shard_specs(module)}

    @override
    @classmethod
    def tp_unsplittable(cls, module: nn.Module, tp_size: int) -> str | None:
        if module.out_features % (2 * tp_size):
            return (
                f"out_features={module.out_features} (two packed weights) is not divisible by 2 x "
                f"tensor_parallel_degree={tp_size}"
            )
        return None


class RowParallelLinear(TensorParallelModule, nn.Linear):
    """``nn.Linear`` split along its input features; the output is whole on every rank.

    Args: as ``nn.Linear``, plus ``input_is_parallel``: the input is already this rank's ``in_features / tp``
    slice (default True, as after a `ColumnParallelLinear`); False takes the whole input and slices it.
    """

    tp_sequence_role: ClassVar[str | None] = "row"

    input_is_parallel: bool = True

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, *, input_is_parallel: bool = True, **factory
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, **factory)
        self.input_is_parallel = input_is_parallel

    @override
    @classmethod
    def tp_shard_specs(cls, module: nn.Module) -> dict[str, ShardSpec]:
        return {"weight": ShardSpec(1)}  # the bias is added once, after the reduction: replicated

    @override
    @classmethod
    def tp_unsplittable(cls, module: nn.Module, tp_size: int) -> str | None:
        if module.in_features % tp_size:
            return f"in_features={module.in_features} is not divisible by tensor_parallel_degree={tp_size}"
        return None

    @override
    def forward(self, input: Tensor) -> Tensor:
        if self._tp is None:
            return F.linear(input, self.weight, self.bias)
        if not self.input_is_parallel:
            input = scatter_to_region(input, self._tp.group)  # (..., in/tp)
        output = self._tp.row_output(F.linear(input, self.weight))  # (..., out), or its slice of the sequence
        return output + self.bias if self.bias is not None else output

    @override
    def extra_repr(self) -> str:
        tp = self._tp.size if self._tp else 1
        return f"{super().extra_repr()}, tp={tp}, input_is_parallel={self.input_is_parallel}"


class DistributedLinear(RowParallelLinear):
    """smp's ``smp.nn.DistributedLinear``: a drop-in ``nn.Linear`` (whole input, whole output) whose weight is
    split along the input features. Prefer a `ColumnParallelLinear` → `RowParallelLinear` pair for an MLP."""

    tp_sequence_role: ClassVar[str | None] = None

    input_is_parallel: bool = False

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **factory) -> None:
        super().__init__(in_features, out_features, bias=bias, input_is_parallel=False, **factory)
