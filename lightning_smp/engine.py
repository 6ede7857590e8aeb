"""The step engine: one training or evaluation step on this rank, the same behind every door.

Lightning's Trainer (`SMPStrategy`), Lightning Fabric and smp v1 scripts (``@smp.step``) each build a `RunContext`
once (the settings, the rank layout with its process groups, the gradient-reduction plan) and hand their steps to
one `StepEngine`, which knows no Lightning and never calls back into a door. `StepEngine.training_step` shows a step
in order: the batch the tensor-parallel group trains on (``prescaled_batch``, `tp_batches`), this rank's chunks of
each sequence (context parallelism), then forward and backward of every microbatch through the pipeline's schedule
(pp > 1) or the step per microbatch (pp = 1: the backward is the door's, as Lightning's loop or the script calls
it).
Outputs are recorded by the door's `StepResults`. The optimizer step (masters, overflow vote, clipping, update,
scaler) stays with `MasterWeightOptimizer`; the reduction over the replicas is the pipeline engine's, DDP's, ZeRO-1's
or FSDP2's, as the run's `ReductionPlan` says.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from torch import Tensor

from lightning_smp import context_parallel, tp_batches
from lightning_smp import topology as topology_builder
from lightning_smp.config import SMPConfig
from lightning_smp.pipeline.results import StepResults
from lightning_smp.pipeline.runtime import PipelineEngine
from lightning_smp.reduction import ReductionPlan, plan_reduction
from lightning_smp.topology import Topology

__all__ = ["Microbatches", "RunContext", "StepEngine"]

Microbatches = Callable[[tuple, dict], Sequence[tuple[tuple, dict]]]
"""How a door cuts a step's arguments into the microbatches' ``(args, kwargs)`` (its rule and its error message)."""


@dataclass(frozen=True, eq=False)
class RunContext:
    """One run: its settings, its rank layout with every process group, and who reduces gradients over the
    replicas. Built once per run (`start`) and passed to what needs it; its topology is the one owner of the run's
    process groups, which everything else looks up through it, and `Topology.release` ends the run's hold on them
    (at interpreter exit, `fault_tolerance.close_process_groups`)."""

    config: SMPConfig
    topology: Topology
    reduction: ReductionPlan

    @classmethod
    def start(
        cls, config: SMPConfig, *, world_size: int, device_type: str, timeout: timedelta | None = None
    ) -> RunContext:
        """The context of a run of ``config`` over ``world_size`` processes (collective: every rank calls it, after
        the default process group exists)."""
        topology = topology_builder.build(
            dp=config.data_parallel_degree(world_size),
            pp=config.pipeline_parallel_degree,
            tp=config.tensor_parallel_degree,
            order=config.placement_order,
            device_type=device_type,
            timeout=timeout,
            sdp=config.sharded_data_parallel_degree,
            cp=config.context_parallel_degree,
        )
        return cls(config, topology, plan_reduction(config, topology))


@dataclass(eq=False)
class StepEngine:
    """Runs the steps of one model on this rank of ``run``; ``pipeline`` is the model's pipeline engine (None
    without pipeline parallelism) and ``microbatches`` the door's rule for cutting a step's arguments."""

    run: RunContext
    pipeline: PipelineEngine | None
    microbatches: Microbatches
    _checked: set[str] = field(default_factory=set)  # the steps whose first batch `tp_batches.check_batches` compared
    _attending: set[str] = field(default_factory=set)  # the steps seen to run attention under context parallelism

    def training_step(
        self,
        step: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        *,
        results: StepResults,
        scale_loss: Callable[..., Tensor],
        sync: bool,
        name: str = "training_step",
    ) -> Any:
        """One training step of ``step(*args, **kwargs)`` (``args[0]`` the batch). Under a pipeline every
        microbatch's backward runs here, from ``scale_loss(loss, divide_by=microbatches)``, and the gradients wait
        for `finish_backward`; with ``sync`` (the last step of an accumulation) their reduction starts during the
        last backwards. Without one, the step runs per microbatch (the door's rule: the Trainer's step runs once) and
        the door's backward follows, or runs inside (``model.backward(loss)`` under ``@smp.step``)."""
        args, own = self._tensor_parallel_group_batch(name, args)  # 1. the batch this tensor-parallel group trains on
        args = self._split_sequences(args)  # 2. this rank's chunks of each sequence
        with self.attention(name):  # 3. attention over the whole split sequences
            if self.pipeline is None:  # 4. the step per microbatch; the door's backward follows (or runs inside)
                return own(results.gather([step(*a, **k) for a, k in self.microbatches(args, kwargs)]))
            output = self.pipeline.training_step(  # 4. forward and backward of every microbatch, on the schedule
                self.microbatches(args, kwargs), step=step, results=results, scale_loss=scale_loss, sync=sync
            )
        return own(output)

    def evaluation_step(
        self, step: Callable[..., Any], args: tuple, kwargs: dict, *, results: StepResults, name: str
    ) -> Any:
        """A validation, test or predict step (``name``): as `training_step`, forward only."""
        args, own = self._tensor_parallel_group_batch(name, args)
        args = self._split_sequences(args)
        with self.attention(name):
            if self.pipeline is None:
                return own(results.gather([step(*a, **k) for a, k in self.microbatches(args, kwargs)]))
            return own(self.pipeline.evaluation_step(self.microbatches(args, kwargs), step=step, results=results))

    def finish_backward(self, *, sync: bool) -> bool:
        """The door's backward call after a pipelined step: its held gradients join ``.grad`` (reduced with
        ``sync``). Returns False when there was no pipelined step to finish."""
        return self.pipeline is not None and self.pipeline.finish_backward(sync=sync)

    def settle(self) -> None:
        """At the end of a loop: no pipeline stage leaves before every stage has its last step's result."""
        if self.pipeline is not None:
            self.pipeline.settle()

    @contextmanager
    def attention(self, name: str) -> Generator[None, None, None]:
        """Under context parallelism, attention over the whole split sequence for a step or a backward (activation
        checkpointing recomputes attention in backward); the first of each kind of step must run attention
        (`context_parallel.attending_over_split_sequences`)."""
        topology = self.run.topology
        if topology.cp == 1:
            yield
            return
        check = name if name != "backward" and name not in self._attending else None
        with context_parallel.attending_over_split_sequences(topology, self.run.config.cp_comm_type, check=check):
            yield
        self._attending.add(name)

    def _tensor_parallel_group_batch(self, name: str, args: tuple) -> tuple[tuple, Callable[[Any], Any]]:
        """The step's arguments with the batch (``args[0]``) its tensor-parallel group trains on, as
        ``prescaled_batch`` defines it (`tp_batches`), and the function that cuts the step's output back to this
        rank's samples. The first batch of each kind of step is checked against the setting."""
        topology, prescaled = self.run.topology, self.run.config.prescaled_batch
        if topology.tp == 1 or not args:
            return args, _whole
        if name not in self._checked:
            tp_batches.check_batches(args[0], topology=topology, prescaled_batch=prescaled)
            self._checked.add(name)
        if prescaled:
            return args, _whole
        combined = tp_batches.combine(args[0], group=topology.group("tp"))
        return (combined.batch, *args[1:]), combined.own

    def _split_sequences(self, args: tuple) -> tuple:
        """Under context parallelism, the batch (``args[0]``, the same on every rank of a context-parallel group)
        cut to this rank's chunks of every sequence (`context_parallel.split_batch`)."""
        topology = self.run.topology
        if topology.cp == 1 or not args:
            return args
        return (context_parallel.split_batch(args[0], cp=topology.cp, rank=topology.rank("cp")), *args[1:])


def _whole(output: Any) -> Any:
    return output
