"""What every tensor-parallel module shares: the run's `TensorParallel` context and the `TensorParallelModule` mixin.

A tensor-parallel module is built whole, exactly like its ``torch.nn`` parent (same arguments, same
initialisation), and behaves like it until `parallelize` calls ``_tp_distribute``, which replaces each parameter
named in ``tp_shard_specs`` by this rank's slice and attaches the `TensorParallel` context its forward uses.
Converting a plain ``torch.nn`` module swaps its class in place (``module.__class__ = ...``), as FSDP2's
``fully_shard`` does: parameter names, hooks and every reference to the module stay valid.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from lightning_smp._compat import parameter_table
from lightning_smp.placement import TPShard, place_tp_shard
from lightning_smp.tensor_parallel.comm import (
    ShapeOnlyGroup,
    copy_to_region,
    gather_sequence,
    gather_sequence_linear,
    reduce_from_region,
    reduce_scatter_sequence,
)
from lightning_smp.tensor_parallel.rng import TensorParallelRNG
from lightning_smp.tensor_parallel.shard import ShardSpec, remember_meta_whole, shard_of, slice_shard

__all__ = ["GroupOwner", "SequenceSplit", "TensorParallel", "TensorParallelModule", "WholeTensorParallelModule"]


@dataclass(frozen=True, slots=True)
class SequenceSplit:
    """Sequence parallelism as one module meets it: outside the span from a column-parallel entry to a row-parallel
    exit, each rank holds 1/tp of the sequence, along ``dim`` of the activations."""

    dim: int
    input_whole: bool = False
    """The module receives the whole sequence: a column-parallel layer whose block has gathered it uses it as it
    is; the first layer of a sequence-parallel region takes its own slice of it."""
    output_whole: bool = False
    """The module returns the whole sequence: the last layer of a region all-gathers its output."""


class GroupOwner(Protocol):
    """What owns a run's process groups and looks them up by axis: the run's `Topology`, or the memory planner's
    shape-only stand-in (`build.ShapeOnlyTopology`, whose groups are `ShapeOnlyGroup`s)."""

    def group(self, axis: str) -> dist.ProcessGroup | ShapeOnlyGroup: ...


@dataclass(frozen=True, eq=False)
class TensorParallel:
    """One model replica's tensor-parallel group, as one module sees it: the run that owns the group, this rank's
    shard, the dropout stream and how the module meets sequence parallelism. It holds no process group itself: a
    layer looks the group up through ``owner`` at each collective, so the run's end (`Topology.release`) reaches
    every layer it split without visiting them."""

    owner: GroupOwner
    """The run's `Topology` (its "tp" axis is the group), or a shape-only stand-in in the memory planner."""
    rank: int
    """This rank's index in ``group``: which shard it holds."""
    size: int
    """Number of shards."""
    rng: TensorParallelRNG
    """The random stream for dropout inside sharded regions."""
    sequence: SequenceSplit | None = None
    """How the module meets sequence parallelism; None: the activations around it are whole."""

    def __deepcopy__(self, memo: dict[int, Any]) -> TensorParallel:
        return self  # a copied module is a layer of the same run: it shares the run's groups and dropout stream

    @property
    def group(self) -> dist.ProcessGroup | ShapeOnlyGroup:
        """The tensor-parallel process group, looked up through the run that owns it (raises once the run ended)."""
        return self.owner.group("tp")

    def with_sequence(self, sequence: SequenceSplit | None) -> TensorParallel:
        """The same group and stream, meeting sequence parallelism as ``sequence`` says."""
        return dataclasses.replace(self, sequence=sequence)

    def column_input(self, input: Tensor) -> Tensor:
        """The input of a column-parallel layer: the whole activation, whose gradient sums every rank's part
        (the all-reduce of "f", or under sequence parallelism the all-gather whose backward reduce-scatters)."""
        sequence = self.sequence
        if sequence is None:
            return copy_to_region(input, self.group)
        return input if sequence.input_whole else gather_sequence(input, self.group, sequence.dim)

    def column_linear(self, input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """A column-parallel ``F.linear`` of ``input``: of `column_input`, or under sequence parallelism of the
        sequence gathered from this rank's slice, keeping only the slice for backward."""
        sequence = self.sequence
        if sequence is not None and not sequence.input_whole:
            return gather_sequence_linear(input, weight, bias, self.group, sequence.dim)
        return F.linear(self.column_input(input), weight, bias)

    def row_output(self, partial: Tensor) -> Tensor:
        """The output of a row-parallel layer from this rank's partial sum: all-reduced ("g"), or under sequence
        parallelism reduce-scattered to this rank's slice of the sequence."""
        if self.sequence is None:
            return reduce_from_region(partial, self.group)
        return reduce_scatter_sequence(partial, self.group, self.sequence.dim)


class TensorParallelModule(nn.Module):
    """Mixin for modules that `parallelize` splits over the tensor-parallel ranks (list it before the nn class).

    Subclasses define ``tp_shard_specs`` (which parameters are split and how), ``tp_unsplittable`` (why a size
    does not split, or None) and a forward that uses ``self._tp`` once it is set.
    """

    _tp: TensorParallel | None = None
    tp_sequence_role: ClassVar[str | None] = None
    """How the module takes part in a sequence-parallel layer: "column" (a column-parallel entry), "row" (a
    row-parallel exit), "block" (gathers the sequence itself, e.g. GPT-2's attention), "whole" (acts on whole
    sequences between an entry and an exit, e.g. a per-head norm), "slice" (acts on the slice); None: it needs
    the whole sequence, so a layer holding it runs without sequence parallelism."""

    @property
    def tp_distributed(self) -> bool:
        """Whether this module holds shards (``parallelize`` has run), rather than the whole layer."""
        return self._tp is not None

    @property
    def tp_context(self) -> TensorParallel | None:
        """The tensor-parallel group, rank and dropout stream this module's forward uses; None until it is split."""
        return self._tp

    def tp_forget_context(self) -> None:
        """Drop this module's tensor-parallel context: its forward runs as the whole layer's, with no collective
        (a pipeline stage's meta-device placeholder of a layer another stage owns). Its shards stay as they are."""
        self._tp = None

    @classmethod
    def tp_shard_specs(cls, module: nn.Module) -> dict[str, ShardSpec]:
        """Parameter names (relative to ``module``) that are split, and how; the others stay replicated.

        A classmethod over any module of the parent ``torch.nn`` class, so a plan can be checked before conversion.
        """
        raise NotImplementedError

    @classmethod
    def tp_unsplittable(cls, module: nn.Module, tp_size: int) -> str | None:
        """Why ``module`` cannot be split ``tp_size`` ways (with the numbers), or None when it can."""
        raise NotImplementedError

    @classmethod
    def tp_convert(cls, module: nn.Module) -> None:
        """Turn a plain ``torch.nn`` module of the parent class into this class, in place, still whole."""
        module.__class__ = cls

    def _tp_distribute(self, tp: TensorParallel, shared: dict[int, nn.Parameter]) -> None:
        """Keep this rank's shard of each split parameter. ``shared`` maps an original parameter's id to its
        shard, so that a weight tied between several modules is sliced once and stays tied."""
        for name, spec in type(self).tp_shard_specs(self).items():
            owner, _, leaf = name.rpartition(".")
            shard_parameter(self.get_submodule(owner) if owner else self, leaf, spec, tp, shared)
        self._tp = tp


class WholeTensorParallelModule(TensorParallelModule):
    """Mixin for a module that takes part in tensor parallelism but stays whole: it splits nothing and always can;
    only its forward (or its gradients) use the group once it is distributed."""

    @override
    @classmethod
    def tp_shard_specs(cls, module: nn.Module) -> dict[str, ShardSpec]:
        return {}

    @override
    @classmethod
    def tp_unsplittable(cls, module: nn.Module, tp_size: int) -> str | None:
        return None


def shard_parameter(
    module: nn.Module, name: str, spec: ShardSpec, tp: TensorParallel, shared: dict[int, nn.Parameter]
) -> None:
    """Replace ``module.<name>`` by this rank's slice (placed as its `TPShard`); a no-op if already sharded."""
    whole = parameter_table(module)[name]
    if whole is None or shard_of(whole) is not None:
        return
    piece = shared.get(id(whole))
    if piece is None:
        with torch.no_grad():
            data = slice_shard(whole.detach(), spec, tp.rank, tp.size).clone(memory_format=torch.contiguous_format)
        piece = nn.Parameter(data, requires_grad=whole.requires_grad)
        place_tp_shard(piece, TPShard(spec.dim, tp.rank, tp.size, spec.blocks))
        if whole.is_meta:  # delayed initialisation: materialised once the pipeline has pruned what this rank drops
            remember_meta_whole(piece, whole)
        shared[id(whole)] = piece
    parameter_table(module)[name] = piece
