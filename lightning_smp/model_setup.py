"""A model set up for a run outside Lightning's Trainer: the one sequence the smp script door
(``smp.DistributedModel``) and the Fabric door (``fabric.setup``) share.

`set_up_model` splits the model for this rank (`build.plan_and_apply`: tensor parallelism, activation
checkpointing, the pipeline stage, FSDP2's shards, materialisation of a meta-device build), casts it to the run's
precision (`PrecisionRules`), puts it on the device, and sets the replicas up as the run's `ReductionPlan` says: a
DDP wrapper where DDP reduces, one broadcast where the pipeline engine or the optimizer reduces (FSDP2 syncs as it
shards). `repoint_optimizer` points an optimizer the user built over the unsplit model at the split model's
parameters of the same names. The Trainer door runs the same steps from Lightning's hooks (`SMPStrategy.setup`), in
the order Lightning calls them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_smp import build
from lightning_smp._compat import sync_module_states
from lightning_smp.engine import RunContext
from lightning_smp.mixed_precision import PrecisionRules
from lightning_smp.pipeline.runtime import PipelineEngine

__all__ = ["SetUpModel", "parameter_names", "repoint_optimizer", "set_up_model"]

_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # DDP's own bucket for the broadcast that makes replicas equal


@dataclass(frozen=True, eq=False)
class SetUpModel:
    """A model set up for this rank of a run."""

    module: nn.Module
    """The user's model, split for this rank (in place)."""
    forward: nn.Module
    """What runs the forward: ``module``, or DDP around it where DDP reduces."""
    pipeline: PipelineEngine | None
    """This rank's pipeline engine; None without pipeline parallelism."""


def set_up_model(
    module: nn.Module,
    *,
    run: RunContext,
    rules: PrecisionRules,
    device: torch.device,
    ddp_kwargs: Mapping[str, Any] | None = None,
) -> SetUpModel:
    """``module`` split, cast and placed for this rank of ``run`` and its replicas set up (collective: every rank
    calls it). ``ddp_kwargs`` go to ``DistributedDataParallel`` where it wraps."""
    pipeline = build.plan_and_apply(
        module, topology=run.topology, config=run.config, device=device, reduction=run.reduction
    )
    rules.convert_module(module)
    if not run.reduction.sharded_parameters:  # FSDP2 has placed its shards; `Module.to` would replace them
        module.to(device)
    topology, reduction = run.topology, run.reduction
    if reduction.wraps_ddp:
        ddp = DistributedDataParallel(
            module,
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=topology.group(reduction.axis),
            **dict(ddp_kwargs or {}),
        )
        return SetUpModel(module, ddp, pipeline)
    if reduction.syncs_replicas_at_setup and topology.size(topology.replica_axis) > 1:
        group = topology.group(topology.replica_axis)
        sync_module_states(module, group, _BROADCAST_BUCKET_BYTES, src=0, params_and_buffers_to_ignore=set())
    return SetUpModel(module, module, pipeline)


def parameter_names(module: nn.Module) -> dict[int, list[str]]:
    """Each parameter's names by ``id`` (a tied one has several): taken before the split replaces them."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def repoint_optimizer(
    optimizer: Optimizer, names: Mapping[int, Sequence[str]], split: nn.Module
) -> tuple[list[str], list[str]]:
    """Point ``optimizer``'s param groups (in place; it has no state yet) at ``split``'s parameters of the same
    ``names`` as the ones it was built over, each once. Returns what it left out: the names of parameters ``split``
    does not hold (another pipeline stage's), and the shapes of tensors that were no parameter of the model; the
    door decides which is an error."""
    now = dict(split.named_parameters(remove_duplicate=False))
    held = {id(param) for param in now.values()}
    elsewhere, foreign = [], []
    for group in optimizer.param_groups:
        params: list[Tensor] = []
        for param in group["params"]:
            found = param if id(param) in held else next((now[n] for n in names.get(id(param), ()) if n in now), None)
            if found is None and id(param) in names:
                elsewhere.append(names[id(param)][0])
            elif found is None:
                foreign.append(f"a tensor of shape {tuple(param.shape)}")
            elif not any(found is kept for kept in params):
                params.append(found)
        group["params"] = params
    return elsewhere, foreign
