"""SMPFabricPrecision: Lightning Fabric's precision plugin for smp-style fp16/bf16 training with fp32 master weights.

It owns where precision meets a Fabric loop: the batch cast in ``model(x)`` (`PrecisionRules.convert_input`), the
scaled ``fabric.backward(loss)`` (`PrecisionRules.loss_scaling` with the loss scale of the run's master-weight
optimizer), the grads noted after each backward, and the master params clipping reads. It holds one
`PrecisionRules`, the same rules the Trainer's `SMPPrecision` and ``smp.DistributedOptimizer`` apply; the update
itself (overflow vote, skip, clip, scaler) is `MasterWeightOptimizer`'s. Casting the module is left to
`SMPFabricStrategy`, which casts after splitting it (Fabric would cast before, and a split builds new parameters).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from lightning.fabric.plugins.precision import Precision
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_smp.mixed_precision import PrecisionRules
from lightning_smp.optimizer import MasterWeightOptimizer
from lightning_smp.topology import Topology

if TYPE_CHECKING:
    from lightning_smp.engine import RunContext

__all__ = ["SMPFabricPrecision"]


class SMPFabricPrecision(Precision):
    """fp16 or bf16 parameters with fp32 master weights (fp16 adds smp's loss scaling), or fp32: ``rules``."""

    def __init__(self, rules: PrecisionRules) -> None:
        self._rules = rules
        self.precision = rules.precision_name  # type: ignore[assignment]
        self._wrapped: list[MasterWeightOptimizer] = []

    @property
    def rules(self) -> PrecisionRules:
        return self._rules

    @property
    def master_weight_optimizers(self) -> list[MasterWeightOptimizer]:
        """The optimizers this plugin wrapped in fp32 masters (empty when the rules wrap none)."""
        return self._wrapped

    def start_run(self, run: RunContext) -> None:
        """The run this plugin serves, from the strategy's ``setup_environment`` (Fabric builds the plugin before any
        process group exists): its gradient reduction says where masters live. The run's groups stay with its
        topology; the optimizers are wrapped with it (`wrap_optimizer`)."""
        self._rules = dataclasses.replace(self._rules, reduction=run.reduction)

    def wrap_optimizer(
        self, optimizer: Optimizer, *, topology: Topology | None, **scaler_settings: Any
    ) -> MasterWeightOptimizer:
        """``optimizer`` (built over the split model's parameters) with fp32 masters (`PrecisionRules`)."""
        wrapped = self._rules.wrap_optimizer(optimizer, topology=topology, **scaler_settings)
        self._wrapped.append(wrapped)
        return wrapped

    @override
    def convert_input(self, data: Any) -> Any:
        return self._rules.convert_input(data)

    @override
    def backward(self, tensor: Tensor, model: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        self._rules.loss_scaling(self._scaling_optimizer())(tensor).backward(*args, **kwargs)

    @override
    def post_backward(self, tensor: Tensor, module: nn.Module | None) -> Any:
        for optimizer in self._wrapped:
            optimizer.note_backward()  # the next unscale reads the grads again

    @override
    def main_params(self, optimizer: Optimizer) -> Any:
        if isinstance(optimizer, MasterWeightOptimizer):
            return optimizer.master_params()
        return super().main_params(optimizer)

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        if isinstance(optimizer, MasterWeightOptimizer):
            optimizer.unscale_grads()

    def _scaling_optimizer(self) -> MasterWeightOptimizer | None:
        """The optimizer whose loss scale a backward multiplies by (None: nothing to scale)."""
        if not self._wrapped:
            return None
        if len({id(optimizer.loss_scaler) for optimizer in self._wrapped}) > 1:
            raise ValueError(
                "`fabric.backward(loss)` cannot tell which loss scale to use: there are several fp16 optimizers, "
                "each with its own scale. Use one optimizer with several param groups instead."
            )
        return self._wrapped[0]
