"""Weights from files into a module: `load_weights`, the public call that gives an unsplit model's parameters and
buffers the values of a state-dict file (`weight_files` reads it).

Under delayed initialisation nothing is read when it is called: each value becomes a deferred tensor
(`delayed_init`), and each rank reads only what it keeps when setup materialises the model. Not owned: which part a
rank keeps (`materialization`), the files' formats (`weight_files`), Hugging Face's ``from_pretrained``
(`delayed_init.huggingface` routes it to the same sources).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_smp.delayed_init import deferred_from, deferred_init
from lightning_smp.weight_files import open_state_dict

__all__ = ["load_weights"]


def load_weights(module: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> None:
    """Give ``module``'s parameters and buffers the values of the unsplit state dict saved at ``path``.

    ``path`` is a safetensors file, a ``*.safetensors.index.json`` with its shards, a ``torch.save`` file of a state
    dict or of a Lightning checkpoint (its ``state_dict``; a `consolidate_checkpoint` file), or the directory
    ``save_pretrained`` wrote. Its keys are ``module.state_dict()``'s: load a checkpoint of the LightningModule into
    the LightningModule, a bare model's into that model. Weights only: nothing of an optimizer or a loop.

    Call it in ``configure_model``, right after building ``module``. Under ``delayed_parameter_initialization`` (or
    ``trainer.init_module(empty_init=True)``) nothing is read then: setup splits the model and each rank reads only
    its part of each tensor (its tensor-parallel piece, its pipeline stage's tensors, its sharded-data-parallel
    rows), cast to the dtype of the parameter it goes into. Otherwise every rank reads the whole file now, one
    tensor at a time.

    Raises ``ValueError`` when the file does not fit the module: keys the module lacks or the file lacks (with
    ``strict``), or shapes that differ (always).
    """
    sources = open_state_dict(path)
    own = {name: value for name, value in module.state_dict(keep_vars=True).items() if isinstance(value, Tensor)}
    problems = _fit_problems(own, sources, strict)
    if problems:
        listed = "\n".join(f"  - {problem}" for problem in problems)
        raise ValueError(
            f"load_weights({type(module).__name__}, {str(path)!r}): the file does not fit the module:\n{listed}\n"
            "The file's keys must be the module's `state_dict()` keys: load a LightningModule checkpoint into the "
            "LightningModule, a bare model's into that model (strict=False loads the entries both have)."
        )
    with torch.no_grad():
        deferred = [(tensor, sources[name]) for name, tensor in own.items() if name in sources and tensor.is_meta]
        if deferred:
            with deferred_init():
                for tensor, source in deferred:
                    tensor.copy_(deferred_from(source))
        for name, tensor in own.items():
            if name in sources and not tensor.is_meta:
                tensor.copy_(sources[name].read(None))


def _fit_problems(own: dict[str, Tensor], sources: Mapping[str, Any], strict: bool) -> list[str]:
    problems = []
    shapes = [
        f"{name}: {tuple(sources[name].shape)} in the file, {tuple(tensor.shape)} in the module"
        for name, tensor in own.items()
        if name in sources and tuple(sources[name].shape) != tuple(tensor.shape)
    ]
    if shapes:
        problems.append(f"{len(shapes)} shape(s) differ: {_listing(shapes)}")
    if strict:
        missing = [name for name in own if name not in sources]
        unexpected = [key for key in sources if key not in own]
        if missing:
            problems.append(f"the file lacks {len(missing)} of the module's entries: {_listing(missing)}")
        if unexpected:
            problems.append(f"the module lacks {len(unexpected)} of the file's entries: {_listing(unexpected)}")
    return problems


def _listing(items: list[str], limit: int = 6) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")
