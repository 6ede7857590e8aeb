"""Consolidation: a sharded checkpoint becomes one plain file that loads into the un-parallelized model.

Owns what the consolidated file holds (every ``model/`` entry whole, in fp32, under its global name, beside
Lightning's own entries), writing it in one process without a process group, and reading its ``state_dict`` back
for a model wrapped in the LightningModule. Not owned: the command line (`lightning_smp/consolidate_checkpoint.py`),
reading tensors whole (`whole_tensors.py`), the file format (`torch_file.py`: a ``torch.save`` file written one
tensor at a time). The peak memory is about the largest tensor, however big the model.
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

from lightning_smp.checkpoint.dcp_adapter import LoadPlanner
from lightning_smp.checkpoint.names import MODEL
from lightning_smp.checkpoint.storage import fsync_dir, remove_path, staging_path
from lightning_smp.checkpoint.torch_file import write_torch_file
from lightning_smp.checkpoint.verification import RECORD, CheckpointError, is_sharded_checkpoint, read_checked
from lightning_smp.checkpoint.whole_tensors import WholeTensors
from lightning_smp.progress import Progress

__all__ = ["consolidate_checkpoint", "consolidated_state_dict"]


def consolidate_checkpoint(src: str | os.PathLike, dst: str | os.PathLike | None = None) -> Path:
    """Write the sharded checkpoint ``src`` as one plain file (default ``<src>.consolidated``); returns its path.

    Its ``state_dict`` holds the whole model under global names in fp32 (the master weights of an fp16/bf16 run;
    tied weights under each of their names), so ``load_state_dict(strict=True)`` takes it into the
    un-parallelized LightningModule; the loop, callback and hyper-parameter entries are kept as Lightning wrote
    them. No process group is needed, and the file is written one tensor at a time: the memory it takes is about
    that of the largest tensor. Load it for inference with ``MyModule.load_from_checkpoint(dst)`` (Lightning
    calls ``configure_model`` first), or take a wrapped model's weights with `consolidated_state_dict`.
    """
    src, meta, record, metadata = read_checked(src, "consolidate")
    dst = Path(dst) if dst is not None else src.with_name(src.name + ".consolidated")
    entries = [entry for entry in metadata.state_dict_metadata if entry.startswith(MODEL)]
    with WholeTensors(src, metadata) as tensors:
        objects = _load_objects(src, [entry for entry in entries if tensors.info(entry) is None])
        state_dict: dict[str, Any] = {}
        source: dict[int, str] = {}  # id(stand-in) → its entry
        for entry in entries:
            info = tensors.info(entry)
            if info is None:
                state_dict[entry[len(MODEL) :]] = objects[entry]
                continue
            dtype = torch.float32 if info.properties.dtype.is_floating_point else info.properties.dtype
            state_dict[entry[len(MODEL) :]] = stand_in = torch.empty(info.size, dtype=dtype, device="meta")
            source[id(stand_in)] = entry
        meta.pop("optimizer_states", None)  # ours are keyed by name, not Lightning's single-device format
        consolidated = {**meta, "state_dict": state_dict, RECORD: {**record, "consolidated_from": str(src)}}
        total = sum(_nbytes(value) for value in state_dict.values() if isinstance(value, Tensor) and value.is_meta)
        dst.parent.mkdir(parents=True, exist_ok=True)
        temporary = staging_path(dst)
        try:
            with Progress(f"consolidating {src.name} into {dst.name}", total) as progress:
                fill = lambda stand_in: tensors.read(source[id(stand_in)], stand_in.dtype)  # noqa: E731
                write_torch_file(temporary, consolidated, fill, progress.advance)
            os.replace(temporary, dst)
        finally:
            remove_path(temporary)
    fsync_dir(dst.parent)
    return dst


def _load_objects(path: Path, entries: list[str]) -> dict[str, Any]:
    """The checkpoint's entries that are not tensors (a module's ``get_extra_state``), by entry."""
    if not entries:
        return {}
    targets: dict[str, Any] = dict.fromkeys(entries)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        planner = LoadPlanner(allow_partial_load=True)
        dcp.load(targets, storage_reader=FileSystemReader(path), planner=planner, no_dist=True)
    return targets


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


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
