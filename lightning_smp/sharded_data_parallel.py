"""Sharded data parallelism (smp's ``sharded_data_parallel_degree``, ZeRO-3) on PyTorch's FSDP2 ``fully_shard``.

Owns which modules become FSDP units over which mesh (`shard`) and `FSDPMasters`, the sharded fp32 parameters as the
masters of `MasterWeightOptimizer`. Not owned: the meshes (`topology.build`), the update (`optimizer.py`) and when
Lightning calls it (`precision.py`).
Why FSDP2: it is PyTorch's own ZeRO-3 and its sharded fp32 DTensor parameters are the master weights (the
mixed-precision policy casts a gathered copy for compute), so there is no flat master copy; smp ran DeepSpeed's
stage 3 (MiCS), a second training engine that would take the step away from Lightning.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from lightning_smp._compat import HSDPMeshInfo, ShardPlacementResult, sync_module_states
from lightning_smp.grad_vote import Counted, norm_copies
from lightning_smp.master_shard import Run
from lightning_smp.placement import placements_kept

if TYPE_CHECKING:
    from lightning_smp.config import SMPConfig
    from lightning_smp.topology import Topology

__all__ = ["FSDPMasters", "keeps_whole", "plan_units", "shard"]


def shard(model: nn.Module, *, units: Sequence[nn.Module], topology: Topology, config: SMPConfig) -> None:
    """``fully_shard`` ``model``'s ``units`` (`plan_units`) over the topology's sharding mesh, in place (a model on
    the meta device too: `materialization` then gives each rank its rows). A parameter with fewer than
    ``sdp_param_persistence_threshold`` elements is kept whole on every rank, in its unit (gathered with it, its
    grads all-reduced rather than reduce-scattered), as smp kept such parameters whole. Parameters stay fp32 (the
    masters); fp16/bf16 runs compute in that dtype, reduce in fp32.

    The data-parallel replicas start from rank 0's values (what DDP does; a model on the meta device gets the same
    values on every rank when materialised), then keep their own shards.
    """
    if isinstance(model, FSDPModule):
        return  # sharded by an earlier fit/validate of the same model
    if not any(param.is_meta for param in model.parameters()):
        group = topology.group(topology.replica_axis)
        sync_module_states(model, group, 250 * 1024 * 1024, src=0, params_and_buffers_to_ignore=set())
    policy = MixedPrecisionPolicy(param_dtype=config.half_dtype, reduce_dtype=torch.float32)
    # One mesh description for every whole parameter: FSDP2 groups a unit's parameters by it (torch 2.13's
    # per-parameter mesh, `fully_shard(shard_placement_fn=...)`; the types are documented there, not exported).
    whole = HSDPMeshInfo(mesh=topology.sharding_mesh(sharded=False), shard_mesh_dim=1, replicate_mesh_dim=0)

    def placement(param: nn.Parameter) -> ShardPlacementResult | None:
        return ShardPlacementResult(placement=Shard(0), mesh_info=whole) if keeps_whole(param.numel(), config) else None

    with placements_kept(model):  # fully_shard makes new parameter objects
        for module in units:
            fully_shard(module, mesh=topology.sharding_mesh(), mp_policy=policy, shard_placement_fn=placement)


def plan_units(model: nn.Module, *, trunk: nn.Module | None) -> list[nn.Module]:
    """The modules `shard` wraps, the root last (FSDP2 wants descendants first): each child of ``trunk`` (the
    sequential container `lightning_smp.build` found; None: the root is the only unit), and the root for the rest.
    Pure: the memory planner reads it through the build's plan.

    A unit's parameters are gathered by its forward hooks, so a unit must be a module whose parameters are used
    only inside its own call. A trunk's children are called one after the other by their container (the pipeline
    relies on the same), which makes them units; any finer boundary could cut a module whose parent reads the
    child's parameters directly (``nn.MultiheadAttention`` reads ``out_proj.weight``, Hugging Face models their
    embeddings' weights), so there is none. A trunk child holding a parameter that another module outside it holds
    too (a tied weight) is left to the root.
    """
    holders = _holders(model)
    units = []
    for child in trunk.children() if trunk is not None else ():
        inside = _holders(child)
        if inside and all(holders[key] == count for key, count in inside.items()):
            units.append(child)
    return [*units, model]


def keeps_whole(elements: int, config: SMPConfig) -> bool:
    """Whether a parameter of ``elements`` elements (as this rank holds it before sharding: its tensor-parallel
    piece) stays whole on every rank: fewer than ``sdp_param_persistence_threshold`` (smp's, as DeepSpeed's
    ``stage3_param_persistence_threshold``)."""
    return elements < config.sdp_param_persistence_threshold


def _holders(module: nn.Module) -> Counter[int]:
    """id(parameter) → how many modules under ``module`` hold it as their own."""
    return Counter(id(p) for m in module.modules() for p in m.parameters(recurse=False))


class FSDPMasters:
    """The masters of a sharded-data-parallel run: FSDP2's sharded fp32 parameters are their own masters and its
    reduce-scattered fp32 grads the master grads, so nothing is copied and the intake has nothing to do. Each grad
    shard counts in the global norm once per data-parallel rank holding the same values (the replicas of a shard
    group, or every rank for a parameter kept whole).

    Args:
        params: the sharded (DTensor) parameters the optimizer updates, built in ``configure_optimizers``.
        run: unused: FSDP2's meshes hold its groups.
    """

    replicated = False

    def __init__(self, params: Sequence[Tensor], run: Run) -> None:
        plain = [tuple(p.shape) for p in params if not isinstance(p, DTensor)]
        if plain:
            raise ValueError(
                f"With sharded_data_parallel_degree > 1 the optimizer must be built over the sharded parameters, "
                f"but {len(plain)} of its parameters (shapes {plain[:3]}...) are not sharded: build it in "
                "`configure_optimizers` from `self.parameters()`, which runs after the model is sharded."
            )
        self.params = list(params)
        # How often each value of a parameter's grad is held across the job, where it counts in the norm (0: never).
        self._norm_copies = [norm_copies(p) for p in self.params]

    def optimized(self) -> dict[int, Tensor]:
        return {id(p): p for p in self.params}

    def master_params(self) -> list[Tensor]:
        return list(self.params)

    def take_grads(self) -> None:
        """Nothing to take: FSDP2 reduce-scattered the grads into the shards during backward."""

    def reduce_during_backward(self) -> AbstractContextManager[None]:
        return nullcontext()  # FSDP2 overlaps its own reduce-scatter with backward

    def grads(self) -> list[Tensor]:
        return [p.grad.to_local() for p in self.params if p.grad is not None]

    def counted_grads(self) -> list[Counted]:
        return [
            (p.grad.to_local(), copies)
            for p, copies in zip(self.params, self._norm_copies, strict=True)
            if copies and p.grad is not None
        ]

    def finite_check_grads(self) -> None:
        return None

    def write_params(self) -> None:
        """Nothing to write: the inner optimizer updated the parameters themselves."""

    def after_step(self) -> None:
        pass

    def positional_masters(self) -> list[tuple[Tensor, Tensor]]:
        return []  # the parameters are the masters: their state dict holds them

    def master_parts(self) -> dict[int, Tensor]:
        """Each parameter itself: the sharded DTensor is the master, and DCP writes and reads its shards."""
        return {id(p): p for p in self.params}

    def load_masters(self, values: dict[int, Tensor]) -> None:
        for param in self.params:
            value = values.get(id(param))
            if value is not None and value is not param:  # a checkpoint loads into the DTensor in place
                param.copy_(value)

    def state_by_param(self, inner_state: dict[Tensor, Any]) -> list[tuple[Tensor, dict[str, Any]]]:
        return [(p, inner_state[p]) for p in self.params if inner_state.get(p)]

    def state_part(self, param: Tensor, dtype: torch.dtype) -> Tensor:
        return torch.empty_like(param, dtype=dtype)  # a DTensor: DCP reads this rank's shard

    def state_of_optimized(self, states: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        return states
