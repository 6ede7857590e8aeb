"""Sharded data parallelism (smp's ``sharded_data_parallel_degree``, ZeRO-3) on PyTorch's FSDP2 ``fully_shard``.

Owns which modules become FSDP units over which mesh (`shard`) and `ShardedOptimizer`, the update over the sharded
fp32 parameters: smp's loss scaling, the job-wide overflow vote, clipping by the global norm. Not owned: the meshes
(`topology.build`), when Lightning calls the update (`precision.py`), the loss-scale rule (`loss_scaler.py`).
Why FSDP2: it is PyTorch's own ZeRO-3 and its sharded fp32 DTensor parameters are the master weights (the
mixed-precision policy casts a gathered copy for compute), so there is no flat master copy; smp ran DeepSpeed's
stage 3 (MiCS), a second training engine that would take the step away from Lightning.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.utils import _sync_module_states
from torch.optim import Optimizer
from typing_extensions import override

from lightning_smp.loss_scaler import LossScaler
from lightning_smp.optimizer import MasterWeightOptimizer, load_state_by_tensor
from lightning_smp.placement import placement_of, placements_kept

if TYPE_CHECKING:
    from lightning_smp.config import SMPConfig
    from lightning_smp.topology import Topology

__all__ = ["ShardedOptimizer", "plan_units", "shard"]


def shard(model: nn.Module, *, units: Sequence[tuple[nn.Module, bool]], topology: Topology, config: SMPConfig) -> None:
    """``fully_shard`` ``model``'s ``units`` (`plan_units`) over the topology's sharding mesh, in place (a model on
    the meta device too: `materialization` then gives each rank its rows). Parameters stay fp32 (the masters);
    fp16/bf16 runs compute in that dtype, reduce in fp32.

    The data-parallel replicas start from rank 0's values (what DDP does; a model on the meta device gets the same
    values on every rank when materialised), then keep their own shards.
    """
    if isinstance(model, FSDPModule):
        return  # sharded by an earlier fit/validate of the same model
    if not any(param.is_meta for param in model.parameters()):
        _sync_module_states(model, topology.group("dp"), 250 * 1024 * 1024, src=0, params_and_buffers_to_ignore=set())
    policy = MixedPrecisionPolicy(param_dtype=config.half_dtype, reduce_dtype=torch.float32)
    meshes = {True: topology.sharding_mesh(), False: topology.sharding_mesh(sharded=False)}
    with placements_kept(model):  # fully_shard makes new parameter objects
        for module, is_sharded in units:
            fully_shard(module, mesh=meshes[is_sharded], mp_policy=policy)


def plan_units(
    model: nn.Module, config: SMPConfig, *, trunk: nn.Module | None, numel: Callable[[Tensor], int] = Tensor.numel
) -> list[tuple[nn.Module, bool]]:
    """The modules `shard` wraps, descendants before their ancestors (as FSDP2 asks), each with whether it is
    sharded (True: a child of ``trunk``, the sequential container `lightning_smp.build` found, or the root, last)
    or kept whole on every rank (False: its own parameters all below ``sdp_param_persistence_threshold`` elements,
    as ``numel`` counts what a rank holds, and not shared). Pure: the memory planner reads it too."""
    units = set(trunk.children()) if trunk is not None else set()
    shared = _shared_parameters(model)
    threshold = config.sdp_param_persistence_threshold
    planned = []
    for module in reversed(list(model.modules())):
        own = list(module.parameters(recurse=False))
        if module is model:
            continue
        if own and all(numel(p) < threshold and id(p) not in shared for p in own):
            planned.append((module, False))
        elif module in units and any(True for _ in module.parameters()):
            planned.append((module, True))
    return [*planned, (model, True)]


def _shared_parameters(model: nn.Module) -> set[int]:
    """Ids of parameters held by more than one module (tied weights): they stay with the unit above both."""
    holders = Counter(id(p) for module in model.modules() for p in module.parameters(recurse=False))
    return {key for key, count in holders.items() if count > 1}


class ShardedOptimizer(MasterWeightOptimizer):
    """The update of a sharded-data-parallel run: the user's optimizer steps the sharded fp32 parameters directly.

    A `MasterWeightOptimizer` to Lightning and the smp facade (the same loss scale, skipped-step count, overflow
    flag, ``clip_master_grads`` and checkpoint content), without a master copy: FSDP2's sharded fp32 parameters
    are the masters and its reduce-scattered fp32 grads the master grads. Overflow is voted over the whole job;
    the global norm sums every rank's shards, each value counted once (data-parallel replicas of a shard and
    tensor-parallel duplicates are left out). Every step clips to ``clip_norm`` (smp's ``sdp_gradient_clipping``).

    Args:
        optimizer: a torch optimizer built over the sharded (DTensor) parameters, in ``configure_optimizers``.
        loss_scaler: fp16: a static or dynamic scaler; bf16 and fp32: ``None``.
        topology: the run's topology (the overflow vote and the norm span its "world" group).
        clip_norm: the norm every step clips the gradients to.
    """

    def __init__(
        self, optimizer: Optimizer, *, loss_scaler: LossScaler | None, topology: Topology, clip_norm: float
    ) -> None:
        if isinstance(optimizer, MasterWeightOptimizer):
            raise ValueError("The optimizer is already wrapped; wrap the plain optimizer once.")
        # Not `super().__init__`: there are no masters to copy, only the update's state to keep.
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        plain = [tuple(p.shape) for p in self._params if not isinstance(p, DTensor)]
        if plain:
            raise ValueError(
                f"With sharded_data_parallel_degree > 1 the optimizer must be built over the sharded parameters, "
                f"but {len(plain)} of its parameters (shapes {plain[:3]}...) are not sharded: build it in "
                "`configure_optimizers` from `self.parameters()`, which runs after the model is sharded."
            )
        device = self._params[0].to_local().device if self._params else torch.device("cpu")
        self._init_update_state(optimizer, loss_scaler, device)
        self._group: dist.ProcessGroup | None = topology.group("world")
        self._clip_norm = clip_norm
        # How often each value of a parameter's grad is held across the job, where it counts in the norm (0: never).
        self._norm_copies = [_copies(p) if placement_of(p).counts_in_norm else 0 for p in self._params]

    def __repr__(self) -> str:
        scaler = type(self._loss_scaler).__name__ if self._loss_scaler is not None else "no loss scaling"
        return f"{type(self).__name__}({type(self._inner).__name__}, {len(self._params)} sharded params, {scaler})"

    # -- what smp users and Lightning read (``loss_scaler``, ``loss_scale``, ``scale_tensor``, ``skipped_steps``,
    # ``last_step_skipped``: the base class's, over the state set up in `__init__`) ---------------------------------

    @property
    def overflow(self) -> bool:
        if any(p.grad is not None for p in self._params):
            self.unscale_grads()
        return bool(self._found_inf.item())  # sync

    def master_params(self) -> list[Tensor]:
        """The sharded fp32 parameters: they are the masters."""
        return list(self._params)

    # -- one update ---------------------------------------------------------------------------------------------

    def note_backward(self) -> None:
        self._step_state.grads_read = False

    def unscale_grads(self) -> None:
        """Unscale this rank's grad shards in place and decide overflow for the whole job, once per backward."""
        if self._step_state.grads_read:
            return
        self._step_state.grads_read = True
        self._found_inf.zero_()
        if self._loss_scaler is None:
            return
        grads = self._update_grads()
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, self._found_inf, self._loss_scaler.inv_scale)
        if self._group is not None:
            dist.all_reduce(self._found_inf, op=dist.ReduceOp.MAX, group=self._group)

    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the grad shards by the global norm; returns that norm, or -1 on overflow (as smp)."""
        self.unscale_grads()
        norm = self._global_norm(float(norm_type))
        grads = self._update_grads()
        if grads:
            torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return torch.where(self._found_inf > 0, torch.full_like(norm, -1.0), norm)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Unscale, clip to ``clip_norm``, update the shards unless the step overflowed, update the scale."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.clip_master_grads(self._clip_norm)
        if self._loss_scaler is None or not self._found_inf.item():  # sync: the inner optimizer cannot gate
            self._inner.step()
        self._count_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._inner.zero_grad(set_to_none=set_to_none)
        self._step_state.grads_read = False

    def forget_process_groups(self) -> None:
        self._group = None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            "Adding a param group after setup is not supported under sharded data parallelism (the norm and "
            "overflow bookkeeping is built at setup). Create every param group in `configure_optimizers`."
        )

    # -- checkpoints: by model parameter (DCP reads and writes the DTensor shards as chunks of the whole tensor) -----

    def model_params(self) -> list[Tensor]:
        return list(self._params)

    def whole_masters(self) -> list[tuple[Tensor, Tensor]]:
        """Each parameter with itself: the sharded DTensor is the master, and DCP saves it as the whole tensor."""
        return [(p, p) for p in self._params]

    @torch.no_grad()
    def load_whole_masters(self, values: dict[int, Tensor]) -> None:
        for param in self._params:
            value = values.get(id(param))
            if value is not None and value is not param:  # a checkpoint loads into the DTensor in place
                param.copy_(value)

    def state_by_param(self) -> list[tuple[Tensor, dict[str, Any]]]:
        return [(p, self._inner.state[p]) for p in self._params if self._inner.state.get(p)]

    def load_state_by_param(self, states: dict[int, dict[str, Any]], param_groups: Sequence[dict[str, Any]]) -> None:
        load_state_by_tensor(self._inner, states, param_groups)

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state (over the shards) and the loss scaler; the masters are the parameters."""
        return {
            "optimizer": self._inner.state_dict(),
            "loss_scaler": self._loss_scaler.state_dict() if self._loss_scaler is not None else None,
            "skipped_steps": int(self._skipped_steps.item()),  # sync: checkpoints only
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved_scaler = state_dict.get("loss_scaler")
        if (saved_scaler is None) != (self._loss_scaler is None):
            raise ValueError(
                "The checkpoint's loss-scaler state does not match this run: one is fp16 (scaled), the other is "
                "not. Resume with the precision (`fp16=True`, `bf16=True` or fp32) the checkpoint was written with."
            )
        self._inner.load_state_dict(state_dict["optimizer"])
        if self._loss_scaler is not None:
            self._loss_scaler.load_state_dict(saved_scaler)
        self._skipped_steps.fill_(state_dict.get("skipped_steps", 0))

    # -- internals ----------------------------------------------------------------------------------------------

    @override
    def _update_grads(self) -> list[Tensor]:
        """This rank's fp32 grad shards (the parameters are their own masters)."""
        return [p.grad.to_local() for p in self._params if p.grad is not None]

    def _global_norm(self, norm_type: float) -> Tensor:
        """The ``norm_type`` norm of the whole model's grads: every rank adds its shards, each divided by the
        number of ranks holding the same values, so that the world-wide sum counts every value once."""
        counted = [
            (p.grad.to_local(), copies)
            for p, copies in zip(self._params, self._norm_copies, strict=True)
            if copies and p.grad is not None
        ]
        local = torch.zeros((), dtype=torch.float32, device=self._found_inf.device)
        if counted and math.isinf(norm_type):
            local = torch.stack([g.abs().max() if g.numel() else local for g, _ in counted]).max()
        elif counted:
            norms = torch._foreach_norm([g for g, _ in counted], norm_type)
            weights = torch.tensor([1.0 / copies for _, copies in counted], device=local.device)
            local = (torch.stack(norms).float().pow(norm_type) * weights).sum()
        if math.isinf(norm_type):
            if self._group is not None:
                dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self._group)
            return local
        if self._group is not None:
            dist.all_reduce(local, op=dist.ReduceOp.SUM, group=self._group)
        return local.pow(1.0 / norm_type)


def _copies(param: Tensor) -> int:
    """On how many data-parallel ranks ``param``'s local values are held: the product of its mesh dims on which it
    is replicated (the replicas of a shard group; every dp rank for a module kept whole)."""
    if not isinstance(param, DTensor):
        return 1
    mesh = param.device_mesh
    return math.prod(mesh.size(dim) for dim, p in enumerate(param.placements) if isinstance(p, Replicate))
