"""Sharded checkpoints: every rank writes what it holds under global names; loading reshards; consolidation.

Owns the on-disk format, publishing a checkpoint atomically, verifying it before use, and the mapping between
what a rank holds (fp32 master weights, tensor-parallel shards, optimizer state keyed by parameter position) and
global parameter names. Not owned: when Lightning saves or loads (the strategy's hooks), the masters themselves
(`optimizer.py`), the shard arithmetic (`tensor_parallel/shard.py`, whose `TPShard` attribute we read).
Built on torch.distributed.checkpoint (DCP): it writes one file per rank, keeps one copy of each replicated tensor,
records every tensor's global shape and chunks, and reads any chunk layout into any other, which is resharding.
We add the name mapping, tensor-parallel shards as chunks of the global tensor (any ``TPShard``, packed blocks
included, without DTensor), a temporary directory renamed into place, per-file checksums, and errors that name
the file, the rank and the parameter.

A checkpoint is a directory (Lightning's sharded-checkpoint convention: ``meta.pt`` marks it)::

    epoch=1-step=8.ckpt/
      meta.pt               torch.save, rank 0: Lightning's loops, callbacks, LR schedulers, hyper-parameters,
                            optimizer hyper-parameters and loss scaler, and the "lightning_smp" record (format,
                            package version, layout, precision, smp config, size and CRC-32 of every shard file)
      .metadata             DCP: every entry's global shape, dtype and where each of its chunks lies
      __<rank>_<n>.distcp   DCP: the entries rank <rank> wrote

Entries: ``model/<name>`` (the module's ``state_dict`` under global names, parameters in fp32: the master
weights of an fp16/bf16 run), ``optim/<i>/state/<name>/<key>`` (optimizer ``i``'s state by parameter name) and
``rng/<rank>`` (each rank's random generators).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import re
import shutil
import signal
import threading
import uuid
import warnings
import zlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.optim import Optimizer

from lightning_smp.optimizer import MasterWeightOptimizer

__all__ = [
    "FORMAT_VERSION",
    "META_FILENAME",
    "CheckpointError",
    "consolidate_checkpoint",
    "describe_run",
    "is_sharded_checkpoint",
    "load",
    "model_state_dict",
    "optimizer_state_dict",
    "record_newest",
    "remove",
    "resolve",
    "save",
    "tagged_path",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
META_FILENAME = "meta.pt"  # Lightning's name (lightning/fabric/utilities/load.py), so its tools see a sharded dir
_DCP_METADATA = ".metadata"
_SHARD_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
_MODEL, _OPTIM, _RNG = "model/", "optim/", "rng/"
_RECORD = "lightning_smp"
# The attribute a tensor-parallel parameter carries (lightning_smp/tensor_parallel/shard.py: SHARD_ATTRIBUTE); its
# value has ``dim``, ``index``, ``parts`` and ``blocks``. Read by name so that checkpoints do not import layers.
_SHARD_ATTRIBUTE = "_smp_tp_shard"
_CRC_CHUNK = 16 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as asked: the message says what is wrong, where, and what to do."""


# -- what a rank holds, under global names -------------------------------------------------------------------


def model_state_dict(module: nn.Module, optimizers: Sequence[Any] = ()) -> dict[str, Any]:
    """``module.state_dict()`` under its global names, with each parameter that has an fp32 master replaced by it.

    Tensors are this rank's (tensor-parallel shards stay shards); nothing is copied.
    """
    masters = _masters_by_param(optimizers)
    return {
        name: masters.get(id(value), value).detach() if isinstance(value, Tensor) else value
        for name, value in module.state_dict(keep_vars=True).items()
    }


def optimizer_state_dict(optimizer: Any, module: nn.Module) -> dict[str, Any]:
    """One optimizer's state keyed by global parameter name (torch keys it by position, which differs between
    layouts): ``{"state": {name: {key: value}}, "param_groups": [hyper-parameters], "loss_scaler", "skipped_steps"}``.
    """
    optimizer = _unwrap(optimizer)
    inner = optimizer.optimizer if isinstance(optimizer, MasterWeightOptimizer) else optimizer
    names = _names_of_optimized(optimizer, module)
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


def describe_run(*, topology: Any, config: Any, precision: str) -> dict[str, Any]:
    """What a checkpoint records about the run that wrote it (its layout, precision and smp config)."""
    settings = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        settings[field.name] = dict(value) if isinstance(value, Mapping) else value
    return {
        "layout": {
            "dp": topology.dp,
            "pp": topology.pp,
            "tp": topology.tp,
            "order": topology.order,
            "world_size": topology.world_size,
        },
        "precision": precision,
        "config": settings,
    }


# -- saving ---------------------------------------------------------------------------------------------------


def save(
    checkpoint: dict[str, Any],
    path: str | os.PathLike,
    *,
    module: nn.Module,
    run: dict[str, Any],
    owned: set[str] | None = None,
) -> None:
    """Write Lightning's ``checkpoint`` dict to the directory ``path``; collective, every rank calls it.

    ``checkpoint["state_dict"]`` and ``checkpoint["optimizer_states"]`` are what `model_state_dict` and
    `optimizer_state_dict` return on this rank; ``run`` is `describe_run`'s record. ``owned`` names the parameters
    whose copy on this rank is the trained one (a pipeline stage also holds stale copies of parameters another
    stage trains); only those are written from here. None: every parameter this rank holds. The checkpoint is written to
    a hidden temporary directory beside ``path`` and renamed to ``path`` only once every rank's files and the
    metadata are on disk, so a crash at any point leaves the previous checkpoint (and nothing that looks whole).
    """
    path = Path(path)
    rank = dist.get_rank()
    entries, rest = _split_for_storage(checkpoint, module, rank, owned)
    if rank == 0:
        _remove_stale_staging(path)
    staging = Path(_broadcast_object(str(_staging_path(path)) if rank == 0 else None))
    staging.mkdir(parents=True, exist_ok=True)
    try:
        with _signals_deferred():
            with _reraised_as_checkpoint_error(f"Saving the checkpoint {str(path)!r} failed; nothing was published"):
                dcp.save(entries, storage_writer=FileSystemWriter(staging, sync_files=True), planner=_SavePlanner())
            files = _all_gather_object(_describe_own_files(staging, rank))
            error = None
            if rank == 0:
                try:
                    record = {**run, "format": FORMAT_VERSION, "version": _package_version()}
                    record["torch"] = str(torch.__version__)
                    record["files"] = {name: info for part in files for name, info in part.items()}
                    _write_file(staging / META_FILENAME, {**rest, _RECORD: record})
                    _publish(staging, path)
                except Exception as exception:  # report it to every rank, then raise it here
                    error = exception
            remote = _broadcast_object(None if error is None else f"{type(error).__name__}: {error}")
            if error is not None:
                raise error
            if remote is not None:
                raise CheckpointError(f"Saving the checkpoint {str(path)!r} failed on rank 0: {remote}")
    except BaseException:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    log.debug("saved checkpoint %s", path)


def _split_for_storage(
    checkpoint: dict[str, Any], module: nn.Module, rank: int, owned: set[str] | None
) -> tuple[dict[str, Any], dict]:
    """DCP entries (tensors and everything per rank) and the rest (identical on every rank; rank 0 writes it)."""
    rest = dict(checkpoint)
    model_state = rest.pop("state_dict", {})
    optimizer_states = rest.pop("optimizer_states", None)
    shards = _shards_by_name(module)
    params = _params_by_name(module)
    stale = set(params) - owned if owned is not None else set()
    entries: dict[str, Any] = {
        f"{_MODEL}{name}": _stored(value, shards.get(name)) for name, value in model_state.items() if name not in stale
    }
    if optimizer_states is not None:
        rest["optimizer_states"] = []
        for index, optimizer_state in enumerate(optimizer_states):
            for name, values in optimizer_state["state"].items():
                if name in stale:
                    continue
                for key, value in values.items():
                    entry = f"{_OPTIM}{index}/state/{name}/{key}"
                    entries[entry] = _stored_like_param(value, params.get(name), shards.get(name), entry)
            rest["optimizer_states"].append({k: v for k, v in optimizer_state.items() if k != "state"})
    entries[f"{_RNG}{rank}"] = _rng_states(module)
    return entries, rest


def _stored(value: Any, shard: Any) -> Any:
    """What DCP writes for one value: the tensor itself, or this rank's chunks of the global tensor."""
    if shard is None or not isinstance(value, Tensor):
        return value
    return _ShardChunks(value, shard)


def _stored_like_param(value: Any, param: Tensor | None, shard: Any, entry: str) -> Any:
    if shard is None or not isinstance(value, Tensor) or value.dim() == 0:
        return value
    if param is not None and value.shape == param.shape:
        return _ShardChunks(value, shard)
    raise CheckpointError(
        f"Optimizer state {entry!r} has shape {tuple(value.shape)}, but its tensor-parallel parameter's shard has "
        f"shape {tuple(param.shape) if param is not None else '?'}: only state shaped like the parameter (Adam's "
        "moments, momentum) or scalar can be saved so that it reshards. Use such an optimizer with tensor "
        "parallelism, or leave that parameter unsharded."
    )


def _publish(staging: Path, path: Path) -> None:
    """Rename the finished ``staging`` directory to ``path`` (rank 0). An existing checkpoint at ``path`` moves to
    ``<path>.previous`` first and is deleted last, so one of the two is whole at every moment; `load` falls back
    to ``.previous`` when a crash came between the two renames."""
    _fsync_dir(staging)
    previous = _previous_path(path)
    if path.exists() or path.is_symlink():
        _remove_path(previous)
        os.replace(path, previous)
        os.replace(staging, path)
        _fsync_dir(path.parent)
        _remove_path(previous)
    else:
        os.replace(staging, path)
        _fsync_dir(path.parent)
        _remove_path(previous)  # left by a crash between the two renames of an earlier save


def _staging_path(path: Path) -> Path:
    # hidden and without the final suffix, so neither a user nor ModelCheckpoint's `*.ckpt` search takes it
    return path.with_name(f".{path.name}.partial-{uuid.uuid4().hex[:12]}")


def _remove_stale_staging(path: Path) -> None:
    """Delete the leftovers of earlier saves to ``path`` that a crash interrupted."""
    if path.parent.is_dir():
        for stale in path.parent.glob(f".{_glob_escape(path.name)}.partial-*"):
            shutil.rmtree(stale, ignore_errors=True)


def _glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def _previous_path(path: Path) -> Path:
    return path.with_name(f"{path.name}.previous")


def _describe_own_files(directory: Path, rank: int) -> dict[str, dict[str, int]]:
    """Size and CRC-32 of the shard files this rank wrote (reading them back from the page cache)."""
    files = {}
    for file in directory.iterdir():
        match = _SHARD_FILE.match(file.name)
        if match and int(match.group(1)) == rank:
            files[file.name] = {"rank": rank, "size": file.stat().st_size, "crc32": _crc32(file)}
    return files


def remove(path: str | os.PathLike) -> None:
    """Delete a checkpoint (a directory or a file) and any ``.previous`` copy of it; call on one rank."""
    path = Path(path)
    _remove_path(path)
    _remove_path(_previous_path(path))


# -- loading --------------------------------------------------------------------------------------------------


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    path = Path(path)
    return path.is_dir() and (path / META_FILENAME).is_file()


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
    meta = _read_meta(path, weights_only)
    record = meta.pop(_RECORD)
    metadata = _read_dcp_metadata(path)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    _raise_if_any(_file_problems(path, record, metadata, share=(rank, world_size)), path)

    optimizers = [_unwrap(optimizer) for optimizer in optimizers]
    saved_optimizers = meta.get("optimizer_states")
    targets = _model_targets(module, optimizers)
    problems = _model_problems(targets, metadata, strict)
    names = _all_gather_object(sorted(targets))
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
    rng_key = f"{_RNG}{rank}"
    if same_layout and rng_key in metadata.state_dict_metadata:
        targets[rng_key] = None
    _raise_if_any(problems, path)

    with _reraised_as_checkpoint_error(f"Loading the checkpoint {str(path)!r} failed"):
        dcp.load(targets, storage_reader=FileSystemReader(path), planner=_LoadPlanner(allow_partial_load=not strict))

    _after_model_load(module, optimizers, targets)
    for plan, optimizer, saved in zip(plans, optimizers, saved_optimizers or [], strict=False):
        _load_optimizer(plan, optimizer, saved, targets)
    if targets.get(rng_key) is not None:
        _set_rng_states(targets[rng_key], module)
    elif not same_layout:
        log.info(
            "lightning_smp: the checkpoint was written with layout %s, this run is %s: its model, optimizer and "
            "loop state are resharded; the random generators keep this run's state.",
            record.get("layout"),
            run.get("layout"),
        )
    meta["state_dict"] = {
        name[len(_MODEL) :]: value.local if isinstance(value, _ShardChunks) else value
        for name, value in targets.items()
        if name.startswith(_MODEL)
    }
    if saved_optimizers is None:
        meta.pop("optimizer_states", None)
    meta[_RECORD] = record
    return meta


def load_plain(
    path: str | os.PathLike, *, module: nn.Module, optimizers: Sequence[Any], strict: bool, weights_only: bool | None
) -> dict[str, Any]:
    """Load a single-file Lightning checkpoint (e.g. a consolidated one): model weights into the masters and the
    parameters, optimizer states (in torch's format) when the file has them."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=bool(weights_only))
    optimizers = [_unwrap(optimizer) for optimizer in optimizers]
    if "state_dict" in checkpoint:
        masters = _masters_by_param(optimizers)
        module.load_state_dict(checkpoint["state_dict"], strict=strict)
        own = module.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, value in checkpoint["state_dict"].items():
                param = own.get(name)
                if isinstance(param, Tensor) and id(param) in masters:
                    masters[id(param)].copy_(value)  # fp32 source, not the rounded half parameter
    for optimizer, state in zip(optimizers, checkpoint.get("optimizer_states") or [], strict=False):
        optimizer.load_state_dict(state)
    return checkpoint


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint directory to read for ``path``, or a `CheckpointError` saying why there is none."""
    path = Path(path)
    if path.exists():
        return path
    previous = _previous_path(path)
    if is_sharded_checkpoint(previous):
        log.warning(
            "lightning_smp: %s is missing but %s is whole: a save that was replacing it was interrupted between "
            "its two renames. Loading the previous checkpoint.",
            path,
            previous,
        )
        return previous
    partial = sorted(path.parent.glob(f".{_glob_escape(path.name)}.partial-*")) if path.parent.is_dir() else []
    hint = (
        f" An interrupted save left {partial[0].name} beside it; that one is incomplete and is never loaded."
        if partial
        else ""
    )
    raise CheckpointError(f"There is no checkpoint at {str(path)!r}.{hint}")


def _read_meta(path: Path, weights_only: bool | None) -> dict[str, Any]:
    meta_file = path / META_FILENAME
    if not path.is_dir() or not meta_file.is_file():
        raise CheckpointError(
            f"{str(path)!r} is not a complete lightning_smp checkpoint: it has no {META_FILENAME}. A checkpoint "
            "directory gets it last, when every rank's files are written; without it, the save did not finish."
        )
    try:
        meta = torch.load(meta_file, map_location="cpu", weights_only=bool(weights_only))
    except Exception as exception:
        raise CheckpointError(f"{str(meta_file)!r} cannot be read ({exception}); the checkpoint is damaged.") from None
    record = meta.get(_RECORD) if isinstance(meta, dict) else None
    if record is None:
        raise CheckpointError(
            f"{str(path)!r} is a sharded checkpoint, but not one written by lightning_smp (its {META_FILENAME} has "
            f"no {_RECORD!r} record). Load it with the strategy that wrote it, or consolidate it to one file first."
        )
    if record.get("format", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{str(path)!r} has checkpoint format {record['format']} (lightning_smp {record.get('version')}); this "
            f"lightning_smp {_package_version()} reads format {FORMAT_VERSION} and older. Upgrade lightning_smp."
        )
    return meta


def _read_dcp_metadata(path: Path) -> Metadata:
    try:
        return FileSystemReader(path).read_metadata()
    except FileNotFoundError:
        raise CheckpointError(
            f"{str(path)!r} has no {_DCP_METADATA} file (the index of every rank's tensors); the checkpoint is "
            "incomplete. Use an earlier checkpoint."
        ) from None
    except Exception as exception:
        raise CheckpointError(
            f"{str(path / _DCP_METADATA)!r} cannot be read ({type(exception).__name__}: {exception}); the checkpoint "
            "is damaged. Use an earlier checkpoint."
        ) from None


def _file_problems(path: Path, record: dict, metadata: Metadata, *, share: tuple[int, int]) -> list[str]:
    """Missing, truncated or corrupted shard files. Every file's size is checked; the CRC-32s are split over the
    ranks (``share`` = (rank, world size)), so each file is read once."""
    expected = dict(record.get("files", {}))
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    rank, world_size = share
    for position, name in enumerate(sorted(set(expected) | set(ends))):
        file = path / name
        writer = _writer_of(name, expected.get(name))
        if not file.is_file():
            problems.append(f"the shard file {name} ({writer}) is missing")
            continue
        size = file.stat().st_size
        want = expected.get(name, {}).get("size", ends.get(name, 0))
        if size < max(want, ends.get(name, 0)):
            problems.append(f"the shard file {name} ({writer}) is truncated: {size} bytes, {want} were written")
        elif name in expected and size != want:
            problems.append(f"the shard file {name} ({writer}) has changed: {size} bytes, {want} were written")
        elif name in expected and position % world_size == rank and _crc32(file) != expected[name]["crc32"]:
            problems.append(f"the shard file {name} ({writer}) is corrupted: its CRC-32 differs from the one saved")
    return problems


def _writer_of(name: str, info: dict | None) -> str:
    match = _SHARD_FILE.match(name)
    rank = info["rank"] if info else (int(match.group(1)) if match else None)
    return f"written by rank {rank}" if rank is not None else "written at save"


def _raise_if_any(problems: list[str], path: Path) -> None:
    """Raise one `CheckpointError` on every rank if any rank has problems (collective when distributed)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered = _all_gather_object(problems)
        problems = list(dict.fromkeys(problem for part in gathered for problem in part))
    if problems:
        listed = "\n".join(f"  - {problem}" for problem in problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise CheckpointError(f"Cannot load the checkpoint {str(path)!r}:\n{listed}{more}")


def _model_targets(module: nn.Module, optimizers: Sequence[Any]) -> dict[str, Any]:
    """Where each ``model/`` entry loads: the fp32 master of a parameter that has one, else the tensor itself."""
    masters = _masters_by_param(optimizers)
    targets = {}
    for name, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, Tensor):
            source = masters.get(id(value), value).detach()
            targets[f"{_MODEL}{name}"] = _stored(source, getattr(value, _SHARD_ATTRIBUTE, None))
        else:
            targets[f"{_MODEL}{name}"] = None  # extra state (`get_extra_state`): read back as an object
    return targets


def _model_problems(targets: dict[str, Any], metadata: Metadata, strict: bool) -> list[str]:
    saved = metadata.state_dict_metadata
    missing, shapes = [], []
    for entry, target in targets.items():
        name = entry[len(_MODEL) :]
        if entry not in saved:
            missing.append(name)
        elif isinstance(saved[entry], TensorStorageMetadata) and target is not None:
            shape = tuple(_global_size(target))
            if tuple(saved[entry].size) != shape:
                shapes.append(f"{name}: {tuple(saved[entry].size)} in the checkpoint, {shape} in this model")
    problems = []
    if missing and strict:
        problems.append(
            f"it comes from a different model: this model has {len(missing)} entries the checkpoint lacks: "
            f"{_listing(missing)}. HINT: set `strict_loading = False` on the LightningModule to load the rest"
        )
    if shapes:
        problems.append(f"it comes from a different model: {len(shapes)} shapes differ: {_listing(shapes)}")
    return problems


def _unexpected_problems(metadata: Metadata, held: set[str]) -> list[str]:
    unexpected = [
        key[len(_MODEL) :] for key in metadata.state_dict_metadata if key.startswith(_MODEL) and key not in held
    ]
    if not unexpected:
        return []
    return [
        f"it comes from a different model: it has {len(unexpected)} entries this model lacks: "
        f"{_listing(sorted(unexpected))}. HINT: set `strict_loading = False` on the LightningModule to ignore them"
    ]


def _listing(items: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def _after_model_load(module: nn.Module, optimizers: Sequence[Any], targets: dict[str, Any]) -> None:
    """Copy the loaded masters into the half-precision parameters; hand extra state back to its modules."""
    with torch.no_grad():
        for optimizer in optimizers:
            if isinstance(optimizer, MasterWeightOptimizer):
                pairs = [(p, m) for p, m in optimizer.param_master_pairs() if p is not m]
                if pairs:
                    torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])
    extra = {
        name[len(_MODEL) :]: value
        for name, value in targets.items()
        if name.startswith(_MODEL) and not isinstance(value, Tensor | _ShardChunks) and value is not None
    }
    if extra:
        module.load_state_dict(extra, strict=False)


class _OptimizerPlan:
    """Where optimizer ``index``'s saved state loads on this rank: entry → (position in the optimizer, state key)."""

    def __init__(self) -> None:
        self.targets: dict[str, Any] = {}
        self.slots: dict[str, tuple[int, str]] = {}


def _optimizer_plan(index: int, optimizer: Any, module: nn.Module, metadata: Metadata) -> _OptimizerPlan:
    inner = optimizer.optimizer if isinstance(optimizer, MasterWeightOptimizer) else optimizer
    names = _names_of_optimized(optimizer, module)
    aliases = _aliases(module)
    params_by_name = _params_by_name(module)
    shards = _shards_by_name(module)
    saved_keys = _optimizer_keys(index, metadata)
    plan = _OptimizerPlan()
    params = [p for group in inner.param_groups for p in group["params"]]
    for position, param in enumerate(params):
        name = names.get(id(param))
        found = next((alias for alias in aliases.get(name, [name]) if alias in saved_keys), None)
        if found is None:
            continue  # never stepped when saved (or a new parameter): it starts with fresh state, as in torch
        for key in saved_keys[found]:
            entry = f"{_OPTIM}{index}/state/{found}/{key}"
            info = metadata.state_dict_metadata[entry]
            if isinstance(info, BytesStorageMetadata):
                plan.targets[entry] = None
            else:
                plan.targets[entry] = _state_target(info, params_by_name.get(name), shards.get(name))
            plan.slots[entry] = (position, key)
    return plan


def _optimizer_keys(index: int, metadata: Metadata) -> dict[str, list[str]]:
    """Saved parameter name → its state keys, for optimizer ``index``."""
    prefix = f"{_OPTIM}{index}/state/"
    keys: dict[str, list[str]] = {}
    for entry in metadata.state_dict_metadata:
        if entry.startswith(prefix):
            name, _, key = entry[len(prefix) :].rpartition("/")
            keys.setdefault(name, []).append(key)
    return keys


def _state_target(info: TensorStorageMetadata, param: Tensor | None, shard: Any) -> Any:
    dtype = info.properties.dtype
    if shard is not None and param is not None and tuple(info.size) == tuple(_global_size(_ShardChunks(param, shard))):
        return _ShardChunks(torch.empty(param.shape, dtype=dtype), shard)
    return torch.empty(info.size, dtype=dtype)


def _load_optimizer(plan: _OptimizerPlan, optimizer: Any, saved: dict[str, Any], targets: dict[str, Any]) -> None:
    inner = optimizer.optimizer if isinstance(optimizer, MasterWeightOptimizer) else optimizer
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(inner.param_groups):
        raise CheckpointError(
            f"The checkpoint's optimizer has {len(saved_groups)} param groups, this one has "
            f"{len(inner.param_groups)}: build the optimizer with the same groups as when it was saved."
        )
    groups, start = [], 0
    for saved_group, group in zip(saved_groups, inner.param_groups, strict=True):
        groups.append({**saved_group, "params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    state: dict[int, dict[str, Any]] = {}
    for entry, (position, key) in plan.slots.items():
        value = targets[entry]
        state.setdefault(position, {})[key] = value.local if isinstance(value, _ShardChunks) else value
    inner.load_state_dict({"state": state, "param_groups": groups})
    if isinstance(optimizer, MasterWeightOptimizer):
        _load_scaler(optimizer, saved)


def _load_scaler(optimizer: MasterWeightOptimizer, saved: dict[str, Any]) -> None:
    scaler_state = saved.get("loss_scaler")
    if optimizer.loss_scaler is not None and scaler_state is not None:
        optimizer.loss_scaler.load_state_dict(scaler_state)
    elif optimizer.loss_scaler is not None:
        log.info("lightning_smp: the checkpoint has no loss scale (not an fp16 run); starting from the initial scale.")
    optimizer.skipped_steps.fill_(saved.get("skipped_steps", 0))


# -- smp's tagged checkpoints -----------------------------------------------------------------------------------

_NEWEST = "newest"


def tagged_path(path: str | os.PathLike, tag: str | None = None) -> Path:
    """smp's layout: checkpoint ``tag`` of the folder ``path`` is ``<path>/<tag>_partial``; with no ``tag``, the one
    named in ``<path>/newest`` (written by `record_newest`)."""
    path = Path(path)
    if tag is None:
        try:
            tag = (path / _NEWEST).read_text().strip()
        except FileNotFoundError:
            raise CheckpointError(
                f"{str(path)!r} has no {_NEWEST!r} file naming its latest checkpoint; pass the tag, e.g. "
                "`smp.resume_from_checkpoint(path, tag='step_1000')`."
            ) from None
    return path / f"{tag}_partial"


def record_newest(path: str | os.PathLike, tag: str, *, keep: int | None = None) -> None:
    """After a tagged save (one rank): name ``tag`` in ``<path>/newest`` (atomically) and delete the oldest tagged
    checkpoints beyond ``keep``, as smp's ``num_kept_partial_checkpoints``."""
    path = Path(path)
    temporary = path / f".{_NEWEST}.partial-{uuid.uuid4().hex[:12]}"
    temporary.write_text(tag)
    os.replace(temporary, path / _NEWEST)
    if keep is not None:
        tagged = [p for p in path.glob("*_partial") if is_sharded_checkpoint(p) and p.name != f"{tag}_partial"]
        tagged.sort(key=lambda p: (p / META_FILENAME).stat().st_mtime)
        for old in tagged[: max(0, len(tagged) - (keep - 1))]:
            remove(old)


# -- consolidation ---------------------------------------------------------------------------------------------


def consolidate_checkpoint(src: str | os.PathLike, dst: str | os.PathLike | None = None) -> Path:
    """Write the sharded checkpoint ``src`` as one plain file (default ``<src>.consolidated``); returns its path.

    Its ``state_dict`` holds the whole model under global names in fp32 (the master weights of an fp16/bf16 run;
    tied weights under each of their names), so ``load_state_dict(strict=True)`` takes it into the
    un-parallelized LightningModule; the loop, callback and hyper-parameter entries are kept as Lightning wrote
    them. No process group is needed.
    """
    src = resolve(src)
    dst = Path(dst) if dst is not None else src.with_name(src.name + ".consolidated")
    meta = _read_meta(src, weights_only=False)
    record = meta.pop(_RECORD)
    metadata = _read_dcp_metadata(src)
    problems = _file_problems(src, record, metadata, share=(0, 1))
    if problems:
        listed = "\n".join(f"  - {problem}" for problem in problems)
        raise CheckpointError(f"Cannot consolidate the checkpoint {str(src)!r}:\n{listed}")
    targets: dict[str, Any] = {}
    for entry, info in metadata.state_dict_metadata.items():
        if entry.startswith(_MODEL):
            is_tensor = isinstance(info, TensorStorageMetadata)
            targets[entry] = torch.empty(info.size, dtype=info.properties.dtype) if is_tensor else None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(targets, storage_reader=FileSystemReader(src), planner=_LoadPlanner(), no_dist=True)
    state_dict = {}
    for entry, value in targets.items():
        if isinstance(value, Tensor) and value.is_floating_point():
            value = value.float()
        state_dict[entry[len(_MODEL) :]] = value
    meta.pop("optimizer_states", None)  # ours are keyed by name, not Lightning's single-device format
    consolidated = {**meta, "state_dict": state_dict, _RECORD: {**record, "consolidated_from": str(src)}}
    dst.parent.mkdir(parents=True, exist_ok=True)
    temporary = dst.with_name(f".{dst.name}.partial-{uuid.uuid4().hex[:12]}")
    try:
        _write_file(temporary, consolidated)
        os.replace(temporary, dst)
    finally:
        _remove_path(temporary)
    _fsync_dir(dst.parent)
    return dst


# -- DCP: tensor-parallel shards as chunks of the global tensor ------------------------------------------------


class _ShardChunks:
    """This rank's shard of a tensor-parallel tensor, seen by DCP as chunks of the global tensor.

    A `TPShard` splits each of ``blocks`` equal blocks along ``dim`` into ``parts`` pieces and keeps piece
    ``index`` of every block, so the local tensor holds ``blocks`` chunks of the global one (one for a plain
    column/row split, three for a packed q/k/v weight). DCP asks objects for their chunks through the methods
    DTensor implements (``__create_write_items__``, ``__create_chunk_list__``); our planners look the chunks up.
    """

    def __init__(self, local: Tensor, shard: Any) -> None:
        self.local = local
        dim, blocks, parts, index = shard.dim, getattr(shard, "blocks", 1), shard.parts, shard.index
        size = list(local.shape)
        size[dim] *= parts
        self._size = torch.Size(size)
        piece = local.shape[dim] // blocks  # this rank's rows of one block
        self._chunks: dict[torch.Size, Tensor] = {}
        for block in range(blocks):
            offsets = [0] * local.dim()
            offsets[dim] = block * piece * parts + index * piece
            self._chunks[torch.Size(offsets)] = local.narrow(dim, block * piece, piece)

    def size(self) -> torch.Size:
        return self._size

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self.local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=chunk.shape),
                    properties=properties,
                    size=self._size,
                ),
            )
            for offsets, chunk in self._chunks.items()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=chunk.shape) for offsets, chunk in self._chunks.items()]

    def chunk(self, offsets: torch.Size) -> Tensor:
        return self._chunks[torch.Size(offsets)]


class _SavePlanner(DefaultSavePlanner):
    """Our entries are flat already: a dict value (the random generators) is one object, not a subtree."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, _ShardChunks):
            return value.chunk(index.offset)
        return super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    """Our entries are flat already. DCP's own set-up would also replace every object it does not know (our
    chunks) by None while preparing meta-device tensors, which we never load into."""

    def __init__(self, *, allow_partial_load: bool = False) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=allow_partial_load)

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        self.original_state_dict = self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, _ShardChunks):
            return value.chunk(index.offset)
        return super().lookup_tensor(index)


def _global_size(value: Any) -> torch.Size:
    return value.size() if isinstance(value, _ShardChunks) else value.shape


# -- names ------------------------------------------------------------------------------------------------------


def _unwrap(optimizer: Any) -> Any:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _masters_by_param(optimizers: Sequence[Any]) -> dict[int, Tensor]:
    """id(model parameter) → the fp32 master the optimizer updates in its place."""
    masters = {}
    for optimizer in optimizers:
        optimizer = _unwrap(optimizer)
        if isinstance(optimizer, MasterWeightOptimizer):
            masters.update({id(param): master for param, master in optimizer.param_master_pairs()})
    return masters


def _names_of_optimized(optimizer: Optimizer, module: nn.Module) -> dict[int, str]:
    """id(tensor the inner optimizer updates) → the module's (first) name for that parameter."""
    names = {id(param): name for name, param in module.named_parameters()}
    if isinstance(optimizer, MasterWeightOptimizer):
        for param, master in optimizer.param_master_pairs():
            if id(param) in names:
                names[id(master)] = names[id(param)]
    return names


def _aliases(module: nn.Module) -> dict[str, list[str]]:
    """Each parameter's names, the first first: a tied weight has several (an embedding and an output head)."""
    by_id: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return {name: names for names in by_id.values() for name in names}


def _params_by_name(module: nn.Module) -> dict[str, Tensor]:
    return dict(module.named_parameters(remove_duplicate=False))


def _shards_by_name(module: nn.Module) -> dict[str, Any]:
    return {
        name: shard
        for name, value in module.state_dict(keep_vars=True).items()
        if (shard := getattr(value, _SHARD_ATTRIBUTE, None)) is not None
    }


# -- random generators -------------------------------------------------------------------------------------------


def _rng_states(module: nn.Module) -> dict[str, Any]:
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    tensor_parallel = _tensor_parallel_rng(module)
    if tensor_parallel is not None:
        states["tensor_parallel"] = tensor_parallel.state_dict()
    try:
        import numpy as np

        states["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: dict[str, Any], module: nn.Module) -> None:
    torch.set_rng_state(states["torch"])
    tensor_parallel = _tensor_parallel_rng(module)
    if tensor_parallel is not None and "tensor_parallel" in states:
        tensor_parallel.load_state_dict(states["tensor_parallel"])
    random.setstate(states["python"])
    if "numpy" in states:
        import numpy as np

        np.random.set_state(states["numpy"])
    if "cuda" in states and torch.cuda.is_available() and len(states["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(states["cuda"])


def _tensor_parallel_rng(module: nn.Module) -> Any:
    """The dropout stream of this rank's sharded regions (one per rank, shared by its tensor-parallel layers:
    ``module._tp.rng``, see lightning_smp/tensor_parallel/base.py), or None without tensor parallelism."""
    for layer in module.modules():
        context = getattr(layer, "_tp", None)
        if context is not None and hasattr(context, "rng"):
            return context.rng
    return None


# -- files and processes -------------------------------------------------------------------------------------------


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGTERM until the block is done: a scheduler's SIGTERM arriving mid-save must neither interrupt the
    write nor run Lightning's handler, whose collective would interleave with DCP's (a hang). It is delivered
    to the previous handler right after, at the same point on every rank that received it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if received:
            if callable(previous):
                previous(signal.SIGTERM, None)
            elif previous == signal.SIG_DFL:
                os.kill(os.getpid(), signal.SIGTERM)


@contextmanager
def _reraised_as_checkpoint_error(what: str) -> Iterator[None]:
    """DCP raises one `CheckpointException` (a BaseException) on every rank with each failed rank's error; name
    them in a `CheckpointError` (the traceback of each stays attached as the cause)."""
    try:
        yield
    except CheckpointException as exception:
        failures = "; ".join(
            f"rank {rank}: {type(error).__name__}: {error}" for rank, (error, _) in sorted(exception.failures.items())
        )
        raise CheckpointError(f"{what} ({failures}).") from exception


def _write_file(path: Path, obj: Any) -> None:
    with open(path, "wb") as stream:
        torch.save(obj, stream)
        stream.flush()
        os.fsync(stream.fileno())


def _fsync_dir(directory: Path) -> None:
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # e.g. a filesystem that does not open directories; the renames are still atomic
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def _remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _crc32(file: Path) -> int:
    crc = 0
    with open(file, "rb") as stream:
        while chunk := stream.read(_CRC_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _all_gather_object(obj: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def _broadcast_object(obj: Any) -> Any:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _package_version() -> str:
    from lightning_smp import __version__

    return __version__
