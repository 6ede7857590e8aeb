"""What one rank of a layout holds, counted from the package's own plans: its parameters, gradients, fp32 masters and
optimizer state by stage and tensor-parallel share (`build.plan`'s), ZeRO-1's and sharded data parallelism's shares
and step buffers, and the activations in flight (one microbatch's, measured by `activation_memory`, times what the
pipeline schedule keeps at once). `layout_report` gives the `MemoryReport` of one layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_smp import build
from lightning_smp._compat import BatchNormBase
from lightning_smp.activation_memory import AFTER, BEFORE, ActivationTrace, TraceError, trace_activations
from lightning_smp.config import SMPConfig
from lightning_smp.memory.report import Layout, MemoryReport, RankMemory
from lightning_smp.pipeline import schedule as schedules
from lightning_smp.pipeline.layout import PipelineLayout
from lightning_smp.sharded_data_parallel import keeps_whole
from lightning_smp.topology import rank_groups

__all__ = ["layout_report"]

_OPTIMIZER_STATES = 2  # Adam/AdamW: exp_avg and exp_avg_sq, in the dtype of what the optimizer updates
_MASTER_BYTES = 4  # fp32


def layout_report(
    model: nn.Module,
    layout: Layout,
    config: SMPConfig,
    device_memory: int | None,
    batch: Any,
    traces: dict[tuple[int, bool], ActivationTrace | TraceError],
    built: build.BuildPlan | None = None,
) -> MemoryReport:
    params = _named_parameters(model)
    if built is None:
        built = build.plan(model, config=config, tp=layout.tp, pp=layout.pp, sdp=layout.sdp)
    sharded = set(built.split_ids)
    pipeline = None
    if built.partition is not None and built.outside is not None:
        pipeline = PipelineLayout(built.partition, built.outside)
    placement = _Placement(layout.pp, pipeline)

    fp32_owners = {id(p) for m in model.modules() if isinstance(m, BatchNormBase) for p in m.parameters()}
    half = config.half_dtype
    activations, recompute, note = _activations(model, placement, config, batch, traces, built)
    groups = rank_groups(config.placement_order, dp=layout.dp, pp=layout.pp, tp=layout.tp)["pp"]
    held = {key: placement.stages_of(names) for key, (_, names) in params.items()}  # once: it walks the plan
    ranks = []
    for stage in range(layout.pp):
        if layout.sdp > 1:  # pp = 1, as the config requires
            count, step_buffer = _sharded_data_parallel(built.shard_units, params, sharded, layout, config)
        else:
            count, step_buffer = _stage_states(stage, params, sharded, held, fp32_owners, layout, half)
        ranks.append(
            RankMemory(
                stage=stage,
                ranks=tuple(group[stage] for group in groups),
                activations=None if activations is None else activations[stage],
                in_flight=_in_flight(layout.pp, stage, config),
                recompute=recompute[stage],
                step_buffer=step_buffer,
                **count,
            )
        )
    precision = "fp32" if half is None else f"{'fp16' if half == torch.float16 else 'bf16'} with fp32 masters"
    return MemoryReport(layout, precision, tuple(ranks), note, device_memory)


def _stage_states(
    stage: int,
    params: dict[int, tuple[nn.Parameter, list[str]]],
    tensor_parallel: set[int],
    held: Mapping[int, set[int]],
    fp32_owners: set[int],
    layout: Layout,
    half: torch.dtype | None,
) -> tuple[dict[str, int], int]:
    """Model states of one rank of ``stage`` (16-bit parameters and grads with fp32 masters under fp16/bf16, the
    masters' share under ``shard_optimizer_state``) and the step buffer of that sharding; ``held`` gives the stages
    holding each parameter."""
    count = dict.fromkeys(("parameters", "gradients", "masters", "master_gradients", "optimizer_state"), 0)
    trained_by_size: dict[int, int] = {}  # bytes per element in the run → trained elements (sharded buckets)
    for key, (param, _) in params.items():
        if stage not in held[key]:
            continue
        elements = param.numel() // layout.tp if key in tensor_parallel else param.numel()
        size = param.element_size() if half is None or key in fp32_owners else half.itemsize
        count["parameters"] += elements * size
        if not param.requires_grad:
            continue
        count["gradients"] += elements * size
        trained_by_size[size] = trained_by_size.get(size, 0) + elements
        updated = size
        if half is not None and key not in fp32_owners:
            count["masters"] += elements * _MASTER_BYTES
            count["master_gradients"] += elements * _MASTER_BYTES
            updated = _MASTER_BYTES
        count["optimizer_state"] += elements * updated * _OPTIMIZER_STATES
    if not layout.shard_optimizer_state:
        return count, 0
    count.update(_sharded_masters(trained_by_size, layout.dp))
    return count, _sharded_step_buffer(trained_by_size, layout.dp)


def _sharded_data_parallel(
    plan: Sequence[tuple[nn.Module, bool]],
    params: dict[int, tuple[nn.Parameter, list[str]]],
    tensor_parallel: set[int],
    layout: Layout,
    config: SMPConfig,
) -> tuple[dict[str, int], int]:
    """A rank's model states under ``sharded_data_parallel_degree`` (the units of the build's ``plan``, as ``shard``
    wraps them): fp32 parameter shards (the masters), fp32 gradient shards and fp32 Adam state of 1/sdp of each sharded
    parameter, whole ones for the parameters kept whole; and the step buffer of the largest unit gathered."""
    unit_of: dict[int, int] = {}
    for index, module in enumerate(plan):  # trunk children first: a parameter's own unit
        for param in module.parameters():
            unit_of.setdefault(id(param), index)
    count = dict.fromkeys(("parameters", "gradients", "masters", "master_gradients", "optimizer_state"), 0)
    gathered: dict[int, int] = {}  # unit → bytes gathered for its compute (parameters, gradients, fp32 reduce input)
    half = config.half_dtype
    compute = _MASTER_BYTES if half is None else half.itemsize
    for key, (param, _) in params.items():
        elements = param.numel() // layout.tp if key in tensor_parallel else param.numel()
        whole = keeps_whole(elements, config)
        local = elements if whole else -(-elements // layout.sdp)
        count["parameters"] += local * _MASTER_BYTES
        if not whole:
            per_element = compute + (
                (compute + (_MASTER_BYTES if half is not None else 0)) if param.requires_grad else 0
            )
            gathered[unit_of[key]] = gathered.get(unit_of[key], 0) + elements * per_element
        if param.requires_grad:
            count["gradients"] += local * _MASTER_BYTES
            count["optimizer_state"] += local * _MASTER_BYTES * _OPTIMIZER_STATES
    return count, max(gathered.values(), default=0)


def _sharded_masters(trained_by_size: Mapping[int, int], dp: int) -> dict[str, int]:
    """A replica's share under ``shard_optimizer_state``: 1/dp of the fp32 masters, of their gradients and of each
    optimizer state, per parameter dtype (``ShardedMasters`` pads each bucket to a multiple of dp: at most dp - 1
    elements more per bucket, not counted)."""
    share = sum(max(1, -(-elements // dp)) for elements in trained_by_size.values())
    return {
        "masters": share * _MASTER_BYTES,
        "master_gradients": share * _MASTER_BYTES,
        "optimizer_state": share * _MASTER_BYTES * _OPTIMIZER_STATES,
    }


def _sharded_step_buffer(trained_by_size: Mapping[int, int], dp: int) -> int:
    """The most a sharded step holds at once besides the model states: the reduce-scatter's padded flat gradients of
    every bucket (they start during backward and are waited for together) plus, for 16-bit ones, the share in their
    dtype; the all-gather after the step holds one bucket at a time, less."""
    total = 0
    for size, elements in trained_by_size.items():
        share = max(1, -(-elements // dp))
        total += size * (share * dp + (share if size != _MASTER_BYTES else 0))
    return total


def _named_parameters(model: nn.Module) -> dict[int, tuple[nn.Parameter, list[str]]]:
    """Each parameter once, with every name it is registered under (tied weights have several)."""
    found: dict[int, tuple[nn.Parameter, list[str]]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        found.setdefault(id(param), (param, []))[1].append(name)
    return found


@dataclass(frozen=True)
class _Placement:
    """Which pipeline stages hold a parameter or module: the `PipelineLayout` the pipeline engine keeps."""

    stages: int
    layout: PipelineLayout | None = None

    def buckets_of(self, stage: int) -> list[str] | None:
        """The `ActivationTrace` buckets ``stage`` runs: before the trunk on the first, its trunk children, after the
        trunk on the last; None (all of them) without a pipeline."""
        if self.layout is None:
            return None
        buckets = [str(child) for child in self.layout.plan.owned(stage)]
        return [*([BEFORE] if stage == 0 else []), *buckets, *([AFTER] if stage == self.stages - 1 else [])]

    def stages_of(self, names: Sequence[str]) -> set[int]:
        """The stages holding what is registered under ``names`` (parameter or module names)."""
        return self.layout.holders(names) if self.layout is not None else {0}


def _in_flight(stages: int, stage: int, config: SMPConfig) -> int:
    """The most microbatches ``stage`` holds activations of at once in a training step; without a pipeline the
    batch (``microbatches`` of them) runs whole."""
    if stages == 1:
        return config.microbatches
    plan = schedules.build(
        config.pipeline,
        stages=stages,
        stage=stage,
        microbatches=config.microbatches,
        active=config.resolved_active_microbatches,
        chunks_per_stage=config.virtual_stages,
    )
    # a stage's activations per microbatch cover all of its chunks
    return -(-schedules.peak_in_flight(plan) // config.virtual_stages)


def _activations(
    model: nn.Module,
    placement: _Placement,
    config: SMPConfig,
    batch: Any,
    traces: dict[tuple[int, bool], ActivationTrace | TraceError],
    built: build.BuildPlan,
) -> tuple[list[int] | None, list[int], str]:
    """Per stage, the bytes one microbatch keeps for backward and what its backward rebuilds, measured by tracing
    ``batch`` through ``model`` as ``config`` lays it out (`trace_activations`; ``traces`` caches one trace per
    tensor-parallel degree); or None and why not."""
    stages = placement.stages
    if batch is None:
        return (
            None,
            [0] * stages,
            (
                "not measured: give a batch (batch=..., or micro_batch_size and sequence_length for a Hugging Face "
                "model; the command line reads one from the config's data), so whether it fits is unknown."
            ),
        )
    key = (config.tensor_parallel_degree, config.pipeline_parallel_degree > 1)
    if key not in traces:
        try:
            traces[key] = trace_activations(model, batch, config=config, built=built)
        except TraceError as error:
            traces[key] = error
    trace = traces[key]
    if isinstance(trace, TraceError):
        return None, [0] * stages, f"not measured, so whether it fits is unknown: {trace}"
    buckets = [placement.buckets_of(stage) for stage in range(stages)]
    features = [f"tp={config.tensor_parallel_degree}"] if config.tensor_parallel_degree > 1 else []
    if config.sequence_parallel and config.tensor_parallel_degree > 1:
        features.append("sequence parallel")
    if any(trace.transient.values()):
        features.append("checkpointed layers rebuilt one at a time in backward (recompute)")
    if config.offload_activations:
        features.append(f"offloaded inputs loaded back {config.activation_loading_horizon} layer(s) ahead")
    return (
        [trace.kept(stage) for stage in buckets],
        [trace.peak_transient(stage) for stage in buckets],
        f"measured: one microbatch ({trace.microbatch}) traced forward and backward on the meta device"
        + (f" ({', '.join(features)})" if features else "")
        + "; every tensor autograd keeps for backward, logits and loss included, attention as the fused kernel.",
    )
