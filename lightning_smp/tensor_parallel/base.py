"""What every tensor-parallel module shares: the run's `TensorParallel` context and the `TensorParallelModule` mixin.

A tensor-parallel module is built whole, exactly like its ``torch.nn`` parent (same arguments, same
initialisation), and behaves like it until `parallelize` calls ``_tp_distribute``, which replaces each parameter
named in ``tp_shard_specs`` by this rank's slice and attaches the `TensorParallel` context its forward uses.
Converting a plain ``torch.nn`` module swaps its class in place (``module.__class__ = ...``), as FSDP2's
``fully_shard`` does: parameter names, hooks and every reference to the module stay valid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import override

from lightning_smp._compat import parameter_table
from lightning_smp.placement import TPShard, place_tp_shard
from lightning_smp.tensor_parallel.rng import TensorParallelRNG
from lightning_smp.tensor_parallel.shard import ShardSpec, remember_meta_whole, shard_of, slice_shard

__all__ = ["TensorParallel", "TensorParallelModule", "WholeTensorParallelModule"]


@dataclass(frozen=True, eq=False)
class TensorParallel:
    """One model replica's tensor-parallel group, as the layers see it."""

    group: dist.ProcessGroup
    """The tensor-parallel process group (the topology's "tp" axis)."""
    rank: int
    """This rank's index in ``group``: which shard it holds."""
    size: int
    """Number of shards."""
    rng: TensorParallelRNG
    """The random stream for dropout inside sharded regions."""

    def __deepcopy__(self, memo: dict[int, Any]) -> TensorParallel:
        return self  # process groups cannot be copied; a copied module shares its group


class TensorParallelModule(nn.Module):
    """Mixin for modules that `parallelize` splits over the tensor-parallel ranks (list it before the nn class).

    Subclasses define ``tp_shard_specs`` (which parameters are split and how), ``tp_unsplittable`` (why a size
    does not split, or None) and a forward that uses ``self._tp`` once it is set.
    """

    _tp: TensorParallel | None = None

    @property
    def tp_distributed(self) -> bool:
        """Whether this module holds shards (``parallelize`` has run), rather than the whole layer."""
        return self._tp is not None

    @property
    def tp_context(self) -> TensorParallel | None:
        """The tensor-parallel group, rank and dropout stream this module's forward uses; None until it is split."""
        return self._tp

    def tp_forget_group(self) -> None:
        """Drop this module's reference to its tensor-parallel group (at teardown, once the groups are destroyed)."""
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
