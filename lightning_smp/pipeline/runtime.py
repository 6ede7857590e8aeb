"""The pipeline engine: one step's schedule on this rank, running the user's step function per microbatch.

Why our own driver rather than ``torch.distributed.pipelining``: smp's contract runs the user's whole
``training_step`` per microbatch on every rank (the code before the trunk, ``self.log``, the loss) and cuts it at
trunk-child boundaries while it runs; torch's ``PipelineStage`` runs one ``nn.Module.forward(*args)`` per stage and
a ``loss_fn(output, target)`` on the last, so a LightningModule's step does not fit it, and it cannot keep tied
weights in sync (pytorch #51931). The schedules are the same family (schedule.py), and
``benchmarks/pipeline_bench.py`` measures this driver against torch's GPipe and 1F1B on the same split.

Owns: the microbatch loop, forward and backward per action, scaling the pipelined loss (× loss scale / (m × k)),
keeping the step's gradients aside until Lightning's backward call (Lightning zeroes gradients between
``training_step`` and ``backward``), the all-reduce of those gradients over data-parallel replicas (unless the
optimizer state is sharded: its optimizer reduce-scatters them) and of tied parameters over the first and last
stages, and handing every stage the last stage's outputs, ``self.log`` calls and the state of the torchmetrics
objects it logged. Not owned: the plan (partition.py, schedule.py), routing
inside the trunk (stage.py), messages (p2p.py).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.utils._pytree import tree_map
from torchmetrics import Metric

from lightning_smp.pipeline import schedule as schedules
from lightning_smp.pipeline.microbatch import merge_outputs, reduce_values, split_batch
from lightning_smp.pipeline.p2p import NOTHING, Transport
from lightning_smp.pipeline.partition import OutsidePlan, PartitionPlan, bytes_per_param
from lightning_smp.pipeline.stage import StageExit, TrunkRouter, hold_outside
from lightning_smp.placement import mark_norm_duplicate

if TYPE_CHECKING:
    from lightning_smp.config import SMPConfig
    from lightning_smp.topology import Topology

__all__ = ["PipelineEngine", "build_engine"]

log = logging.getLogger(__name__)

_BUCKET_ELEMENTS = 1 << 24
_LOG_SIGNATURE = inspect.signature(pl.LightningModule.log)
_REDUCE_NAMES = {torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min"}


def build_engine(
    module: pl.LightningModule, *, topology: Topology, config: SMPConfig, plan: PartitionPlan, outside: OutsidePlan
) -> PipelineEngine:
    """Print the partition ``plan`` (rank 0), keep this rank's stage of it in ``module`` (in place: other stages'
    trunk children and the modules ``outside`` the trunk that it does not hold become placeholders) and return the
    engine that runs its steps. The plan is `lightning_smp.build`'s."""
    if not module.automatic_optimization:
        raise ValueError(
            "pipeline_parallel_degree > 1 runs forward and backward of every microbatch inside the step, which "
            "needs automatic optimization; remove `self.automatic_optimization = False` (with one optimizer) or "
            "set pipeline_parallel_degree=1."
        )
    trunk = module.get_submodule(plan.trunk)
    trunk_params = [sum(plan.children[i].params for i in plan.owned(s)) for s in range(plan.stages)]
    per_stage = [a + b for a, b in zip(trunk_params, outside.params_per_stage, strict=True)]
    if 0 in per_stage:
        empty = per_stage.index(0)
        raise ValueError(
            f"pipeline stage {empty} would hold no parameters ({plan.table().splitlines()[2 + empty]}), "
            "and torch optimizers refuse an empty parameter list. Give every stage a child with parameters "
            f"with partition=(...) (now {plan.sizes}), or use fewer stages."
        )
    rank_zero_info(
        plan.table(
            outside=outside.params_per_stage, bytes_per_param=bytes_per_param(config.half_dtype or torch.float32)
        )
    )
    stage = topology.rank("pp")
    log.debug("PipelineEngine: stage %d of %d holds trunk children %s", stage, topology.pp, plan.owned(stage))
    router = TrunkRouter(trunk, plan, stage)
    hold_outside(module, outside, router)
    engine = PipelineEngine(module, plan=plan, router=router, topology=topology, config=config, outside=outside)
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
    microbatches: list[Any]
    rest: tuple
    kwargs: dict
    step: Callable[..., Any]
    training: bool
    factor: Tensor | float = 1.0
    live: dict[tuple[int, int], _Live] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)
    logs: dict[int, list[tuple[str, Any, dict[str, Any]]]] = field(default_factory=dict)
    metric_logs: dict[int, dict[str, tuple[Metric, Tensor | None, dict[str, Any]]]] = field(default_factory=dict)
    metric_inputs: dict[int, dict[int, list[tuple[tuple, dict]]]] = field(default_factory=dict)


class PipelineEngine:
    """Runs training and evaluation steps of one rank's pipeline stage. Create it with `build_engine`."""

    def __init__(
        self,
        module: pl.LightningModule,
        *,
        plan: PartitionPlan,
        router: TrunkRouter,
        topology: Topology,
        config: SMPConfig,
        outside: OutsidePlan,
    ) -> None:
        self._module = module
        self._plan = plan
        self._router = router
        self._topology = topology
        self._config = config
        self._outside = outside
        self._stage = topology.rank("pp")
        self._transport: Transport | None = None
        self._pending: list[tuple[nn.Parameter, Tensor | None]] | None = None
        self._shared_checked = False
        self._shared_owner: dict[str, int] = {}
        self._named_metrics: dict[int, tuple[str, Metric]] | None = None  # by id: name in the module, the metric
        self._step_copies: dict[int, Metric] = {}  # per logged metric: a copy that sees one step's inputs

    @property
    def plan(self) -> PartitionPlan:
        return self._plan

    @property
    def module(self) -> pl.LightningModule:
        """The LightningModule whose trunk this engine routes (a later fit/validate/test reuses the engine)."""
        return self._module

    @property
    def tied_parameters(self) -> list[nn.Parameter]:
        """Parameters held by the first and the last stage (tied embedding and head); kept identical. Empty on the
        other stages. Looked up by name, so a parameter replaced after setup (materialised) is found."""
        if not (self._topology.is_first_stage or self._topology.is_last_stage):
            return []
        return list({id(p): p for p in self._parameters(self._outside.tied)}.values())

    def _parameters(self, names: Sequence[str]) -> list[nn.Parameter]:
        return [self._module.get_parameter(name) for name in names]

    # -- steps -----------------------------------------------------------------------------------------------

    def training_step(
        self,
        args: tuple,
        kwargs: dict,
        *,
        step: Callable[..., Any],
        loss_scale: Tensor | None,
        grad_divisor: int,
    ) -> Any:
        """Forward and backward of every microbatch of the batch ``args[0]``; returns the last stage's output
        (loss = mean over microbatches) on every stage. The gradients wait for `finish_backward`."""
        microbatches = split_batch(args[0], self._config.microbatches)
        divisor = len(microbatches) * grad_divisor
        factor = loss_scale / divisor if loss_scale is not None else 1.0 / divisor
        state = _Step(microbatches, tuple(args[1:]), dict(kwargs), step, training=True, factor=factor)
        params = self._trainable()
        saved = [p.grad for p in params]
        for param in params:
            param.grad = None
        try:
            self._run(state)
            self._pending = [(p, p.grad) for p in params]
        finally:
            for param, grad in zip(params, saved, strict=True):
                param.grad = grad
        return self._share(state)

    def evaluation_step(self, args: tuple, kwargs: dict, *, step: Callable[..., Any]) -> Any:
        """Forward of every microbatch (validation, test, predict); returns the merged output on every stage."""
        microbatches = split_batch(args[0], self._config.microbatches)
        state = _Step(microbatches, tuple(args[1:]), dict(kwargs), step, training=False)
        self._run(state)
        return self._share(state)

    def settle(self) -> None:
        """At the end of a training or evaluation loop: wait for this stage's last sends and meet the other
        stages. A step's result sends otherwise complete during the next step; after the last one the last stage
        could leave ``fit`` and exit, closing its connections before the earlier stages have received that step's
        result (gloo: "Connection closed by peer" on their side)."""
        if self._transport is not None:
            self._transport.wait_sends()
        dist.barrier(group=self._topology.group("pp"))

    def finish_backward(self, *, sync: bool) -> bool:
        """Add the gradients of the last pipelined step to ``.grad`` (Lightning's backward call); with ``sync``
        (the last step of an accumulation) reduce them over tied stages and data-parallel replicas. Returns
        False when there was nothing pipelined to finish."""
        if self._pending is None:
            return False
        pending, self._pending = self._pending, None
        for param, grad in pending:
            if grad is None:
                continue
            if param.grad is None:
                param.grad = grad
            else:
                param.grad.add_(grad)
        if sync:
            self._reduce_gradients()
        return True

    # -- the schedule ------------------------------------------------------------------------------------------

    def _run(self, state: _Step) -> None:
        plan = schedules.build(
            self._config.pipeline,
            stages=self._topology.pp,
            stage=self._stage,
            microbatches=len(state.microbatches),
            active=self._config.resolved_active_microbatches,
            chunks_per_stage=self._plan.chunks_per_stage,
            training=state.training,
        )
        transport = self._transport_()
        transport.begin_step()
        for chunk in self._plan.chunks_of(self._stage):
            if chunk > 0:
                transport.expect(src=transport.peer(-1), tag=2 * (chunk - 1), count=len(state.microbatches))
        if not self._topology.is_last_stage:  # gloo moves a message only once its receive is posted
            transport.expect(src=self._topology.ranks("pp")[-1], tag=self._result_tag(state.training), count=1)
        for action in plan:
            if action.forward:
                self._forward(action, state, transport)
            else:
                self._backward(action, state, transport)
        transport.wait_sends()

    def _forward(self, action: schedules.Action, state: _Step, transport: Transport) -> None:
        chunk, index = action.chunk, action.microbatch
        is_last = chunk == self._plan.num_chunks - 1
        received, leaves = NOTHING, []
        if chunk > 0:
            received, leaves = transport.recv_activation(
                src=transport.peer(-1), requires_grad=state.training, tag=2 * (chunk - 1)
            )
        capture = _LogCapture(self._module, self._metrics() if is_last else ())
        exited = False
        with self._router.run(chunk, received) as call, capture:
            try:
                output = state.step(state.microbatches[index], *state.rest, **state.kwargs)
            except StageExit as stop:
                output, exited = stop.output, True
        if is_last:
            if received is not NOTHING and not call.reached_entry:
                raise RuntimeError(
                    f"the last pipeline stage received microbatch {index}'s activation, but its step never reached "
                    "the trunk. The step must run the trunk for every microbatch, or for none."
                )
            state.outputs[index] = _detach(output)  # the loss keeps its graph in `live` until its backward
            state.logs[index] = capture.calls
            state.metric_logs[index] = capture.metrics
            state.metric_inputs[index] = capture.metric_inputs
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

    def _backward(self, action: schedules.Action, state: _Step, transport: Transport) -> None:
        chunk = action.chunk
        live = state.live.pop((action.microbatch, chunk))
        if chunk == self._plan.num_chunks - 1:
            if live.loss is not None and live.loss.requires_grad:
                torch.autograd.backward(live.loss.float() * state.factor)
        else:
            grads = transport.wait_grads(live.grads)
            if live.outputs:
                torch.autograd.backward(live.outputs, grads)
        if chunk > 0:
            transport.send_grads(live.leaves, dst=transport.peer(-1), tag=2 * (chunk - 1) + 1)

    def _share(self, state: _Step) -> Any:
        """The last stage's merged output and reduced ``self.log`` calls, on every stage; the logs replayed.

        The last stage sends them without waiting (the sends complete during the next step), so it goes on to its
        optimizer step while the earlier stages finish their last backwards; they receive the result once those
        are done. A collective here would hold the last stage until the first one's last backward."""
        transport = self._transport_()
        stages = self._topology.ranks("pp")
        tag = self._result_tag(state.training)
        if self._topology.is_last_stage:
            indices = sorted(state.outputs)
            package = (
                merge_outputs([state.outputs[i] for i in indices]),
                _reduce_logs([state.logs[i] for i in indices]),
                self._describe_metrics(
                    [state.metric_logs[i] for i in indices], [state.metric_inputs[i] for i in indices]
                ),
            )
            for rank in stages[:-1]:
                transport.send_activation(package, dst=rank, tag=tag)
        else:
            package, _ = transport.recv_activation(src=stages[-1], requires_grad=False, tag=tag)
        merged, calls, metrics = package
        for name, value, options in calls:
            self._module.log(name, value, **options)
        for name, (path, forward, states, updates, options) in metrics.items():
            metric = self._module.get_submodule(path)
            if not self._topology.is_last_stage:  # the last stage updated it: take its state
                for state_name, value in states.items():
                    setattr(metric, state_name, _own(value))
                metric._update_count = int(updates)
                metric._computed = None
            metric._forward_cache = forward
            self._module.log(name, metric, **options)
        return merged

    def _describe_metrics(
        self,
        per_microbatch: Sequence[dict[str, tuple[Metric, Tensor | None, dict[str, Any]]]],
        inputs: Sequence[dict[int, list[tuple[tuple, dict]]]],
    ) -> dict[str, tuple[str, Tensor | None, dict[str, Any], Tensor, dict[str, Any]]]:
        """For each torchmetrics ``Metric`` logged by the step on the last stage: where it sits in the module, its
        step value, its state after the step and its update count, so that every stage's copy of it holds the same
        state (Lightning computes epoch values from the object, on every rank). The step value is the metric over
        all the inputs it was called with in the step, as one device computes it on the whole batch (the mean of
        the per-microbatch values only for a metric that was logged but never called, e.g. updated directly)."""
        described = {}
        for name in dict.fromkeys(name for calls in per_microbatch for name in calls):
            logged = [calls[name] for calls in per_microbatch if name in calls]
            metric, _, options = logged[-1]
            path = self._metric_path(metric)
            if path is None:
                raise ValueError(
                    f"self.log({name!r}, <{type(metric).__name__}>) inside a pipelined step: the metric must be an "
                    "attribute of the LightningModule (e.g. `self.train_acc = MulticlassAccuracy(...)` in __init__), "
                    "so that every pipeline stage holds a copy of it."
                )
            calls = [call for microbatch in inputs for call in microbatch.get(id(metric), [])]
            if calls:
                forward = self._step_value(metric, calls)
            else:
                forwards = [forward for _, forward, _ in logged if isinstance(forward, Tensor)]
                forward = torch.stack(forwards).float().mean() if forwards else None
            updates = torch.tensor(metric._update_count)
            described[name] = (path, forward, metric.metric_state, updates, options)
        return described

    def _step_value(self, metric: Metric, calls: list[tuple[tuple, dict]]) -> Any:
        """``metric`` computed on the step's inputs alone, in a copy kept for it (reset every step; no sync:
        Lightning's step value of a Metric is this rank's, its epoch value the synced one)."""
        copy = self._step_copies.get(id(metric))
        if copy is None:
            group, metric.process_group = metric.process_group, None  # a process group cannot be copied
            try:
                copy = self._step_copies[id(metric)] = metric.clone()
            finally:
                metric.process_group = group
            copy.distributed_available_fn = _never  # compute on this rank's values: never sync
        copy.reset()
        with torch.no_grad():
            for args, kwargs in calls:
                copy.update(*args, **kwargs)
            return _detach(copy.compute())

    def _metrics(self) -> list[Metric]:
        """The torchmetrics objects of the LightningModule (their calls are recorded during a step)."""
        return [metric for _, metric in self._module_metrics().values()]

    def _metric_path(self, metric: Metric) -> str | None:
        """``metric``'s name in the LightningModule, or None when it is not a submodule. The metrics are looked up
        once, and again only for a metric not seen before (it is then watched from the next step)."""
        if id(metric) not in self._module_metrics():
            self._named_metrics = None
        named = self._module_metrics().get(id(metric))
        return named[0] if named is not None else None

    def _module_metrics(self) -> dict[int, tuple[str, Metric]]:
        if self._named_metrics is None:
            modules = self._module.named_modules()
            self._named_metrics = {id(m): (name, m) for name, m in modules if isinstance(m, Metric)}
        return self._named_metrics

    def _result_tag(self, training: bool) -> int:
        """The tag of the step results' link: after every chunk link's two tags; training and evaluation apart."""
        return 2 * self._plan.num_chunks + int(training)

    # -- gradients ----------------------------------------------------------------------------------------------

    def _reduce_gradients(self) -> None:
        topology = self._topology
        tied = [p for p in self.tied_parameters if p.requires_grad]  # a frozen one gets no grad, as on one device
        if tied:
            for param in tied:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
            _all_reduce([p.grad for p in tied], topology.group("embedding"), divide_by=1)
        if topology.dp > 1 and not self._config.shard_optimizer_state:  # sharded: the optimizer reduce-scatters
            grads = [p.grad for p in self._trainable() if p.grad is not None]
            _all_reduce(grads, topology.group("dp"), divide_by=topology.dp)
        if not self._shared_checked:
            self._shared_checked = True
            self._check_shared_parameters()

    def _check_shared_parameters(self) -> None:
        """Once, at the first synchronised step: learn which stage trains each parameter that every stage holds
        (set directly on the LightningModule), and refuse one trained on several stages."""
        names = self._outside.shared
        if not names:
            return
        stages = self._topology.pp
        used = torch.zeros(stages, len(names), device=self._device())
        used[self._stage] = torch.tensor([float(p.grad is not None) for p in self._parameters(names)])
        dist.all_reduce(used, group=self._topology.group("pp"))
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
        self._shared_owner = {
            name: max(range(stages), key=row.__getitem__) for name, row in zip(names, table, strict=True)
        }

    def owned_parameter_names(self) -> set[str]:
        """Names (in the LightningModule) of the parameters whose copy on this rank is the trained one: its trunk
        children, the modules outside the trunk on its side of it, the tied parameters on the first stage, and
        the parameters every stage holds on the stage that uses them (known after the first optimizer step;
        before it, stage 0 holds them). Every parameter is owned by exactly one stage; a checkpoint takes each
        from its owner."""
        prefix = f"{self._plan.trunk}."
        names = set()
        for name, _ in self._module.named_parameters(remove_duplicate=False):
            if name.startswith(prefix):
                names.add(name)
            elif name in self._outside.shared:
                if self._shared_owner.get(name, 0) == self._stage:
                    names.add(name)
            elif self._outside.side_of(name) in (self._stage, None):
                names.add(name)
        return names

    def _trainable(self) -> list[nn.Parameter]:
        return [p for p in self._module.parameters() if p.requires_grad]

    def _device(self) -> torch.device:
        return next(self._module.parameters(), torch.empty(0)).device

    def _transport_(self) -> Transport:
        if self._transport is None:
            self._transport = Transport(self._topology.group("pp"), self._device())
        return self._transport


# -- helpers -------------------------------------------------------------------------------------------------------


class _LogCapture:
    """Holds back ``self.log`` calls made by one microbatch's step, to be reduced and replayed once per step, and
    the inputs each torchmetrics ``Metric`` of the module was called with (the step's value is computed from all
    of the step's inputs, as one device computes it from the whole batch)."""

    def __init__(self, module: pl.LightningModule, metrics: Sequence[Metric]) -> None:
        self._module = module
        self._watched = metrics
        self._hooks: list[Any] = []
        self.calls: list[tuple[str, Any, dict[str, Any]]] = []
        self.metrics: dict[str, tuple[Metric, Tensor | None, dict[str, Any]]] = {}
        self.metric_inputs: dict[int, list[tuple[tuple, dict]]] = {}

    def __enter__(self) -> _LogCapture:
        object.__setattr__(self._module, "log", self._log)
        self._hooks = [metric.register_forward_pre_hook(self._record, with_kwargs=True) for metric in self._watched]
        return self

    def __exit__(self, *exc: object) -> None:
        self._module.__dict__.pop("log", None)
        for hook in self._hooks:
            hook.remove()

    def _record(self, metric: nn.Module, args: tuple, kwargs: dict) -> None:
        self.metric_inputs.setdefault(id(metric), []).append((_detach(args), _detach(kwargs)))

    def _log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        bound = _LOG_SIGNATURE.bind(self._module, name, value, *args, **kwargs)
        options = {k: v for k, v in bound.arguments.items() if k not in ("self", "name", "value")}
        options.pop("sync_dist_group", None)  # a process group cannot be sent; the strategy's default is used
        if isinstance(value, Metric):  # its value on this microbatch now; its state once the step is done
            self.metrics[name] = (value, _detach(value._forward_cache), options)
            return
        if not isinstance(value, Tensor | int | float):
            raise ValueError(
                f"self.log({name!r}, <{type(value).__name__}>) inside a pipelined step: only the last stage computes "
                "the step's values, so lightning_smp sends them to the other stages, which works for tensors, "
                "numbers and torchmetrics Metric objects that are attributes of the LightningModule. Log one of "
                "those instead."
            )
        if not isinstance(value, Tensor):
            value = torch.tensor(float(value), dtype=torch.float64)  # numbers ride in the shared tensor buffer
        reduce_fx = options.get("reduce_fx", "mean")
        options["reduce_fx"] = _REDUCE_NAMES.get(reduce_fx, reduce_fx)
        self.calls.append((name, _detach(value), options))


def _reduce_logs(per_microbatch: Sequence[list[tuple[str, Any, dict[str, Any]]]]) -> list[tuple[str, Any, dict]]:
    """One call per logged name: its values over the microbatches reduced with its ``reduce_fx``."""
    values: dict[str, list[Any]] = {}
    options: dict[str, dict[str, Any]] = {}
    for calls in per_microbatch:
        for name, value, opts in calls:
            values.setdefault(name, []).append(value)
            options.setdefault(name, opts)
    return [(name, reduce_values(values[name], options[name]["reduce_fx"]), options[name]) for name in values]


def _loss_of(output: Any) -> Tensor:
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, Tensor):
        raise RuntimeError(
            f"training_step returned {type(output).__name__} on the last pipeline stage; with pipeline parallelism "
            "it must return the loss tensor, or a dict with a 'loss' tensor, for every microbatch."
        )
    return loss


def _own(value: Any) -> Any:
    """A received tensor (a view into the message buffer), or a list of them, as tensors of their own."""
    return [t.clone() for t in value] if isinstance(value, list) else value.clone()


def _never() -> bool:
    return False


def _detach(value: Any) -> Any:
    return tree_map(lambda x: x.detach() if isinstance(x, Tensor) else x, value)


def _all_reduce(grads: list[Tensor], group: dist.ProcessGroup, *, divide_by: int) -> None:
    """Sum ``grads`` over ``group`` in place (divided by ``divide_by`` first, as DDP averages), one flat bucket
    per dtype of at most ``_BUCKET_ELEMENTS`` elements per collective."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for same in by_dtype.values():
        for bucket in _buckets(same):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            if divide_by > 1:
                flat.div_(divide_by)
            dist.all_reduce(flat, group=group)
            pieces = flat.split([g.numel() for g in bucket])
            torch._foreach_copy_(bucket, [piece.view_as(g) for piece, g in zip(pieces, bucket, strict=True)])


def _buckets(tensors: list[Tensor]) -> list[list[Tensor]]:
    buckets: list[list[Tensor]] = [[]]
    size = 0
    for tensor in tensors:
        if buckets[-1] and size + tensor.numel() > _BUCKET_ELEMENTS:
            buckets.append([])
            size = 0
        buckets[-1].append(tensor)
        size += tensor.numel()
    return [bucket for bucket in buckets if bucket]
