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

from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_smp.checkpoint.verification import CheckpointError
from lightning_smp.optimizer import MasterWeightOptimizer
from lightning_smp.placement import TPShard, placement_of

__all__ = [
    "MODEL",
    "OPTIM",
    "RNG",
    "aliases",
    "masters_by_param",
    "model_state_dict",
    "names_of_optimized",
    "optimizer_state_dict",
    "params_by_name",
    "shards_by_name",
    "unwrap",
]

MODEL, OPTIM, RNG = "model/", "optim/", "rng/"  # the entries' prefixes (see the package's docstring)


def model_state_dict(module: nn.Module, optimizers: Sequence[Any] = ()) -> dict[str, Any]:
    """``module.state_dict()`` under its global names, with each parameter that has an fp32 master replaced by it.

    Tensors are this rank's (tensor-parallel shards stay shards); nothing is copied.
    """
    masters = masters_by_param(optimizers)
    return {
        name: masters.get(id(value), value).detach() if isinstance(value, Tensor) else value
        for name, value in module.state_dict(keep_vars=True).items()
    }


def optimizer_state_dict(optimizer: Any, module: nn.Module) -> dict[str, Any]:
    """One optimizer's state keyed by global parameter name (torch keys it by position, which differs between
    layouts): ``{"state": {name: {key: value}}, "param_groups": [hyper-parameters], "loss_scaler", "skipped_steps"}``.
    """
    optimizer = unwrap(optimizer)
    inner = optimizer.optimizer if isinstance(optimizer, MasterWeightOptimizer) else optimizer
    names = names_of_optimized(optimizer, module)
    params = [p for group in inner.param_groups for p in group["params"]]
    saved = inner.state_dict()
    state = {}
    for index, values in saved["state"].items():
        name = names.get(id(params[index]))
        if name is None:
            raise CheckpointError(
                f"The optimizer updates a parameter of shape {tuple(params[index].shape)} that is not in the "
                "LightningModule, so it has no name to be saved under. Register it on the module (as an "
                "nn.Parameter attribute) before building the optimizer."
            )
        state[name] = dict(values)
    result: dict[str, Any] = {
        "state": state,
        "param_groups": [{k: v for k, v in group.items() if k != "params"} for group in saved["param_groups"]],
    }
    if isinstance(optimizer, MasterWeightOptimizer):
        scaler = optimizer.loss_scaler
        result["loss_scaler"] = scaler.state_dict() if scaler is not None else None
        result["skipped_steps"] = int(optimizer.skipped_steps.item())  # sync: checkpoints only
    return result


def unwrap(optimizer: Any) -> Any:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def masters_by_param(optimizers: Sequence[Any]) -> dict[int, Tensor]:
    """id(model parameter) → the fp32 master the optimizer updates in its place."""
    masters = {}
    for optimizer in optimizers:
        optimizer = unwrap(optimizer)
        if isinstance(optimizer, MasterWeightOptimizer):
            masters.update({id(param): master for param, master in optimizer.param_master_pairs()})
    return masters


def names_of_optimized(optimizer: Optimizer, module: nn.Module) -> dict[int, str]:
    """id(tensor the inner optimizer updates) → the module's (first) name for that parameter."""
    names = {id(param): name for name, param in module.named_parameters()}
    if isinstance(optimizer, MasterWeightOptimizer):
        for param, master in optimizer.param_master_pairs():
            if id(param) in names:
                names[id(master)] = names[id(param)]
    return names


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
