"""Sequence parallelism (Korthikanti et al. 2022, arXiv 2205.05198): the layers whose norms, dropouts and residual
adds hold 1/tp of the sequence, and the pure decision of which layers run so.

With tensor parallelism alone every rank keeps whole copies of what lies between a row-parallel exit and the next
column-parallel entry (layer norms, dropout masks, residual adds: ``10·s·b·h`` bytes per layer that never shrink
with tp). Under ``sequence_parallel=True`` those regions hold this rank's slice of the sequence: a column-parallel
entry all-gathers the sequence (backward: reduce-scatter) and a row-parallel exit reduce-scatters it (backward:
all-gather), in place of the all-reduces, so the same bytes travel (`comm.py`). Consecutive layers of one
``nn.ModuleList`` / ``nn.Sequential`` form a *region*: its first layer takes its slice of the whole input (no
communication), the layers pass slices to each other (pipeline stages send slices too: 1/tp of the bytes), and its
last layer all-gathers its output, so the code around the layers sees whole activations.

Which layers: ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` split by lightning_smp (sequence dim 1
when ``batch_first``, else 0), and the layers of a Hugging Face transformers model split by its own plan whose blocks
(attention, MLP) meet one level up: a block gathers its hidden states (the first argument, or ``hidden_states``) as
it starts, its row-parallel layers reduce-scatter (sequence dim 1). Inside a region, replicated parameters (norms,
row-parallel biases) see only their slice of the sequence, so their gradients are summed over the group
(`replicated.sum_gradients`; tp-rank 0 still counts them once in the global norm); dropouts draw the mask of the whole
activation from the default generator and keep their slice (`SequenceParallelDropout`), so every rank's generator
stays equal and the masks are those of the run without sequence parallelism. The plan style "sequence_parallel"
(transformers' name) marks a module with replicated parameters that runs on the slice: inside a region as it comes,
elsewhere on a slice it takes and gathers back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from lightning_smp.tensor_parallel.base import (
    SequenceSplit,
    TensorParallel,
    TensorParallelModule,
    WholeTensorParallelModule,
)
from lightning_smp.tensor_parallel.comm import gather_from_region, gather_sequence, split_sequence
from lightning_smp.tensor_parallel.replicated import GradientSummed, sum_gradients
from lightning_smp.tensor_parallel.shard import shard_of

__all__ = [
    "SequenceLayer",
    "SequenceParallelDropout",
    "SequenceParallelLayer",
    "SequenceParallelModule",
    "gather_hidden",
    "gathering_block_class",
    "regions",
    "sequence_parallel_class",
]

_HIDDEN_NAMES = ("hidden_states", "src", "tgt", "x", "input")  # keyword names of a layer's hidden states


class SequenceParallelDropout(WholeTensorParallelModule, nn.Dropout):
    """``nn.Dropout`` on this rank's slice of an activation split over the group: draws the mask of the whole
    activation from the default generator, as every rank does, and keeps its slice."""

    @override
    def forward(self, input: Tensor) -> Tensor:
        tp = self._tp
        if tp is None or tp.sequence is None or not self.training or self.p == 0:
            return super().forward(input)
        dim = tp.sequence.dim
        # F.dropout fills a mask laid out as its input in memory (empty_like): draw on ones of the whole shape laid
        # out as this slice is (dims by decreasing stride), so that each element gets the draw the whole would give
        order = sorted(range(input.dim()), key=lambda d: -input.stride(d))
        whole = [input.shape[d] * (tp.size if d == dim else 1) for d in order]
        ones = torch.ones(whole, dtype=input.dtype, device=input.device)
        noise = F.dropout(ones, self.p, training=True).permute(*sorted(range(input.dim()), key=order.__getitem__))
        kept = noise.chunk(tp.size, dim=dim)[tp.rank] != 0  # this slice's mask, one byte per element
        return _KeptScaled.apply(input, kept, noise.amax())  # = input * noise: amax is the kept value, 1 / (1 - p)


class _KeptScaled(torch.autograd.Function):
    """``where(kept, input * scale, 0)``, keeping the boolean mask (not a mask of the input's dtype) for backward."""

    @staticmethod
    def forward(ctx: Any, input: Tensor, kept: Tensor, scale: Tensor) -> Tensor:
        ctx.save_for_backward(kept, scale)
        return torch.where(kept, input * scale, 0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        kept, scale = ctx.saved_tensors
        return torch.where(kept, grad * scale, 0), None, None


class SequenceParallelLayer(TensorParallelModule):
    """Mixin for a layer of a sequence-parallel region (list it before the layer's class). Once distributed with a
    ``sequence`` setting, its hidden states (the first positional argument, or the keyword ``hidden_states``, ``src``,
    ``tgt``) hold this rank's slice of the sequence; the region's first layer takes that slice itself, its last
    all-gathers its output (the first output when it returns several)."""

    draws_own_dropout: ClassVar[bool] = False
    """Whether the class runs its dropouts itself (then a layer around it leaves them as they are)."""

    @override
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        tp = self._tp
        sequence = tp.sequence if tp is not None else None
        if sequence is None:
            return super().forward(*args, **kwargs)
        group, dim = tp.group, sequence.dim
        hidden = _hidden(args, kwargs)
        if hidden is None or hidden.dim() != 3:
            shape = None if hidden is None else tuple(hidden.shape)
            raise ValueError(
                f"sequence_parallel=True runs {type(self).__name__} on a slice of the sequence, which needs batched "
                f"hidden states (3-D: batch, sequence and features in some order) as its first argument; it got "
                f"{shape}. Add the batch dimension, or set sequence_parallel=False."
            )
        if sequence.input_whole:
            args, kwargs = _replace_hidden(args, kwargs, split_sequence(hidden, group, dim))
        output = super().forward(*args, **kwargs)
        if sequence.output_whole:
            output = _map_first(output, lambda h: gather_from_region(h, group, dim))
        return output

    def _sequence_setup(self, tp: TensorParallel) -> None:
        """Under sequence parallelism: its dropouts draw for the slice, its replicated parameters sum their
        gradients."""
        dropout = tp.with_sequence(SequenceSplit(tp.sequence.dim))
        for module in _own_modules(self):
            if type(module) is nn.Dropout:
                SequenceParallelDropout.tp_convert(module)
                module._tp_distribute(dropout, {})
        sum_gradients(self)

    def _summed_parameters(self) -> Iterable[nn.Parameter]:
        """The replicated parameters of the layer that no module inside it sums itself."""
        summing = [m for m in self.modules() if m is not self and isinstance(m, GradientSummed | SequenceParallelLayer)]
        theirs = {id(p) for module in summing for p in module.parameters()}
        return [p for p in self.parameters() if shard_of(p) is None and id(p) not in theirs]


class SequenceParallelModule(SequenceParallelLayer, WholeTensorParallelModule):
    """A sequence-parallel layer that splits no weight itself (a transformers decoder layer, whose blocks are split
    by the model's plan, or a module of the style "sequence_parallel")."""

    tp_sequence_role: ClassVar[str | None] = "slice"

    @override
    def _tp_distribute(self, tp: TensorParallel, shared: dict[int, nn.Parameter]) -> None:
        self._tp = tp
        if tp.sequence is not None:
            self._sequence_setup(tp)


class _GatheringBlock(WholeTensorParallelModule):
    """Mixin for a block of a transformers layer (its attention or MLP) under sequence parallelism: the hidden states
    arrive as this rank's slice of the sequence and are all-gathered for its column-parallel layers (backward:
    reduce-scattered); its row-parallel layers reduce-scatter their output back to the slice."""

    @override
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        tp = self._tp
        if tp is None or tp.sequence is None:
            return super().forward(*args, **kwargs)
        args, kwargs = gather_hidden(self, tp, args, kwargs)
        return super().forward(*args, **kwargs)


def gather_hidden(
    block: nn.Module, tp: TensorParallel, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``block``'s arguments with its hidden states (the first argument, or ``hidden_states``) all-gathered along
    ``tp.sequence.dim`` (backward: reduce-scattered)."""
    hidden = _hidden(args, kwargs)
    if hidden is None:
        raise ValueError(
            f"sequence_parallel=True gathers the sequence of {type(block).__name__}'s hidden states, its first "
            "argument or its keyword argument hidden_states, but it got neither; set sequence_parallel=False."
        )
    return _replace_hidden(args, kwargs, gather_sequence(hidden, tp.group, tp.sequence.dim))


@functools.cache
def sequence_parallel_class(module_class: type[nn.Module]) -> type[SequenceParallelLayer]:
    """The sequence-parallel class of a layer (or "sequence_parallel"-style module) of ``module_class``."""
    return type(f"SequenceParallel{module_class.__name__}", (SequenceParallelModule, module_class), {})


@functools.cache
def gathering_block_class(module_class: type[nn.Module]) -> type[TensorParallelModule]:
    """The class of an attention or MLP block of ``module_class`` that gathers the sequence as it starts."""
    return type(f"SequenceGathering{module_class.__name__}", (_GatheringBlock, module_class), {})


def _own_modules(layer: nn.Module) -> list[nn.Module]:
    """``layer``'s submodules, leaving out those inside a module that runs its own dropout."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if getattr(child, "draws_own_dropout", False):
                continue
            found.append(child)
            visit(child)

    visit(layer)
    return found


def _hidden(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
    if args:
        return args[0] if isinstance(args[0], Tensor) else None
    name = next((name for name in _HIDDEN_NAMES if name in kwargs), None)
    return kwargs[name] if name is not None and isinstance(kwargs[name], Tensor) else None


def _replace_hidden(args: tuple[Any, ...], kwargs: dict[str, Any], hidden: Tensor) -> tuple[tuple, dict]:
    if args:
        return (hidden, *args[1:]), kwargs
    name = next(name for name in _HIDDEN_NAMES if name in kwargs)
    return args, {**kwargs, name: hidden}


def _map_first(output: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``output`` with ``fn`` applied to it, or to its first element when it is a plain tuple."""
    if isinstance(output, Tensor):
        return fn(output)
    if type(output) is tuple and output and isinstance(output[0], Tensor):
        return (fn(output[0]), *output[1:])
    raise ValueError(
        f"sequence_parallel=True all-gathers the sequence of a layer's output, a tensor or a tuple starting with "
        f"one, but it returned {type(output).__name__}; set sequence_parallel=False."
    )


# -- which layers run sequence-parallel: pure -------------------------------------------------------------------


@dataclass(frozen=True)
class SequenceLayer:
    """A layer of a sequence-parallel region."""

    name: str
    dim: int
    """The sequence dim of its hidden states."""
    blocks: tuple[str, ...] = ()
    """Its blocks that gather the sequence as they start (transformers layers)."""


def regions(layers: Sequence[SequenceLayer], model: nn.Module) -> dict[str, SequenceSplit]:
    """Each layer's `SequenceSplit`: consecutive children of one ``nn.ModuleList`` / ``nn.Sequential`` form a region,
    whose first layer takes its slice of the whole input and whose last gathers its output."""
    by_parent: dict[str, list[tuple[int, SequenceLayer]]] = {}
    alone: list[SequenceLayer] = []
    for layer in layers:
        parent_name, _, leaf = layer.name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if isinstance(parent, nn.ModuleList | nn.Sequential) and leaf.isdigit():
            by_parent.setdefault(parent_name, []).append((int(leaf), layer))
        else:
            alone.append(layer)
    runs: list[list[SequenceLayer]] = [[layer] for layer in alone]
    for members in by_parent.values():
        members.sort(key=lambda item: item[0])
        for position, (index, layer) in enumerate(members):
            if position and index == members[position - 1][0] + 1 and layer.dim == runs[-1][-1].dim:
                runs[-1].append(layer)
            else:
                runs.append([layer])
    splits = {}
    for run in runs:
        for position, layer in enumerate(run):
            splits[layer.name] = SequenceSplit(
                layer.dim, input_whole=position == 0, output_whole=position == len(run) - 1
            )
    return splits
