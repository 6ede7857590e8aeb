"""``smp.DistributedModel``: an smp v1 script's model, split for this rank and wrapped as smp wrapped it.

Wrapping applies the run's layout with the Trainer door's own build path (`build.plan_and_apply`: tensor
parallelism, activation checkpointing, this rank's pipeline stage, sharded data parallelism, materialisation of a
model created on the meta device), puts the model on this process's device in the run's precision (`PrecisionRules`:
smp's fp16 module casts floating inputs to fp16 and its outputs to fp32, so scripts compute their loss in fp32), and
sets up the replicas as the run's `ReductionPlan` says (DDP, or one broadcast where the pipeline engine or the
optimizer reduces). It makes the model's `StepEngine`, which ``@smp.step`` runs. The rest is smp's API on the split
model: ``backward`` (inside a step), ``get_module``, ``state_dict`` under the model's own names, ``local_state_dict``
and ``local_parameters`` (what this rank holds), ``load_state_dict``, ``register_post_partition_hook``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from lightning_smp import fault_tolerance, model_setup
from lightning_smp.engine import StepEngine
from lightning_smp.pipeline.microbatch import split_batch
from lightning_smp.smp.script import script_run

__all__ = ["DistributedModel"]


class DistributedModel(nn.Module):
    """smp's model wrapper: ``model = smp.DistributedModel(model)`` after ``smp.init()``, on every rank.

    smp's keyword arguments (``trace_device``, ``backward_passes_per_step``, ``average_grads_across_microbatches``,
    ``bucket_cap_mb``, ``gradient_as_bucket_view``, ...) are accepted and have no effect: the model is not traced,
    and gradients are averaged over the microbatches (smp's default) and reduced once per step.
    """

    def __init__(self, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        script = script_run("DistributedModel")
        if script.model is not None:
            raise RuntimeError(
                "smp.DistributedModel was called twice in one run; lightning_smp runs one model per smp.init(): "
                "wrap the model that holds every trained module once."
            )
        super().__init__()
        run = script.run
        if run.topology.pp > 1 and isinstance(module, nn.Sequential | nn.ModuleList):
            raise ValueError(
                f"smp.DistributedModel was given an {type(module).__name__} with pipeline_parallel_degree > 1: the "
                "pipeline splits a sequential container inside the model, and the model's own forward runs on every "
                "stage. Wrap it in a module that holds it as an attribute (`self.layers = layers`, forward "
                "`return self.layers(x)`), as models built for smp are."
            )
        self._names_before_split = model_setup.parameter_names(module)
        set_up = model_setup.set_up_model(module, run=run, rules=script.rules, device=script.device)
        self.module = set_up.forward  # smp's name: `model.module` is the wrapped module
        microbatches = functools.partial(_split_step_arguments, microbatches=run.config.microbatches)
        self.engine = StepEngine(run, set_up.pipeline, microbatches)
        self._script = script
        self._post_partition_hooks: list[Callable[..., Any]] = []
        self._stepped = False
        self._backward: Callable[[Tensor], None] | None = None
        script.model = self

    # -- running ------------------------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        rules = self._script.rules
        output = self.module(*rules.convert_input(args), **rules.convert_input(kwargs))
        if rules.dtype is None:
            return output
        return apply_to_collection(output, Tensor, lambda t: t.float() if t.is_floating_point() else t)

    def backward(self, loss: Tensor) -> None:
        """smp's ``model.backward(loss)``, inside an ``@smp.step`` function: the backward of this microbatch's loss,
        scaled by the fp16 loss scale and divided by the microbatches. Under pipeline parallelism the engine runs
        it on its schedule."""
        if self._backward is None:
            raise RuntimeError(
                "model.backward(loss) runs inside an @smp.step function (where smp ran it per microbatch): move the "
                "forward, the loss and model.backward(loss) into a function decorated with @smp.step."
            )
        self._backward(loss)

    @contextmanager
    def stepping(self, backward: Callable[[Tensor], None]) -> Generator[None, None, None]:
        """While an ``@smp.step`` call runs: ``model.backward(loss)`` goes to ``backward``."""
        self._backward = backward
        try:
            yield
        finally:
            self._backward = None

    def microbatch_context(self, index: int, microbatches: int) -> AbstractContextManager[None]:
        """Around microbatch ``index``'s forward and backward without a pipeline: DDP reduces only in the last."""
        if isinstance(self.module, DistributedDataParallel) and index < microbatches - 1:
            return self.module.no_sync()
        return nullcontext()

    def run_post_partition_hooks(self) -> None:
        """Before the first step: the hooks smp ran once it had partitioned the model, with the model and the
        optimizer."""
        if self._stepped:
            return
        self._stepped = True
        optimizer = self._script.optimizers[0] if self._script.optimizers else None
        for hook in self._post_partition_hooks:
            hook(self, optimizer)

    # -- smp's API ----------------------------------------------------------------------------------------------

    def get_module(self) -> nn.Module:
        """The user's model as split for this rank (no DDP wrapper)."""
        return self.module.module if isinstance(self.module, DistributedDataParallel) else self.module

    def register_post_partition_hook(self, hook: Callable[..., Any]) -> None:
        """``hook(model, optimizer)`` runs once, before the first step (when smp had partitioned the model)."""
        self._post_partition_hooks.append(hook)

    def local_parameters(self) -> Iterator[nn.Parameter]:
        """The parameters this rank holds (its stage's, its tensor-parallel shards)."""
        return self.get_module().parameters()

    def local_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.get_module().named_parameters()

    def local_state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """What this rank holds, under the model's names (``smp.save(..., partial=True)`` writes it per rank)."""
        return self.get_module().state_dict(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """This rank's part under the model's own names, as ``local_state_dict``; the whole model of any layout is
        ``smp.save_checkpoint`` then ``lightning_smp.consolidated_state_dict(path)``."""
        return self.local_state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, same_partition_load: bool = True) -> Any:  # type: ignore[override]
        """Load what ``local_state_dict`` returned on this rank of the same layout (smp's ``same_partition_load``);
        a checkpoint of another layout loads with ``smp.resume_from_checkpoint``."""
        return self.get_module().load_state_dict(state_dict, strict=strict)

    @property
    def names_before_split(self) -> dict[int, list[str]]:
        """The model's parameter names by ``id`` before the split (an optimizer built then is re-pointed)."""
        return self._names_before_split

    def forget_process_groups(self) -> None:
        """Drop the groups the model's torchmetrics metrics hold (at exit); its split layers look theirs up through
        the run's topology, which releases them."""
        fault_tolerance.forget_metric_groups(self.get_module())


def _split_step_arguments(args: tuple, kwargs: dict, *, microbatches: int) -> list[tuple[tuple, dict]]:
    """smp's split of an ``@smp.step`` call, whose arguments reach the engine as one batch (``args[0]``, the call's
    ``(args, kwargs)``): every tensor in them, positional or keyword, nested in containers or not, cut on dim 0
    into ``microbatches`` pieces; other arguments (the model) handed whole to each."""
    return [((piece,), {}) for piece in split_batch(args[0], microbatches)]
