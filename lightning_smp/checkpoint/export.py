"""Export: a sharded checkpoint becomes a Hugging Face model directory, or plain safetensors, one tensor at a time;
or a peft model's adapter directory.

Owns `export_hf`: which tensors go out under which names (a wrapped transformers model's own, as its
``save_pretrained`` names them; else the LightningModule's state dict), their dtype, their split into shard files
with the index, and publishing the directory whole. Not owned: the record of the wrapped model and its configs
(`hugging_face.py`), reading tensors whole (`whole_tensors.py`), the file format (`safetensors_file.py`). No
process group is needed, and each tensor is read from the shards, cast, written and freed before the next: the
memory the export takes is about the largest tensor, whatever the size of the model or of a shard file. A peft
model's adapters (small) are read together and handed to peft's own ``save_pretrained``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import Metadata

from lightning_smp.checkpoint.hugging_face import RECORD_KEY, HuggingFaceModel
from lightning_smp.checkpoint.names import MODEL
from lightning_smp.checkpoint.safetensors_file import DTYPE_CODES, write_safetensors
from lightning_smp.checkpoint.storage import publish, staging_path
from lightning_smp.checkpoint.verification import CheckpointError, read_checked
from lightning_smp.checkpoint.whole_tensors import WholeTensors
from lightning_smp.progress import Progress
from lightning_smp.units import parse_bytes

__all__ = ["export_hf"]

log = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_WEIGHTS, _INDEX = "model.safetensors", "model.safetensors.index.json"  # transformers' names


def export_hf(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Write the model in the sharded ``checkpoint`` (any layout) to the new directory ``out_dir``; returns it.

    A LightningModule that wraps a Hugging Face transformers model (``self.model = LlamaForCausalLM(...)``) gets
    that model's directory, as its ``save_pretrained`` writes it: safetensors files under the model's own tensor
    names (without the ``model.`` prefix; a tied weight once), ``model.safetensors.index.json`` when there are
    several, ``config.json`` and ``generation_config.json`` from the run's own model, so that
    ``AutoModelForCausalLM.from_pretrained(out_dir)`` needs nothing else (add the tokenizer's files to use it as a
    pipeline). Any other LightningModule gets its whole state dict under its own names, in the same files.

    A peft model (``self.model = get_peft_model(base, LoraConfig(...))``) gets its adapters, as its own
    ``save_pretrained`` writes them: ``adapter_config.json`` and ``adapter_model.safetensors``, which
    ``PeftModel.from_pretrained(base, out_dir)`` loads onto the pretrained base model (the base weights are not
    written: the run did not change them). ``max_shard_size`` does not apply (peft writes one file).

    Args:
        checkpoint: the directory `trainer.save_checkpoint` or `ModelCheckpoint` wrote under SMPStrategy.
        out_dir: where to write; it must not exist or be empty. It appears whole, or not at all.
        dtype: the dtype of the floating-point tensors ("float32", "bfloat16", "float16", or a torch dtype);
            default: as saved, which is fp32 (the master weights of an fp16 or bf16 run).
        max_shard_size: the most bytes in one file ("5GB", "2GiB", or a number), as ``save_pretrained``'s; a
            tensor larger than that gets a file of its own.

    No process group is needed. Each tensor is read from the shards, cast, written and freed before the next, so
    the memory this takes is about that of the largest tensor, however big the model.
    """
    dtype = _parse_dtype(dtype)
    limit = _parse_size(max_shard_size)
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise CheckpointError(
            f"Cannot export into {str(out_dir)!r}: it exists and is not an empty directory. Export into a new "
            "directory (it appears whole when the export is done), or delete this one first."
        )
    src, _, record, metadata = read_checked(checkpoint, "export")
    model = _wrapped_model(src, record)
    with WholeTensors(src, metadata) as tensors:
        staging = staging_path(out_dir)
        staging.mkdir(parents=True)
        try:
            what = f"exporting {src.name} to {out_dir}"
            if model is not None and model.adapters:
                _write_adapters(model, metadata, tensors, dtype, staging, what)
            else:
                _write_model(model, metadata, tensors, dtype, limit, staging, what)
            publish(staging, out_dir)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    log.info("lightning_smp: exported %s to %s", src, out_dir)
    return out_dir


def _write_model(
    model: HuggingFaceModel | None,
    metadata: Metadata,
    tensors: WholeTensors,
    dtype: torch.dtype | None,
    limit: int,
    directory: Path,
    what: str,
) -> None:
    """The model's files (or the LightningModule's state dict's) into ``directory``, one tensor at a time."""
    sources = _sources(model, metadata)  # exported name → checkpoint entry
    specs = _specs(sources, tensors, dtype)
    files = _shard_files({name: shape.numel() * out.itemsize for name, (shape, out) in specs.items()}, limit)
    total = sum(shape.numel() * out.itemsize for shape, out in specs.values())
    with Progress(what, total) as progress:
        for filename, names in files.items():
            listed = [(name, *specs[name]) for name in names]
            fill = lambda name: tensors.read(sources[name], specs[name][1])  # noqa: E731
            write_safetensors(directory / filename, listed, fill, progress.advance)
    if len(files) > 1:
        parameters = model.num_parameters() if model is not None else sum(s.numel() for s, _ in specs.values())
        _write_index(directory / _INDEX, files, total, parameters)
    if model is not None:
        model.write_configs(directory, _config_dtype(specs, dtype))


def _write_adapters(
    model: HuggingFaceModel,
    metadata: Metadata,
    tensors: WholeTensors,
    dtype: torch.dtype | None,
    directory: Path,
    what: str,
) -> None:
    """A peft model's adapters into ``directory``, as its ``save_pretrained`` writes them. Adapters are small (the
    point of them): they are read whole, together, and peft writes them."""
    sources = {name: f"{MODEL}{model.prefix}{name}" for name in model.adapter_names()}
    _check_present(model, sources, metadata)
    specs = _specs(sources, tensors, dtype)
    adapters = {}
    with Progress(what, sum(shape.numel() * out.itemsize for shape, out in specs.values())) as progress:
        for name, (shape, out) in specs.items():
            adapters[name] = tensors.read(sources[name], out)
            progress.advance(shape.numel() * out.itemsize)
    model.write_adapters(directory, adapters)


def _wrapped_model(src: Path, record: Mapping) -> HuggingFaceModel | None:
    """The transformers model the checkpoint's LightningModule wraps, rebuilt on meta; None when it wraps none."""
    models = record.get(RECORD_KEY)
    if models is None:
        raise CheckpointError(
            f"{str(src)!r} was saved by an earlier lightning_smp, which did not record the Hugging Face config of "
            "the model it holds, so export_hf cannot write config.json. Resume from it and save again "
            "(`trainer.fit(model, ckpt_path=...)` with the same max_steps, then `trainer.save_checkpoint(...)`), or "
            "consolidate it and load `consolidated_state_dict(file, 'model')` into the model to `save_pretrained`."
        )
    if len(models) > 1:
        raise CheckpointError(
            f"{str(src)!r} holds {len(models)} Hugging Face models ({', '.join(sorted(models))}); export_hf writes "
            "one. Consolidate the checkpoint and load each with `consolidated_state_dict(file, '<name>')` into its "
            "model to `save_pretrained` it."
        )
    return HuggingFaceModel(*next(iter(models.items()))) if models else None


def _sources(model: HuggingFaceModel | None, metadata: Metadata) -> dict[str, str]:
    entries = [entry for entry in metadata.state_dict_metadata if entry.startswith(MODEL)]
    if model is None:
        return {entry[len(MODEL) :]: entry for entry in entries}
    sources = {name: f"{MODEL}{model.prefix}{own}" for name, own in model.saved_names().items()}
    _check_present(model, sources, metadata)
    others = [entry[len(MODEL) :] for entry in entries if not entry.startswith(MODEL + model.prefix)]
    if others:
        log.warning(
            "lightning_smp: export_hf writes the Hugging Face model at %r; %d entries of the LightningModule outside "
            "it are not exported: %s",
            model.place,
            len(others),
            ", ".join(others[:10]),
        )
    return sources


def _check_present(model: HuggingFaceModel, sources: Mapping[str, str], metadata: Metadata) -> None:
    missing = [entry[len(MODEL) :] for entry in sources.values() if entry not in metadata.state_dict_metadata]
    if missing:
        raise CheckpointError(
            f"The checkpoint lacks {len(missing)} of the tensors of the {type(model.model).__name__} it recorded at "
            f"{model.place!r}: {', '.join(missing[:10])}. It does not match the model's config (its layers were "
            "changed after it was built?): consolidate the checkpoint and load `consolidated_state_dict(file, "
            f"{model.place!r})` into the model you mean, then call its `save_pretrained`."
        )


def _specs(
    sources: Mapping[str, str], tensors: WholeTensors, dtype: torch.dtype | None
) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Each exported tensor's shape and dtype (floating-point ones cast to ``dtype``)."""
    specs = {}
    for name, entry in sources.items():
        info = tensors.info(entry)
        if info is None:
            raise CheckpointError(
                f"The checkpoint's entry {entry[len(MODEL) :]!r} is not a tensor (a module's extra state), which "
                "safetensors cannot hold. Consolidate the checkpoint instead (`lightning_smp.consolidate_checkpoint`)."
            )
        saved = info.properties.dtype
        if saved not in DTYPE_CODES:
            raise CheckpointError(
                f"{name!r} has dtype {saved}, which safetensors cannot hold: consolidate the checkpoint instead "
                "(`lightning_smp.consolidate_checkpoint`)."
            )
        specs[name] = (info.size, dtype if dtype is not None and saved.is_floating_point else saved)
    return specs


def _shard_files(sizes: Mapping[str, int], limit: int) -> dict[str, list[str]]:
    """Tensors by file, in order, each file at most ``limit`` bytes unless one tensor alone is larger; named as
    ``save_pretrained`` names them (huggingface_hub's ``split_torch_state_dict_into_shards``, the same greedy split)."""
    shards: list[list[str]] = []
    current: list[str] = []
    filled = 0
    for name, size in sizes.items():
        if size > limit:
            shards.append([name])
            continue
        if current and filled + size > limit:
            shards.append(current)
            current, filled = [], 0
        current.append(name)
        filled += size
    if current or not shards:
        shards.append(current)
    if len(shards) == 1:
        return {_WEIGHTS: shards[0]}
    return {f"model-{i:05d}-of-{len(shards):05d}.safetensors": names for i, names in enumerate(shards, start=1)}


def _write_index(path: Path, files: Mapping[str, list[str]], total: int, parameters: int) -> None:
    weight_map = {name: filename for filename, names in files.items() for name in names}
    index = {"metadata": {"total_parameters": parameters, "total_size": total}, "weight_map": weight_map}
    path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _config_dtype(specs: Mapping[str, tuple[torch.Size, torch.dtype]], dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    floating = [out for _, out in specs.values() if out.is_floating_point]
    return floating[0] if floating else torch.float32


def _parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype in _DTYPES.values()):
        return dtype
    key = dtype.removeprefix("torch.") if isinstance(dtype, str) else str(dtype)
    if key in _DTYPES:
        return _DTYPES[key]
    raise ValueError(
        f"dtype={dtype!r} is not one export_hf writes; use one of {', '.join(_DTYPES)} (or the torch dtype), or "
        "leave it unset to keep the saved fp32."
    )


def _parse_size(size: int | str) -> int:
    try:
        limit = size if isinstance(size, int) else parse_bytes(size)
    except ValueError:
        limit = 0
    if limit <= 0:
        raise ValueError(
            f"max_shard_size={size!r} is not a size; give bytes with a unit, e.g. '5GB' (save_pretrained's "
            "default) or '2GiB', or a positive number of bytes."
        )
    return limit
