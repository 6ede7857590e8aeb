"""What a rank holds, under global parameter names: model weights (fp32 masters in place of half parameters) and
optimizer state keyed by name.

Owns the mapping between the tensors a rank holds (parameters, their masters, the positions torch's optimizer
state is keyed by, tied weights' several names) and the global names a checkpoint stores. Not owned: the masters
themselves (`optimizer.py`). Names, unlike positions, are the same in every layout, which is what lets a
checkpoint load into another one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_smp.checkpoint.verification import CheckpointError
from lightning_smp.master_shard import FlatPiece
from lightning_smp.optimizer import MasterWeightOptimizer, load_state_by_tensor
from lightning_smp.placement import TPShard, placement_of

__all__ = [
    "MODEL",
    "OPTIM",
    "RNG",
    "aliases",
    "load_state_by_param",
    "masters_by_param",
    "model_state_dict",
    "optimized_params",
    "optimizer_state_dict",
    "params_by_name",
    "shards_by_name",
    "state_by_param",
    "state_part",
    "unwrap",
]

MODEL, OPTIM, RNG = "model/", "optim/", "rng/"  # the entries' prefixes (see the package's docstring)


def model_state_dict(module: nn.Module, optimizers: Sequence[Any] = ()) -> dict[str, Any]:
    """``module.state_dict()`` under its global names, with each parameter that has an fp32 master replaced by it.

    Values are what this rank holds, nothing is copied: tensor-parallel shards stay shards, and a sharded
    optimizer's master is this replica's `FlatPiece` of it (saving writes each replica's share).
    """
    masters = masters_by_param(optimizers)
    return {
        name: _detached(masters.get(id(value), value)) if isinstance(value, Tensor) else value
        for name, value in module.state_dict(keep_vars=True).items()
    }


def optimizer_state_dict(optimizer: Any, module: nn.Module) -> dict[str, Any]:
    """One optimizer's state keyed by global parameter name (torch keys it by position, which differs between
    layouts): ``{"state": {name: {key: value}}, "param_groups": [hyper-parameters], "loss_scaler", "skipped_steps"}``.
    Under ZeRO-1 a replica lists the parameters it holds a piece of, element-wise values as `FlatPiece`s.
    """
    optimizer = unwrap(optimizer)
    names = {id(param): name for name, param in module.named_parameters()}
    state = {}
    for param, values in state_by_param(optimizer):
        name = names.get(id(param))
        if name is None:
            raise CheckpointError(
                f"The optimizer updates a parameter of shape {tuple(param.shape)} that is not in the "
                "LightningModule, so it has no name to be saved under. Register it on the module (as an "
                "nn.Parameter attribute) before building the optimizer."
            )
        state[name] = dict(values)
    result: dict[str, Any] = {
        "state": state,
        "param_groups": [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups],
    }
    if isinstance(optimizer, MasterWeightOptimizer):
        scaler = optimizer.loss_scaler
        result["loss_scaler"] = scaler.state_dict() if scaler is not None else None
        result["skipped_steps"] = int(optimizer.skipped_steps.item())  # sync: checkpoints only
    return result


def unwrap(optimizer: Any) -> Any:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def optimized_params(optimizer: Optimizer) -> list[Tensor]:
    """The model parameters ``optimizer`` updates (through fp32 masters or not)."""
    if isinstance(optimizer, MasterWeightOptimizer):
        return optimizer.model_params()
    return [param for group in optimizer.param_groups for param in group["params"]]


def state_by_param(optimizer: Optimizer) -> list[tuple[Tensor, dict[str, Any]]]:
    """Each model parameter that has optimizer state, with its state shaped like the parameter."""
    if isinstance(optimizer, MasterWeightOptimizer):
        return optimizer.state_by_param()
    return [(p, optimizer.state[p]) for p in optimized_params(optimizer) if optimizer.state.get(p)]


def load_state_by_param(
    optimizer: Optimizer, states: dict[int, dict[str, Any]], param_groups: Sequence[dict[str, Any]]
) -> None:
    """Set ``optimizer``'s state from states by id(model parameter) and its groups' hyper-parameters."""
    if isinstance(optimizer, MasterWeightOptimizer):
        optimizer.load_state_by_param(states, param_groups)
    else:
        load_state_by_tensor(optimizer, states, param_groups)


def state_part(optimizer: Optimizer, param: Tensor, dtype: torch.dtype) -> Tensor | FlatPiece | None:
    """An empty tensor for what this rank holds of an element-wise optimizer state of ``param``."""
    if isinstance(optimizer, MasterWeightOptimizer):
        return optimizer.state_part(param, dtype)
    return torch.empty_like(param, dtype=dtype)


def masters_by_param(optimizers: Sequence[Any]) -> dict[int, Tensor | FlatPiece]:
    """id(model parameter) → its fp32 master as this rank holds it (`MasterWeightOptimizer.master_parts`)."""
    masters = {}
    for optimizer in optimizers:
        optimizer = unwrap(optimizer)
        if isinstance(optimizer, MasterWeightOptimizer):
            masters.update(optimizer.master_parts())
    return masters


def _detached(value: Tensor | FlatPiece) -> Tensor | FlatPiece:
    return value.detach() if isinstance(value, Tensor) else value


def aliases(module: nn.Module) -> dict[str, list[str]]:
    """Each parameter's names, the first first: a tied weight has several (an embedding and an output head)."""
    by_id: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return {name: names for names in by_id.values() for name in names}


def params_by_name(module: nn.Module) -> dict[str, Tensor]:
    return dict(module.named_parameters(remove_duplicate=False))


def shards_by_name(module: nn.Module) -> dict[str, TPShard]:
    """The module's tensor-parallel pieces on this rank, by name (a tensor held whole is not listed)."""
    return {
        name: shard
        for name, value in module.state_dict(keep_vars=True).items()
        if isinstance(value, Tensor) and (shard := placement_of(value).tp_shard) is not None
    }
