"""The memory planner's report: a layout's degrees (`Layout`), what one rank holds (`RankMemory`), the whole layout's
verdict with its assumptions (`MemoryReport`, with its table, its text and its chart), and the table that lists
several layouts (`layouts_table`). Types and text only: the counting is `memory.states`, the search `memory`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lightning_smp.memory_plot import plot_memory
from lightning_smp.units import format_bytes

__all__ = ["ASSUMPTIONS", "Layout", "MemoryReport", "RankMemory", "layouts_table"]

SHARDED_ASSUMPTION = (
    "shard_optimizer_state: each replica keeps 1/dp of the fp32 masters, their gradients and the optimizer state of "
    "every trained parameter (fp32 ones too), padded per bucket; a step adds flat buffers of the stage's gradients "
    "in their dtype (every bucket's reduce-scatter at once: they start during backward), then one bucket's "
    "all-gather at a time; saving a checkpoint gathers whole fp32 "
    "masters and optimizer state for a moment (not counted)"
)
SDP_ASSUMPTION = (
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
        assumptions = (*ASSUMPTIONS, SHARDED_ASSUMPTION) if self.layout.shard_optimizer_state else ASSUMPTIONS
        if self.layout.sdp > 1:  # no 16-bit copies nor separate masters: the fp32 shards are both
            assumptions = (ASSUMPTIONS[0], *ASSUMPTIONS[2:], SDP_ASSUMPTION)
        lines += [f"Assumes {line}." for line in assumptions]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def plot(self, path: str | Path) -> Path:
        """Draw the per-stage bars, stacked by kind, against the device memory into ``path`` (needs matplotlib)."""
        return plot_memory(self, path)


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


def _ranks_text(ranks: Sequence[int]) -> str:
    return ",".join(map(str, ranks)) if len(ranks) <= 8 else f"{','.join(map(str, ranks[:7]))},... ({len(ranks)})"
