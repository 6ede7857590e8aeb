"""Building the model as smp code does: ``smp.model_creation`` / ``smp.tensor_parallelism`` (which modules tensor
parallelism splits, and delayed initialisation), ``smp.partition`` / ``smp.set_partition`` (pipeline placement),
``smp.set_activation_checkpointing``; each records a mark the strategy reads when it builds the layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_smp import activation_checkpointing as _activation_checkpointing
from lightning_smp.delayed_init import deferred_init
from lightning_smp.pipeline import partition as _placement
from lightning_smp.smp.script import running_script
from lightning_smp.tensor_parallel import creation as _tp_creation

__all__ = [
    "delay_param_initialization",
    "model_creation",
    "partition",
    "set_activation_checkpointing",
    "set_partition",
    "tensor_parallelism",
    "tp_register",
    "tp_register_with_module",
]


@contextmanager
def tensor_parallelism(enabled: bool = True, **tp_config: Any) -> Generator[None, None, None]:
    """Modules created inside are distributed over the tensor-parallel ranks (the innermost context wins)."""
    with _tp_creation.scope(enabled, tp_config):
        yield


@contextmanager
def model_creation(
    tensor_parallelism: bool = False, dtype: torch.dtype | None = None, **tp_config: Any
) -> Generator[None, None, None]:
    """smp's ``model_creation``: create parameters in ``dtype`` and, optionally, tensor-parallel. In an smp script
    whose config sets ``delayed_parameter_initialization``, on the meta device too, as smp's did (under a Trainer
    the strategy's ``configure_model`` context does that)."""
    script = running_script()
    delayed = script is not None and not script.attached and script.config.delayed_parameter_initialization
    previous_dtype = torch.get_default_dtype()
    with _tp_creation.scope(tensor_parallelism, tp_config), deferred_init() if delayed else contextlib.nullcontext():
        if dtype is not None:
            torch.set_default_dtype(dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous_dtype)


@contextmanager
def delay_param_initialization(enabled: bool = True) -> Generator[None, None, None]:
    """smp's ``smp.delay_param_initialization``: modules created inside get no memory (meta tensors whose
    initialisation is recorded) until the strategy sets the model up and materialises, per rank, only what the rank
    keeps, with the values an eager build with the same seed gives (`delayed_init`). Works in ``configure_model``
    and in ``__init__``; ``enabled=False`` builds as usual."""
    if not enabled:
        yield
        return
    with deferred_init():
        yield


# -- pipeline placement ----------------------------------------------------------------------------------------


def partition(index: int) -> contextlib.AbstractContextManager[None]:
    """smp's ``with smp.partition(i):``: modules created inside run on pipeline stage ``i`` (read when
    ``auto_partition=False``). Works before the run starts, e.g. in ``__init__``."""
    return _placement.partition(index)


def set_partition(module: torch.nn.Module, index: int) -> None:
    """smp's ``smp.set_partition(module, i)``: run ``module`` on stage ``i``: a child of the pipelined trunk (read when
    ``auto_partition=False``), or a module outside the trunk on the first stage (0, before the trunk) or the last
    (after it), where its registration order would place it on the other side."""
    _placement.set_partition(module, index)


# -- memory --------------------------------------------------------------------------------------------------------


def set_activation_checkpointing(
    module: torch.nn.Module, preserve_rng_state: bool = True, pack_args_as_tuple: bool = False, strategy: str = "each"
) -> None:
    """smp's ``smp.set_activation_checkpointing``: ``module`` recomputes its forward in backward instead of keeping
    its activations; for an ``nn.Sequential``, ``strategy`` ("each", "group_N", "contiguous") groups its children.
    Works before the run starts, e.g. in ``__init__``; applied when the strategy sets the model up."""
    _activation_checkpointing.set_activation_checkpointing(module, preserve_rng_state, pack_args_as_tuple, strategy)


def tp_register(dist_module: Any, init_hook: Any = None, forward_hook: Any = None, return_hook: Any = None) -> Any:
    """smp's ``@smp.tp_register(smp.nn.DistributedX)`` paired a custom module with one of smp's distributed modules;
    lightning_smp splits modules by plan instead."""
    raise RuntimeError(_TP_REGISTER_INSTEAD.format(call="smp.tp_register"))


def tp_register_with_module(module_cls: Any, dist_module: Any, *args: Any, **kwargs: Any) -> None:
    """smp's ``smp.tp_register_with_module``: see `tp_register`."""
    raise RuntimeError(_TP_REGISTER_INSTEAD.format(call="smp.tp_register_with_module"))


_TP_REGISTER_INSTEAD = (
    "{call}() is not needed with lightning_smp: modules are split by plan, not by registered smp.nn modules. Name "
    "the custom module's layers in SMPStrategy(tensor_parallel_plan={{'blocks.*.fc': 'colwise', 'blocks.*.proj': "
    "'rowwise'}}) (docs/tensor-parallelism.md, Plan styles), or build it from torch layers lightning_smp splits by "
    "itself (nn.TransformerEncoderLayer, nn.MultiheadAttention, nn.Embedding) under "
    "smp.model_creation(tensor_parallelism=True); then remove the {call} call."
)
