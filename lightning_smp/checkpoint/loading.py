"""Loading: a checkpoint written in any layout goes into this rank's part of the model and its optimizers.

Owns the order of a load (verify, check the checkpoint fits this model, plan where every entry lands, read,
copy the masters into the half-precision parameters, rebuild torch's optimizer state) and a plain single-file
checkpoint's load, each rank reading only its parts of it. Not owned: the names (`names.py`), the chunking
(`dcp_adapter.py`), the file checks (`verification.py`), which part of a tensor a rank holds (`materialization`).
Every check runs on every rank before anything is read, so a bad checkpoint changes nothing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from lightning_smp.checkpoint.dcp_adapter import Chunks, LoadPlanner, global_size, state_target, stored
from lightning_smp.checkpoint.names import (
    MODEL,
    OPTIM,
    RNG,
    aliases,
    load_state_by_param,
    masters_by_param,
    optimized_params,
    params_by_name,
    shards_by_name,
    state_part,
    unwrap,
)
from lightning_smp.checkpoint.rng import set_rng_states
from lightning_smp.checkpoint.storage import all_gather_object
from lightning_smp.checkpoint.verification import (
    RECORD,
    CheckpointError,
    file_problems,
    raise_if_any,
    read_dcp_metadata,
    read_meta,
    reraised_as_checkpoint_error,
    resolve,
)
from lightning_smp.master_shard import FlatPiece
from lightning_smp.materialization import cut_of
from lightning_smp.optimizer import MasterWeightOptimizer
from lightning_smp.placement import placement_of
from lightning_smp.progress import Progress

__all__ = ["load", "load_plain"]

log = logging.getLogger(__name__)


def load(
    path: str | os.PathLike,
    *,
    module: nn.Module,
    optimizers: Sequence[Any],
    run: dict[str, Any],
    strict: bool = True,
    weights_only: bool | None = None,
    load_optimizer_states: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint written by `save` into ``module`` and ``optimizers``, whatever layout wrote it.

    Collective: every rank calls it with its own part of the model. Model weights load into the fp32 masters
    (then into the half-precision parameters), optimizer state by parameter name, the loss scaler and the random
    generators (when the layout is unchanged). Returns the rest of Lightning's checkpoint (loops, callbacks, LR
    schedulers, ...) for Lightning to restore. Every check runs on every rank before anything is read, and every
    rank raises the same `CheckpointError` if any rank finds a problem.
    """
    path = resolve(path)
    if path.is_file():
        return load_plain(path, module=module, optimizers=optimizers, strict=strict, weights_only=weights_only)
    meta = read_meta(path, weights_only)
    record = meta.pop(RECORD)
    metadata = read_dcp_metadata(path)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    raise_if_any(file_problems(path, record, metadata, share=(rank, world_size)), path)

    optimizers = [unwrap(optimizer) for optimizer in optimizers]
    saved_optimizers = meta.get("optimizer_states")
    masters = masters_by_param(optimizers)
    targets = _model_targets(module, masters)
    problems = _model_problems(targets, metadata, strict)
    names = all_gather_object(sorted(targets))
    if strict:
        problems += _unexpected_problems(metadata, {name for part in names for name in part})
    restore_optimizers = load_optimizer_states and bool(optimizers) and saved_optimizers is not None
    if restore_optimizers and len(saved_optimizers) != len(optimizers):
        problems.append(
            f"it holds the state of {len(saved_optimizers)} optimizer(s), this run has {len(optimizers)}: "
            "`configure_optimizers` must return as many optimizers as when it was saved"
        )
    plans = []
    if restore_optimizers and not problems:
        for index, optimizer in enumerate(optimizers):
            plan = _optimizer_plan(index, optimizer, module, metadata)
            targets.update(plan.targets)
            plans.append(plan)
    same_layout = record.get("layout") == run.get("layout")
    rng_key = f"{RNG}{rank}"
    if same_layout and rng_key in metadata.state_dict_metadata:
        targets[rng_key] = None
    raise_if_any(problems, path)

    with reraised_as_checkpoint_error(f"Loading the checkpoint {str(path)!r} failed"):
        dcp.load(targets, storage_reader=FileSystemReader(path), planner=LoadPlanner(allow_partial_load=not strict))

    _after_model_load(module, optimizers, masters, targets)
    for plan, optimizer, saved in zip(plans, optimizers, saved_optimizers or [], strict=False):
        _load_optimizer(plan, optimizer, saved, targets)
    if targets.get(rng_key) is not None:
        set_rng_states(targets[rng_key], module)
    elif not same_layout:
        log.info(
            "lightning_smp: the checkpoint was written with layout %s, this run is %s: its model, optimizer and "
            "loop state are resharded; the random generators keep this run's state.",
            record.get("layout"),
            run.get("layout"),
        )
    meta["state_dict"] = _loaded_state_dict(module, targets)
    if saved_optimizers is None:
        meta.pop("optimizer_states", None)
    meta[RECORD] = record
    return meta


def _loaded_state_dict(module: nn.Module, targets: dict[str, Any]) -> dict[str, Any]:
    """The model entries as loaded, for Lightning's hooks: this rank's tensors (a ZeRO-1 master's piece is given
    as the model's parameter, which the optimizer has set from the gathered pieces)."""
    own = module.state_dict(keep_vars=True)
    loaded = {}
    for entry, value in targets.items():
        if entry.startswith(MODEL):
            name = entry[len(MODEL) :]
            held = value.local if isinstance(value, Chunks) else value
            loaded[name] = own[name] if isinstance(held, FlatPiece) else held
    return loaded


def load_plain(
    path: str | os.PathLike, *, module: nn.Module, optimizers: Sequence[Any], strict: bool, weights_only: bool | None
) -> dict[str, Any]:
    """Load a single-file Lightning checkpoint (a consolidated one, or one written by a single-device run) under
    any layout: each rank takes its part of every ``state_dict`` tensor (its tensor-parallel piece, its stage's
    tensors, its sharded-data-parallel rows) from the memory-mapped file, into the masters and the parameters.
    Optimizer states (in torch's format) load when the file has them.

    Collective: every rank calls it; every rank raises the same `CheckpointError` when the file does not fit."""
    checkpoint = _load_mapped(path, weights_only)
    optimizers = [unwrap(optimizer) for optimizer in optimizers]
    saved = checkpoint.get("state_dict")
    if saved is not None:
        masters = masters_by_param(optimizers)
        own = module.state_dict(keep_vars=True)
        problems = _plain_problems(own, saved, strict)
        raise_if_any(problems, resolve(path))
        targets: dict[str, Any] = {}
        total = sum(_local(value).nbytes for name, value in own.items() if name in saved and isinstance(value, Tensor))
        with torch.no_grad(), Progress("loading the weights", total) as progress:
            for name, value in own.items():
                if name not in saved:
                    continue
                if not isinstance(value, Tensor):
                    targets[f"{MODEL}{name}"] = saved[name]  # extra state, handed back to its module
                    continue
                target = masters.get(id(value), value)
                part = cut_of(value)(saved[name])
                if isinstance(target, FlatPiece):  # this replica's elements of the master (ZeRO-1)
                    target.flat.copy_(part.reshape(-1)[target.start : target.start + target.flat.numel()])
                else:
                    target = target.detach()
                    _local(target).copy_(part)
                targets[f"{MODEL}{name}"] = target
                progress.advance(_local(value).nbytes)
        _after_model_load(module, optimizers, masters, targets)
    saved_optimizers = checkpoint.get("optimizer_states")
    for optimizer, state in zip(optimizers, saved_optimizers or [], strict=False):
        optimizer.load_state_dict(state)
    if optimizers and not saved_optimizers:
        log.info(
            "lightning_smp: %s holds no optimizer state (a consolidated checkpoint): the optimizers start fresh.", path
        )
    return checkpoint


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _load_mapped(path: str | os.PathLike, weights_only: bool | None) -> dict[str, Any]:
    """The file's content, its tensors memory-mapped (a rank's reads touch only the pages of its parts)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=bool(weights_only), mmap=True)
    except RuntimeError as error:  # written in torch's legacy (non-zip) format, which cannot be mapped
        if "mmap" not in str(error):
            raise
        return torch.load(path, map_location="cpu", weights_only=bool(weights_only))


def _plain_problems(own: dict[str, Any], saved: dict[str, Any], strict: bool) -> list[str]:
    """Shapes that differ; with ``strict``, entries this rank holds that the file lacks and entries of the file no
    rank holds (collective)."""
    shapes = [
        f"{name}: {tuple(saved[name].shape)} in the checkpoint, {placement_of(value).global_shape} in this model"
        for name, value in own.items()
        if isinstance(value, Tensor)
        and isinstance(saved.get(name), Tensor)
        and tuple(saved[name].shape) != placement_of(value).global_shape
    ]
    if not strict:
        return _fit_problems(shapes=shapes)
    held = {name for part in all_gather_object(sorted(own)) for name in part}
    missing = [name for name in own if name not in saved]
    return _fit_problems(missing=missing, shapes=shapes, unexpected=sorted(n for n in saved if n not in held))


def _model_targets(module: nn.Module, masters: dict[int, Tensor | FlatPiece]) -> dict[str, Any]:
    """Where each ``model/`` entry loads: the fp32 master of a parameter that has one, else the tensor itself."""
    targets = {}
    for name, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, Tensor):
            source = masters.get(id(value), value)
            source = source.detach() if isinstance(source, Tensor) else source
            targets[f"{MODEL}{name}"] = stored(source, placement_of(value).tp_shard)
        else:
            targets[f"{MODEL}{name}"] = None  # extra state (`get_extra_state`): read back as an object
    return targets


def _model_problems(targets: dict[str, Any], metadata: Metadata, strict: bool) -> list[str]:
    saved = metadata.state_dict_metadata
    missing, shapes = [], []
    for entry, target in targets.items():
        name = entry[len(MODEL) :]
        if entry not in saved:
            missing.append(name)
        elif isinstance(saved[entry], TensorStorageMetadata) and target is not None:
            shape = tuple(global_size(target))
            if tuple(saved[entry].size) != shape:
                shapes.append(f"{name}: {tuple(saved[entry].size)} in the checkpoint, {shape} in this model")
    return _fit_problems(missing=missing if strict else [], shapes=shapes)


def _unexpected_problems(metadata: Metadata, held: set[str]) -> list[str]:
    unexpected = [
        key[len(MODEL) :] for key in metadata.state_dict_metadata if key.startswith(MODEL) and key not in held
    ]
    return _fit_problems(unexpected=sorted(unexpected))


def _fit_problems(
    *, missing: Sequence[str] = (), shapes: Sequence[str] = (), unexpected: Sequence[str] = ()
) -> list[str]:
    """The messages for entries this model has and the checkpoint lacks, shapes that differ, and entries the
    checkpoint has and this model lacks."""
    problems = []
    if missing:
        problems.append(
            f"it comes from a different model: this model has {len(missing)} entries the checkpoint lacks: "
            f"{_listing(missing)}. HINT: set `strict_loading = False` on the LightningModule to load the rest"
        )
    if shapes:
        problems.append(f"it comes from a different model: {len(shapes)} shapes differ: {_listing(shapes)}")
    if unexpected:
        problems.append(
            f"it comes from a different model: it has {len(unexpected)} entries this model lacks: "
            f"{_listing(unexpected)}. HINT: set `strict_loading = False` on the LightningModule to ignore them"
        )
    return problems


def _listing(items: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def _after_model_load(
    module: nn.Module, optimizers: Sequence[Any], masters: dict[int, Tensor | FlatPiece], targets: dict[str, Any]
) -> None:
    """Hand the loaded masters to their optimizers (which set the model's parameters from them); hand extra state
    back to its modules."""
    for optimizer in optimizers:
        if isinstance(optimizer, MasterWeightOptimizer):
            optimizer.load_masters(masters)
    extra = {
        name[len(MODEL) :]: value
        for name, value in targets.items()
        if name.startswith(MODEL) and not isinstance(value, Tensor | Chunks) and value is not None
    }
    if extra:
        module.load_state_dict(extra, strict=False)


class _OptimizerPlan:
    """Where optimizer ``index``'s saved state loads on this rank: entry → (model parameter, state key)."""

    def __init__(self) -> None:
        self.targets: dict[str, Any] = {}
        self.slots: dict[str, tuple[Tensor, str]] = {}


def _optimizer_plan(index: int, optimizer: Any, module: nn.Module, metadata: Metadata) -> _OptimizerPlan:
    names = {id(param): name for name, param in module.named_parameters()}
    names_of = aliases(module)
    params = params_by_name(module)
    shards = shards_by_name(module)
    saved_keys = _optimizer_keys(index, metadata)
    plan = _OptimizerPlan()
    for param in optimized_params(optimizer):
        name = names.get(id(param))
        found = next((alias for alias in names_of.get(name, [name]) if alias in saved_keys), None)
        if found is None:
            continue  # never stepped when saved (or a new parameter): it starts with fresh state, as in torch
        for key in saved_keys[found]:
            entry = f"{OPTIM}{index}/state/{found}/{key}"
            info = metadata.state_dict_metadata[entry]
            if isinstance(info, BytesStorageMetadata):
                target = None
            else:
                target = state_target(info, params.get(name), shards.get(name), partial(state_part, optimizer, param))
                if target is None:
                    continue  # this rank holds none of it (ZeRO-1: another replica's share)
            plan.targets[entry] = target
            plan.slots[entry] = (param, key)
    return plan


def _optimizer_keys(index: int, metadata: Metadata) -> dict[str, list[str]]:
    """Saved parameter name → its state keys, for optimizer ``index``."""
    prefix = f"{OPTIM}{index}/state/"
    keys: dict[str, list[str]] = {}
    for entry in metadata.state_dict_metadata:
        if entry.startswith(prefix):
            name, _, key = entry[len(prefix) :].rpartition("/")
            keys.setdefault(name, []).append(key)
    return keys


def _load_optimizer(plan: _OptimizerPlan, optimizer: Any, saved: dict[str, Any], targets: dict[str, Any]) -> None:
    states: dict[int, dict[str, Any]] = {}
    for entry, (param, key) in plan.slots.items():
        value = targets[entry]
        states.setdefault(id(param), {})[key] = value.local if isinstance(value, Chunks) else value
    try:
        load_state_by_param(optimizer, states, saved["param_groups"])
    except ValueError as error:
        raise CheckpointError(str(error)) from None
    if isinstance(optimizer, MasterWeightOptimizer):
        _load_scaler(optimizer, saved)


def _load_scaler(optimizer: MasterWeightOptimizer, saved: dict[str, Any]) -> None:
    scaler_state = saved.get("loss_scaler")
    if optimizer.loss_scaler is not None and scaler_state is not None:
        optimizer.loss_scaler.load_state_dict(scaler_state)
    elif optimizer.loss_scaler is not None:
        log.info("lightning_smp: the checkpoint has no loss scale (not an fp16 run); starting from the initial scale.")
    optimizer.skipped_steps.fill_(saved.get("skipped_steps", 0))
