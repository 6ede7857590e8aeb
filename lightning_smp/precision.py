"""SMPPrecision: the Lightning precision plugin for smp-style fp16/bf16 training with fp32 master weights.

It owns where precision meets Lightning's loop: it applies the run's `PrecisionRules` (casting the module and the
batch, which optimizers get a `MasterWeightOptimizer`, what a backward starts from) in Lightning's hooks, clips the
master grads, and keeps LR schedulers from stepping when an optimizer step was skipped (Lightning steps them anyway:
issues #5558, #16228). The rules themselves are Lightning-free (`mixed_precision.py`), shared with the other doors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_smp._compat import after_closure, replace_scheduler_methods, scheduler_state_without
from lightning_smp.grad_vote import clip_grad_norm_counted
from lightning_smp.mixed_precision import PRECISION_NAMES, LossScaling, PrecisionRules
from lightning_smp.optimizer import MasterWeightOptimizer

if TYPE_CHECKING:
    from lightning_smp.engine import RunContext
    from lightning_smp.topology import Topology

__all__ = ["SMPPrecision"]


class SMPPrecision(Precision):
    """fp16 or bf16 parameters with fp32 master weights; fp16 adds smp's loss scaling (`PrecisionRules`).

    Args:
        dtype: ``torch.float16``, ``torch.bfloat16``, or ``None`` for plain fp32 training.
        dynamic_loss_scale: fp16 only: dynamic (smp's ``DynamicLossScaler``) rather than a static scale.
        static_loss_scale: fp16 with ``dynamic_loss_scale=False``: the fixed scale.
        dynamic_loss_args: fp16 dynamic scaling: smp's ``dynamic_loss_args`` (``init_scale``, ``scale_factor``,
            ``scale_window``, ``min_scale``, ``delayed_shift``, ``consecutive_hysteresis``).
        clip_norm: every optimizer clips the gradients to this global norm at every step (smp's
            ``sdp_gradient_clipping``); every optimizer, fp32 ones too, is then wrapped.
    """

    def __init__(
        self,
        dtype: torch.dtype | None = torch.float16,
        *,
        dynamic_loss_scale: bool = True,
        static_loss_scale: float = 1.0,
        dynamic_loss_args: dict[str, Any] | None = None,
        clip_norm: float | None = None,
    ) -> None:
        if dtype not in PRECISION_NAMES:
            raise ValueError(
                f"SMPPrecision(dtype={dtype}) is not supported; use torch.float16, torch.bfloat16 or None."
            )
        self.dtype = dtype
        self.precision = PRECISION_NAMES[dtype]  # type: ignore[assignment]
        self._rules = PrecisionRules(
            dtype,
            dynamic_loss_scale=dynamic_loss_scale,
            static_loss_scale=static_loss_scale,
            dynamic_loss_args=dict(dynamic_loss_args or {}),
            clip_norm=clip_norm,
        )
        self._run: RunContext | None = None  # from `start_run`
        self._wrapped: list[MasterWeightOptimizer] = []
        self._scheduler_gates: list[_SkipAwareSchedulerStep] = []

    def start_run(self, run: RunContext) -> None:
        """The run this plugin serves, from SMPStrategy's ``setup_environment`` (before `connect`).

        The one hand-over after construction, and unavoidable: Lightning builds the precision plugin with the Trainer,
        before the process groups exist, and a later fit or validate of the same Trainer is a new run. Its reduction
        plan (`plan_reduction`) says where optimizers keep their masters and whether the module stays fp32 (FSDP2's
        sharded parameters are the masters and cast for compute); its topology, owner of the process groups, is what
        the optimizers this plugin wraps vote and clip over. The plugin keeps no group: the run's end
        (`Topology.release`) reaches it through the topology."""
        self._run = run
        self._rules = dataclasses.replace(self._rules, reduction=run.reduction)

    @property
    def topology(self) -> Topology | None:
        """The run's layout (None before a run)."""
        return self._run.topology if self._run is not None else None

    @property
    def rules(self) -> PrecisionRules:
        """The precision rules this plugin applies in Lightning's hooks."""
        return self._rules

    @property
    def master_weight_optimizers(self) -> list[MasterWeightOptimizer]:
        """The optimizers this plugin updates through fp32 masters (empty in fp32 mode)."""
        return self._wrapped

    # -- module and data ------------------------------------------------------------------------------------

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        return self._rules.convert_module(module)

    @override
    def convert_input(self, data: Any) -> Any:
        return self._rules.convert_input(data)

    # -- optimizers ----------------------------------------------------------------------------------------

    def wrap_optimizer(self, optimizer: Optimizer, **scaler_settings: Any) -> MasterWeightOptimizer:
        """Wrap ``optimizer`` (built over this plugin's half params) in fp32 master weights.

        ``scaler_settings`` (``dynamic_loss_scale``, ``static_loss_scale``, ``dynamic_loss_args``) override the
        plugin's, as ``smp.DistributedOptimizer`` passes them.
        """
        wrapped = self._rules.wrap_optimizer(optimizer, topology=self.topology, **scaler_settings)
        self._wrapped.append(wrapped)
        return wrapped

    @override
    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[LRSchedulerConfig]
    ) -> tuple[nn.Module, list[Optimizer], list[LRSchedulerConfig]]:
        if not self._rules.wraps_optimizers:
            return model, optimizers, lr_schedulers
        optimizers = [opt if isinstance(opt, MasterWeightOptimizer) else self.wrap_optimizer(opt) for opt in optimizers]
        self._wrapped = [opt for opt in optimizers if isinstance(opt, MasterWeightOptimizer)]  # this run's
        for config in lr_schedulers:
            if config.interval == "step":
                owner = next(opt for opt in optimizers if opt == config.scheduler.optimizer)
                self._scheduler_gates.append(_SkipAwareSchedulerStep(config.scheduler, owner))
        return model, optimizers, lr_schedulers

    # -- backward and step ---------------------------------------------------------------------------------

    @override
    def backward(  # type: ignore[override]
        self,
        tensor: Tensor,
        model: pl.LightningModule,
        optimizer: Optimizable | None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        if self._optimizer_for_backward(optimizer) is None:
            return super().backward(tensor, model, optimizer, *args, **kwargs)
        model.backward(self.loss_scaling(optimizer)(tensor), *args, **kwargs)

    def loss_scaling(self, optimizer: Optimizable | None, *, accumulation: int = 1) -> LossScaling:
        """What a backward starts from (`PrecisionRules.loss_scaling`) for ``optimizer`` (a `MasterWeightOptimizer`,
        a Lightning wrapper of one, or None: the only one). Lightning's backward (above) takes it with
        ``accumulation`` 1 (Lightning has divided the loss by its accumulation count already); a pipelined step,
        whose backward runs inside ``training_step`` before Lightning sees the loss, is handed it with the
        accumulation count and divides by its microbatches."""
        return PrecisionRules.loss_scaling(self._optimizer_for_backward(optimizer), accumulation=accumulation)

    @override
    def post_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:
        # The one place a backward is noted, whichever ran it (Lightning's, or the pipeline engine's gradients
        # joining `.grad`): the masters' next unscale reads the grads again.
        for optimizer in self._wrapped:
            optimizer.note_backward()
        return super().post_backward(tensor, module)

    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizable,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        if not isinstance(optimizer, MasterWeightOptimizer):
            return super().optimizer_step(optimizer, model, closure, **kwargs)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            return closure_result  # training_step returned None: nothing to update (as Lightning's AMP plugin)
        for gate in self._scheduler_gates:
            gate.flush(wait=True)
        # No explicit unscale here: clipping unscales when it runs; otherwise a fused optimizer takes the scaled
        # grads and unscales inside its own kernel (one memory pass fewer).
        after_closure(self, model, optimizer)
        optimizer.step(**kwargs)
        return closure_result

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if isinstance(optimizer, MasterWeightOptimizer):
            optimizer.clip_master_grads(clip_val)
        else:  # fp32: the norm still spans every model-parallel rank, counting replicated values once
            clip_grad_norm_counted(self.main_params(optimizer), clip_val, topology=self.topology)

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if isinstance(optimizer, MasterWeightOptimizer):
            optimizer.clip_master_grads_by_value(clip_val)
        else:
            super().clip_grad_by_value(optimizer, clip_val)

    @override
    def main_params(self, optimizer: Optimizer) -> list[Tensor]:  # type: ignore[override]
        if isinstance(optimizer, MasterWeightOptimizer):
            return optimizer.master_params()
        return super().main_params(optimizer)

    @override
    def teardown(self) -> None:
        for gate in self._scheduler_gates:
            gate.flush(wait=True)

    def _optimizer_for_backward(self, optimizer: Optimizable | None) -> MasterWeightOptimizer | None:
        if isinstance(optimizer, MasterWeightOptimizer):
            return optimizer
        inner = getattr(optimizer, "optimizer", None)  # a LightningOptimizer
        if isinstance(inner, MasterWeightOptimizer):
            return inner
        if optimizer is None and self._wrapped:
            # manual optimization: `self.manual_backward(loss)` names no optimizer
            scalers = {id(opt.loss_scaler) for opt in self._wrapped}
            if len(scalers) > 1:
                raise ValueError(
                    "`manual_backward(loss)` cannot tell which loss scale to use: there are several fp16 "
                    "optimizers, each with its own scale. Use one optimizer with several param groups instead."
                )
            return self._wrapped[0]
        return None


class _SkipAwareSchedulerStep:
    """Replaces a step-interval LR scheduler's ``step`` so it does not advance after a skipped optimizer step.

    The decision needs the overflow flag on the host. Rather than stall the stream right after the step, a call
    is held until the flag has landed, at the latest until just before the next optimizer step reads the LR.
    On the CPU the flag is always there, so the call is decided at once.
    """

    def __init__(self, scheduler: Any, optimizer: MasterWeightOptimizer) -> None:
        self._stepped = optimizer
        self._pending: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self._step, self._state_dict = replace_scheduler_methods(scheduler, step=self.step, state_dict=self.state_dict)

    def step(self, *args: Any, **kwargs: Any) -> None:
        self._pending.append((args, kwargs))
        self.flush(wait=False)

    def state_dict(self) -> dict[str, Any]:
        self.flush(wait=True)
        return scheduler_state_without(self._state_dict(), ("step", "state_dict"))

    def flush(self, *, wait: bool) -> None:
        if not self._pending or not (wait or self._stepped.last_step_skipped_ready()):
            return
        pending, self._pending = self._pending, []
        if self._stepped.last_step_skipped():
            return
        for args, kwargs in pending:
            self._step(*args, **kwargs)
