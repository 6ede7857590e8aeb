"""Where every parameter lives under pipeline parallelism: which stages hold it and which one trains it.

Owns the one answer that the engine (what this stage trains), checkpoints (each parameter written once, by the
stage that trains it) and the memory planner (what each stage holds) read: trunk children by the partition plan;
outside the trunk by the outside plan (before it: the first stage; after it: the last; a tied weight: both, the
first trains it); a parameter set directly on the trunk's ancestors on every stage, trained by the stage whose
step uses it, which `learn_shared_owners` finds at the first synchronised step. Not owned: the plans themselves
(`lightning_smp.build` makes them, by `partition.py`'s rules), routing on a rank (`stage.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from lightning_smp.pipeline.partition import OutsidePlan, PartitionPlan

__all__ = ["PipelineLayout", "learn_shared_owners"]


@dataclass(frozen=True)
class PipelineLayout:
    """The partition of the trunk and the placement of what lies outside it."""

    plan: PartitionPlan
    outside: OutsidePlan
    shared_owners: Mapping[str, int] = field(default_factory=dict)
    """The stage that trains each parameter every stage holds (`OutsidePlan.shared`), once learned; until then
    stage 0."""

    @property
    def stages(self) -> int:
        return self.plan.stages

    def holders(self, names: Sequence[str]) -> set[int]:
        """The stages holding what is registered under ``names`` (the names of one parameter, or module names)."""
        stages: set[int] = set()
        for name in names:
            child = self._trunk_child(name)
            if child is not None:
                stages.add(self.plan.stage_of(child))
            elif name in self.outside.tied:
                stages |= {0, self.stages - 1}
            elif (side := self.outside.side_of(name)) is None:
                stages |= set(range(self.stages))
            else:
                stages.add(side)
        return stages

    def trains(self, name: str, stage: int) -> bool:
        """Whether ``stage``'s copy of the parameter ``name`` is the trained one (each parameter has exactly one
        such stage; a name that lies on no side of the trunk, on each stage that holds it)."""
        child = self._trunk_child(name)
        if child is not None:
            return self.plan.stage_of(child) == stage
        if name in self.outside.shared:
            return self.shared_owners.get(name, 0) == stage
        return self.outside.side_of(name) in (stage, None)

    def trained_names(self, module: nn.Module, stage: int) -> set[str]:
        """Names (in ``module``, every name of a tied parameter) of the parameters ``stage`` trains among those
        ``module`` holds on this rank."""
        return {name for name, _ in module.named_parameters(remove_duplicate=False) if self.trains(name, stage)}

    def _trunk_child(self, name: str) -> int | None:
        prefix = f"{self.plan.trunk}."
        return int(name[len(prefix) :].split(".")[0]) if name.startswith(prefix) else None


def learn_shared_owners(
    layout: PipelineLayout, module: nn.Module, *, stage: int, group: dist.ProcessGroup, device: torch.device
) -> PipelineLayout:
    """At the first synchronised step, once every stage has its gradients: learn which stage trains each parameter
    every stage holds (the one where it got a gradient), and refuse one trained on several stages."""
    names = layout.outside.shared
    if not names:
        return layout
    used = torch.zeros(layout.stages, len(names), device=device)
    used[stage] = torch.tensor([float(module.get_parameter(name).grad is not None) for name in names])
    dist.all_reduce(used, group=group)
    table = used.t().tolist()  # sync: once per run
    several = [name for name, row in zip(names, table, strict=True) if sum(row) > 1]
    if several:
        raise ValueError(
            f"parameters outside the pipelined trunk got gradients on several pipeline stages: {several}. Each "
            "stage holds its own copy, so they would drift apart. If a weight is shared (an embedding reused "
            "by the output head), register it in both modules, e.g. `self.lm_head.weight = self.wte.weight`, "
            "and lightning_smp sums its gradients over the first and last stage; otherwise use it on one side "
            "of the trunk only."
        )
    owners = {name: max(range(layout.stages), key=row.__getitem__) for name, row in zip(names, table, strict=True)}
    return dataclasses.replace(layout, shared_owners=owners)
