"""The loss-scale state machine: the current scale and, for the dynamic scaler, when it backs off and grows.

The semantics are smp v1.12.1's (``torch/fp16/loss_scaler.py``), which are Megatron-legacy's and DeepSpeed's
``DynamicLossScaler.update_scale``. The state lives in 0-dim tensors on the training device and ``update`` is
branch-free tensor ops, so a CUDA step never waits on the host to read the overflow flag. Detecting overflow,
unscaling grads and skipping the step belong to the precision plugin, not here.
"""

import difflib
import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar, Self

import torch

__all__ = ["DynamicLossScaler", "LossScaler", "StaticLossScaler"]

# Keys only a dynamic scaler's state_dict carries; their presence tells the two kinds apart.
_DYNAMIC_STATE_KEYS = ("cur_iter", "last_overflow_iter", "cur_hysteresis")
# smp's dynamic_loss_args keys, which are DynamicLossScaler's constructor arguments.
_DYNAMIC_LOSS_ARGS = (
    "init_scale",
    "scale_factor",
    "scale_window",
    "min_scale",
    "delayed_shift",
    "consecutive_hysteresis",
)


class LossScaler(ABC):
    """A loss scale held as a 0-dim float32 tensor on one device.

    ``scale`` is updated in place, so a reference taken once (e.g. by a fused optimizer or a captured graph)
    stays current across ``update`` and ``load_state_dict``; ``to`` replaces it.
    """

    dynamic: ClassVar[bool]

    def __init__(self, scale: float, device: torch.device | str | None) -> None:
        self._scale = torch.tensor(scale, dtype=torch.float32, device=device)

    @property
    def scale(self) -> torch.Tensor:
        """The current loss scale, 0-dim float32 on the scaler's device."""
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        """``1 / scale`` as a new 0-dim tensor, for unscaling gradients."""
        return self._scale.reciprocal()

    @property
    def loss_scale(self) -> float:
        """The current loss scale as a Python float (smp's ``optimizer.loss_scale``)."""
        return self._scale.item()  # sync: reads the device scale back to the host

    def to(self, device: torch.device | str) -> Self:
        self._scale = self._scale.to(device)
        return self

    @abstractmethod
    def update(self, found_inf: torch.Tensor) -> None:
        """Advance one optimizer step; ``found_inf`` is a 0-dim float tensor, 1.0 if this step overflowed."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abstractmethod
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None: ...


class StaticLossScaler(LossScaler):
    """A fixed loss scale (smp's ``static_loss_scale``, default 1.0).

    The scale never changes: ``update`` accepts the overflow flag for a uniform interface and ignores it.
    (smp's static ``LossScaler.has_overflow`` always returned False, so smp applied inf/NaN gradients to the
    weights; `MasterWeightOptimizer` still checks and skips such a step, which only ever saves a run.)
    """

    dynamic: ClassVar[bool] = False

    def __init__(self, scale: float = 1.0, *, device: torch.device | str | None = None) -> None:
        if not scale > 0 or not math.isfinite(scale):
            raise ValueError(f"StaticLossScaler(scale={scale!r}): the scale must be finite and > 0, e.g. 1.0")
        super().__init__(scale, device)

    def update(self, found_inf: torch.Tensor) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"cur_scale": self.loss_scale}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if any(key in state_dict for key in _DYNAMIC_STATE_KEYS):
            raise ValueError(
                "This state_dict comes from a dynamic loss scaler but this scaler is static. "
                "HINT: build the scaler with dynamic_loss_scale=True to resume it, or drop the loss-scaler "
                "state to restart with the static scale."
            )
        self._scale.fill_(state_dict["cur_scale"])


class DynamicLossScaler(LossScaler):
    """smp's dynamic loss scaler: back off on overflow, grow after ``scale_window`` clean steps.

    Args:
        init_scale: The first loss scale.
        scale_factor: Backoff divides the scale by this, growth multiplies it.
        scale_window: Growth happens when ``(cur_iter - last_overflow_iter) % scale_window == 0`` on a clean
            step, i.e. after ``scale_window`` clean steps in a row.
        min_scale: Backoff never goes below this.
        delayed_shift: Hysteresis: overflows tolerated before the first backoff (1 = back off on every one).
        consecutive_hysteresis: Refill the hysteresis on every clean step rather than only on growth.
        device: Where the state tensors live; the training device.

    The scale is float32 while smp's is a Python float, so a growth whose result would be ``inf`` is skipped
    (as in ``torch.amp.GradScaler``). fp16 gradients overflow long before a scale near 2**128 is reached, so
    this never changes the sequence of scales in practice.
    """

    dynamic: ClassVar[bool] = True

    def __init__(
        self,
        *,
        init_scale: float = 2.0**32,
        scale_factor: float = 2.0,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        delayed_shift: int = 1,
        consecutive_hysteresis: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        if not init_scale > 0 or not math.isfinite(init_scale):
            raise ValueError(f"init_scale={init_scale!r} must be finite and > 0; smp's default is 2**32.")
        if not scale_factor > 1 or not math.isfinite(scale_factor):
            raise ValueError(f"scale_factor={scale_factor!r} must be finite and > 1; smp's default is 2.0.")
        if not _is_positive_int(scale_window):
            raise ValueError(f"scale_window={scale_window!r} must be an int >= 1; smp's default is 1000.")
        if not min_scale > 0 or not math.isfinite(min_scale):
            raise ValueError(f"min_scale={min_scale!r} must be finite and > 0; smp's default is 1.")
        if not _is_positive_int(delayed_shift):
            raise ValueError(
                f"delayed_shift={delayed_shift!r} must be an int >= 1 (1 = no hysteresis); smp's examples use 2."
            )
        super().__init__(init_scale, device)
        self._scale_factor = float(scale_factor)
        self._scale_window = scale_window
        self._min_scale = float(min_scale)
        self._delayed_shift = delayed_shift
        self._consecutive_hysteresis = bool(consecutive_hysteresis)
        self._cur_iter = torch.tensor(0, dtype=torch.int64, device=device)
        self._last_overflow_iter = torch.tensor(-1, dtype=torch.int64, device=device)
        self._cur_hysteresis = torch.tensor(delayed_shift, dtype=torch.int64, device=device)

    @classmethod
    def from_args(
        cls, dynamic_loss_args: Mapping[str, Any] | None, *, device: torch.device | str | None = None
    ) -> Self:
        """Build from smp's ``DistributedOptimizer(dynamic_loss_args=...)``; None means smp's defaults."""
        args = dict(dynamic_loss_args or {})
        for key in args:
            if key not in _DYNAMIC_LOSS_ARGS:
                nearest = difflib.get_close_matches(key, _DYNAMIC_LOSS_ARGS, n=1, cutoff=0.0)[0]
                raise ValueError(
                    f"Unknown dynamic_loss_args key {key!r}; did you mean {nearest!r}? "
                    f"Valid keys: {', '.join(_DYNAMIC_LOSS_ARGS)}."
                )
        return cls(**args, device=device)

    def to(self, device: torch.device | str) -> Self:
        super().to(device)
        self._cur_iter = self._cur_iter.to(device)
        self._last_overflow_iter = self._last_overflow_iter.to(device)
        self._cur_hysteresis = self._cur_hysteresis.to(device)
        return self

    def update(self, found_inf: torch.Tensor) -> None:
        """smp's ``update_scale(overflow)`` as tensor ops, with no host sync.

        Launches about 25 one-element kernels (~0.1 ms of launch overhead on CUDA). Every new value is
        computed from the old state before any is written.
        """
        if found_inf.dim() != 0 or found_inf.device != self._scale.device:
            raise ValueError(
                f"found_inf must be a 0-dim tensor on {self._scale.device}, got shape "
                f"{tuple(found_inf.shape)} on {found_inf.device}. HINT: reduce the overflow flag to a scalar "
                "and move the scaler with `.to(device)`."
            )
        overflow = found_inf != 0
        clean = overflow.logical_not()
        since_overflow = self._cur_iter - self._last_overflow_iter
        window_hit = clean & (torch.remainder(since_overflow, self._scale_window) == 0)
        # smp: `delayed_shift == 1 or cur_hysteresis == 1`; the first half is config, decided on the host.
        backoff = overflow if self._delayed_shift == 1 else overflow & (self._cur_hysteresis == 1)
        backed_off = (self._scale / self._scale_factor).clamp_min(self._min_scale)
        grown = self._scale * self._scale_factor
        grow = window_hit & torch.isfinite(grown)
        new_scale = torch.where(backoff, backed_off, torch.where(grow, grown, self._scale))
        refill = clean if self._consecutive_hysteresis else window_hit
        held = self._cur_hysteresis - (overflow & backoff.logical_not()).long()
        new_hysteresis = torch.where(refill, self._delayed_shift, held)

        self._scale.copy_(new_scale)
        self._cur_hysteresis.copy_(new_hysteresis)
        self._last_overflow_iter.copy_(torch.where(overflow, self._cur_iter, self._last_overflow_iter))
        self._cur_iter.add_(1)

    def state_dict(self) -> dict[str, Any]:
        # sync: four scalar reads; checkpoints only.
        return {
            "cur_scale": self.loss_scale,
            "cur_iter": int(self._cur_iter),
            "last_overflow_iter": int(self._last_overflow_iter),
            "cur_hysteresis": int(self._cur_hysteresis),
            **self._config(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the counters and scale; the config keeps the constructor's values (a difference warns)."""
        if not any(key in state_dict for key in _DYNAMIC_STATE_KEYS):
            raise ValueError(
                "This state_dict comes from a static loss scaler but this scaler is dynamic. "
                "HINT: build the scaler with dynamic_loss_scale=False to resume it, or drop the loss-scaler "
                "state to restart dynamic scaling from init_scale."
            )
        differing = {
            key: (state_dict[key], value)
            for key, value in self._config().items()
            if key in state_dict and state_dict[key] != value
        }
        if differing:
            details = ", ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in differing.items())
            warnings.warn(
                f"Resuming the loss scaler with a different config ({details}); the constructor's values are used.",
                stacklevel=2,
            )
        self._scale.fill_(state_dict["cur_scale"])
        self._cur_iter.fill_(state_dict["cur_iter"])
        self._last_overflow_iter.fill_(state_dict["last_overflow_iter"])
        self._cur_hysteresis.fill_(state_dict["cur_hysteresis"])

    def _config(self) -> dict[str, Any]:
        return {
            "scale_factor": self._scale_factor,
            "scale_window": self._scale_window,
            "min_scale": self._min_scale,
            "delayed_shift": self._delayed_shift,
            "consecutive_hysteresis": self._consecutive_hysteresis,
        }


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
