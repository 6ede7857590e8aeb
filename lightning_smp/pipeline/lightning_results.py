"""A pipelined LightningModule step's results on every stage: the last stage's outputs, ``self.log`` calls and
torchmetrics state (the Trainer door's `StepResults`).

Only the last stage runs the user's step to its end, so only it sees the loss, the logged values and the metric
updates. This module records them per microbatch there (`LogCapture` holds the ``self.log`` calls back), packs them
once per step (`LightningResults.pack`: the outputs merged, each logged name reduced with its ``reduce_fx``, each
logged ``Metric``'s step value and state) and replays the package on every stage (`LightningResults.replay`), so
that Lightning sees the same values on every rank. A metric's state travels as its
``metric_state`` and is set on the other stages' copies by attribute, after a ``reset`` (torchmetrics' public
state API); the update count and the step value Lightning logs have no public setter (`_compat`). Not owned:
moving the package between stages (the engine, over `p2p.Transport`).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_smp._compat import replaced_log, set_metric_step_value, set_metric_update_count
from lightning_smp.pipeline.microbatch import merge_outputs, reduce_values
from lightning_smp.pipeline.results import StepRecord, detach

__all__ = ["LightningResults", "LogCapture"]

_LOG_SIGNATURE = inspect.signature(pl.LightningModule.log)
_REDUCE_NAMES = {torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min"}

_Call = tuple[str, Any, dict[str, Any]]  # a self.log call: name, value, options
_MetricCall = tuple[tuple, dict]  # the arguments a metric was called with


class LogCapture:
    """Holds back ``self.log`` calls made by one microbatch's step, to be reduced and replayed once per step, and
    the inputs each torchmetrics ``Metric`` of ``metrics`` was called with (the step's value is computed from all
    of the step's inputs, as one device computes it from the whole batch)."""

    def __init__(self, module: pl.LightningModule, metrics: Sequence[Metric]) -> None:
        self._module = module
        self._watched = metrics
        self._hooks: list[Any] = []
        self._replaced: Any = None
        self.calls: list[_Call] = []
        self.metrics: dict[str, tuple[Metric, dict[str, Any]]] = {}
        self.metric_calls: dict[int, list[_MetricCall]] = {}

    def __enter__(self) -> LogCapture:
        self._replaced = replaced_log(self._module, self._log)
        self._replaced.__enter__()
        self._hooks = [metric.register_forward_pre_hook(self._record, with_kwargs=True) for metric in self._watched]
        return self

    def __exit__(self, *exc: object) -> None:
        self._replaced.__exit__(*exc)
        for hook in self._hooks:
            hook.remove()

    def _record(self, metric: nn.Module, args: tuple, kwargs: dict) -> None:
        self.metric_calls.setdefault(id(metric), []).append((detach(args), detach(kwargs)))

    def _log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        bound = _LOG_SIGNATURE.bind(self._module, name, value, *args, **kwargs)
        options = {k: v for k, v in bound.arguments.items() if k not in ("self", "name", "value")}
        options.pop("sync_dist_group", None)  # a process group cannot be sent; the strategy's default is used
        if isinstance(value, Metric):  # its state is read once the step is done
            self.metrics[name] = (value, options)
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
        self.calls.append((name, detach(value), options))


class LightningResults:
    """Packs the last stage's `StepRecord` and replays it on every stage, for one LightningModule."""

    def __init__(self, module: pl.LightningModule) -> None:
        self._module = module
        self._named_metrics: dict[int, tuple[str, Metric]] | None = None  # by id: name in the module, the metric
        self._step_copies: dict[int, Metric] = {}  # per logged metric: a copy that sees one step's inputs

    def capture(self, *, watch_metrics: bool) -> LogCapture:
        """A `LogCapture` for one microbatch's step (on every stage: only the last stage's calls count), watching
        the module's metrics with ``watch_metrics`` (the step's last chunk)."""
        metrics = [metric for _, metric in self._module_metrics().values()] if watch_metrics else []
        return LogCapture(self._module, metrics)

    def pack(self, record: StepRecord) -> tuple:
        """The step's result, to send to the other stages: the merged outputs, the reduced log calls, and per logged
        metric (name → its path in the module, step value, state, update count and log options)."""
        indices = sorted(record.outputs)
        logs: dict[str, list[Any]] = {}
        options: dict[str, dict[str, Any]] = {}
        captures: list[LogCapture] = [record.captures[i] for i in indices]  # type: ignore[misc]
        for capture in captures:
            for name, value, opts in capture.calls:
                logs.setdefault(name, []).append(value)
                options.setdefault(name, opts)
        reduced = [
            (name, reduce_values(values, options[name]["reduce_fx"]), options[name]) for name, values in logs.items()
        ]
        return (
            merge_outputs([record.outputs[i] for i in indices]),
            reduced,
            self._describe_metrics([c.metrics for c in captures], [c.metric_calls for c in captures]),
        )

    def replay(self, package: tuple, *, updated_here: bool) -> Any:
        """Log the package's values and metrics on this stage and return its merged output. ``updated_here``: this
        stage's metrics saw the step (the last stage); elsewhere they take the state the package carries."""
        merged, calls, metrics = package
        for name, value, options in calls:
            self._module.log(name, value, **options)
        for name, (path, step_value, state, updates, options) in metrics.items():
            metric = self._module.get_submodule(path)
            if not updated_here:
                metric.reset()
                for state_name, value in state.items():
                    setattr(metric, state_name, _own(value))
                set_metric_update_count(metric, int(updates))
            set_metric_step_value(metric, step_value)
            self._module.log(name, metric, **options)
        return merged

    def gather(self, outputs: list[Any]) -> Any:
        """A step without a pipeline: its output (merged over microbatches, Lightning's step runs once)."""
        return merge_outputs(outputs)

    def _describe_metrics(
        self,
        per_microbatch: Sequence[dict[str, tuple[Metric, dict[str, Any]]]],
        calls: Sequence[dict[int, list[_MetricCall]]],
    ) -> dict[str, tuple[str, Any, dict[str, Any], Tensor, dict[str, Any]]]:
        """For each torchmetrics ``Metric`` logged by the step on the last stage: where it sits in the module, its
        step value, its state after the step and its update count, so that every stage's copy of it holds the same
        state (Lightning computes epoch values from the object, on every rank). The step value is the metric over
        all the inputs it was called with in the step, as one device computes it on the whole batch (None for a
        metric that was logged but never called, e.g. updated directly: Lightning then logs nothing at the step)."""
        described = {}
        for name in dict.fromkeys(name for logged in per_microbatch for name in logged):
            metric, options = [logged[name] for logged in per_microbatch if name in logged][-1]
            path = self._metric_path(metric)
            if path is None:
                raise ValueError(
                    f"self.log({name!r}, <{type(metric).__name__}>) inside a pipelined step: the metric must be an "
                    "attribute of the LightningModule (e.g. `self.train_acc = MulticlassAccuracy(...)` in __init__), "
                    "so that every pipeline stage holds a copy of it."
                )
            inputs = [call for microbatch in calls for call in microbatch.get(id(metric), [])]
            step_value = self._step_value(metric, inputs) if inputs else None
            updates = torch.tensor(metric.update_count)
            described[name] = (path, step_value, metric.metric_state, updates, options)
        return described

    def _step_value(self, metric: Metric, inputs: list[_MetricCall]) -> Any:
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
            for args, kwargs in inputs:
                copy.update(*args, **kwargs)
            return detach(copy.compute())

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


def _own(value: Any) -> Any:
    """A received tensor (a view into the message buffer), or a list of them, as tensors of their own."""
    return [t.clone() for t in value] if isinstance(value, list) else value.clone()


def _never() -> bool:
    return False
