"""Sharded data parallelism (smp's ``sharded_data_parallel_degree``, ZeRO-3) on PyTorch's FSDP2 ``fully_shard``.

Owns which modules become FSDP units over which mesh (`shard`) and `FSDPMasters`, the sharded fp32 parameters as the
masters of `MasterWeightOptimizer`. Not owned: the meshes (`topology.build`), the update (`optimizer.py`) and when
Lightning calls it (`precision.py`).
Why FSDP2: it is PyTorch's own ZeRO-3 and its sharded fp32 DTensor parameters are the master weights (the
mixed-precision policy casts a gathered copy for compute), so there is no flat master copy; smp ran DeepSpeed's
stage 3 (MiCS), a second training engine that would take the step away from Lightning.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.utils import _sync_module_states

from lightning_smp.grad_vote import Counted
from lightning_smp.master_shard import Run
from lightning_smp.pipeline.partition import find_trunk
from lightning_smp.placement import placement_of, set_placement

if TYPE_CHECKING:
    from lightning_smp.config import SMPConfig
    from lightning_smp.topology import Topology

__all__ = ["FSDPMasters", "plan_units", "shard"]


def shard(model: nn.Module, *, topology: Topology, config: SMPConfig) -> None:
    """``fully_shard`` ``model`` over the topology's sharding mesh, in place: each child of its sequential trunk
    (the container with the most parameters) is one unit, the rest belongs to the root unit (``model``, whose
    forward hooks the strategy runs every step through). A module whose own parameters all have fewer than
    ``sdp_param_persistence_threshold`` elements (and are not shared with another module) is kept whole on every
    rank. Parameters stay fp32 (the masters); fp16/bf16 runs compute in that dtype, reduce in fp32.

    The data-parallel replicas start from rank 0's values (what DDP does), then keep their own shards.
    """
    if isinstance(model, FSDPModule):
        return  # sharded by an earlier fit/validate of the same model
    placements = {name: placement_of(param) for name, param in model.named_parameters()}
    _sync_module_states(model, topology.group("dp"), 250 * 1024 * 1024, src=0, params_and_buffers_to_ignore=set())
    policy = MixedPrecisionPolicy(param_dtype=config.half_dtype, reduce_dtype=torch.float32)
    meshes = {True: topology.sharding_mesh(), False: topology.sharding_mesh(sharded=False)}
    for module, is_sharded in plan_units(model, config):
        fully_shard(module, mesh=meshes[is_sharded], mp_policy=policy)
    for name, param in model.named_parameters():  # fully_shard made new parameter objects
        set_placement(param, placements[name])


def plan_units(model: nn.Module, config: SMPConfig) -> list[tuple[nn.Module, bool]]:
    """The modules `shard` wraps, descendants before their ancestors (as FSDP2 asks), each with whether it is
    sharded (True: a trunk child or the root, last) or kept whole on every rank (False: its own parameters all
    below ``sdp_param_persistence_threshold`` and not shared). Pure: the memory planner reads it too."""
    units = set(_trunk_children(model, config.pipeline_module))
    shared = _shared_parameters(model)
    threshold = config.sdp_param_persistence_threshold
    planned = []
    for module in reversed(list(model.modules())):
        own = list(module.parameters(recurse=False))
        if module is model:
            continue
        if own and all(p.numel() < threshold and id(p) not in shared for p in own):
            planned.append((module, False))
        elif module in units and any(True for _ in module.parameters()):
            planned.append((module, True))
    return [*planned, (model, True)]


def _trunk_children(model: nn.Module, path: str | None) -> list[nn.Module]:
    try:
        return list(find_trunk(model, path)[1].children())
    except ValueError:
        if path is not None:
            raise
        return []  # no sequential container: the root is the only sharded unit


def _shared_parameters(model: nn.Module) -> set[int]:
    """Ids of parameters held by more than one module (tied weights): they stay with the unit above both."""
    holders = Counter(id(p) for module in model.modules() for p in module.parameters(recurse=False))
    return {key for key, count in holders.items() if count > 1}


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
        self._norm_copies = [_copies(p) if placement_of(p).counts_in_norm else 0 for p in self.params]

    def optimized(self) -> dict[int, Tensor]:
        return {id(p): p for p in self.params}

    def master_params(self) -> list[Tensor]:
        return list(self.params)

    def take_grads(self) -> None:
        """Nothing to take: FSDP2 reduce-scattered the grads into the shards during backward."""

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

    def whole_masters(self) -> list[tuple[Tensor, Tensor]]:
        """Each parameter with itself: the sharded DTensor is the master, and DCP saves it as the whole tensor."""
        return [(p, p) for p in self.params]

    def load_whole_masters(self, values: dict[int, Tensor]) -> None:
        for param in self.params:
            value = values.get(id(param))
            if value is not None and value is not param:  # a checkpoint loads into the DTensor in place
                param.copy_(value)

    def state_by_param(self, inner_state: dict[Tensor, Any]) -> list[tuple[Tensor, dict[str, Any]]]:
        return [(p, inner_state[p]) for p in self.params if inner_state.get(p)]

    def state_of_optimized(self, states: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        return states


def _copies(param: Tensor) -> int:
    """On how many data-parallel ranks ``param``'s local values are held: the product of its mesh dims on which it
    is replicated (the replicas of a shard group; every dp rank for a module kept whole)."""
    if not isinstance(param, DTensor):
        return 1
    mesh = param.device_mesh
    return math.prod(mesh.size(dim) for dim, p in enumerate(param.placements) if isinstance(p, Replicate))
