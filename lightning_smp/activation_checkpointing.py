"""Activation checkpointing: smp's ``set_activation_checkpointing``, applied when the strategy sets the model up.

A checkpointed module keeps only its inputs from the forward pass and runs its forward again during backward to
rebuild the activations its gradients need: compute traded for memory, the usual trade for large models. Built on
``torch.utils.checkpoint`` in its non-reentrant form, which takes keyword and nested arguments as they are (smp's
``pack_args_as_tuple`` is accepted and not needed). The recomputation draws the same random numbers as the
forward did: from the default generators (``preserve_rng_state``) and from the tensor-parallel dropout stream,
which ``torch.utils.checkpoint`` does not know about. With ``offload_activations`` the inputs a checkpointed forward
keeps wait in host memory until its backward (`activation_offloading`).

`set_activation_checkpointing` only marks a module (call it in ``__init__`` or ``configure_model``); `apply` wraps
the marked modules' forwards at setup, after tensor parallelism has converted its layers (it swaps their class in
place, which a forward wrapped earlier would bypass) and before the pipeline routes the trunk's children (so a
checkpointed child saves the activation its stage received, not the one it would have computed).
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_smp.activation_offloading import ActivationOffloader
from lightning_smp.tensor_parallel.base import TensorParallelModule
from lightning_smp.tensor_parallel.rng import TensorParallelRNG

__all__ = ["apply", "clear_marks", "is_marked", "set_activation_checkpointing", "spans_children"]

_REQUEST = "_smp_activation_checkpointing"
# Every module `apply` has seen: a mark made on one of them later would never be applied.
_set_up: weakref.WeakSet[nn.Module] = weakref.WeakSet()


@dataclass
class _Request:
    preserve_rng_state: bool
    group_size: int | None  # children per checkpoint of an nn.Sequential: 1 ("each"), N ("group_N"), all (None)
    strategy: str
    applied: bool = False


def set_activation_checkpointing(
    module: nn.Module, preserve_rng_state: bool = True, pack_args_as_tuple: bool = False, strategy: str = "each"
) -> None:
    """smp's ``smp.set_activation_checkpointing``: recompute ``module``'s forward in backward instead of keeping
    its activations.

    For an ``nn.Sequential`` (or an ``nn.ModuleList``), ``strategy`` says what one checkpoint spans: "each" child,
    "group_N" (N consecutive children) or the "contiguous" children (all of them; on a pipelined trunk, smp meant
    those of one stage). ``pack_args_as_tuple`` is accepted for smp code; non-reentrant checkpointing needs no
    packing.
    """
    if not isinstance(module, nn.Module):
        raise ValueError(
            f"smp.set_activation_checkpointing takes an nn.Module, got {type(module).__name__}; pass the layer "
            "(or the nn.Sequential of layers) whose activations it should recompute."
        )
    request = _Request(preserve_rng_state, _group_size(strategy), strategy)
    if module in _set_up:
        applied = module.__dict__.get(_REQUEST)
        if applied is not None and (applied.preserve_rng_state, applied.strategy) == (preserve_rng_state, strategy):
            return  # the same mark again: Lightning runs configure_model at every fit / validate / test
        raise RuntimeError(
            f"smp.set_activation_checkpointing({type(module).__name__}) came after the strategy set the model up, "
            "so it would change nothing. Call it where the model is built: in the LightningModule's __init__ or "
            "configure_model."
        )
    object.__setattr__(module, _REQUEST, request)


def is_marked(module: nn.Module) -> bool:
    """Whether `set_activation_checkpointing` marked ``module``."""
    return _REQUEST in module.__dict__


def spans_children(module: nn.Module) -> bool:
    """Whether a mark on ``module`` (an ``nn.Sequential``) puts several of its children in one checkpoint
    ("group_N" with N > 1, "contiguous"; a pipelined trunk's children are checkpointed one by one all the same)."""
    request = module.__dict__.get(_REQUEST)
    return request is not None and request.group_size != 1 and isinstance(module, nn.Sequential)


def clear_marks(model: nn.Module) -> None:
    """Forget the `set_activation_checkpointing` marks of ``model``'s modules not applied yet: the memory planner
    measures on a copy what the marked modules keep without checkpointing (what their backward rebuilds)."""
    for module in model.modules():
        request = module.__dict__.get(_REQUEST)
        if request is not None and not request.applied:
            del module.__dict__[_REQUEST]


def apply(
    model: nn.Module, *, pipelined_trunk: nn.Module | None = None, offloader: ActivationOffloader | None = None
) -> None:
    """Wrap the forward of every module of ``model`` marked by `set_activation_checkpointing` (once each).

    ``pipelined_trunk`` is the container the pipeline will split: its children are checkpointed one by one, as
    each stage runs only its own. ``offloader`` (``offload_activations``) keeps the checkpointed modules' inputs
    in host memory between their forward and their backward.
    """
    if offloader is not None and not any(_REQUEST in module.__dict__ for module in model.modules()):
        raise ValueError(
            "offload_activations=True moves the inputs that checkpointed modules keep for their backward to host "
            f"memory, but no module of {type(model).__name__} is marked for activation checkpointing, so there "
            "is nothing to offload. Mark the layers with smp.set_activation_checkpointing(layer) in the "
            "LightningModule's __init__ or configure_model, or set offload_activations=False."
        )
    _set_up.update(model.modules())
    for name, module in model.named_modules():
        request = module.__dict__.get(_REQUEST)
        if request is None or request.applied:
            continue
        request.applied = True
        if not isinstance(module, nn.Sequential | nn.ModuleList):
            _checkpoint_forward(module, request, offloader)
            continue
        if request.group_size != 1 and (module is pipelined_trunk or isinstance(module, nn.ModuleList)):
            why = "the pipelined trunk" if module is pipelined_trunk else "an nn.ModuleList, which has no forward"
            label = name or type(module).__name__
            rank_zero_warn(
                f"smp.set_activation_checkpointing({label}, strategy={request.strategy!r}): {label} is {why}, so "
                "lightning_smp checkpoints each of its children on its own. The gradients are the same; each "
                "child's input is kept instead of one per group. Pass strategy='each' to silence this."
            )
            request.group_size = 1
        if request.group_size == 1:
            for child in module.children():
                _checkpoint_forward(child, request, offloader)
        else:
            _checkpoint_groups(module, request, offloader)


def _group_size(strategy: str) -> int | None:
    if strategy == "each":
        return 1
    if strategy == "contiguous":
        return None
    match = re.fullmatch(r"group_([1-9][0-9]*)", strategy) if isinstance(strategy, str) else None
    if match is None:
        raise ValueError(
            f"smp.set_activation_checkpointing(strategy={strategy!r}) is not a strategy; use 'each' (every child "
            "its own checkpoint), 'group_N' with N >= 1 (N consecutive children per checkpoint, e.g. 'group_2') "
            "or 'contiguous' (all children in one)."
        )
    return int(match[1])


def _checkpoint_forward(module: nn.Module, request: _Request, offloader: ActivationOffloader | None) -> None:
    streams = _tensor_parallel_streams(module)
    module.forward = _Checkpointed(module.forward, request.preserve_rng_state, streams, offloader)


def _checkpoint_groups(sequential: nn.Sequential, request: _Request, offloader: ActivationOffloader | None) -> None:
    children = list(sequential)
    size = request.group_size or len(children)
    streams = _tensor_parallel_streams(sequential)
    runs = [
        _Checkpointed(
            partial(_run_in_order, children[start : start + size]), request.preserve_rng_state, streams, offloader
        )
        for start in range(0, len(children), size)
    ]
    sequential.forward = partial(_run_in_order, runs)


def _run_in_order(steps: Sequence[Callable[[Any], Any]], input: Any) -> Any:
    for step in steps:
        input = step(input)
    return input


def _tensor_parallel_streams(module: nn.Module) -> list[TensorParallelRNG]:
    """The dropout streams of the tensor-parallel layers inside ``module`` (one per `parallelize` call)."""
    streams = {}
    for layer in module.modules():
        if isinstance(layer, TensorParallelModule) and layer.tp_context is not None:
            streams[id(layer.tp_context.rng)] = layer.tp_context.rng
    return list(streams.values())


class _Checkpointed:
    """A forward run under ``torch.utils.checkpoint`` while autograd records; as it is otherwise (evaluation)."""

    def __init__(
        self,
        forward: Callable[..., Any],
        preserve_rng_state: bool,
        streams: list[TensorParallelRNG],
        offloader: ActivationOffloader | None,
    ):
        self._forward = forward
        self._preserve_rng_state = preserve_rng_state
        self._streams = streams
        self._offloader = offloader

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self._forward(*args, **kwargs)
        # The checkpoint saves its positional tensor arguments through the offloader's hooks; tensors passed by
        # keyword or inside containers stay where they are (torch.utils.checkpoint holds those itself).
        with self._offloader.offloading() if self._offloader is not None else nullcontext():
            return checkpoint(
                self._forward,
                *args,
                use_reentrant=False,
                preserve_rng_state=self._preserve_rng_state,
                context_fn=self._contexts,
                **kwargs,
            )

    def _contexts(self) -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
        """Called at the forward: nothing around it; the recomputation replays the tensor-parallel streams."""
        if not (self._streams and self._preserve_rng_state):
            return nullcontext(), nullcontext()
        return nullcontext(), _Replaying(self._streams, [stream.state_dict() for stream in self._streams])


class _Replaying:
    """Rewinds ``streams`` to their state at the forward for a recomputation, then puts them back. Entered once
    per recomputation: a backward split in two (``pipeline="zero_bubble"``) recomputes twice."""

    def __init__(self, streams: list[TensorParallelRNG], at_forward: list[dict[str, Any]]) -> None:
        self._streams = streams
        self._at_forward = at_forward
        self._now: list[list[dict[str, Any]]] = []

    def __enter__(self) -> None:
        self._now.append([stream.state_dict() for stream in self._streams])
        for stream, state in zip(self._streams, self._at_forward, strict=True):
            stream.load_state_dict(state)

    def __exit__(self, *exc: object) -> None:
        for stream, state in zip(self._streams, self._now.pop(), strict=True):
            stream.load_state_dict(state)
