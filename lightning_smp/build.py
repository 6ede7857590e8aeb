"""The one build path of a run's model: plan how it is split, then apply the plan (*plan, then apply*).

Owns the order of setup's work on the model and the plan every step of it reads: which parameters tensor
parallelism splits (`plan_tensor_parallel`), the pipelined trunk (found once, `find_trunk`), the partition of its
children over the stages with the modules outside it placed (`plan_configured_partition`, `plan_outside`) and the
units of sharded data parallelism (`plan_units`). `plan` is pure over the module tree (a model on the meta device
costs nothing), so the memory planner (`memory`) reads exactly the plan the strategy applies. `plan_and_apply`
then splits the model over the tensor-parallel ranks, wraps the modules marked for activation checkpointing, keeps
this rank's pipeline stage, shards what is left over the sdp ranks and, for a model built on the meta device, gives
each tensor the rank keeps its values (`materialization`). Under a `ShapeOnlyTopology` (no processes) it stops after
the checkpointing: the memory planner measures activations on a meta copy built so, by this same code. How each step
is done is its module's business.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from lightning_smp import activation_checkpointing, sharded_data_parallel, tensor_parallel
from lightning_smp.activation_offloading import ActivationOffloader
from lightning_smp.materialization import has_meta_tensors, materialize_kept, pending_values
from lightning_smp.pipeline.partition import (
    ChildCost,
    OutsidePlan,
    PartitionPlan,
    describe_children,
    find_trunk,
    plan_configured_partition,
    plan_outside,
)
from lightning_smp.pipeline.runtime import PipelineEngine, build_engine
from lightning_smp.pipeline.trace import measure_children
from lightning_smp.reduction import ReductionPlan
from lightning_smp.tensor_parallel.comm import ShapeOnlyGroup
from lightning_smp.tensor_parallel.plan import TensorParallelPlan, plan_tensor_parallel

if TYPE_CHECKING:
    from lightning_smp.config import SMPConfig
    from lightning_smp.topology import Topology

__all__ = ["BuildPlan", "ShapeOnlyTopology", "plan", "plan_and_apply"]


@dataclass(frozen=True, eq=False)
class BuildPlan:
    """How one model is split under one layout: what each rank of it keeps."""

    tp: int
    """The tensor-parallel degree the plan is for."""
    tensor_parallel: TensorParallelPlan
    """The modules tensor parallelism splits (``sharded_specs``: every parameter it splits, by name)."""
    trunk: tuple[str, nn.Module] | None
    """The trunk (name, module): the sequential container the pipeline cuts into stages, whose children sharded data
    parallelism makes its units and the memory planner measures one by one; None when the model has none (required
    only with a pipeline, or with a ``pipeline_module`` named under sharded data parallelism)."""
    partition: PartitionPlan | None = None
    """The trunk's children over the stages; None without a pipeline."""
    outside: OutsidePlan | None = None
    """Where the modules outside the trunk live; None without a pipeline."""
    shard_units: tuple[nn.Module, ...] = ()
    """Sharded data parallelism's units (`sharded_data_parallel.plan_units`); empty without it."""
    split_ids: frozenset[int] = frozenset()
    """Ids of the (still whole) parameters that tensor parallelism splits ``tp`` ways."""

    def local_numel(self, param: Tensor) -> int:
        """The elements of ``param`` a tensor-parallel rank holds (a parameter already split is local already)."""
        return param.numel() // self.tp if id(param) in self.split_ids else param.numel()


def plan(model: nn.Module, *, config: SMPConfig, tp: int, pp: int, sdp: int = 1) -> BuildPlan:
    """The plan of splitting ``model`` ``tp`` ways, over ``pp`` stages and ``sdp`` shard ranks; reads ``model``,
    changes nothing. The partition balances the trunk children's parameters as each rank holds them (1/tp of the
    split ones). Raises ``ValueError`` when the model cannot take the layout."""
    tensor_parallel_plan = plan_tensor_parallel(
        model, tp_size=tp, patterns=config.tensor_parallel_plan, sequence_parallel=config.sequence_parallel
    )
    split_ids: frozenset[int] = frozenset()
    if tp > 1:
        split_ids = frozenset(
            id(param)
            for name, param in model.named_parameters(remove_duplicate=False)
            if name in tensor_parallel_plan.sharded_specs and tensor_parallel.shard_of(param) is None
        )
    built = BuildPlan(tp, tensor_parallel_plan, _trunk(model, config, pp=pp, sdp=sdp), split_ids=split_ids)
    if pp > 1:
        assert built.trunk is not None
        trunk_name, trunk = built.trunk
        built = _partitioned(built, model, describe_children(trunk, trunk_name, numel=built.local_numel), config, pp)
    if sdp > 1:
        trunk_module = built.trunk[1] if built.trunk is not None else None
        units = sharded_data_parallel.plan_units(model, trunk=trunk_module)
        built = dataclasses.replace(built, shard_units=tuple(units))
    return built


def _partitioned(
    built: BuildPlan, model: nn.Module, costs: Sequence[ChildCost], config: SMPConfig, stages: int
) -> BuildPlan:
    """``built`` with its trunk's children, of these ``costs``, partitioned over ``stages``."""
    assert built.trunk is not None
    trunk_name, trunk = built.trunk
    partition = plan_configured_partition(trunk_name, trunk, costs, stages=stages, config=config)
    return dataclasses.replace(built, partition=partition, outside=plan_outside(model, partition))


def _trunk(model: nn.Module, config: SMPConfig, *, pp: int, sdp: int) -> tuple[str, nn.Module] | None:
    """The trunk the pipeline cuts (pp > 1: required), whose children sharded data parallelism makes its units
    (without one, the root is the only sharded unit) and the memory planner measures; None when there is none."""
    try:
        return find_trunk(model, config.pipeline_module)
    except ValueError:
        if pp > 1 or (sdp > 1 and config.pipeline_module is not None):
            raise
    return None


@dataclass(frozen=True)
class ShapeOnlyTopology:
    """Stands in for the `Topology` of rank 0 of a ``pp`` x ``tp`` layout (``sdp`` sharded) when only shapes matter:
    every group is a `ShapeOnlyGroup`, so nothing communicates. `plan_and_apply` under it, on a model on the meta
    device, applies what changes what a rank keeps for backward (tensor parallelism, activation checkpointing and
    offloading, as the pipeline has them) and stops before what needs processes: the partition and the pipeline
    engine, sharding over the sdp ranks, materialisation. The memory planner measures activations on a model built
    so (a repeating trunk cut to its first layers, which a partition into ``pp`` stages could not take)."""

    pp: int = 1
    tp: int = 1
    sdp: int = 1

    @classmethod
    def of(cls, config: SMPConfig) -> ShapeOnlyTopology:
        """Rank 0 of ``config``'s layout."""
        return cls(config.pipeline_parallel_degree, config.tensor_parallel_degree, config.sharded_data_parallel_degree)

    def size(self, axis: str) -> int:
        return {"pp": self.pp, "tp": self.tp, "sdp": self.sdp}.get(axis, 1)

    def rank(self, axis: str) -> int:
        return 0

    def group(self, axis: str) -> ShapeOnlyGroup:
        return ShapeOnlyGroup(0, self.size(axis))


def plan_and_apply(
    model: nn.Module,
    *,
    topology: Topology | ShapeOnlyTopology,
    config: SMPConfig,
    device: torch.device,
    engine: PipelineEngine | None = None,
    reduction: ReductionPlan | None = None,
    offloader: ActivationOffloader | None = None,
) -> PipelineEngine | None:
    """Split ``model`` in place for this rank of ``topology``: tensor parallelism, activation checkpointing, this
    rank's pipeline stage (in this order: see `activation_checkpointing`), then under sharded data parallelism
    FSDP2's shards. A model on the meta device is planned, pruned and sharded so, then only what this rank keeps is
    materialised, on ``device`` (the values a single-device build gives: its recorded initialisation, or its
    checkpoint files). Returns the pipeline engine (``engine`` when a later fit/validate reuses it), or None; a new
    engine reduces its stage's gradients over the replicas as the run's ``reduction`` plan says (needed then).
    ``offloader`` keeps what checkpointed modules save under ``offload_activations`` (an `ActivationOffloader` by
    default; the memory planner passes one that counts).

    Collective over the run's groups. Running it again on the same model (``trainer.validate`` after ``fit``)
    applies only what is new. Under a `ShapeOnlyTopology` it returns after the activation checkpointing.
    """
    on_meta = has_meta_tensors(model)
    rehearsal = isinstance(topology, ShapeOnlyTopology)
    builds_pipeline = topology.pp > 1 and (engine is None or engine.module is not model)
    stages = topology.pp if builds_pipeline and not rehearsal else 1  # a rehearsal builds no engine: no partition
    built = plan(model, config=config, tp=topology.size("tp"), pp=stages, sdp=topology.sdp)
    tensor_parallel.parallelize(model, topology=topology, config=config, plan=built.tensor_parallel)
    if offloader is None and config.offload_activations:
        offloader = ActivationOffloader(config.activation_loading_horizon)
    trunk = built.trunk[1] if builds_pipeline and built.trunk is not None else None
    activation_checkpointing.apply(model, pipelined_trunk=trunk, offloader=offloader)
    if rehearsal:
        return None  # no ranks to route the stages over, shard over or materialise for
    if builds_pipeline:
        assert trunk is not None and built.partition is not None
        example = getattr(model, "example_input_array", None)
        if example is not None and not on_meta:
            # Measured on the split model, the costs replace the counted ones. On the meta device (delayed
            # initialisation) nothing can run yet: the cost model counts parameters.
            costs = measure_children(model, trunk, built.partition.children, example)
            built = _partitioned(built, model, costs, config, stages)
        assert built.partition is not None and built.outside is not None
        if reduction is None:
            raise TypeError("plan_and_apply builds a pipeline engine: pass the run's `reduction` plan.")
        engine = build_engine(
            model, topology=topology, config=config, plan=built.partition, outside=built.outside, reduction=reduction
        )
    pending = pending_values(model) if on_meta else None  # taken before FSDP2 replaces the parameters
    if topology.sdp > 1:
        sharded_data_parallel.shard(model, units=built.shard_units, topology=topology, config=config)
    if pending is not None:
        materialize_kept(model, device=device, pending=pending)
    return engine
