"""The run's precision rules, the same behind every door (Lightning's Trainer, Fabric, smp v1 scripts).

Owns what fp16/bf16 training with fp32 master weights decides, without Lightning: what the module and the batch are
cast to (BatchNorm layers stay fp32, as Apex's O2 did: their running statistics lose too much in fp16), which
optimizers are wrapped in a `MasterWeightOptimizer` and where their masters live (whole, ZeRO-1's share, FSDP2's
shards, as the run's `ReductionPlan` says), which loss scaler an fp16 optimizer gets, and what a backward starts
from (`loss_scaling`). The Lightning and Fabric precision plugins hold one `PrecisionRules` and call it from their
hooks; ``smp.DistributedModel`` and ``smp.DistributedOptimizer`` call it directly. The update itself lives in
`optimizer.py`, the scale rule in `loss_scaler.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_smp._compat import BatchNormBase
from lightning_smp.master_shard import Masters, Run, ShardedMasters, WholeMasters
from lightning_smp.optimizer import MasterWeightOptimizer, build_loss_scaler
from lightning_smp.reduction import ReductionPlan
from lightning_smp.sharded_data_parallel import FSDPMasters

if TYPE_CHECKING:
    from lightning_smp.config import SMPConfig
    from lightning_smp.topology import Topology

__all__ = ["PRECISION_NAMES", "LossScaling", "PrecisionRules"]

LossScaling = Callable[..., Tensor]
"""``(loss, divide_by=1) -> the tensor backward starts from`` (`PrecisionRules.loss_scaling`)."""

PRECISION_NAMES = {torch.float16: "16-true", torch.bfloat16: "bf16-true", None: "32-true"}
"""Lightning's (and Fabric's) name for each parameter dtype, which sizes parameters in the model summary and is
recorded in checkpoints; the fp32 masters are the optimizer's."""


@dataclass(frozen=True)
class PrecisionRules:
    """fp16 or bf16 parameters with fp32 master weights (fp16 adds smp's loss scaling), or plain fp32 (``dtype``
    None).

    ``dynamic_loss_scale``, ``static_loss_scale``, ``dynamic_loss_args``: fp16's loss scaler (smp's settings);
    ``clip_norm``: every optimizer clips its gradients to this global norm at every step (smp's
    ``sdp_gradient_clipping``), so every optimizer, fp32 ones too, is then wrapped; ``reduction``: how the run
    reduces gradients over the replicas, which says where masters live.
    """

    dtype: torch.dtype | None = torch.float16
    dynamic_loss_scale: bool = True
    static_loss_scale: float = 1.0
    dynamic_loss_args: dict[str, Any] = field(default_factory=dict)
    clip_norm: float | None = None
    reduction: ReductionPlan = field(default_factory=ReductionPlan)

    def __post_init__(self) -> None:
        if self.dtype not in PRECISION_NAMES:
            raise ValueError(f"dtype={self.dtype} is not supported; use torch.float16, torch.bfloat16 or None.")

    @classmethod
    def of(cls, config: SMPConfig, reduction: ReductionPlan | None = None) -> PrecisionRules:
        """The rules an smp ``config`` sets (``fp16``/``bf16``, its loss-scale settings, ``sdp_gradient_clipping``
        under sharded data parallelism)."""
        return cls(
            config.half_dtype,
            dynamic_loss_scale=config.dynamic_loss_scale,
            static_loss_scale=config.static_loss_scale,
            dynamic_loss_args=dict(config.dynamic_loss_args or {}),
            clip_norm=config.sdp_gradient_clipping if config.sharded_data_parallel_degree > 1 else None,
            reduction=reduction if reduction is not None else ReductionPlan(),
        )

    @property
    def precision_name(self) -> str:
        """Lightning's name for the parameter dtype (`PRECISION_NAMES`)."""
        return PRECISION_NAMES[self.dtype]

    # -- module and data ------------------------------------------------------------------------------------

    @property
    def casts_module(self) -> bool:
        """Whether the module's parameters become ``dtype`` (not under FSDP2, whose fp32 shards are the masters and
        are cast for compute)."""
        return self.dtype is not None and not self.reduction.sharded_parameters

    def convert_module(self, module: nn.Module) -> nn.Module:
        """``module`` in the run's parameter dtype, BatchNorm layers kept fp32 (in place)."""
        if not self.casts_module:
            return module
        assert self.dtype is not None
        module.to(self.dtype)
        for layer in module.modules():
            if isinstance(layer, BatchNormBase):
                _keep_in_fp32(layer, self.dtype)
        return module

    def convert_input(self, data: Any) -> Any:
        """Every floating tensor in ``data`` in the run's parameter dtype."""
        if self.dtype is None:
            return data
        return apply_to_collection(data, function=self._to_half, dtype=Tensor)

    def _to_half(self, tensor: Tensor) -> Tensor:
        return tensor.to(self.dtype) if torch.is_floating_point(tensor) else tensor

    # -- optimizers -------------------------------------------------------------------------------------------

    @property
    def wraps_optimizers(self) -> bool:
        """Whether optimizers get a `MasterWeightOptimizer`: fp16/bf16 masters, masters other than the parameters
        themselves (ZeRO-1's share, FSDP2's shards), or a step that clips by itself."""
        whole = not (self.reduction.shards_masters or self.reduction.sharded_parameters)
        return self.dtype is not None or not whole or self.clip_norm is not None

    def wrap_optimizer(
        self, optimizer: Optimizer, *, topology: Topology | None, **scaler_settings: Any
    ) -> MasterWeightOptimizer:
        """``optimizer`` (built over the run's half params) with fp32 master weights. ``scaler_settings``
        (``dynamic_loss_scale``, ``static_loss_scale``, ``dynamic_loss_args``) override the rules' own, as
        ``smp.DistributedOptimizer`` passes them."""
        if not self.wraps_optimizers:
            raise ValueError(
                "fp32 training has no master weights; use fp16=True or bf16=True (or shard_optimizer_state=True with "
                "more than one data-parallel replica) to wrap optimizers."
            )
        loss_scaler = None
        if self.dtype == torch.float16:
            loss_scaler = build_loss_scaler(
                dynamic=scaler_settings.get("dynamic_loss_scale", self.dynamic_loss_scale),
                static_scale=scaler_settings.get("static_loss_scale", self.static_loss_scale),
                dynamic_args=scaler_settings.get("dynamic_loss_args", self.dynamic_loss_args),
            )
        return MasterWeightOptimizer(
            optimizer, loss_scaler=loss_scaler, topology=topology, masters=self._masters(), clip_norm=self.clip_norm
        )

    def _masters(self) -> Callable[[list[Tensor], Run], Masters]:
        """Where optimizers keep their masters, as the run's reduction plan has it."""
        if self.reduction.sharded_parameters:
            return FSDPMasters
        if self.reduction.shards_masters:
            return functools.partial(
                ShardedMasters,
                scatter_by_all_reduce=self.reduction.scatter_by_all_reduce,
                bucket_bytes=self.reduction.bucket_bytes,
            )
        return WholeMasters

    # -- backward ---------------------------------------------------------------------------------------------

    @staticmethod
    def loss_scaling(optimizer: MasterWeightOptimizer | None, *, accumulation: int = 1) -> LossScaling:
        """The one rule of what a backward starts from: the loss in fp32, times the fp16 loss scale of ``optimizer``
        (None: no masters, only the divisions apply), divided by ``accumulation`` × the call's ``divide_by`` (the
        step's microbatches). The scale is read at each call: it changes per step."""

        def scaled(loss: Tensor, divide_by: int = 1) -> Tensor:
            divisor = divide_by * accumulation
            scale = optimizer.scale_tensor if optimizer is not None else None
            return loss.float() * (scale / divisor if scale is not None else 1.0 / divisor)

        return scaled


def _keep_in_fp32(layer: nn.Module, model_dtype: torch.dtype) -> None:
    """Keep a layer (BatchNorm) in fp32 inside a half-precision model: fp32 in, the model's dtype out."""
    layer.float()

    def cast_in(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(a.float() if isinstance(a, Tensor) and torch.is_floating_point(a) else a for a in args)

    def cast_out(_: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        return output.to(model_dtype) if isinstance(output, Tensor) and output.is_floating_point() else output

    layer.register_forward_pre_hook(cast_in)
    layer.register_forward_hook(cast_out)
