"""Deciding what tensor parallelism splits: pure, over the module tree and the degree; no process group needed.

A *unit* is a module split as a whole: a layer this package can split (``nn.TransformerEncoderLayer``,
``nn.TransformerDecoderLayer``, ``nn.MultiheadAttention``, ``nn.Embedding``) created under
``smp.tensor_parallelism()``, one of our own tensor-parallel modules (always), or a module named by a
``tensor_parallel_plan`` pattern. A unit stays whole when a size does not divide or when one of its weights is
shared with a module that would split it differently (or not at all); automatic units then stay replicated with a
warning, plan entries raise, because the user asked for exactly that split.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Literal

from torch import nn

from lightning_smp.config import TENSOR_PARALLEL_STYLES
from lightning_smp.tensor_parallel.attention import DistributedMultiheadAttention
from lightning_smp.tensor_parallel.base import TensorParallelModule
from lightning_smp.tensor_parallel.creation import creation_setting
from lightning_smp.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear
from lightning_smp.tensor_parallel.shard import ShardSpec
from lightning_smp.tensor_parallel.transformer import DistributedTransformerDecoderLayer, DistributedTransformerLayer
from lightning_smp.tensor_parallel.vocab import DistributedEmbedding

__all__ = ["TensorParallelPlan", "Unit", "plan_tensor_parallel"]

# torch class -> the tensor-parallel class it becomes, per plan style ("auto": what the context converts)
_AUTOMATIC: dict[type[nn.Module], type[TensorParallelModule]] = {
    nn.TransformerEncoderLayer: DistributedTransformerLayer,
    nn.TransformerDecoderLayer: DistributedTransformerDecoderLayer,
    nn.MultiheadAttention: DistributedMultiheadAttention,
    nn.Embedding: DistributedEmbedding,
}
_BY_STYLE: dict[str, dict[type[nn.Module], type[TensorParallelModule]]] = {
    "auto": _AUTOMATIC,
    "colwise": {nn.Linear: ColumnParallelLinear},
    "rowwise": {nn.Linear: RowParallelLinear},
    "vocab": {nn.Embedding: DistributedEmbedding},
}
# what an already tensor-parallel module must be to answer to a style
_STYLE_BASES: dict[str, type[TensorParallelModule]] = {
    "colwise": ColumnParallelLinear,
    "rowwise": RowParallelLinear,
    "vocab": DistributedEmbedding,
}


@dataclass(frozen=True, eq=False)
class Unit:
    """A module split as a whole."""

    name: str
    """Its qualified name in the model ("" for the root)."""
    module: nn.Module
    target: type[TensorParallelModule]
    """The class it has once converted (its own class if it is tensor-parallel already)."""
    source: Literal["plan", "context", "module"]
    """Why it is split: a plan pattern, ``smp.tensor_parallelism()``, or its own (tensor-parallel) class."""

    @property
    def label(self) -> str:
        return f"{self.name or '<root>'} ({type(self.module).__name__})"


@dataclass(frozen=True)
class TensorParallelPlan:
    units: tuple[Unit, ...]
    """The modules to split, in module order."""
    kept_whole: tuple[tuple[str, str], ...] = ()
    """``(module label, reason)`` of every automatic unit that stays replicated."""
    created_tensor_parallel: int = 0
    """How many modules were created with tensor parallelism enabled."""
    sharded_specs: dict[str, ShardSpec] = field(default_factory=dict)
    """Qualified parameter name -> its split, for every parameter the plan shards."""


def plan_tensor_parallel(
    model: nn.Module, *, tp_size: int, patterns: Mapping[str, str] | None = None
) -> TensorParallelPlan:
    """Which modules of ``model`` to split ``tp_size`` ways; raises ``ValueError`` for an unusable ``patterns``."""
    patterns = dict(patterns or {})
    units, created = _find_units(model, patterns)
    reasons = {id(unit): unit.target.tp_unsplittable(unit.module, tp_size) for unit in units}
    candidates = [unit for unit in units if reasons[id(unit)] is None]
    for unit, reason in _shared_weight_conflicts(model, candidates).items():
        reasons[id(unit)] = reason
    refused = [f"{unit.label}: {reasons[id(unit)]}" for unit in units if unit.source == "plan" and reasons[id(unit)]]
    if refused:
        raise ValueError(
            f"tensor_parallel_plan cannot split {len(refused)} module(s) {tp_size} ways: " + "; ".join(refused) + ". "
            "Make the sizes divisible by tensor_parallel_degree, untie the weight (or give every module that "
            "shares it the same split), or remove the entry."
        )
    kept = tuple((unit.label, reasons[id(unit)]) for unit in units if reasons[id(unit)] is not None)
    split = tuple(unit for unit in units if reasons[id(unit)] is None)
    specs = {
        f"{unit.name}.{name}" if unit.name else name: spec
        for unit in split
        for name, spec in unit.target.tp_shard_specs(unit.module).items()
    }
    return TensorParallelPlan(units=split, kept_whole=kept, created_tensor_parallel=created, sharded_specs=specs)


def match_pattern(pattern: str, name: str) -> bool:
    """Whether module path ``name`` matches ``pattern``: dotted, ``*`` / ``?`` / ``[..]`` within one component."""
    parts, pattern_parts = name.split("."), pattern.split(".")
    return len(parts) == len(pattern_parts) and all(map(fnmatchcase, parts, pattern_parts))


def _find_units(model: nn.Module, patterns: dict[str, str]) -> tuple[list[Unit], int]:
    names = [name for name, _ in model.named_modules() if name]
    styles: dict[str, str] = {}
    for pattern, style in patterns.items():
        matched = [name for name in names if match_pattern(pattern, name)]
        if not matched:
            depth = pattern.count(".")
            close = difflib.get_close_matches(pattern, [n for n in names if n.count(".") == depth] or names, n=3)
            hint = f"close module names: {', '.join(close)}" if close else "print(model) shows the module names"
            raise ValueError(f"tensor_parallel_plan pattern {pattern!r} matches no module of the model; {hint}.")
        for name in matched:
            if styles.setdefault(name, style) != style:
                raise ValueError(
                    f"module {name!r} is matched by several tensor_parallel_plan patterns with different styles "
                    f"({styles[name]!r} and {style!r}); make the patterns name it once."
                )
    units: list[Unit] = []
    seen: set[int] = set()
    reached: set[str] = set()
    created = 0

    def visit(module: nn.Module, name: str) -> None:
        nonlocal created
        if id(module) in seen:
            return
        seen.add(id(module))
        style = styles.get(name)
        if style is not None:
            reached.add(name)
            if style == "replicate":
                return
            units.append(Unit(name, module, _target_for_style(module, name, style), "plan"))
            return
        if isinstance(module, TensorParallelModule):
            if not module.tp_distributed:
                units.append(Unit(name, module, type(module), "module"))
            return
        setting = creation_setting(module)
        if setting is not None and setting.enabled:
            created += 1
            target = _AUTOMATIC.get(type(module))
            if target is not None and (target is not DistributedEmbedding or setting.distribute_embedding):
                units.append(Unit(name, module, target, "context"))
                return
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name)

    visit(model, "")
    unreached = sorted(set(styles) - reached)
    if unreached:
        raise ValueError(
            f"tensor_parallel_plan names {', '.join(map(repr, unreached))}, inside a module that is already split "
            "as a whole (created under smp.tensor_parallelism() or tensor-parallel itself). Remove those entries, "
            "or give the enclosing module the style 'replicate' and plan its parts."
        )
    return units, created


def _target_for_style(module: nn.Module, name: str, style: str) -> type[TensorParallelModule]:
    if style not in TENSOR_PARALLEL_STYLES:  # SMPConfig checks this; a direct caller may not have
        raise ValueError(f"unknown tensor-parallel style {style!r}; use one of {', '.join(TENSOR_PARALLEL_STYLES)}.")
    if isinstance(module, TensorParallelModule):
        base = _STYLE_BASES.get(style)
        if style == "auto" or (base is not None and isinstance(module, base)):
            return type(module)
    else:
        target = _BY_STYLE[style].get(type(module))
        if target is not None:
            return target
    accepted = ", ".join(f"{cls.__name__}" for cls in _BY_STYLE[style])
    raise ValueError(
        f"tensor_parallel_plan gives {name!r} the style {style!r}, but it is a {type(module).__name__}; {style!r} "
        f"applies to exactly {accepted} (not subclasses, whose forward may differ) or to the matching "
        "lightning_smp tensor-parallel module."
    )


def _shared_weight_conflicts(model: nn.Module, units: list[Unit]) -> dict[Unit, str]:
    """Units that must stay whole because a weight they would split is used elsewhere in another way."""
    # every place a parameter is registered: (owner module id, attribute) -> printable name
    places: dict[int, dict[tuple[int, str], str]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is not None:
                label = f"{module_name}.{attr}" if module_name else attr
                places.setdefault(id(param), {}).setdefault((id(module), attr), f"{label} ({type(module).__name__})")
    blocked: dict[Unit, str] = {}
    while True:
        split_as: dict[tuple[int, str], tuple[Unit, ShardSpec | None]] = {}
        for unit in units:
            if unit in blocked:
                continue
            specs = unit.target.tp_shard_specs(unit.module)
            for sub_name, sub in unit.module.named_modules():
                for attr, param in sub._parameters.items():
                    if param is not None:
                        split_as[(id(sub), attr)] = (unit, specs.get(f"{sub_name}.{attr}" if sub_name else attr))
        newly = {}
        for where in places.values():
            if len(where) < 2:
                continue
            ways = {split_as.get(place, (None, None))[1] for place in where}
            if len(ways) < 2:
                continue
            for place in where:
                unit = split_as.get(place, (None, None))[0]
                if unit is not None and unit not in newly:
                    others = [label for other, label in where.items() if other != place]
                    newly[unit] = f"its weight {where[place].split(' ')[0]} is shared with {', '.join(others)}"
        if not newly:
            return blocked
        blocked.update(newly)
