"""Hugging Face models inside a checkpoint: what a save records about them, and their names and files at export.

Owns finding the transformers models a LightningModule wraps (``self.model = LlamaForCausalLM(...)``, or a peft
``PeftModel`` around one), the record a save keeps of each (its place in the module, its class, its config and
generation config, a peft model's adapter configs, as JSON), and at export the model rebuilt on the meta device
from that record: the names ``save_pretrained`` gives its tensors (a tied weight once, transformers' reversible
renames applied) and its ``config.json`` and ``generation_config.json``; for a peft model, the adapter tensors its
``save_pretrained`` writes, and peft writing them. Not owned: reading and writing the tensors of a whole model
(`export.py`). transformers and peft are imported only where they are in use already (a save) or needed (an
export); a module without such a model records an empty dict.
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
    """The outermost transformers ``PreTrainedModel`` and peft ``PeftModel`` instances in ``module``, by attribute
    path ("" for the module itself): ``{"class": import path, "config": JSON, "generation_config": JSON or None}``
    of the transformers model, and for a peft model ``"peft": {adapter name: its config as JSON}``."""
    transformers = sys.modules.get("transformers")
    if transformers is None:  # then nothing in the module can be a transformers model
        return {}
    peft = sys.modules.get("peft")
    found: dict[str, dict[str, Any]] = {}
    for name, child in module.named_modules():
        if any(_inside(name, outer) for outer in found):
            continue
        if peft is not None and isinstance(child, peft.PeftModel):
            adapters = {
                adapter: json.dumps(config.to_dict(), default=sorted) for adapter, config in child.peft_config.items()
            }
            found[name] = {**_describe(child.get_base_model()), "peft": adapters}  # sets (target_modules) as lists
        elif isinstance(child, transformers.PreTrainedModel):
            found[name] = _describe(child)
    return found


def _describe(model: nn.Module) -> dict[str, Any]:
    # the model's own class: sharded data parallelism (FSDP2) puts a class of torch's in front of it
    cls = next(c for c in type(model).__mro__ if not c.__module__.startswith("torch."))
    generation = model.generation_config if model.can_generate() else None
    return {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "config": model.config.to_json_string(use_diff=False),
        "generation_config": generation.to_json_string(use_diff=False) if generation is not None else None,
    }


def _inside(name: str, outer: str) -> bool:
    return outer == "" or name.startswith(outer + ".")


class HuggingFaceModel:
    """A recorded model rebuilt on the meta device (no memory): what ``save_pretrained`` would write of it. For a
    peft model (``adapters``), ``model`` is the ``PeftModel`` with its adapters, whose ``save_pretrained`` writes
    the adapters only."""

    def __init__(self, place: str, description: dict[str, Any]) -> None:
        self.place = place
        self.prefix = f"{place}." if place else ""  # of its entries in the LightningModule's state dict
        cls = _import(description["class"])
        self._config = cls.config_class.from_dict(json.loads(description["config"]))
        generation = description.get("generation_config")
        self._generation = json.loads(generation) if generation is not None else None
        adapters = description.get("peft")
        self.adapters = adapters is not None
        with torch.device("meta"):
            self.model = cls(self._config)
            if adapters is not None:
                self.model = _with_adapters(self.model, {name: json.loads(config) for name, config in adapters.items()})

    def adapter_names(self) -> list[str]:
        """The names, in the peft model's state dict, of the tensors its ``save_pretrained`` writes (every
        adapter's)."""
        from peft import get_peft_model_state_dict

        state = self.model.state_dict()
        names = {id(tensor): name for name, tensor in state.items()}
        return [
            names[id(tensor)]
            for adapter in self.model.peft_config
            for tensor in get_peft_model_state_dict(self.model, state_dict=state, adapter_name=adapter).values()
        ]

    def write_adapters(self, directory: Path, tensors: dict[str, torch.Tensor]) -> None:
        """peft's own ``save_pretrained`` of the adapters ``tensors`` (by `adapter_names`): ``adapter_config.json``
        and ``adapter_model.safetensors`` (an adapter other than "default" in a directory of its name) and the
        model card, which ``PeftModel.from_pretrained(base_model, directory)`` loads."""
        self.model.save_pretrained(directory, state_dict=tensors)

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


def _with_adapters(model: nn.Module, adapters: dict[str, dict[str, Any]]) -> nn.Module:
    try:
        from peft import PeftConfig, PeftModel
    except ImportError:
        raise CheckpointError(
            "The checkpoint holds a peft model (LoRA adapters), and peft cannot be imported here. Export where peft "
            "is installed (`pip install 'lightning-smp[hf]'`)."
        ) from None
    (first, config), *others = adapters.items()
    peft_model = PeftModel(model, PeftConfig.from_peft_type(**config), adapter_name=first)
    for name, other in others:
        peft_model.add_adapter(name, PeftConfig.from_peft_type(**other))
    return peft_model


def _import(path: str) -> type:
    module_name, _, qualname = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), qualname)
    except (ImportError, AttributeError) as error:
        raise CheckpointError(
            f"The checkpoint holds a Hugging Face model of class {path}, which cannot be imported here ({error}). "
            "Export where the run's code and transformers are importable (`pip install 'lightning-smp[hf]'`)."
        ) from None
