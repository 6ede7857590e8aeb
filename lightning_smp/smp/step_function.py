"""``@smp.step`` and its `StepOutput`: an smp v1 script's step function, run by the step engine.

A decorated call ``train_step(model, data, target)`` hands the engine the call's arguments as one batch: every tensor
in them is cut on dim 0 into ``microbatches`` pieces (smp's split, with its error when they do not divide) and the
function's body runs once per microbatch, ``model.backward(loss)`` inside it. Without pipeline parallelism the
body runs here, microbatch after microbatch, and ``model.backward`` runs the backward of each (scaled by the fp16
loss scale, divided by the microbatches; DDP reduces once, in the last). With it the engine runs the body on every
stage on its schedule: ``model.backward(loss)`` only hands the engine the loss, whose backward the schedule runs, and
the gradients join ``.grad`` when the call returns. A call with gradients disabled (``torch.no_grad()``, as
evaluation loops run) is forward only. Each value the body returns comes back as a `StepOutput` holding one value
per microbatch, the same on every rank (under a pipeline the last stage's values, sent to the others).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_smp.mixed_precision import LossScaling, PrecisionRules
from lightning_smp.pipeline.results import MicrobatchOutputs
from lightning_smp.smp.model import DistributedModel
from lightning_smp.smp.script import ScriptRun, script_run

__all__ = ["StepOutput", "step"]

_LOSS, _RETURNED = "loss", "returned"  # a pipelined microbatch's output: its loss for the engine, the body's return


class StepOutput:
    """One value an ``@smp.step`` function returned, per microbatch (smp's ``StepOutput``)."""

    def __init__(self, outputs: Sequence[Any]) -> None:
        self.outputs = list(outputs)
        """The value of each microbatch, in order."""

    def reduce_mean(self) -> Any:
        """The mean over the microbatches (tensors element-wise, numbers as a float)."""
        return self._stacked().mean(0) if self._tensors() else sum(self.outputs) / len(self.outputs)

    def reduce_sum(self) -> Any:
        """The sum over the microbatches."""
        return self._stacked().sum(0) if self._tensors() else sum(self.outputs)

    def concat(self) -> Tensor:
        """The microbatches' tensors concatenated on dim 0 (the whole batch's predictions, in order)."""
        return torch.cat([output.reshape(1) if output.dim() == 0 else output for output in self.outputs])

    def stack(self) -> Tensor:
        """The microbatches' tensors stacked on a new dim 0."""
        return torch.stack(self.outputs)

    def _tensors(self) -> bool:
        return all(isinstance(output, Tensor) for output in self.outputs)

    def _stacked(self) -> Tensor:
        stacked = self.stack()
        return stacked if stacked.is_floating_point() else stacked.double()

    def __repr__(self) -> str:
        return f"StepOutput({self.outputs!r})"


def step(
    function: Callable[..., Any] | None = None,
    *,
    non_split_inputs: Sequence[str] | None = None,
    input_split_axes: Mapping[str, int] | None = None,
    **_: Any,
) -> Any:
    """smp's ``@smp.step`` (or ``@smp.step(non_split_inputs=[...])``). The decorated function takes the
    ``smp.DistributedModel`` among its arguments (or reaches it otherwise) and runs after ``smp.init()``.
    ``non_split_inputs`` names arguments handed whole to every microbatch; ``input_split_axes`` may only name axis 0
    (the split's); smp's other keyword arguments are accepted and have no effect."""
    if function is None:  # @smp.step(...)
        return functools.partial(step, non_split_inputs=non_split_inputs, input_split_axes=input_split_axes)
    other_axes = {name: axis for name, axis in (input_split_axes or {}).items() if axis != 0}
    if other_axes:
        raise ValueError(
            f"@smp.step(input_split_axes={other_axes}) splits along an axis other than 0, which lightning_smp does "
            "not: move the batch axis of those arguments to dim 0 (e.g. `x.transpose(0, axis)`) before the call, "
            "and back inside the step."
        )
    whole_names = frozenset(non_split_inputs or ())
    signature = inspect.signature(function)

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        script = script_run("step")
        model = _model(script)
        model.run_post_partition_hooks()
        whole: dict[str, Any] = {}
        if whole_names:
            bound = signature.bind(*args, **kwargs)
            whole = {name: bound.arguments.pop(name) for name in whole_names if name in bound.arguments}
            args, kwargs = bound.args, bound.kwargs
        training = torch.is_grad_enabled()
        outputs = _StepCall(function, script, model, whole).run(args, kwargs, training=training)
        return _as_step_outputs(outputs)

    return run


class _StepCall:
    """One call of a step function: its body per microbatch, where ``model.backward`` goes during it."""

    def __init__(
        self, body: Callable[..., Any], script: ScriptRun, model: DistributedModel, whole: dict[str, Any]
    ) -> None:
        self._body, self._script, self._model = body, script, model
        self._whole = whole  # `non_split_inputs`: handed to every microbatch as they are
        self._microbatches = script.config.microbatches
        self._index = 0
        self._loss: Tensor | None = None  # a pipelined microbatch's loss, handed over by model.backward
        self._scale_loss: LossScaling = PrecisionRules.loss_scaling(None)  # a training call's: set in `run`

    def run(self, args: tuple, kwargs: dict, *, training: bool) -> list[Any]:
        engine = self._model.engine
        batch = ((args, kwargs),)  # the engine's batch: every tensor argument, split per microbatch
        pipelined = engine.pipeline is not None
        if not training:
            outputs = engine.evaluation_step(self._evaluate, batch, {}, results=MicrobatchOutputs(), name="smp.step")
            return [output[_RETURNED] for output in outputs] if pipelined else outputs
        self._scale_loss = self._script.loss_scaling()  # the step's optimizer and scale, looked up once
        backward = self._hand_over_loss if pipelined else self._backward
        with self._model.stepping(backward):
            outputs = engine.training_step(
                self._train if pipelined else self._train_unpipelined,
                batch,
                {},
                results=MicrobatchOutputs(),
                scale_loss=self._scale_loss,
                sync=True,
                name="smp.step",
            )
        if pipelined:
            engine.finish_backward(sync=True)
            outputs = [output[_RETURNED] for output in outputs]
        self._script.note_backward()
        return outputs

    # -- the body per microbatch -----------------------------------------------------------------------------------

    def _train_unpipelined(self, packed: tuple[tuple, dict]) -> Any:
        index, self._index = self._index, self._index + 1
        with self._model.microbatch_context(index, self._microbatches):
            return self._call(packed)

    def _train(self, packed: tuple[tuple, dict]) -> dict[str, Any]:
        self._loss = None
        returned = self._call(packed)
        return {_LOSS: self._loss, _RETURNED: returned}  # `PipelineEngine` runs the backward of "loss"

    def _evaluate(self, packed: tuple[tuple, dict]) -> Any:
        returned = self._call(packed)
        return returned if self._model.engine.pipeline is None else {_RETURNED: returned}

    def _call(self, packed: tuple[tuple, dict]) -> Any:
        args, kwargs = packed
        return self._body(*args, **kwargs, **self._whole)

    # -- model.backward(loss) ------------------------------------------------------------------------------------

    def _backward(self, loss: Tensor) -> None:
        with self._model.engine.attention("backward"):
            self._scale_loss(loss, divide_by=self._microbatches).backward()

    def _hand_over_loss(self, loss: Tensor) -> None:
        self._loss = loss


def _model(script: ScriptRun) -> DistributedModel:
    if script.model is None:
        raise RuntimeError(
            "an @smp.step function ran before smp.DistributedModel(model): wrap the model after smp.init() and "
            "before the first step."
        )
    return script.model


def _as_step_outputs(outputs: list[Any]) -> Any:
    """smp's return: a `StepOutput` per value the body returned (a tuple of them for a tuple), each holding one
    value per microbatch."""
    first = outputs[0]
    if isinstance(first, tuple):
        return tuple(StepOutput([output[i] for output in outputs]) for i in range(len(first)))
    return StepOutput(outputs)
