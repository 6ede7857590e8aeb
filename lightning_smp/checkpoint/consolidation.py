"""Consolidation: a sharded checkpoint becomes one plain file that loads into the un-parallelized model.

Owns reading every ``model/`` entry whole, in one process and without a process group, writing the Lightning
checkpoint file, and reading its ``state_dict`` back for a model wrapped in the LightningModule. Not owned: the
command line (`lightning_smp/consolidate_checkpoint.py`). DCP assembles each global tensor from whichever ranks'
chunks hold it, so consolidating is a load into whole-tensor targets.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_smp.checkpoint.dcp_adapter import LoadPlanner
from lightning_smp.checkpoint.names import MODEL
from lightning_smp.checkpoint.storage import fsync_dir, remove_path, staging_path, write_file
from lightning_smp.checkpoint.verification import (
    RECORD,
    CheckpointError,
    file_problems,
    is_sharded_checkpoint,
    read_dcp_metadata,
    read_meta,
    resolve,
)

__all__ = ["consolidate_checkpoint", "consolidated_state_dict"]


def consolidate_checkpoint(src: str | os.PathLike, dst: str | os.PathLike | None = None) -> Path:
    """Write the sharded checkpoint ``src`` as one plain file (default ``<src>.consolidated``); returns its path.

    Its ``state_dict`` holds the whole model under global names in fp32 (the master weights of an fp16/bf16 run;
    tied weights under each of their names), so ``load_state_dict(strict=True)`` takes it into the
    un-parallelized LightningModule; the loop, callback and hyper-parameter entries are kept as Lightning wrote
    them. No process group is needed. Load it for inference with ``MyModule.load_from_checkpoint(dst)`` (Lightning
    calls ``configure_model`` first), or take a wrapped model's weights with `consolidated_state_dict`.
    """
    src = resolve(src)
    dst = Path(dst) if dst is not None else src.with_name(src.name + ".consolidated")
    meta = read_meta(src, weights_only=False)
    record = meta.pop(RECORD)
    metadata = read_dcp_metadata(src)
    problems = file_problems(src, record, metadata, share=(0, 1))
    if problems:
        listed = "\n".join(f"  - {problem}" for problem in problems)
        raise CheckpointError(f"Cannot consolidate the checkpoint {str(src)!r}:\n{listed}")
    targets: dict[str, Any] = {}
    for entry, info in metadata.state_dict_metadata.items():
        if entry.startswith(MODEL):
            is_tensor = isinstance(info, TensorStorageMetadata)
            targets[entry] = torch.empty(info.size, dtype=info.properties.dtype) if is_tensor else None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(targets, storage_reader=FileSystemReader(src), planner=LoadPlanner(), no_dist=True)
    state_dict = {}
    for entry, value in targets.items():
        if isinstance(value, Tensor) and value.is_floating_point():
            value = value.float()
        state_dict[entry[len(MODEL) :]] = value
    meta.pop("optimizer_states", None)  # ours are keyed by name, not Lightning's single-device format
    consolidated = {**meta, "state_dict": state_dict, RECORD: {**record, "consolidated_from": str(src)}}
    dst.parent.mkdir(parents=True, exist_ok=True)
    temporary = staging_path(dst)
    try:
        write_file(temporary, consolidated)
        os.replace(temporary, dst)
    finally:
        remove_path(temporary)
    fsync_dir(dst.parent)
    return dst


def consolidated_state_dict(path: str | os.PathLike, submodule: str | None = None) -> dict[str, Any]:
    """The ``state_dict`` of the consolidated file ``path`` (written by `consolidate_checkpoint`); with
    ``submodule``, the attribute path of a model the LightningModule wraps (e.g. "model" for ``self.model``), only
    that model's entries, without the prefix, so they load into it directly::

        llama = LlamaForCausalLM(config)
        llama.load_state_dict(consolidated_state_dict("last.ckpt.consolidated", "model"), strict=True)

    The file is read with ``torch.load(weights_only=True)``: tensors and plain containers.
    """
    path = Path(path)
    if is_sharded_checkpoint(path):
        raise CheckpointError(
            f"{str(path)!r} is a sharded checkpoint (a directory); consolidate it first: "
            f"`lightning_smp.consolidate_checkpoint({str(path)!r})` writes {str(path)!r} + '.consolidated'."
        )
    state_dict = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    if submodule is None:
        return state_dict
    prefix = submodule.rstrip(".") + "."
    inner = {key[len(prefix) :]: value for key, value in state_dict.items() if key.startswith(prefix)}
    if not inner:
        names = sorted({key.split(".", 1)[0] for key in state_dict})
        raise CheckpointError(
            f"{str(path)!r} has no entries under {prefix!r}; pass the attribute path of the wrapped model, one of "
            f"the LightningModule's top-level names: {', '.join(names)}."
        )
    return inner
