"""Hugging Face models inside a checkpoint: what a save records about them, and their names and files at export.

Owns finding the transformers models a LightningModule wraps (``self.model = LlamaForCausalLM(...)``), the record a
save keeps of each (its place in the module, its class, its config and generation config, as JSON), and at export
the model rebuilt on the meta device from that record: the names ``save_pretrained`` gives its tensors (a tied
weight once, transformers' reversible renames applied) and its ``config.json`` and ``generation_config.json``.
Not owned: reading and writing the tensors (`export.py`). transformers is imported only where it is in use already
(a save) or needed (an export); a module without such a model records an empty dict.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_smp.checkpoint.verification import CheckpointError

__all__ = ["RECORD_KEY", "HuggingFaceModel", "describe_models"]

RECORD_KEY = "hugging_face"  # in the checkpoint's record: {place in the LightningModule: describe_models' entry}


def describe_models(module: nn.Module) -> dict[str, dict[str, Any]]:
    """The outermost transformers ``PreTrainedModel`` instances in ``module``, by attribute path ("" for the module
    itself): ``{"class": import path, "config": JSON, "generation_config": JSON or None}``."""
    transformers = sys.modules.get("transformers")
    if transformers is None:  # then nothing in the module can be a transformers model
        return {}
    found: dict[str, dict[str, Any]] = {}
    for name, child in module.named_modules():
        if not isinstance(child, transformers.PreTrainedModel) or any(_inside(name, outer) for outer in found):
            continue
        # the model's own class: sharded data parallelism (FSDP2) puts a class of torch's in front of it
        cls = next(c for c in type(child).__mro__ if not c.__module__.startswith("torch."))
        generation = child.generation_config if child.can_generate() else None
        found[name] = {
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "config": child.config.to_json_string(use_diff=False),
            "generation_config": generation.to_json_string(use_diff=False) if generation is not None else None,
        }
    return found


def _inside(name: str, outer: str) -> bool:
    return outer == "" or name.startswith(outer + ".")


class HuggingFaceModel:
    """A recorded model rebuilt on the meta device (no memory): what ``save_pretrained`` would write of it."""

    def __init__(self, place: str, description: dict[str, Any]) -> None:
        self.place = place
        self.prefix = f"{place}." if place else ""  # of its entries in the LightningModule's state dict
        cls = _import(description["class"])
        self._config = cls.config_class.from_dict(json.loads(description["config"]))
        generation = description.get("generation_config")
        self._generation = json.loads(generation) if generation is not None else None
        with torch.device("meta"):
            self.model = cls(self._config)

    def saved_names(self) -> dict[str, str]:
        """``{name in the exported files: name in the model's state dict}``, in ``save_pretrained``'s order: a
        tied weight once (under the name transformers loads it by), transformers' renames for saving applied."""
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        state = dict(self.model.state_dict())
        kept = remove_tied_weights_from_state_dict(dict(state), self.model)
        names = {id(tensor): name for name, tensor in kept.items()}
        saved = revert_weight_conversion(self.model, dict(kept))
        unmatched = [name for name, tensor in saved.items() if id(tensor) not in names]
        if unmatched:
            raise CheckpointError(
                f"{type(self.model).__name__} converts weights when it saves (its files hold {unmatched[0]!r}, made "
                "from several of its tensors); export_hf writes one tensor at a time and cannot merge them. "
                "Consolidate the checkpoint, load the weights with `consolidated_state_dict(file, "
                f"{self.place!r})` and call the model's `save_pretrained`."
            )
        return {name: names[id(tensor)] for name, tensor in saved.items()}

    def num_parameters(self) -> int:
        return self.model.num_parameters()

    def write_configs(self, directory: Path, dtype: torch.dtype) -> None:
        """``config.json`` (saying ``dtype`` and the model's class, as ``save_pretrained`` does) and, for a model
        that generates, ``generation_config.json``."""
        self._config.dtype = str(dtype).removeprefix("torch.")
        self._config.architectures = [type(self.model).__name__]
        self._config.save_pretrained(directory)
        if self._generation is not None:
            from transformers import GenerationConfig

            GenerationConfig.from_dict(self._generation).save_pretrained(directory)


def _import(path: str) -> type:
    module_name, _, qualname = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), qualname)
    except (ImportError, AttributeError) as error:
        raise CheckpointError(
            f"The checkpoint holds a Hugging Face model of class {path}, which cannot be imported here ({error}). "
            "Export where the run's code and transformers are importable (`pip install 'lightning-smp[hf]'`)."
        ) from None
