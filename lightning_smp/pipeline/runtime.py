"""The pipeline engine: one step's schedule on this rank, running the user's step function per microbatch.

Why our own driver rather than ``torch.distributed.pipelining``: smp's contract runs the user's whole
``training_step`` per microbatch on every rank (the code before the trunk, ``self.log``, the loss) and cuts it at
trunk-child boundaries while it runs; torch's ``PipelineStage`` runs one ``nn.Module.forward(*args)`` per stage and
a ``loss_fn(output, target)`` on the last, so a LightningModule's step does not fit it, and it cannot keep tied
weights in sync (pytorch #51931). The schedules are the same family (schedule.py), and
``benchmarks/pipeline_bench.py`` measures this driver against torch's on the same split.

It knows no Lightning: each door (the Trainer's strategy, Fabric, ``smp.step``) hands it the microbatches' arguments,
a step callable, the loss scaling and how to record the step's results. Owns the schedule loop: the microbatch loop,
forward and backward per action (a backward split in two where the plan has a W action for it, `split_backward`),
and dividing the pipelined loss by the microbatches (the scale and the accumulation count applied by the door's
callable). It hands the rest to one object each: the step's gradients wait in `HeldGradients` until the door's
backward call, `StageGradientReduction` reduces them (on the last step of an accumulation its all-reduces start while
the schedule runs: the engine arms them around each chunk's last backward), the door's `StepResults` packs the last
stage's outputs (and under Lightning its logs and metrics) and replays them on every stage, and the `PipelineLayout`
says which parameters this stage trains. Not owned: the plans (partition.py, schedule.py,
layout.py), routing inside the trunk (stage.py), messages (p2p.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn

from lightning_smp.overlap import ReadyBuckets
from lightning_smp.pipeline import schedule as schedules
from lightning_smp.pipeline.held_gradients import HeldGradients
from lightning_smp.pipeline.layout import PipelineLayout, learn_shared_owners
from lightning_smp.pipeline.p2p import NOTHING, Transport
from lightning_smp.pipeline.partition import OutsidePlan, PartitionPlan, bytes_per_param
from lightning_smp.pipeline.reduction import StageGradientReduction
from lightning_smp.pipeline.results import StepRecord, StepResults
from lightning_smp.pipeline.split_backward import BackwardSplitter, WeightGradients
from lightning_smp.pipeline.stage import StageExit, TrunkRouter, hold_outside
from lightning_smp.placement import mark_norm_duplicate

if TYPE_CHECKING:
    from lightning_smp.config import SMPConfig
    from lightning_smp.reduction import ReductionPlan
    from lightning_smp.topology import Topology

__all__ = ["PipelineEngine", "build_engine"]

log = logging.getLogger(__name__)


def build_engine(
    module: nn.Module,
    *,
    topology: Topology,
    config: SMPConfig,
    plan: PartitionPlan,
    outside: OutsidePlan,
    reduction: ReductionPlan,
) -> PipelineEngine:
    """Print the partition ``plan`` (rank 0), keep this rank's stage of it in ``module`` (in place: other stages'
    trunk children and the modules ``outside`` the trunk that it does not hold become placeholders) and return the
    engine that runs its steps, reducing over the replicas as the run's ``reduction`` plan says. The partition plan
    is `lightning_smp.build`'s."""
    trunk_params = [sum(plan.children[i].params for i in plan.owned(s)) for s in range(plan.stages)]
    per_stage = [a + b for a, b in zip(trunk_params, outside.params_per_stage, strict=True)]
    if 0 in per_stage:
        empty = per_stage.index(0)
        raise ValueError(
            f"pipeline stage {empty} would hold no parameters ({plan.table().splitlines()[2 + empty]}), "
            "and torch optimizers refuse an empty parameter list. Give every stage a child with parameters "
            f"with partition=(...) (now {plan.sizes}), or use fewer stages."
        )
    layout = PipelineLayout(plan, outside)
    rank_zero_info(
        plan.table(
            outside=outside.params_per_stage, bytes_per_param=bytes_per_param(config.half_dtype or torch.float32)
        )
    )
    stage = topology.rank("pp")
    log.debug("PipelineEngine: stage %d of %d holds trunk children %s", stage, topology.pp, plan.owned(stage))
    router = TrunkRouter(module.get_submodule(plan.trunk), plan, stage)
    hold_outside(module, outside, router)
    reduce = StageGradientReduction(topology=topology, plan=reduction)
    engine = PipelineEngine(module, layout=layout, router=router, topology=topology, config=config, reduce=reduce)
    if topology.pp > 1 and topology.is_last_stage:
        for param in engine.tied_parameters:
            mark_norm_duplicate(param, axis="pp")  # the first stage's copy counts in the global norm
    return engine


@dataclass
class _Live:
    """What a forward left for its backward."""

    leaves: list[Tensor]
    outputs: list[Tensor] = field(default_factory=list)
    grads: list[Any] = field(default_factory=list)  # the posted receives of the outputs' gradients
    loss: Tensor | None = None


@dataclass
class _Step:
    microbatches: Sequence[tuple[tuple, dict]]  # each microbatch's positional and keyword arguments of the step
    step: Callable[..., Any]
    results: StepResults
    training: bool
    scale_loss: Callable[..., Tensor] | None = None  # training: what a microbatch's backward starts from
    params: list[nn.Parameter] = field(default_factory=list)  # this stage's trained parameters
    reduction: ReadyBuckets | None = None  # the last step of an accumulation: the replicas' all-reduce
    splitter: BackwardSplitter | None = None  # when the plan splits backwards
    live: dict[tuple[int, int], _Live] = field(default_factory=dict)
    weights: dict[tuple[int, int], WeightGradients] = field(default_factory=dict)  # W passes not run yet
    record: StepRecord = field(default_factory=StepRecord)
    package: tuple | None = None  # the step's result, as the last stage sent it


class PipelineEngine:
    """Runs training and evaluation steps of one rank's pipeline stage. Create it with `build_engine`.

    Args:
        module: the model (a LightningModule, or any module), holding this rank's stage.
        layout: where every parameter lives (`PipelineLayout`, of `lightning_smp.build`'s plan).
        router: routes the trunk's children on this rank.
        topology: the run's process groups.
        config: the run's settings.
        reduce: reduces the step's gradients at the last step of an accumulation (`StageGradientReduction`).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        layout: PipelineLayout,
        router: TrunkRouter,
        topology: Topology,
        config: SMPConfig,
        reduce: StageGradientReduction,
    ) -> None:
        self._module = module
        self._layout = layout
        self._router = router
        self._topology = topology
        self._config = config
        self._reduce = reduce
        self._stage = topology.rank("pp")
        self._transport: Transport | None = None
        self._held = HeldGradients()
        self._synced_once = False
        self._reduction: ReadyBuckets | None = None  # started by the last training step, for `finish_backward`

    @property
    def plan(self) -> PartitionPlan:
        return self._layout.plan

    @property
    def layout(self) -> PipelineLayout:
        """Where every parameter lives; which stage trains a shared one is known after the first synced step."""
        return self._layout

    @property
    def module(self) -> nn.Module:
        """The model whose trunk this engine routes (a later fit/validate/test reuses the engine)."""
        return self._module

    @property
    def tied_parameters(self) -> list[nn.Parameter]:
        """Parameters held by the first and the last stage (tied embedding and head); kept identical. Empty on the
        other stages. Looked up by name, so a parameter replaced after setup (materialised) is found."""
        if not (self._topology.is_first_stage or self._topology.is_last_stage):
            return []
        params = [self._module.get_parameter(name) for name in self._layout.outside.tied]
        return list({id(p): p for p in params}.values())

    def owned_parameter_names(self) -> set[str]:
        """Names (in the LightningModule) of the parameters whose copy on this rank is the trained one; every
        parameter is owned by exactly one stage, and a checkpoint takes each from its owner (`PipelineLayout`)."""
        return self._layout.trained_names(self._module, self._stage)

    # -- steps -----------------------------------------------------------------------------------------------

    def training_step(
        self,
        microbatches: Sequence[tuple[tuple, dict]],
        *,
        step: Callable[..., Any],
        results: StepResults,
        scale_loss: Callable[..., Tensor],
        sync: bool,
    ) -> Any:
        """Forward and backward of ``step(*args, **kwargs)`` for every microbatch's arguments; returns what
        ``results`` replays of the last stage's outputs, on every stage. Each microbatch's backward starts from
        ``scale_loss(loss, divide_by=len(microbatches))`` (`PrecisionRules.loss_scaling`: the loss scale and the
        accumulation count are the door's). The gradients wait for `finish_backward`; with ``sync`` (the last step
        of an accumulation) their reduction over the replicas starts during the last backwards."""
        params = self._trainable()
        if self._reduction is not None:  # a step whose backward was skipped: its reductions end here
            self._reduction.finish()
        self._reduction = self._reduce.start(trained=params, tied=self.tied_parameters) if sync else None
        state = _Step(
            microbatches,
            step,
            results,
            training=True,
            scale_loss=scale_loss,
            params=params,
            reduction=self._reduction,
        )
        with self._held.collect(params):
            self._run(state)
            if self._reduction is not None:
                self._reduction.launch_rest()  # parameters no backward reached: their gradients as they are
        return self._share(state)

    def evaluation_step(
        self, microbatches: Sequence[tuple[tuple, dict]], *, step: Callable[..., Any], results: StepResults
    ) -> Any:
        """Forward of every microbatch (validation, test, predict); returns what ``results`` replays, on every
        stage."""
        state = _Step(microbatches, step, results, training=False)
        self._run(state)
        return self._share(state)

    def settle(self) -> None:
        """At the end of a training or evaluation loop: wait for this stage's last sends and meet the other
        stages. A completed send has left this process, not necessarily reached its receiver: after the last step
        the last stage could leave ``fit`` and exit, closing its connections before the earlier stages have received
        that step's result (gloo: "Connection closed by peer" on their side)."""
        if self._transport is not None:
            self._transport.wait_sends()
        dist.barrier(group=self._topology.group("pp"))

    def finish_backward(self, *, sync: bool) -> bool:
        """Add the gradients of the last pipelined step to ``.grad`` (Lightning's backward call); with ``sync``
        (the last step of an accumulation) reduce them over tied stages and data-parallel replicas. Returns
        False when there was nothing pipelined to finish."""
        reduction, self._reduction = self._reduction, None
        if sync:
            tied = {id(p) for p in self.tied_parameters}
            earlier = [p.grad for p in self._trainable() if p.grad is not None and id(p) not in tied]
            self._reduce.finish(reduction, earlier=earlier)
        if not self._held.release():
            return False
        if sync:
            self._reduce.reduce_tied(self.tied_parameters)
            if not self._synced_once:
                self._synced_once = True
                self._layout = learn_shared_owners(
                    self._layout,
                    self._module,
                    stage=self._stage,
                    group=self._topology.group("pp"),
                    device=self._device(),
                )
        return True

    # -- the schedule ------------------------------------------------------------------------------------------

    def _run(self, state: _Step) -> None:
        plan = schedules.build(
            self._config.pipeline,
            stages=self._topology.pp,
            stage=self._stage,
            microbatches=len(state.microbatches),
            active=self._config.resolved_active_microbatches,
            chunks_per_stage=self.plan.chunks_per_stage,
            training=state.training,
        )
        transport = self._transport_()
        transport.begin_step()
        for chunk in self.plan.chunks_of(self._stage):
            if chunk > 0:
                transport.expect(src=transport.peer(-1), tag=2 * (chunk - 1), count=len(state.microbatches))
        if not self._topology.is_last_stage:  # gloo moves a message only once its receive is posted
            transport.expect(src=self._topology.ranks("pp")[-1], tag=self._result_tag(state.training), count=1)
        split = {(a.microbatch, a.chunk) for a in plan if a.kind == schedules.WEIGHT}
        if split:
            state.splitter = BackwardSplitter(state.params)
        # a chunk's last backward or weight-gradient action makes its parameters' gradients final
        last = {a.chunk: i for i, a in enumerate(plan) if a.kind in (schedules.BACKWARD, schedules.WEIGHT)}
        finals = set(last.values()) if state.reduction is not None else set()
        for index, action in enumerate(plan):
            with state.reduction.armed() if index in finals else nullcontext():
                if action.kind == schedules.FORWARD:
                    self._forward(action, state, transport)
                elif action.kind == schedules.BACKWARD:
                    self._backward(action, state, transport, split=(action.microbatch, action.chunk) in split)
                else:
                    self._weight(action, state)
        transport.wait_sends()

    def _forward(self, action: schedules.Action, state: _Step, transport: Transport) -> None:
        chunk, index = action.chunk, action.microbatch
        is_last = chunk == self.plan.num_chunks - 1
        received, leaves = NOTHING, []
        if chunk > 0:
            received, leaves = transport.recv_activation(
                src=transport.peer(-1), requires_grad=state.training, tag=2 * (chunk - 1)
            )
        capture = state.results.capture(watch_metrics=is_last)
        exited = False
        with self._router.run(chunk, received) as call, capture:
            try:
                args, kwargs = state.microbatches[index]
                output = state.step(*args, **kwargs)
            except StageExit as stop:
                output, exited = stop.output, True
        if is_last:
            if received is not NOTHING and not call.reached_entry:
                raise RuntimeError(
                    f"the last pipeline stage received microbatch {index}'s activation, but its step never reached "
                    "the trunk. The step must run the trunk for every microbatch, or for none."
                )
            state.record.add(index, output, capture)  # the loss keeps its graph in `live` until its backward
            if len(state.record.outputs) == len(state.microbatches):
                self._send_results(state, transport)
            if state.training:
                state.live[(index, chunk)] = _Live(leaves, loss=_loss_of(output))
            return
        if not exited:
            if call.reached_entry or received is not NOTHING:
                raise RuntimeError(
                    f"pipeline stage {self._stage}'s step returned before the end of its part of the trunk "
                    f"(microbatch {index}). A pipelined step must run every trunk child, in order, once."
                )
            output = NOTHING  # the step does not use the trunk: every stage runs it whole
        sent = transport.send_activation(output, dst=transport.peer(1), tag=2 * chunk)
        if state.training:
            grads = transport.post_grads(sent, src=transport.peer(1), tag=2 * chunk + 1)
            state.live[(index, chunk)] = _Live(leaves, outputs=sent, grads=grads)

    def _backward(self, action: schedules.Action, state: _Step, transport: Transport, *, split: bool) -> None:
        """The backward of one microbatch through one chunk; ``split``: only its input gradient, its weight
        gradients kept for the plan's W action (`split_backward`)."""
        chunk = action.chunk
        live = state.live.pop((action.microbatch, chunk))
        outputs: list[Tensor] = []
        grads: list[Tensor | None] = []
        if chunk == self.plan.num_chunks - 1:
            if live.loss is not None and live.loss.requires_grad:
                assert state.scale_loss is not None
                outputs, grads = [state.scale_loss(live.loss, divide_by=len(state.microbatches))], [None]
        else:
            received = transport.wait_grads(live.grads)
            if live.outputs:
                outputs, grads = live.outputs, received
        if split:
            assert state.splitter is not None
            state.weights[(action.microbatch, chunk)] = state.splitter.backward_input(outputs, grads, live.leaves)
        elif outputs:
            torch.autograd.backward(outputs, grads)
        if chunk > 0:
            transport.send_grads(live.leaves, dst=transport.peer(-1), tag=2 * (chunk - 1) + 1)

    def _weight(self, action: schedules.Action, state: _Step) -> None:
        """The weight gradients of a backward that ran split (a zero-bubble plan's W action)."""
        state.weights.pop((action.microbatch, action.chunk))()

    def _send_results(self, state: _Step, transport: Transport) -> None:
        """On the last stage, once its last microbatch's forward is done: send the step's result (the merged output,
        the reduced ``self.log`` calls, the metrics) to the other stages, without waiting. They receive it once
        their own last backward is done, while this stage runs its last backwards (and held weight gradients):
        neither waits for the other's tail. A collective would hold each stage until the slowest's end."""
        state.package = state.results.pack(state.record)
        for rank in self._topology.ranks("pp")[:-1]:
            transport.send_activation(state.package, dst=rank, tag=self._result_tag(state.training))

    def _share(self, state: _Step) -> Any:
        """The last stage's merged output, on every stage; its ``self.log`` calls and metrics replayed."""
        package = state.package
        if not self._topology.is_last_stage:
            last = self._topology.ranks("pp")[-1]
            package, _ = self._transport_().recv_activation(
                src=last, requires_grad=False, tag=self._result_tag(state.training)
            )
        assert package is not None  # the last stage sent it after its last forward
        return state.results.replay(package, updated_here=self._topology.is_last_stage)

    def _result_tag(self, training: bool) -> int:
        """The tag of the step results' link: after every chunk link's two tags; training and evaluation apart."""
        return 2 * self.plan.num_chunks + int(training)

    def _trainable(self) -> list[nn.Parameter]:
        return [p for p in self._module.parameters() if p.requires_grad]

    def _device(self) -> torch.device:
        return next(self._module.parameters(), torch.empty(0)).device

    def _transport_(self) -> Transport:
        if self._transport is None:
            self._transport = Transport(self._topology, self._device())
        return self._transport


def _loss_of(output: Any) -> Tensor:
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, Tensor):
        raise RuntimeError(
            f"the step returned {type(output).__name__} on the last pipeline stage; with pipeline parallelism "
            "it must return the loss tensor, or a dict with a 'loss' tensor, for every microbatch (under @smp.step: "
            "call model.backward(loss) in every microbatch, or run an evaluation step under torch.no_grad())."
        )
    return loss
