"""``smp.DistributedOptimizer``: the running run's master-weight wrapper around a user's optimizer, with smp's loss
scaling arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer

from lightning_smp.config import SMPConfig
from lightning_smp.smp.run import running
from lightning_smp.smp.script import running_script

__all__ = [
    "DistributedOptimizer",
]


_SMP_SCALING = MappingProxyType({"static_loss_scale": 1.0, "dynamic_loss_scale": False, "dynamic_loss_args": None})
"""smp.DistributedOptimizer's loss-scale defaults."""
_NOT_GIVEN: Any = object()


def DistributedOptimizer(
    optimizer: Optimizer,
    static_loss_scale: float | None = _NOT_GIVEN,
    dynamic_loss_scale: bool = _NOT_GIVEN,
    dynamic_loss_args: Mapping[str, Any] | None = _NOT_GIVEN,
) -> Optimizer:
    """smp's optimizer wrapper, with smp's defaults (``static_loss_scale=1.0``, ``dynamic_loss_scale=False``).

    In an smp script (after ``smp.init()``) an optimizer built over the model before ``smp.DistributedModel`` split
    it is re-pointed at the split model's parameters of the same names. With ``fp16`` or ``bf16`` set it returns the
    `MasterWeightOptimizer` that the strategy would otherwise build (``optimizer.optimizer`` is the inner one;
    Lightning does not wrap it again); in fp32 it returns ``optimizer`` unchanged (wrapped where ZeRO-1 or sharded
    data parallelism keep masters apart). In fp16, when smp's defaults for the settings not given replace loss scaling
    configured otherwise on the strategy (its default is dynamic), it warns: pass them here, or return the plain
    optimizer from ``configure_optimizers`` and let the strategy wrap it with its own.
    """
    run = running("DistributedOptimizer", "build optimizers in configure_optimizers")
    script = running_script()
    if script is not None and not script.builds_optimizers:
        script = None  # a Fabric loop's optimizer set up with fabric.setup: the strategy's record wraps it
    if script is not None:  # an smp script: over the split model's parameters, kept for backward and checkpoints
        optimizer = script.optimizer_over_split_model(optimizer)
        wrap = script.wrap_optimizer
    else:
        wrap = run.wrap_optimizer
    if wrap is None:  # fp32
        if script is not None:
            script.optimizers.append(optimizer)
        return optimizer
    given = {"static_loss_scale": static_loss_scale, "dynamic_loss_scale": dynamic_loss_scale}
    given = {**given, "dynamic_loss_args": dynamic_loss_args}
    given = {name: value for name, value in given.items() if value is not _NOT_GIVEN}
    settings = {**_SMP_SCALING, **given}
    if run.config.fp16:
        _warn_if_defaults_override(run.config, settings, given)
    wrapped = wrap(
        optimizer,
        dynamic_loss_scale=settings["dynamic_loss_scale"],
        static_loss_scale=1.0 if settings["static_loss_scale"] is None else settings["static_loss_scale"],
        dynamic_loss_args=dict(settings["dynamic_loss_args"] or {}),
    )
    if script is not None:
        script.optimizers.append(wrapped)
    return wrapped


def _warn_if_defaults_override(config: SMPConfig, settings: Mapping[str, Any], given: Mapping[str, Any]) -> None:
    """Warn when smp.DistributedOptimizer's defaults (for the settings not ``given``) make another loss scaler than
    the strategy's ``config`` would with the same ``given`` settings."""
    configured = {name: getattr(config, name) for name in _SMP_SCALING}
    if _scaler(settings) == _scaler({**configured, **given}):
        return
    taken = ", ".join(f"{name}={settings[name]!r}" for name in _SMP_SCALING if name not in given)
    kind, value = _scaler(configured)
    strategy = f"dynamic, {value or 'smp defaults'}" if kind == "dynamic" else f"static, scale {value}"
    rank_zero_warn(
        f"smp.DistributedOptimizer(optimizer) takes smp's defaults for what it was not given ({taken}), which replace "
        f"the strategy's loss scaling ({strategy}); with a static scale of 1 small fp16 gradients underflow to zero. "
        "Pass the loss-scale arguments to smp.DistributedOptimizer (e.g. dynamic_loss_scale=True), or return the "
        "plain optimizer from configure_optimizers and let the strategy wrap it with its own settings."
    )


def _scaler(settings: Mapping[str, Any]) -> tuple[str, Any]:
    """The loss scaler ``settings`` make: ("dynamic", its args) or ("static", its scale)."""
    if settings["dynamic_loss_scale"]:
        return "dynamic", dict(settings["dynamic_loss_args"] or {})
    return "static", 1.0 if settings["static_loss_scale"] is None else float(settings["static_loss_scale"])
