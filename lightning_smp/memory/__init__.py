"""The memory planner: what each rank of a pp × tp × dp layout holds, computed before any process starts.

Owns the arithmetic only: bytes per element of parameters, gradients, fp32 masters and optimizer state, whether the
largest rank fits a device, and the search over layouts for a device count. What a rank holds is not re-derived
here: the package's own pure plans run on the model (best built on the meta device) — `lightning_smp.build.plan`, the
one the strategy applies, says which parameters each tensor-parallel rank keeps 1/tp of, which trunk children each
stage keeps, which stages keep the modules outside the trunk and which modules sharded data parallelism shards; the
pipeline schedule how many microbatches a stage holds at once — and the activations are measured by tracing one
microbatch through the model as laid out (`activation_memory`), so the estimate follows the code that trains. Where
the trace cannot run, the activations are unknown and so is whether a layout fits.

One module per concern: `report` (the report types and tables), `states` (what one rank of a layout holds), and
here the two entry points and the search over layouts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from lightning_smp import build
from lightning_smp.activation_memory import ActivationTrace, TraceError, example_batch
from lightning_smp.config import SMPConfig
from lightning_smp.memory.report import Layout, MemoryReport, RankMemory, layouts_table
from lightning_smp.memory.states import layout_report
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
    return layout_report(model, layout, config, _as_bytes(device_memory), batch, {})


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
                report = layout_report(module, layout, layout_config, memory, sized, traces, plans[layout.sdp])
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
