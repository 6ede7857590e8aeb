"""Saving: Lightning's checkpoint dict becomes DCP entries under global names plus the meta file, published whole.

Owns the order of a save (split the dict, write every rank's entries to a staging directory, record the files,
write the meta file last, rename into place) and which copy of a parameter a rank writes. Not owned: the names
(`names.py`), the chunking (`dcp_adapter.py`), the files (`storage.py`). Every rank learns whether rank 0's part
failed, so all raise the same error and none waits for a save that will not come.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from lightning_smp.checkpoint import asynchronous as asynchronous_saves
from lightning_smp.checkpoint.dcp_adapter import ReportingWriter, SavePlanner, stored, stored_like_param
from lightning_smp.checkpoint.hugging_face import RECORD_KEY, describe_models
from lightning_smp.checkpoint.names import MODEL, OPTIM, RNG, params_by_name, shards_by_name
from lightning_smp.checkpoint.rng import rng_states
from lightning_smp.checkpoint.storage import (
    all_gather_object,
    broadcast_object,
    publish,
    remove_stale_staging,
    signals_deferred,
    staging_path,
    write_file,
)
from lightning_smp.checkpoint.verification import (
    FORMAT_VERSION,
    META_FILENAME,
    RECORD,
    CheckpointError,
    describe_own_files,
    reraised_as_checkpoint_error,
)
from lightning_smp.version import __version__

__all__ = ["save"]

log = logging.getLogger(__name__)


def save(
    checkpoint: dict[str, Any],
    path: str | os.PathLike,
    *,
    module: nn.Module,
    run: dict[str, Any],
    owned: set[str] | None = None,
    asynchronous: bool = False,
) -> None:
    """Write Lightning's ``checkpoint`` dict to the directory ``path``; collective, every rank calls it.

    ``checkpoint["state_dict"]`` and ``checkpoint["optimizer_states"]`` are what `model_state_dict` and
    `optimizer_state_dict` return on this rank; ``run`` is `describe_run`'s record. ``owned`` names the parameters
    whose copy on this rank is the trained one (a pipeline stage also holds stale copies of parameters another
    stage trains); only those are written from here. None: every parameter this rank holds. The checkpoint is written to
    a hidden temporary directory beside ``path`` and renamed to ``path`` only once every rank's files and the
    metadata are on disk, so a crash at any point leaves the previous checkpoint (and nothing that looks whole).
    ``asynchronous``: return once this rank's part is copied (`asynchronous.snapshot`) and write it on a background
    thread; any save first waits for the one in flight.
    """
    asynchronous_saves.wait()
    path = Path(path)
    rank = dist.get_rank()
    entries, rest = _split_for_storage(checkpoint, module, rank, owned)
    if rank == 0:
        remove_stale_staging(path)
    staging = Path(broadcast_object(str(staging_path(path)) if rank == 0 else None))
    staging.mkdir(parents=True, exist_ok=True)
    models = describe_models(module)  # what export_hf writes config.json from
    if not asynchronous:
        _write(entries, rest, path, staging, rank=rank, run=run, models=models, group=None)
        return
    group = asynchronous_saves.process_group()
    entries, rest = asynchronous_saves.snapshot(entries), asynchronous_saves.snapshot(rest)
    asynchronous_saves.submit(
        lambda: _write(entries, rest, path, staging, rank=rank, run=run, models=models, group=group)
    )


def _write(
    entries: dict[str, Any],
    rest: dict[str, Any],
    path: Path,
    staging: Path,
    *,
    rank: int,
    run: dict[str, Any],
    models: Any,
    group: Any,
) -> None:
    """Every rank's entries into ``staging``, then (rank 0) the meta file and the publish; collective over
    ``group`` (None: the default group)."""
    try:
        with signals_deferred():
            with reraised_as_checkpoint_error(f"Saving the checkpoint {str(path)!r} failed; nothing was published"):
                writer = ReportingWriter(staging, what=f"saving {path.name} (rank {rank}'s files)")
                dcp.save(entries, storage_writer=writer, planner=SavePlanner(), process_group=group)
            files = all_gather_object(describe_own_files(staging, rank), group=group)
            error = None
            if rank == 0:
                try:
                    record = {**run, "format": FORMAT_VERSION, "version": __version__}
                    record["torch"] = str(torch.__version__)
                    record[RECORD_KEY] = models
                    record["files"] = {name: info for part in files for name, info in part.items()}
                    write_file(staging / META_FILENAME, {**rest, RECORD: record})
                    publish(staging, path)
                except Exception as exception:  # report it to every rank, then raise it here
                    error = exception
            remote = broadcast_object(None if error is None else f"{type(error).__name__}: {error}", group=group)
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
    shards = shards_by_name(module)
    params = params_by_name(module)
    stale = set(params) - owned if owned is not None else set()
    entries: dict[str, Any] = {
        f"{MODEL}{name}": stored(value, shards.get(name)) for name, value in model_state.items() if name not in stale
    }
    if optimizer_states is not None:
        rest["optimizer_states"] = []
        for index, optimizer_state in enumerate(optimizer_states):
            for name, values in optimizer_state["state"].items():
                if name in stale:
                    continue
                for key, value in values.items():
                    entry = f"{OPTIM}{index}/state/{name}/{key}"
                    entries[entry] = stored_like_param(value, params.get(name), shards.get(name), entry)
            rest["optimizer_states"].append({k: v for k, v in optimizer_state.items() if k != "state"})
    entries[f"{RNG}{rank}"] = rng_states(module)
    return entries, rest
