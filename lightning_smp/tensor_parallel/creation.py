"""Which modules were created tensor-parallel: smp's ``tensor_parallelism`` context, recorded on the modules.

While a `scope` is open, global module-registration hooks note the current setting on every module whose own
``__init__`` registers a parameter or a submodule (i.e. the modules being created), first note wins, so the
innermost scope around a module's creation decides, as in smp. The note is an instance attribute, so
``copy.deepcopy`` (``nn.TransformerEncoder`` clones its layer) carries it. `set_tensor_parallelism` overrides
it after the fact. Nothing is split here: `parallelize` reads the notes once the tensor-parallel group exists.
"""

from __future__ import annotations

import contextvars
import difflib
import threading
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

__all__ = ["CreationSetting", "creation_setting", "scope", "set_tensor_parallelism"]

_ATTRIBUTE = "_smp_tensor_parallelism"

# smp's tensor-parallel keyword arguments (``smp.tensor_parallelism(**kw)``, ``smp.model_creation(**kw)``).
_ACTIVE_KEYS = {
    "distribute_embedding": "split nn.Embedding layers created here along the vocabulary (default True here; "
    "smp's own default was False)",
}
_INERT_KEYS = frozenset(
    {
        "alibi_bias_max",
        "attention_in_fp32",
        "distribute_memory",
        "flash_attention",
        "fp32_residual_addition",
        "fused_bias_gelu",
        "fused_dropout",
        "fused_softmax",
        "gpt_neox_type_rotary",
        "initializer_range",
        "mask_value",
        "parallel_attn_output",
        "query_key_layer_scaling",
        "rotary_dim",
        "rotary_emb_base",
        "use_alibi",
        "use_normal_initialization",
        "use_positional_embedding",
        "window_size",
        "zero_init",
    }
)


@dataclass(frozen=True)
class CreationSetting:
    """The tensor-parallel setting in force when a module was created."""

    enabled: bool
    options: dict[str, Any] = field(default_factory=dict)  # a plain dict: deepcopy and pickle must work

    @property
    def distribute_embedding(self) -> bool:
        return bool(self.options.get("distribute_embedding", True))


_current: contextvars.ContextVar[CreationSetting | None] = contextvars.ContextVar("smp_tp_creation", default=None)
_hooks_lock = threading.Lock()
_hook_users = 0
_hook_handles: list[Any] = []


def _record(module: nn.Module, *_: Any) -> None:
    setting = _current.get()
    if setting is not None and _ATTRIBUTE not in module.__dict__:
        module.__dict__[_ATTRIBUTE] = setting


@contextmanager
def scope(enabled: bool, options: Mapping[str, Any]) -> Iterator[None]:
    """Modules created inside are tensor-parallel when ``enabled`` (the innermost scope wins)."""
    setting = CreationSetting(bool(enabled), check_options(options))
    global _hook_users
    with _hooks_lock:
        if _hook_users == 0:
            _hook_handles.extend(
                [
                    register_module_module_registration_hook(_record),
                    register_module_parameter_registration_hook(_record),
                ]
            )
        _hook_users += 1
    token = _current.set(setting)
    try:
        yield
    finally:
        _current.reset(token)
        with _hooks_lock:
            _hook_users -= 1
            if _hook_users == 0:
                for handle in _hook_handles:
                    handle.remove()
                _hook_handles.clear()


def creation_setting(module: nn.Module) -> CreationSetting | None:
    """The setting ``module`` was created under, or None if it was created outside every scope."""
    return module.__dict__.get(_ATTRIBUTE)


def set_tensor_parallelism(module: nn.Module, enabled: bool = True, **options: Any) -> None:
    """smp's ``set_tensor_parallelism``: mark ``module`` and its submodules as (not) tensor-parallel, whatever
    scope they were created in. Call it before training starts (before ``Trainer.fit`` reaches the strategy's
    setup)."""
    setting = CreationSetting(bool(enabled), check_options(options))
    for submodule in module.modules():
        submodule.__dict__[_ATTRIBUTE] = setting


def check_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """Validate smp's tensor-parallel keyword arguments: unknown names raise, names without effect warn."""
    options = dict(options)
    known = sorted({*_ACTIVE_KEYS, *_INERT_KEYS})
    for key in options:
        if key not in _ACTIVE_KEYS and key not in _INERT_KEYS:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"accepted names: {', '.join(known)}."
            raise ValueError(f"unknown tensor-parallelism option {key!r}; {hint}")
    inert = sorted(key for key in options if key in _INERT_KEYS)
    if inert:
        warnings.warn(
            f"tensor-parallelism option(s) {', '.join(inert)} have no effect in lightning_smp: they tune smp's own "
            "fused transformer kernels, which lightning_smp does not have (its layers run torch's).",
            UserWarning,
            stacklevel=4,
        )
    if "distribute_embedding" in options and not isinstance(options["distribute_embedding"], bool):
        raise ValueError(f"distribute_embedding={options['distribute_embedding']!r} is not a bool; pass True or False.")
    return options
