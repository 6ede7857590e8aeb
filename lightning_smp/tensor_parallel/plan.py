"""Deciding what tensor parallelism splits: pure, over the module tree and the degree; no process group needed.

A *unit* is a module split as a whole: a layer this package can split (``nn.TransformerEncoderLayer``,
``nn.TransformerDecoderLayer``, ``nn.MultiheadAttention``, ``nn.Embedding``) created under
``smp.tensor_parallelism()``, one of our own tensor-parallel modules (always), a module named by a
``tensor_parallel_plan`` pattern, or a module named by the plan of a Hugging Face transformers model created
tensor-parallel (``hf_plan.py``; the user's patterns override its entries). A unit stays whole when a size does not
divide or when one of its weights is shared with a module that would split it differently (or not at all);
automatic and model-plan units then stay replicated with a warning, user plan entries raise, because the user
asked for exactly that split. Model-plan entries that pass a split activation to each other (a "colwise" layer
feeding a "rowwise" one) split together or stay whole together, and so do their neighbours when an entry's style
is one lightning_smp cannot honour. A layer wrapped by peft's adapters (LoRA) that the model's plan would split is
refused: the adapter would need a split of its own, which is not built.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Literal

from torch import nn

from lightning_smp._compat import parameter_table
from lightning_smp.config import TENSOR_PARALLEL_STYLES
from lightning_smp.tensor_parallel import hf_plan
from lightning_smp.tensor_parallel.attention import DistributedMultiheadAttention
from lightning_smp.tensor_parallel.base import SequenceSplit, TensorParallelModule
from lightning_smp.tensor_parallel.creation import creation_setting
from lightning_smp.tensor_parallel.linear import (
    ColumnParallelLinear,
    DistributedLinear,
    GatheredColumnParallelLinear,
    PackedColumnParallelLinear,
    RowParallelLinear,
)
from lightning_smp.tensor_parallel.replicated import GradientSummed, gradient_summed_class
from lightning_smp.tensor_parallel.sequence import (
    SequenceLayer,
    SequenceParallelLayer,
    SequenceParallelModule,
    gathering_block_class,
    regions,
    sequence_parallel_class,
)
from lightning_smp.tensor_parallel.shard import ShardSpec
from lightning_smp.tensor_parallel.transformer import DistributedTransformerDecoderLayer, DistributedTransformerLayer
from lightning_smp.tensor_parallel.vocab import DistributedEmbedding

__all__ = ["TensorParallelPlan", "Unit", "plan_tensor_parallel"]

# torch class -> the tensor-parallel class it becomes, per plan style ("auto": what the context converts);
# transformers' own classes are in hf_layers.LAYERS_BY_STYLE, any class answers to "replicated_with_grad_allreduce"
_AUTOMATIC: dict[type[nn.Module], type[TensorParallelModule]] = {
    nn.TransformerEncoderLayer: DistributedTransformerLayer,
    nn.TransformerDecoderLayer: DistributedTransformerDecoderLayer,
    nn.MultiheadAttention: DistributedMultiheadAttention,
    nn.Embedding: DistributedEmbedding,
}
_BY_STYLE: dict[str, dict[type[nn.Module], type[TensorParallelModule]]] = {
    "auto": _AUTOMATIC,
    "colwise": {nn.Linear: ColumnParallelLinear},
    "colwise_gather_output": {nn.Linear: GatheredColumnParallelLinear},
    "colwise_rep": {nn.Linear: GatheredColumnParallelLinear},
    "rowwise": {nn.Linear: RowParallelLinear},
    "rowwise_split_input": {nn.Linear: DistributedLinear},
    "rowwise_rep": {nn.Linear: DistributedLinear},
    "packed_colwise": {nn.Linear: PackedColumnParallelLinear},
    "vocab": {nn.Embedding: DistributedEmbedding},
    "embedding_rowwise": {nn.Embedding: DistributedEmbedding},
}
# what an already tensor-parallel module must be to answer to a style
_STYLE_BASES: dict[str, type[TensorParallelModule]] = {
    "colwise": ColumnParallelLinear,
    "colwise_gather_output": GatheredColumnParallelLinear,
    "colwise_rep": GatheredColumnParallelLinear,
    "rowwise": RowParallelLinear,
    "rowwise_split_input": DistributedLinear,
    "rowwise_rep": DistributedLinear,
    "packed_colwise": PackedColumnParallelLinear,
    "vocab": DistributedEmbedding,
    "embedding_rowwise": DistributedEmbedding,
    "replicated_with_grad_allreduce": GradientSummed,
    "sequence_parallel": SequenceParallelModule,
}
_LAYER_NUMBER = re.compile(r"(?<=\.)\d+(?=\.|$|\W)")


@dataclass(frozen=True, eq=False)
class Unit:
    """A module split as a whole."""

    name: str
    """Its qualified name in the model ("" for the root)."""
    module: nn.Module
    target: type[TensorParallelModule]
    """The class it has once converted (its own class if it is tensor-parallel already)."""
    source: Literal["plan", "model", "context", "module"]
    """Why it is split: a user plan pattern, the plan of a transformers model, ``smp.tensor_parallelism()``, or its
    own (tensor-parallel) class."""
    sequence: SequenceSplit | None = None
    """How it meets sequence parallelism (`sequence.py`); None: the activations around it are whole."""

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
    sequence_kept: tuple[tuple[str, str], ...] = ()
    """``(layer label, reason)`` of every layer that runs on whole sequences although ``sequence_parallel`` is on."""

    @property
    def sequence_layers(self) -> tuple[Unit, ...]:
        """The layers that run sequence-parallel (each holds its slice of the sequence between its blocks)."""
        return tuple(unit for unit in self.units if issubclass(unit.target, SequenceParallelLayer) and unit.sequence)


def plan_tensor_parallel(
    model: nn.Module, *, tp_size: int, patterns: Mapping[str, str] | None = None, sequence_parallel: bool = False
) -> TensorParallelPlan:
    """Which modules of ``model`` to split ``tp_size`` ways (and, with ``sequence_parallel``, which layers hold a
    slice of the sequence); raises ``ValueError`` for an unusable ``patterns``."""
    found = _find_units(model, dict(patterns or {}))
    units = found.units
    reasons = {id(unit): unit.target.tp_unsplittable(unit.module, tp_size) for unit in units}
    for unit in units:
        if unit.source == "model" and reasons[id(unit)] is None:
            reasons[id(unit)] = _heads_reason(model, unit, tp_size)
    group_reasons: dict[str, tuple[str, str]] = {}
    _hold_linked(found, reasons, group_reasons)
    candidates = [unit for unit in units if reasons[id(unit)] is None]
    for unit, reason in _shared_weight_conflicts(model, candidates).items():
        reasons[id(unit)] = reason
    _hold_linked(found, reasons, group_reasons)
    refused = [f"{unit.label}: {reasons[id(unit)]}" for unit in units if unit.source == "plan" and reasons[id(unit)]]
    if refused:
        raise ValueError(
            f"tensor_parallel_plan cannot split {len(refused)} module(s) {tp_size} ways: " + "; ".join(refused) + ". "
            "Make the sizes divisible by tensor_parallel_degree, untie the weight (or give every module that "
            "shares it the same split), or remove the entry."
        )
    kept = [(unit.label, reasons[id(unit)]) for unit in units if unit.source != "model" and reasons[id(unit)]]
    kept += _model_groups_kept(found, group_reasons)
    split = tuple(unit for unit in units if reasons[id(unit)] is None)
    specs = {
        f"{unit.name}.{name}" if unit.name else name: spec
        for unit in split
        for name, spec in unit.target.tp_shard_specs(unit.module).items()
    }
    split, sequence_kept = _plan_sequence(model, found, split, sequence_parallel and tp_size > 1)
    return TensorParallelPlan(
        units=split,
        kept_whole=tuple(kept),
        created_tensor_parallel=found.created,
        sharded_specs=specs,
        sequence_kept=tuple(sequence_kept),
    )


def match_pattern(pattern: str, name: str) -> bool:
    """Whether module path ``name`` matches ``pattern``: dotted, ``*`` / ``?`` / ``[..]`` within one component."""
    parts, pattern_parts = name.split("."), pattern.split(".")
    return len(parts) == len(pattern_parts) and all(map(fnmatchcase, parts, pattern_parts))


@dataclass
class _Found:
    """What `_find_units` found: the units, and for units from a transformers model's plan the group each splits
    with (``links``) and the plan entries that cannot be honoured (``refused``: label, group, reason)."""

    units: list[Unit]
    created: int
    links: dict[str, str]
    refused: list[tuple[str, str, str]]


def _user_styles(names: list[str], patterns: dict[str, str]) -> dict[str, str]:
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
    return styles


def _model_styles(
    model: nn.Module, names: list[str]
) -> tuple[dict[str, tuple[str, str]], set[str], list[tuple[str, str, str]]]:
    """Module name -> (style, link group) from the plans of the transformers models created tensor-parallel (the
    outermost one of a nesting), the names of those models, and the entries that name a parameter (refused)."""
    styles: dict[str, tuple[str, str]] = {}
    roots: set[str] = set()
    refused: list[tuple[str, str, str]] = []
    for root_name, root in model.named_modules():
        if any(not r or root_name.startswith(f"{r}.") for r in roots) or not hf_plan.is_transformers_model(root):
            continue
        setting = creation_setting(root)
        plan = hf_plan.model_plan(root) if setting is not None and setting.enabled else None
        if plan is None:
            continue
        roots.add(root_name)
        prefix = f"{root_name}." if root_name else ""
        modules = [name for name in names if name.startswith(prefix)]
        parameters = [f"{prefix}{name}" for name, _ in root.named_parameters()]
        for pattern, style in plan.entries.items():
            for name in modules:
                if match_pattern(prefix + pattern, name):
                    styles.setdefault(name, (style, hf_plan.link_key(name, style, plan.link_up)))
            if style == "replicate":
                continue
            for name in parameters:
                if match_pattern(prefix + pattern, name):
                    owner = name.rpartition(".")[0]
                    group = hf_plan.link_key(owner, style, plan.link_up)
                    refused.append((name, group, f"its plan entry {pattern!r}: {style!r} names a parameter"))
    return styles, roots, refused


def _find_units(model: nn.Module, patterns: dict[str, str]) -> _Found:
    names = [name for name, _ in model.named_modules() if name]
    styles = _user_styles(names, patterns)
    model_styles, roots, refused = _model_styles(model, names)
    units: list[Unit] = []
    links: dict[str, str] = {}
    seen: set[int] = set()
    reached: set[str] = set()
    created = 0

    def visit(module: nn.Module, name: str, automatic: bool) -> None:
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
        if name in model_styles:
            model_style, group = model_styles[name]
            if model_style == "replicate":
                return
            if hf_plan.is_adapter_layer(module):
                # every layer's parent, not only this one's: the pattern a user puts in tensor_parallel_plan
                parent = re.sub(r"(?<=\.)\d+(?=\.)", "*", name.rpartition(".")[0])
                raise ValueError(
                    f"LoRA under tensor parallelism is not supported: {name} is a {type(module).__module__}."
                    f"{type(module).__qualname__}, peft's adapter around a layer the model's tensor-parallel plan "
                    f"splits ({model_style!r}), and the adapter's low-rank product would need a split of its own. "
                    "Train the adapters with pipeline_parallel_degree, sharded_data_parallel_degree or data "
                    "parallelism (tensor_parallel_degree=1), or keep the wrapped layers whole: "
                    f"tensor_parallel_plan={{{parent!r}: 'replicate'}}."
                )
            target = _lookup_target(module, model_style) if model_style in hf_plan.HONOURED_STYLES else None
            if target is None:
                refused.append((f"{name} ({type(module).__name__})", group, _unhonoured(module, model_style)))
            else:
                units.append(Unit(name, module, target, "model"))
                links[name] = group
            return
        setting = creation_setting(module)
        if setting is not None and setting.enabled:
            created += 1
            target = _AUTOMATIC.get(type(module)) if automatic else None
            if target is not None and (target is not DistributedEmbedding or setting.distribute_embedding):
                units.append(Unit(name, module, target, "context"))
                return
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name, automatic and name not in roots)

    visit(model, "", "" not in roots)
    unreached = sorted(set(styles) - reached)
    if unreached:
        raise ValueError(
            f"tensor_parallel_plan names {', '.join(map(repr, unreached))}, inside a module that is already split "
            "as a whole (created under smp.tensor_parallelism() or tensor-parallel itself). Remove those entries, "
            "or give the enclosing module the style 'replicate' and plan its parts."
        )
    return _Found(units, created, links, refused)


def _lookup_target(module: nn.Module, style: str) -> type[TensorParallelModule] | None:
    """The tensor-parallel class ``module`` becomes under ``style``, or None when the style does not apply to it."""
    if isinstance(module, TensorParallelModule):
        base = _STYLE_BASES.get(style)
        return type(module) if style == "auto" or (base is not None and isinstance(module, base)) else None
    if style == "replicated_with_grad_allreduce":
        return gradient_summed_class(type(module))
    if style == "sequence_parallel":
        return sequence_parallel_class(type(module))
    own = _BY_STYLE.get(style, {}).get(type(module))
    return own or hf_plan.layers_by_style().get(style, {}).get(type(module))


def _target_for_style(module: nn.Module, name: str, style: str) -> type[TensorParallelModule]:
    if style not in TENSOR_PARALLEL_STYLES:  # SMPConfig checks this; a direct caller may not have
        raise ValueError(f"unknown tensor-parallel style {style!r}; use one of {', '.join(TENSOR_PARALLEL_STYLES)}.")
    target = _lookup_target(module, style)
    if target is not None:
        return target
    classes = [*_BY_STYLE.get(style, {}), *hf_plan.layers_by_style().get(style, {})]
    accepted = ", ".join(cls.__name__ for cls in classes)
    raise ValueError(
        f"tensor_parallel_plan gives {name!r} the style {style!r}, but it is a {type(module).__name__}; {style!r} "
        f"applies to exactly {accepted} (not subclasses, whose forward may differ) or to the matching "
        "lightning_smp tensor-parallel module."
    )


def _unhonoured(module: nn.Module, style: str) -> str:
    if style not in hf_plan.HONOURED_STYLES:
        return f"lightning_smp cannot honour its plan style {style!r}"
    return f"its plan style {style!r} does not apply to a {type(module).__name__}"


def _heads_reason(model: nn.Module, unit: Unit, tp_size: int) -> str | None:
    """Whether a projection of a transformers attention layer splits into whole heads (grouped-query attention has
    fewer key/value heads than query heads: its k and v projections may not split where q does)."""
    parent = model.get_submodule(unit.name.rpartition(".")[0])
    target = unit.target
    if issubclass(target, PackedColumnParallelLinear):
        return None
    if issubclass(target, ColumnParallelLinear) and not target.gather_output:
        return hf_plan.heads_reason(parent, unit.module.out_features, tp_size, "out_features")
    if issubclass(target, RowParallelLinear) and target.input_is_parallel:
        return hf_plan.heads_reason(parent, unit.module.in_features, tp_size, "in_features")
    return None


def _hold_linked(found: _Found, reasons: dict[int, str | None], group_reasons: dict[str, tuple[str, str]]) -> None:
    """Keep every model-plan unit of a group whole when one of them (or a refused entry) stays whole, and record
    in ``group_reasons`` why each such group does: the first module found whole, and why."""
    members: dict[str, list[Unit]] = {}
    for unit in found.units:
        if unit.source == "model":
            members.setdefault(found.links[unit.name], []).append(unit)
    for label, group, reason in found.refused:
        group_reasons.setdefault(group, (label, reason))
    for group, units in members.items():
        if group not in group_reasons:
            whole = next((unit for unit in units if reasons[id(unit)] is not None), None)
            if whole is None:
                continue
            group_reasons[group] = (whole.label, reasons[id(whole)])
        for unit in units:
            if reasons[id(unit)] is None:
                reasons[id(unit)] = f"it splits together with {group}, which stays whole"


def _model_groups_kept(found: _Found, group_reasons: dict[str, tuple[str, str]]) -> list[tuple[str, str]]:
    """One ``(label, reason)`` per group kept whole, with layer numbers as ``*`` so that a layer stack reads once."""
    parts: dict[str, list[str]] = {}
    for unit in found.units:
        group = found.links.get(unit.name)
        if unit.source == "model" and group in group_reasons:
            parts.setdefault(group, []).append(unit.name)
    for label, group, _ in found.refused:
        parts.setdefault(group, []).append(label.split(" ")[0])
    kept: dict[str, str] = {}
    for group, (whole, reason) in group_reasons.items():
        leaves = sorted({name[len(group) + 1 :] if group and name != group else name for name in parts[group]})
        if len(leaves) > 1:  # name the group, then the module that keeps it whole
            whole, reason = f"{group}.{{{', '.join(leaves)}}}".lstrip("."), f"{whole}: {reason}"
        kept.setdefault(_LAYER_NUMBER.sub("*", whole), _LAYER_NUMBER.sub("*", reason))
    return list(kept.items())


def _shared_weight_conflicts(model: nn.Module, units: list[Unit]) -> dict[Unit, str]:
    """Units that must stay whole because a weight they would split is used elsewhere in another way."""
    # every place a parameter is registered: (owner module id, attribute) -> printable name
    places: dict[int, dict[tuple[int, str], str]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr, param in parameter_table(module).items():
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
                for attr, param in parameter_table(sub).items():
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


# -- sequence parallelism ---------------------------------------------------------------------------------------

_HF_SEQUENCE_DIM = 1  # transformers' hidden states are (batch, sequence, features)


def _plan_sequence(
    model: nn.Module, found: _Found, split: tuple[Unit, ...], enabled: bool
) -> tuple[tuple[Unit, ...], list[tuple[str, str]]]:
    """``split`` with the sequence splits set (and the transformers layers and blocks that take part added) and the
    layers that stay on whole sequences, with why. Modules of the style "sequence_parallel" always take part."""
    layers: list[SequenceLayer] = []
    kept: list[tuple[str, str]] = []
    if enabled:
        for unit in split:
            if isinstance(unit.module, nn.TransformerEncoderLayer | nn.TransformerDecoderLayer):
                layers.append(SequenceLayer(unit.name, 1 if unit.module.self_attn.batch_first else 0))
        hf_layers, kept = _transformers_layers(model, found, split)
        layers += hf_layers
    splits = regions(layers, model)
    blocks = {block: layer for layer in layers for block in layer.blocks}
    in_layer = {unit.name: _enclosing(unit.name, splits) for unit in split}
    planned = []
    for unit in split:
        layer = in_layer[unit.name]
        if unit.name in splits:
            planned.append(dataclasses.replace(unit, sequence=splits[unit.name]))
        elif issubclass(unit.target, SequenceParallelModule):  # style "sequence_parallel"
            alone = layer is None
            sequence = SequenceSplit(_HF_SEQUENCE_DIM, input_whole=alone, output_whole=alone)
            planned.append(dataclasses.replace(unit, sequence=sequence))
        elif layer is not None and unit.target.tp_sequence_role in ("column", "row", "block"):
            gathered = _enclosing(unit.name, blocks) is not None and unit.target.tp_sequence_role == "column"
            planned.append(dataclasses.replace(unit, sequence=SequenceSplit(_HF_SEQUENCE_DIM, input_whole=gathered)))
        else:
            planned.append(unit)
    for block in blocks:
        module = model.get_submodule(block)
        target = gathering_block_class(type(module))
        planned.append(Unit(block, module, target, "model", SequenceSplit(_HF_SEQUENCE_DIM)))
    for layer in layers:
        module = model.get_submodule(layer.name)
        if not isinstance(module, SequenceParallelLayer):  # a transformers layer: it becomes one
            planned.append(Unit(layer.name, module, sequence_parallel_class(type(module)), "model", splits[layer.name]))
    return tuple(planned), kept


def _transformers_layers(
    model: nn.Module, found: _Found, split: tuple[Unit, ...]
) -> tuple[list[SequenceLayer], list[tuple[str, str]]]:
    """The layers of transformers models whose every plan entry splits in a way sequence parallelism can run, and
    (label, reason) for the layers that cannot."""
    split_names = {unit.name for unit in split}
    by_layer: dict[str, list[Unit]] = {}
    for unit in found.units:
        if unit.source != "model":
            continue
        layer = _layer_of(model, found.links.get(unit.name, unit.name))
        if layer is not None:
            by_layer.setdefault(layer, []).append(unit)
    layers, kept = [], []
    for name, units in by_layer.items():
        reason, blocks = None, set()
        for unit in units:
            group = found.links.get(unit.name, unit.name)
            depth = unit.name.count(".") - group.count(".")
            role = unit.target.tp_sequence_role
            if unit.name not in split_names:
                reason = f"its {unit.label} stays whole"
            elif depth > 1:
                reason = f"its plan's blocks meet {depth} levels above their layers, where a residual may be added"
            elif role is None:
                reason = f"its {unit.label} needs whole sequences"
            elif depth == 1 and group != name:
                blocks.add(group)
            if reason is not None:
                break
        if reason is None and any(isinstance(model.get_submodule(b), TensorParallelModule) for b in blocks):
            reason = "a block of it is split as a whole"
        module = model.get_submodule(name)
        if reason is not None:
            kept.append((_LAYER_NUMBER.sub("*", f"{name} ({type(module).__name__})"), _LAYER_NUMBER.sub("*", reason)))
        else:
            layers.append(SequenceLayer(name, _HF_SEQUENCE_DIM, tuple(sorted(blocks))))
    return layers, list(dict.fromkeys(kept))


def _layer_of(model: nn.Module, name: str) -> str | None:
    """The nearest module at or above ``name`` that is a child of an ``nn.ModuleList`` / ``nn.Sequential``."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        parent = ".".join(parts[: end - 1])
        if isinstance(model.get_submodule(parent), nn.ModuleList | nn.Sequential) and parts[end - 1].isdigit():
            return ".".join(parts[:end])
    return None


def _enclosing(name: str, candidates: Mapping[str, object]) -> str | None:
    """The candidate that is ``name`` or one of its ancestors, if any."""
    parts = name.split(".")
    return next(
        (".".join(parts[:end]) for end in range(len(parts), 0, -1) if ".".join(parts[:end]) in candidates), None
    )
