"""Where the pipeline cuts the model: trunk discovery, the cost model, manual placement, the partition table.

Owns the planning half of pipeline parallelism, as pure functions over sizes and names (plus two read-only
walks over the module: `find_trunk` and `describe_children`): which sequential container is the trunk, how
many of its children each stage (chunk) holds — balanced by a cost model mixing compute and memory with smp's
``memory_weight``, given as ``partition`` sizes, or read from ``smp.partition`` / ``smp.set_partition`` tags —
where the modules outside the trunk live (`plan_outside`: before it on the first stage, after it on the last,
tied parameters on both; by registration order, or ``smp.set_partition``), and the table printed at setup.
`stage.py` and `runtime.py` execute it.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from lightning_smp.config import SMPConfig

__all__ = [
    "ChildCost",
    "OutsidePlan",
    "PartitionPlan",
    "assigned_partition",
    "balance",
    "child_weights",
    "describe_children",
    "find_trunk",
    "partition",
    "plan_configured_partition",
    "plan_outside",
    "plan_partition",
    "set_partition",
    "sizes_from_assignment",
]

# Bytes of training state per parameter, for the table's estimate: weight + grad in the parameter dtype, an
# fp32 master when that dtype is 16-bit, and two fp32 Adam moments.
_ADAM_STATE_BYTES = 8


@dataclass(frozen=True, slots=True)
class ChildCost:
    """What the planner knows of one trunk child."""

    name: str
    """Its qualified name in the LightningModule, e.g. "model.blocks.3"."""
    params: int
    """Number of parameters it holds."""
    param_bytes: int = 0
    """Bytes of those parameters in their dtype."""
    flops: float | None = None
    """Forward FLOPs per sample, when measured (``example_input_array``); None: estimated from ``params``."""
    activation_bytes: int | None = None
    """Bytes of its output on ``example_input_array`` (kept for backward), when measured; None: unknown (0)."""


@dataclass(frozen=True, slots=True)
class PartitionPlan:
    """The trunk's children split into ``stages * chunks_per_stage`` consecutive chunks; chunk ``c`` runs on
    stage ``c % stages``."""

    trunk: str
    children: tuple[ChildCost, ...]
    sizes: tuple[int, ...]
    stages: int
    method: str
    chunks_per_stage: int = 1

    def __post_init__(self) -> None:
        if len(self.sizes) != self.stages * self.chunks_per_stage or sum(self.sizes) != len(self.children):
            raise ValueError(f"sizes {self.sizes} do not split {len(self.children)} children into chunks")

    @property
    def num_chunks(self) -> int:
        return len(self.sizes)

    def chunk_range(self, chunk: int) -> range:
        """Indices of the trunk children in ``chunk``."""
        start = sum(self.sizes[:chunk])
        return range(start, start + self.sizes[chunk])

    def chunks_of(self, stage: int) -> tuple[int, ...]:
        return tuple(range(stage, self.num_chunks, self.stages))

    def stage_of(self, child: int) -> int:
        start = 0
        for chunk, size in enumerate(self.sizes):
            if start <= child < start + size:
                return chunk % self.stages
            start += size
        raise IndexError(f"the trunk has no child {child}")

    def owned(self, stage: int) -> tuple[int, ...]:
        """Indices of the trunk children held by ``stage``."""
        return tuple(i for chunk in self.chunks_of(stage) for i in self.chunk_range(chunk))

    def table(self, *, outside: Sequence[int] | None = None, bytes_per_param: float = 4.0) -> str:
        """The partition table: one row per stage with its children, parameters and estimated memory;
        ``outside``: per stage, the parameters it holds outside the trunk (`OutsidePlan.params_per_stage`)."""
        header = ("stage", "trunk children", "params", "est. memory")
        rows = []
        for stage in range(self.stages):
            owned = self.owned(stage)
            names = ", ".join(_span(self.children, self.chunk_range(c)) for c in self.chunks_of(stage))
            params = sum(self.children[i].params for i in owned) + (outside[stage] if outside else 0)
            extra = []
            if stage == 0:
                extra.append("modules before the trunk")
            if stage == self.stages - 1:
                extra.append("modules after the trunk")
            if extra:
                names += " + " + " and ".join(extra)
            memory = params * bytes_per_param
            rows.append((str(stage), names, f"{params:,}", _bytes(memory)))
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(4)]
        lines = [
            f"Pipeline partition of {self.trunk!r} ({len(self.children)} children, {self.method}):",
            "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)),
        ]
        lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
        lines.append(
            f"(est. memory: params x {bytes_per_param:g} bytes for weights, grads and optimizer state; a stage holds "
            "the modules outside the trunk only on its side of it, tied weights on the first and the last stage.)"
        )
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class OutsidePlan:
    """Where the parameters outside the trunk live.

    Along the path from the LightningModule to the trunk, the modules holding parameters that are registered
    (in ``__init__`` order) before the trunk's branch run before it and live on the first stage only; those
    registered after it live on the last stage only. ``smp.set_partition(module, 0)`` (or the last stage) on one
    of them places it there instead, for a model whose registration order is not its run order and cannot be
    edited (LitGPT registers its ``lm_head`` before its blocks). A parameter registered under several of those
    names (an embedding tied to its output head) is ``tied``: held by the first and the last stage, kept identical.
    Parameters set directly on the trunk's ancestors are ``shared``: every stage holds them and the stage that
    uses them trains them.
    """

    stages: int
    before: tuple[str, ...]
    """Modules (qualified names) that only the first stage holds."""
    after: tuple[str, ...]
    """Modules that only the last stage holds."""
    tied: tuple[str, ...]
    """Every name of every tied parameter."""
    shared: tuple[str, ...]
    """Names of the parameters every stage holds (not tied)."""
    params_per_stage: tuple[int, ...]
    """Parameters each stage holds outside the trunk (a tied one counted on both stages)."""

    def dropped(self, stage: int) -> tuple[str, ...]:
        """The modules outside the trunk that ``stage`` does not hold."""
        return (self.before if stage > 0 else ()) + (self.after if stage < self.stages - 1 else ())

    def side_of(self, name: str) -> int | None:
        """The stage that trains the parameter or module ``name`` outside the trunk (0: before it, the last
        stage: after it; tied parameters: the first stage), or None for a shared one (or a trunk name)."""
        if name in self.tied:
            return 0
        if any(_within(name, module) for module in self.before):
            return 0
        if any(_within(name, module) for module in self.after):
            return self.stages - 1
        return None


def _runs_after(name: str, module: nn.Module, plan: PartitionPlan, *, registered_after: bool) -> bool:
    """Whether the module ``name`` outside the trunk lives on the last stage (after the trunk) rather than the first:
    where ``smp.set_partition`` put it, else where it is registered."""
    stage = getattr(module, _PARTITION_ATTR, None)
    if stage is None:
        return registered_after
    last = plan.stages - 1
    if stage not in (0, last):
        raise ValueError(
            f"{name!r} is placed on pipeline stage {stage} (smp.set_partition / smp.partition), but it lies outside "
            f"the pipelined trunk {plan.trunk!r}, so it runs before the trunk, on the first stage (0), or after it, "
            f"on the last ({last}). Place it on stage 0 or {last}, or make it part of the trunk."
        )
    return stage == last


def _within(name: str, module: str) -> bool:
    return name == module or name.startswith(f"{module}.")


def plan_outside(root: nn.Module, plan: PartitionPlan) -> OutsidePlan:
    """Place the modules and parameters outside ``plan``'s trunk (see `OutsidePlan`); refuses a parameter
    shared across stages in a way the pipeline cannot keep in sync. Reads ``root``, changes nothing."""
    parts = plan.trunk.split(".")
    before: list[str] = []
    after: list[str] = []
    for depth, part in enumerate(parts):
        path = ".".join(parts[:depth])
        registered_after = False
        for name, child in root.get_submodule(path).named_children():
            if name == part:
                registered_after = True
            elif next(child.parameters(), None) is not None:
                qualified = f"{path}.{name}" if path else name
                runs_after = _runs_after(qualified, child, plan, registered_after=registered_after)
                (after if runs_after else before).append(qualified)
    last = plan.stages - 1
    every = set(range(plan.stages))
    prefix = f"{plan.trunk}."
    names: dict[int, list[str]] = {}
    sizes: dict[int, int] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        sizes[id(param)] = param.numel()
    tied: list[str] = []
    shared: list[str] = []
    per_stage = [0] * plan.stages
    for key, found in names.items():
        stages = {plan.stage_of(int(n[len(prefix) :].split(".")[0])) for n in found if n.startswith(prefix)}
        outside = [n for n in found if not n.startswith(prefix)]
        if len(stages) > 1 or (stages and outside):
            raise ValueError(
                f"one parameter is shared by {', '.join(found)}, which run on different pipeline stages; the "
                "pipeline keeps only tied weights outside the trunk (an embedding and its output head) in sync. "
                "Place the modules sharing it on one stage (partition=...), or give each its own parameter."
            )
        if stages:
            continue
        holders: set[int] = set()
        for name in outside:
            if any(_within(name, module) for module in before):
                holders.add(0)
            elif any(_within(name, module) for module in after):
                holders.add(last)
            else:
                holders |= every
        for stage in holders:
            per_stage[stage] += sizes[key]
        if len(outside) > 1 and {0, last} <= holders:
            tied += outside
        elif holders == every:
            shared += outside
    return OutsidePlan(plan.stages, tuple(before), tuple(after), tuple(tied), tuple(shared), tuple(per_stage))


def bytes_per_param(param_dtype: torch.dtype) -> float:
    """Training-state bytes per parameter: weight + grad, fp32 master for 16-bit params, Adam moments."""
    size = torch.empty((), dtype=param_dtype).element_size()
    return 2 * size + (4 if size < 4 else 0) + _ADAM_STATE_BYTES


# -- the trunk ---------------------------------------------------------------------------------------------------


def find_trunk(root: nn.Module, path: str | None = None) -> tuple[str, nn.Module]:
    """The sequential container to pipeline: ``path`` (dotted, from ``root``) or the ``nn.Sequential`` /
    ``nn.ModuleList`` holding the most parameters (the shallowest on a tie)."""
    if path is not None:
        try:
            trunk = root.get_submodule(path)
        except AttributeError as err:
            raise ValueError(
                f"pipeline_module={path!r} does not name a submodule of {type(root).__name__} ({err}). "
                f"Sequential containers it has: {_candidates_text(root)}."
            ) from None
        if not isinstance(trunk, nn.Sequential | nn.ModuleList):
            raise ValueError(
                f"pipeline_module={path!r} is a {type(trunk).__name__}; the pipelined trunk must be an "
                "nn.Sequential or an nn.ModuleList run in order. Name one of: " + _candidates_text(root) + "."
            )
        return path, trunk
    candidates = _candidates(root)
    if not candidates:
        raise ValueError(
            f"{type(root).__name__} has no nn.Sequential or nn.ModuleList to split into pipeline stages. Put the "
            "repeated blocks in an nn.ModuleList run in order in forward (`for block in self.blocks: x = "
            "block(x)`) or in an nn.Sequential, or set pipeline_parallel_degree=1."
        )
    name, trunk, _ = max(candidates, key=lambda item: item[2])  # max keeps the first of equals
    return name, trunk


def describe_children(
    trunk: nn.Module, trunk_name: str, *, numel: Callable[[Tensor], int] = Tensor.numel
) -> tuple[ChildCost, ...]:
    """Parameter counts and bytes of each trunk child (shared parameters counted where first seen); ``numel``
    gives the elements of a parameter that a rank holds (a tensor-parallel rank holds 1/tp of a split one)."""
    seen: set[int] = set()
    costs = []
    for index, child in enumerate(trunk.children()):
        params = [p for p in child.parameters() if id(p) not in seen]
        seen.update(map(id, params))
        costs.append(
            ChildCost(
                name=f"{trunk_name}.{index}" if trunk_name else str(index),
                params=sum(numel(p) for p in params),
                param_bytes=sum(numel(p) * p.element_size() for p in params),
            )
        )
    return tuple(costs)


def _candidates(root: nn.Module) -> list[tuple[str, nn.Module, int]]:
    return [
        (name, module, sum(p.numel() for p in module.parameters()))
        for name, module in root.named_modules()
        if isinstance(module, nn.Sequential | nn.ModuleList) and len(module) > 0
    ]


def _candidates_text(root: nn.Module) -> str:
    found = [f"{name!r} ({len(module)} children, {params:,} params)" for name, module, params in _candidates(root)]
    return ", ".join(found) if found else "none"


# -- the cost model and balancing ------------------------------------------------------------------------------


def child_weights(children: Sequence[ChildCost], memory_weight: float) -> list[float]:
    """Each child's share of the work: ``memory_weight`` x its share of memory + (1 - ``memory_weight``) x its
    share of compute (smp's trade-off). Compute is measured FLOPs when every child has them, else the parameter
    count (a block's matmul FLOPs per token are proportional to its weights); memory is the training state of
    its parameters (weights, grads and two Adam moments: 4 x their bytes) plus its measured activation bytes."""
    if not children:
        return []
    if all(c.flops is not None for c in children):
        compute = [float(c.flops or 0.0) for c in children]
    else:
        compute = [float(c.params) for c in children]
    memory = [4.0 * float(c.param_bytes or c.params) + float(c.activation_bytes or 0) for c in children]
    return [
        memory_weight * m + (1.0 - memory_weight) * c for m, c in zip(_shares(memory), _shares(compute), strict=True)
    ]


def balance(weights: Sequence[float], parts: int) -> tuple[int, ...]:
    """Sizes of ``parts`` consecutive, non-empty groups of ``weights`` that minimise the heaviest group (exact,
    by dynamic programming). Among the splits that reach it: the most even weights (least sum of squares, so no
    group is left without work when it can have some), then the most even sizes."""
    n = len(weights)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} trunk children into {parts} non-empty stages")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def weight(j: int, i: int) -> float:
        return prefix[i] - prefix[j]

    # pass 1: the least possible heaviest group
    heaviest = [[float("inf")] * (n + 1) for _ in range(parts + 1)]
    heaviest[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            heaviest[k][i] = min(max(heaviest[k - 1][j], weight(j, i)) for j in range(k - 1, i))
    limit = heaviest[parts][n] * (1 + 1e-9) + 1e-12
    # pass 2: among splits within that limit, least (sum of squared weights, sum of squared sizes)
    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                if best[k - 1][j] == inf or weight(j, i) > limit:
                    continue
                previous = best[k - 1][j]
                candidate = (previous[0] + weight(j, i) ** 2, previous[1] + (i - j) ** 2)
                if _less(candidate, best[k][i]):
                    best[k][i], cut[k][i] = candidate, j
    sizes = []
    i = n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return tuple(reversed(sizes))


def _less(candidate: tuple[float, float], incumbent: tuple[float, float]) -> bool:
    """Lexicographic, with a relative tolerance on the first key so float noise does not decide."""
    tolerance = 1e-9 * max(1.0, abs(incumbent[0])) if incumbent[0] != float("inf") else 0.0
    if candidate[0] < incumbent[0] - tolerance:
        return True
    return abs(candidate[0] - incumbent[0]) <= tolerance and candidate[1] < incumbent[1]


def _shares(values: Sequence[float]) -> list[float]:
    total = sum(values)
    if total <= 0:
        return [1.0 / len(values)] * len(values)
    return [v / total for v in values]


# -- manual placement: smp.partition / smp.set_partition ---------------------------------------------------------

_PARTITION_ATTR = "_smp_partition"
_current_partition: contextvars.ContextVar[int | None] = contextvars.ContextVar("smp_partition", default=None)
_hooks_installed = False


@contextmanager
def partition(index: int) -> Generator[None, None, None]:
    """smp's ``smp.partition(i)``: modules created inside go to pipeline stage ``index`` (read when
    ``auto_partition=False``; the innermost context wins)."""
    _check_index(index, "smp.partition")
    _install_hooks()
    token = _current_partition.set(index)
    try:
        yield
    finally:
        _current_partition.reset(token)


def set_partition(module: nn.Module, index: int) -> None:
    """smp's ``smp.set_partition(module, i)``: put ``module`` on pipeline stage ``index``."""
    _check_index(index, "smp.set_partition")
    if not isinstance(module, nn.Module):
        raise ValueError(f"smp.set_partition takes an nn.Module, got {type(module).__name__}")
    object.__setattr__(module, _PARTITION_ATTR, index)


def assigned_partition(module: nn.Module) -> int | None:
    """The stage ``module`` was put on by ``set_partition`` or created under by ``partition``: its own tag,
    else the one tag its submodules agree on; None if untagged."""
    own = getattr(module, _PARTITION_ATTR, None)
    if own is not None:
        return own
    tags = {getattr(m, _PARTITION_ATTR) for m in module.modules() if getattr(m, _PARTITION_ATTR, None) is not None}
    if len(tags) > 1:
        raise ValueError(
            f"{type(module).__name__} holds submodules placed on stages {sorted(tags)}; a trunk child runs on "
            "one stage. Place the whole child with smp.set_partition(child, stage), or split it into several "
            "trunk children."
        )
    return tags.pop() if tags else None


def sizes_from_assignment(
    names: Sequence[str], assignment: Sequence[int | None], *, stages: int, default: int | None
) -> tuple[int, ...]:
    """Stage sizes from each trunk child's assigned stage (None: ``default``); stages must follow the trunk
    order and none may be empty."""
    resolved = []
    for name, stage in zip(names, assignment, strict=True):
        if stage is None:
            if default is None:
                raise ValueError(
                    f"trunk child {name!r} has no pipeline stage: create it under `with smp.partition(i):`, call "
                    "smp.set_partition(child, i), or set default_partition (or auto_partition=True)."
                )
            stage = default
        if not 0 <= stage < stages:
            raise ValueError(
                f"trunk child {name!r} is placed on stage {stage}, but pipeline_parallel_degree={stages}; use a "
                f"stage in [0, {stages - 1}]."
            )
        if resolved and stage < resolved[-1]:
            raise ValueError(
                f"trunk child {name!r} is placed on stage {stage} after {names[len(resolved) - 1]!r} on stage "
                f"{resolved[-1]}; stages must follow the trunk's order (each stage holds consecutive children)."
            )
        resolved.append(stage)
    sizes = tuple(resolved.count(stage) for stage in range(stages))
    if 0 in sizes:
        raise ValueError(
            f"stage {sizes.index(0)} holds no trunk child (children per stage: {sizes}); place at least one "
            "child on every stage or use fewer stages."
        )
    return sizes


def _install_hooks() -> None:
    """Tag modules created under `partition`: every module that registers a submodule or parameter there."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True

    def tag_submodule(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
        index = _current_partition.get()
        if index is not None and submodule is not None and getattr(submodule, _PARTITION_ATTR, None) is None:
            object.__setattr__(submodule, _PARTITION_ATTR, index)

    def tag_owner(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        index = _current_partition.get()
        if index is not None and getattr(module, _PARTITION_ATTR, None) is None:
            object.__setattr__(module, _PARTITION_ATTR, index)

    nn.modules.module.register_module_module_registration_hook(tag_submodule)
    nn.modules.module.register_module_parameter_registration_hook(tag_owner)


def _check_index(index: int, caller: str) -> None:
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"{caller}({index!r}): the stage index must be an int >= 0")


# -- the plan ----------------------------------------------------------------------------------------------------


def plan_configured_partition(
    trunk_name: str, trunk: nn.Module, children: Sequence[ChildCost], *, stages: int, config: SMPConfig
) -> PartitionPlan:
    """`plan_partition` with the run's settings: ``partition`` sizes, the cost model (``auto_partition``,
    ``memory_weight``), or the trunk children's smp.partition tags with ``default_partition``. The strategy and
    the memory planner both plan through it, so the planner's cut is the run's."""
    assignment = None
    if not config.auto_partition and config.partition is None:
        assignment = [assigned_partition(child) for child in trunk.children()]
    return plan_partition(
        trunk_name,
        children,
        stages=stages,
        chunks_per_stage=config.virtual_stages,
        sizes=config.partition,
        auto=config.auto_partition,
        memory_weight=config.memory_weight,
        assignment=assignment,
        default=config.default_partition,
    )


def plan_partition(
    trunk: str,
    children: Sequence[ChildCost],
    *,
    stages: int,
    chunks_per_stage: int = 1,
    sizes: Sequence[int] | None = None,
    auto: bool = True,
    memory_weight: float = 0.8,
    assignment: Sequence[int | None] | None = None,
    default: int | None = None,
) -> PartitionPlan:
    """Split ``children`` into ``stages * chunks_per_stage`` chunks: ``sizes`` if given, else balanced by the
    cost model (``auto``), else from each child's ``assignment`` (smp.partition tags) with ``default``."""
    chunks = stages * chunks_per_stage
    count = len(children)
    if count < chunks:
        per = f" x {chunks_per_stage} chunks per stage" if chunks_per_stage > 1 else ""
        raise ValueError(
            f"the trunk {trunk!r} has {count} children, fewer than the {stages} pipeline stages{per}: each "
            f"stage needs at least one. Use pipeline_parallel_degree <= {count // chunks_per_stage}, or name a "
            "container with more children with pipeline_module='...'."
        )
    if sizes is not None:
        if len(sizes) != chunks:
            raise ValueError(f"partition={tuple(sizes)} needs {chunks} sizes, one per chunk, got {len(sizes)}")
        if sum(sizes) != count:
            raise ValueError(
                f"partition={tuple(sizes)} places {sum(sizes)} trunk children, but {trunk!r} has {count}; make the "
                f"sizes add up to {count}."
            )
        return PartitionPlan(
            trunk, tuple(children), tuple(sizes), stages, f"manual: partition={tuple(sizes)}", chunks_per_stage
        )
    if not auto and chunks_per_stage > 1:
        raise ValueError(
            f"smp.partition / default_partition place trunk children on stages, but virtual_stages={chunks_per_stage} "
            "cuts the trunk into chunks; give partition=(one size per chunk), or auto_partition=True."
        )
    if auto:
        weights = child_weights(children, memory_weight)
        found = balance(weights, chunks)
        return PartitionPlan(
            trunk, tuple(children), found, stages, f"auto, memory_weight={memory_weight:g}", chunks_per_stage
        )
    names = [c.name for c in children]
    found = sizes_from_assignment(names, assignment or [None] * count, stages=stages, default=default)
    return PartitionPlan(trunk, tuple(children), found, stages, "manual: smp.partition / default_partition")


def _span(children: Sequence[ChildCost], indices: range) -> str:
    if not indices:
        return "-"
    first, last = children[indices[0]].name, children[indices[-1]].name
    return first if first == last else f"{first} .. {last.rsplit('.', 1)[-1]}"


def _bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:.1f} GiB"
