"""The memory planner: what each rank of a pp × tp × dp layout holds, computed before any process starts.

Owns the arithmetic only: bytes per element of parameters, gradients, fp32 masters and optimizer state, whether the
largest rank fits a device, and the search over layouts for a device count. What a rank holds is not re-derived
here: the package's own pure plans run on the model (best built on the meta device) — `lightning_smp.build.plan`, the
one the strategy applies, says which parameters each tensor-parallel rank keeps 1/tp of, which trunk children each
stage keeps, which stages keep the modules outside the trunk and which modules sharded data parallelism shards; the
pipeline schedule how many microbatches a stage holds at once — and the activations are measured by tracing one
microbatch through the model as laid out (`activation_memory`), so the estimate follows the code that trains. Where
the trace cannot run, the activations are unknown and so is whether a layout fits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_smp import build
from lightning_smp._compat import BatchNormBase
from lightning_smp.activation_memory import (
    AFTER,
    BEFORE,
    ActivationTrace,
    TraceError,
    example_batch,
    trace_activations,
)
from lightning_smp.config import SMPConfig
from lightning_smp.memory_plot import plot_memory
from lightning_smp.pipeline import schedule as schedules
from lightning_smp.pipeline.layout import PipelineLayout
from lightning_smp.sharded_data_parallel import keeps_whole
from lightning_smp.topology import rank_groups
from lightning_smp.units import format_bytes, parse_bytes

__all__ = [
    "Layout",
    "MemoryReport",
    "RankMemory",
    "estimate_memory",
    "fitting_layouts",
    "format_bytes",
    "layouts_table",
    "parse_bytes",
]

_OPTIMIZER_STATES = 2  # Adam/AdamW: exp_avg and exp_avg_sq, in the dtype of what the optimizer updates
_MASTER_BYTES = 4  # fp32
_SHARDED_ASSUMPTION = (
    "shard_optimizer_state: each replica keeps 1/dp of the fp32 masters, their gradients and the optimizer state of "
    "every trained parameter (fp32 ones too), padded per bucket; a step adds flat buffers of the stage's gradients "
    "in their dtype (every bucket's reduce-scatter at once: they start during backward), then one bucket's "
    "all-gather at a time; saving a checkpoint gathers whole fp32 "
    "masters and optimizer state for a moment (not counted)"
)
_SDP_ASSUMPTION = (
    "sharded_data_parallel_degree: the parameters of each sharded unit (a trunk child, the root's rest) are held as "
    "fp32 shards of 1/sdp (dim 0 split, rounded up), which are the masters, with fp32 gradient shards and fp32 Adam "
    "state over them; parameters kept whole (below sdp_param_persistence_threshold) are held whole in fp32, with "
    "their gradients and state; the step buffer is the largest unit gathered for compute: its parameters and "
    "gradients in the compute dtype, plus the fp32 gradients of the reduce-scatter under fp16/bf16; not counted: the "
    "next unit prefetched while one computes, the root kept gathered between forward and backward, the "
    "communication buffers"
)

ASSUMPTIONS = (
    "optimizer: Adam-like, 2 states per trained element in the updated dtype (fp32 masters under fp16/bf16), "
    "step counters not counted",
    "fp16/bf16: 16-bit parameters and gradients, fp32 masters and fp32 master gradients (one flat buffer each), "
    "BatchNorm kept in fp32 with no master",
    "frozen parameters (requires_grad=False) hold only their weights",
    "not counted: buffers, the framework and allocator overhead, other communication buffers",
)


@dataclass(frozen=True, slots=True)
class Layout:
    """Degrees of one layout; ``pp * tp * dp`` devices. ``shard_optimizer_state``: the fp32 masters, their
    gradients and the optimizer state are split over the dp replicas (ZeRO-1; only meaningful with dp > 1).
    ``sdp``: ``sharded_data_parallel_degree`` (ZeRO-3: the fp32 parameters, gradients and optimizer state split over
    groups of sdp replicas; divides dp, pp = 1)."""

    pp: int
    tp: int
    dp: int
    shard_optimizer_state: bool = False
    sdp: int = 1

    @property
    def devices(self) -> int:
        return self.pp * self.tp * self.dp

    @property
    def model_parallel(self) -> int:
        return self.pp * self.tp

    def __str__(self) -> str:
        sharded = " (optimizer state sharded)" if self.shard_optimizer_state else ""
        sharded += f" (sharded data parallel {self.sdp})" if self.sdp > 1 else ""
        return f"pp={self.pp} x tp={self.tp} x dp={self.dp}{sharded}"


@dataclass(frozen=True, slots=True)
class RankMemory:
    """Bytes held by each rank of one pipeline stage (its tensor-parallel and data-parallel ranks hold the same)."""

    stage: int
    ranks: tuple[int, ...]
    """Global ranks of this stage, under the config's ``placement_strategy``."""
    parameters: int
    gradients: int
    """Gradients in the parameters' dtype (``.grad``)."""
    masters: int
    """fp32 master weights (0 in fp32 training)."""
    master_gradients: int
    """fp32 gradients of the masters (0 in fp32 training)."""
    optimizer_state: int
    activations: int | None = None
    """Activation bytes kept for backward per microbatch, measured (None: not measured; the report says why)."""
    in_flight: int = 1
    """Microbatches whose activations the stage holds at once under the schedule (pp = 1: all of the batch's)."""
    recompute: int = 0
    """Bytes backward adds once, for a moment: a checkpointed layer's activations rebuilt and, with
    ``offload_activations``, the inputs of ``activation_loading_horizon`` + 1 layers loaded back."""
    step_buffer: int = 0
    """Bytes a step allocates and frees again: under ``shard_optimizer_state`` the flat gradients for the
    reduce-scatter, then the flat parameters for the all-gather (one at a time, the parameters' dtype); under
    sharded data parallelism the largest unit gathered for compute (see the report's assumptions)."""

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.masters + self.master_gradients + self.optimizer_state

    @property
    def total(self) -> int:
        """Model states, the step's transient buffer, the activations of every microbatch in flight and what
        backward rebuilds (unknown activations count as none: see `MemoryReport.fits`)."""
        return self.model_states + self.step_buffer + (self.activations or 0) * self.in_flight + self.recompute


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """Per-rank memory of one layout; ``str()`` is the printable table."""

    layout: Layout
    precision: str
    ranks: tuple[RankMemory, ...]
    """One entry per pipeline stage."""
    activation_note: str
    """How the activations were measured, or why they were not."""
    device_memory: int | None = None

    @property
    def largest(self) -> RankMemory:
        return max(self.ranks, key=lambda rank: rank.total)

    @property
    def fits(self) -> bool | None:
        """Whether the largest rank fits ``device_memory``; None when no device memory was given or the activations
        could not be measured (``activation_note`` says why), never a guess."""
        if self.device_memory is None or any(rank.activations is None for rank in self.ranks):
            return None
        return self.largest.total <= self.device_memory

    def table(self) -> str:
        header = ("stage", "ranks", "params", "grads", "masters", "master grads", "optimizer", "model states")
        header += ("step buffer", "activations/mb", "in flight", "recompute", "total")
        rows = [
            (
                str(rank.stage),
                _ranks_text(rank.ranks),
                *map(format_bytes, (rank.parameters, rank.gradients, rank.masters, rank.master_gradients)),
                format_bytes(rank.optimizer_state),
                format_bytes(rank.model_states),
                format_bytes(rank.step_buffer),
                "-" if rank.activations is None else format_bytes(rank.activations),
                str(rank.in_flight),
                format_bytes(rank.recompute),
                format_bytes(rank.total),
            )
            for rank in self.ranks
        ]
        widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
        lines = [f"Memory per rank, {self.layout} on {self.layout.devices} device(s), {self.precision}:"]
        lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in (header, *rows)]
        largest = self.largest
        verdict = ""
        if self.device_memory is not None:
            spare = self.device_memory - largest.total
            verdict = (
                f"; fits in {format_bytes(self.device_memory)} ({format_bytes(spare)} to spare)"
                if spare >= 0
                else f"; does NOT fit in {format_bytes(self.device_memory)} ({format_bytes(-spare)} over)"
            )
            if self.fits is None and spare >= 0:
                verdict = f"; unknown whether it fits in {format_bytes(self.device_memory)}: activations not measured"
        lines.append(
            f"Largest rank: stage {largest.stage} (ranks {_ranks_text(largest.ranks)}), "
            f"{format_bytes(largest.total)}{verdict}."
        )
        lines.append(f"Activations: {self.activation_note}")
        assumptions = (*ASSUMPTIONS, _SHARDED_ASSUMPTION) if self.layout.shard_optimizer_state else ASSUMPTIONS
        if self.layout.sdp > 1:  # no 16-bit copies nor separate masters: the fp32 shards are both
            assumptions = (ASSUMPTIONS[0], *ASSUMPTIONS[2:], _SDP_ASSUMPTION)
        lines += [f"Assumes {line}." for line in assumptions]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def plot(self, path: str | Path) -> Path:
        """Draw the per-stage bars, stacked by kind, against the device memory into ``path`` (needs matplotlib)."""
        return plot_memory(self, path)


def estimate_memory(
    model: nn.Module,
    *,
    config: SMPConfig | Mapping[str, Any] | None = None,
    world_size: int | None = None,
    device_memory: int | str | None = None,
    batch: Any = None,
    micro_batch_size: int | None = None,
    sequence_length: int | None = None,
) -> MemoryReport:
    """Per-rank bytes of training ``model`` with ``config`` on ``world_size`` devices.

    ``model`` is the model as built (a LightningModule after ``configure_model``), ideally on the meta device
    (``with torch.device("meta"):``), which costs no memory. ``config`` is an `SMPConfig` or the `SMPStrategy`
    keyword arguments (``smp_options`` included); ``world_size`` defaults to the model-parallel degree times the
    context-parallel degree (dp = 1). Under context parallelism the activations are one rank's part of the sequences.
    ``device_memory`` (bytes, or text such as ``"40GiB"``) adds the verdict whether the largest rank fits.

    The activations are measured on ``batch``: one training batch of one data-parallel replica, as the dataloader
    gives it (its tensors' shapes matter, not their values; real tensors are not touched), traced on the meta device
    through ``training_step`` (or ``forward``). ``micro_batch_size`` and ``sequence_length`` resize it: every tensor's
    dim 0 to ``micro_batch_size`` x ``microbatches``, dim 1 (of tensors with one) to ``sequence_length``; without a
    batch a Hugging Face transformers model gets token ids of that size. Without either, or when the trace fails,
    ``fits`` is None and the report says why.
    """
    config = SMPConfig.of(config)
    world_size = config.replica_parallel_degree if world_size is None else world_size
    dp = config.data_parallel_degree(world_size)
    layout = Layout(
        config.pipeline_parallel_degree,
        config.tensor_parallel_degree,
        dp,
        config.shard_optimizer_state and dp > 1,
        config.sharded_data_parallel_degree,
    )
    batch = example_batch(
        model, batch, config=config, micro_batch_size=micro_batch_size, sequence_length=sequence_length
    )
    return _report(model, layout, config, _as_bytes(device_memory), batch, {})


def fitting_layouts(
    model: nn.Module | Callable[[int], nn.Module],
    *,
    devices: int,
    device_memory: int | str,
    config: SMPConfig | Mapping[str, Any] | None = None,
    batch: Any = None,
    micro_batch_size: int | None = None,
    sequence_length: int | None = None,
) -> list[MemoryReport]:
    """The layouts of ``devices`` devices whose largest rank fits ``device_memory``, smallest model-parallel degree
    (pp × tp) first, then least memory. Every pp and tp whose product divides ``devices`` is tried (dp is the rest);
    with dp > 1 a layout that does not fit is tried again with ``shard_optimizer_state``, then (pp = 1) with
    ``sharded_data_parallel_degree`` = dp, so sharding is listed where it is what makes the layout fit; ``config``'s
    own sharding is where the tries start (with sharded data parallelism, pp > 1 layouts are left out, as smp
    could not combine them). Other settings come from ``config``,
    ``partition`` only where pp is the configured one. ``model`` may be a
    function of the tensor-parallel degree that builds the model, for models whose construction reads it
    (``smp.model_creation(tensor_parallelism=smp.tp_size() > 1)``). Layouts the model cannot take (a trunk with
    fewer children than stages, a plan that does not divide) are left out, and so are all layouts when the
    activations cannot be measured (``batch`` etc. as for `estimate_memory`): none is known to fit then."""
    base = SMPConfig.of(config)
    memory = _as_bytes(device_memory)
    built: dict[int, nn.Module] = {}
    traces: dict[tuple[int, bool], ActivationTrace | TraceError] = {}  # per tensor-parallel degree, pipelined or not
    found = []
    for degrees in _layouts(devices):
        plans: dict[int, build.BuildPlan] = {}  # per sdp: the optimizer state's sharding does not change the plan
        for layout in _sharding_tries(degrees, base):
            try:
                layout_config = dataclasses.replace(
                    base,
                    pipeline_parallel_degree=layout.pp,
                    tensor_parallel_degree=layout.tp,
                    partition=base.partition if layout.pp == base.pipeline_parallel_degree else None,
                    shard_optimizer_state=layout.shard_optimizer_state,
                    sharded_data_parallel_degree=layout.sdp,
                )
                if not isinstance(model, nn.Module) and layout.tp not in built:
                    built[layout.tp] = model(layout.tp)
                module = model if isinstance(model, nn.Module) else built[layout.tp]
                sized = example_batch(
                    module,
                    batch,
                    config=layout_config,
                    micro_batch_size=micro_batch_size,
                    sequence_length=sequence_length,
                )
                if layout.sdp not in plans:
                    plans[layout.sdp] = build.plan(
                        module, config=layout_config, tp=layout.tp, pp=layout.pp, sdp=layout.sdp
                    )
                report = _report(module, layout, layout_config, memory, sized, traces, plans[layout.sdp])
            except ValueError:
                break  # the model cannot take these degrees; its own error says why when they are the configured ones
            if report.fits:
                found.append(report)
                break
    return sorted(found, key=lambda r: (r.layout.model_parallel, r.largest.total, r.layout.pp))


def _sharding_tries(degrees: Layout, base: SMPConfig) -> list[Layout]:
    """``degrees`` unsharded, with the optimizer state sharded, then (pp = 1) with sharded data parallelism over
    every replica: from the sharding ``base`` asks for on, as far as the degrees allow."""
    if degrees.dp == 1:
        return [degrees]
    tries = [degrees, dataclasses.replace(degrees, shard_optimizer_state=True)]
    if degrees.pp == 1:
        tries.append(dataclasses.replace(degrees, sdp=degrees.dp))
    start = 2 if base.sharded_data_parallel_degree > 1 else int(base.shard_optimizer_state)
    return tries[start:]


def _sharding_name(layout: Layout) -> str:
    if layout.sdp > 1:
        return f"sdp={layout.sdp}"
    return "sharded" if layout.shard_optimizer_state else "whole"


def layouts_table(reports: Sequence[MemoryReport]) -> str:
    """One line per layout: the degrees and the largest rank's memory, by kind."""
    header = ("pp", "tp", "dp", "optimizer state", "largest rank", "model states", "activations in flight", "stage")
    rows = [
        (
            str(r.layout.pp),
            str(r.layout.tp),
            str(r.layout.dp),
            _sharding_name(r.layout),
            format_bytes(r.largest.total),
            format_bytes(r.largest.model_states),
            "-" if r.largest.activations is None else format_bytes(r.largest.activations * r.largest.in_flight),
            str(r.largest.stage),
        )
        for r in reports
    ]
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in (header, *rows))


# -- the per-rank count -----------------------------------------------------------------------------------------


def _report(
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


def _layouts(devices: int) -> list[Layout]:
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices={devices!r} is not a device count; give an integer >= 1.")
    return [
        Layout(pp, tp, devices // (pp * tp))
        for pp in range(1, devices + 1)
        for tp in range(1, devices // pp + 1)
        if devices % (pp * tp) == 0
    ]


def _as_bytes(memory: int | str | None) -> int | None:
    if memory is None or (isinstance(memory, int) and not isinstance(memory, bool)):
        return memory
    if isinstance(memory, str):
        return parse_bytes(memory)
    raise ValueError(f"device_memory={memory!r} is not a size; give bytes (an int) or text such as '40GiB'.")


def _ranks_text(ranks: Sequence[int]) -> str:
    return ",".join(map(str, ranks)) if len(ranks) <= 8 else f"{','.join(map(str, ranks[:7]))},... ({len(ranks)})"
