"""The FP16/BF16 master-weight optimizer: fp32 master copies, unscale + overflow check, clipping, the gated step.

It owns the master weights and the order of one update (unscale → check → clip → step → copy back → rescale).
It does not own the loss-scale rule (`loss_scaler.py`) nor when Lightning calls it (`precision.py`).
Masters and their grads live in one flat fp32 buffer each, so unscale, overflow check and norm are one kernel
each. `found_inf` stays on the device: fused optimizers (`fused=True`) take it and skip the update themselves,
so a CUDA step never waits for the host; other optimizers read it once per step, as `torch.amp.GradScaler` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from lightning_smp.host_mirror import HostMirror
from lightning_smp.loss_scaler import DynamicLossScaler, LossScaler, StaticLossScaler
from lightning_smp.placement import placement_of

__all__ = ["HALF_DTYPES", "MasterWeightOptimizer", "clip_grad_norm_counted", "global_grad_norm"]

HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class _StepState:
    """Per-step flags. Kept in one mutable object because Lightning's `LightningOptimizer` subclasses this
    optimizer's class dynamically and forwards attribute reads (not writes) to it: methods must never assign
    attributes on `self`."""

    grads_read: bool = False  # the half grads of the latest backward are in the masters' grads and checked
    grads_detached: bool = False  # some masters had their grad set to None for one step (unused params)


class MasterWeightOptimizer(Optimizer):
    """Wraps a torch optimizer built over fp16/bf16 parameters so that it updates fp32 master copies.

    The inner optimizer's param groups are re-pointed at the masters, and this wrapper's ``param_groups`` and
    ``state`` ARE the inner optimizer's, so ``StepLR(wrapper)`` and ``StepLR(wrapper.optimizer)`` both work.
    Parameters that are already fp32 (e.g. BatchNorm kept in fp32) are their own masters.

    Args:
        optimizer: the inner optimizer, constructed over the model's (half-precision) parameters.
        loss_scaler: fp16: a static or dynamic scaler; bf16: ``None`` (no scaling, no overflow check).
        overflow_group: the process group over which ``found_inf`` is max-reduced, so every rank skips the same
            steps (the whole job). ``None``: the default group when one is initialised.
        norm_group: the process group over which gradient norms are summed (the model-parallel ranks holding
            different parameters). ``None``: norms are local.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        loss_scaler: LossScaler | None,
        overflow_group: dist.ProcessGroup | None = None,
        norm_group: dist.ProcessGroup | None = None,
    ) -> None:
        if isinstance(optimizer, MasterWeightOptimizer):
            raise ValueError("The optimizer is already a MasterWeightOptimizer; wrap the plain optimizer once.")
        # Deliberately no `super().__init__`: the param groups and state are the inner optimizer's own objects.
        self._inner = optimizer
        self._step_state = _StepState()
        self._overflow_group = overflow_group
        self._norm_group = norm_group

        self._half_params, self._masters, self._own_master_params = _split_params(optimizer)
        device = _single_device(self._half_params + self._own_master_params)
        numels = [p.numel() for p in self._half_params]
        self._flat_master = torch.empty(sum(numels), dtype=torch.float32, device=device)
        self._flat_master_grad = torch.zeros_like(self._flat_master)
        master_views = _views(self._flat_master, self._half_params)
        grad_views = _views(self._flat_master_grad, self._half_params)
        with torch.no_grad():
            if self._half_params:
                torch._foreach_copy_(master_views, self._half_params)
        for index, (view, grad) in enumerate(zip(master_views, grad_views, strict=True)):
            master = torch.nn.Parameter(view)
            master.grad = grad
            self._masters[index] = master
        _repoint_param_groups(optimizer, dict(zip(map(id, self._half_params), self._masters, strict=True)))
        self._master_grads = grad_views

        self._loss_scaler = loss_scaler.to(device) if loss_scaler is not None else None
        self._found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self._skipped_steps = torch.zeros((), dtype=torch.float32, device=device)
        self._last_skip = HostMirror(device)
        self._fused = any(group.get("fused") for group in optimizer.param_groups)
        self._norm_counts = [placement_of(p).counts_in_norm for p in self._half_params + self._own_master_params]

    # -- the inner optimizer's objects, shared ------------------------------------------------------------------

    @property
    def optimizer(self) -> Optimizer:
        """The wrapped torch optimizer (smp's ``optimizer.optimizer``)."""
        return self._inner

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._inner.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._inner.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._inner.defaults

    def __eq__(self, other: object) -> bool:
        # Lightning checks `scheduler.optimizer in optimizers`; smp-era code builds `StepLR(optimizer.optimizer)`.
        # Treating the wrapper as equal to its inner optimizer lets that check pass; hashes agree accordingly.
        return other is self or other is self._inner

    def __hash__(self) -> int:
        return hash(self._inner)

    def __repr__(self) -> str:
        scaler = type(self._loss_scaler).__name__ if self._loss_scaler is not None else "no loss scaling"
        return f"{type(self).__name__}({type(self._inner).__name__}, {len(self._masters)} masters, {scaler})"

    # -- what smp users read ------------------------------------------------------------------------------------

    @property
    def loss_scaler(self) -> LossScaler | None:
        return self._loss_scaler

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without scaling)."""
        return self._loss_scaler.loss_scale if self._loss_scaler is not None else 1.0  # sync

    @property
    def scale_tensor(self) -> Tensor | None:
        """The current loss scale as a 0-dim device tensor (no sync), or ``None`` without scaling."""
        return self._loss_scaler.scale if self._loss_scaler is not None else None

    @property
    def skipped_steps(self) -> Tensor:
        """How many steps were skipped for overflow, as a 0-dim device tensor (no sync)."""
        return self._skipped_steps

    @property
    def overflow(self) -> bool:
        """Whether the current gradients overflowed: after backward, those of the coming step; after ``step``,
        those of the step just taken (smp's ``optimizer.overflow``)."""
        if any(p.grad is not None for p in self._half_params + self._own_master_params):
            self.unscale_grads()
        return bool(self._found_inf.item())  # sync

    def master_params(self) -> list[Tensor]:
        """The fp32 parameters the inner optimizer updates: the masters, then the params that are fp32 already."""
        return [*self._masters, *self._own_master_params]

    def param_master_pairs(self) -> list[tuple[Tensor, Tensor]]:
        """Each model parameter with the fp32 tensor updated in its place (itself when already fp32): checkpoints
        save and load the master under the parameter's name."""
        return [*zip(self._half_params, self._masters, strict=True), *((p, p) for p in self._own_master_params)]

    # -- one update ---------------------------------------------------------------------------------------------

    def note_backward(self) -> None:
        """The half-precision grads changed (a backward ran): the next unscale must read them again."""
        self._step_state.grads_read = False

    def unscale_grads(self) -> None:
        """Copy the half grads into the fp32 master grads, unscale them and decide overflow for the whole job.

        Runs at most once per backward; clipping, ``overflow`` and ``step`` call it as needed.
        """
        if self._step_state.grads_read:
            return
        self._read_half_grads()
        self._found_inf.zero_()
        if self._loss_scaler is None:
            return
        grads = self._unscale_targets()
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, self._found_inf, self._loss_scaler.inv_scale)
        self._vote_overflow()

    def _read_half_grads(self) -> None:
        """Copy the half grads of the latest backward, still scaled, into the fp32 master grads."""
        self._step_state.grads_read = True
        half_grads = [p.grad for p in self._half_params]
        if any(g is None for g in half_grads):
            # Unused parameters keep no gradient, like in the fp32 run: torch optimizers skip a param whose
            # grad is None, so the master has none either for this step (restored in `step`). Its slot in the
            # flat buffer is zeroed so a stale value counts neither for overflow nor for the norm.
            present, missing = [], []
            self._step_state.grads_detached = True
            for master, grad, view in zip(self._masters, half_grads, self._master_grads, strict=True):
                master.grad = None if grad is None else view
                (missing if grad is None else present).append((view, grad))
            torch._foreach_zero_([view for view, _ in missing])
            if present:
                torch._foreach_copy_([view for view, _ in present], [grad for _, grad in present])
        elif half_grads:
            torch._foreach_copy_(self._master_grads, half_grads)

    def _vote_overflow(self) -> None:
        """Make ``found_inf`` the job's answer: a step overflows everywhere if it overflows anywhere."""
        if _group_size(self._overflow_group) > 1:
            dist.all_reduce(self._found_inf, op=dist.ReduceOp.MAX, group=self._overflow_group)

    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the fp32 master grads by their global norm; returns that norm, or -1 on overflow (as smp).

        The result is a 0-dim device tensor, so clipping costs no host sync.
        """
        self.unscale_grads()
        grads = self._unscale_targets()
        norm = self._global_norm(self._norm_targets(), float(norm_type))
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_(grads, coefficient)
        return torch.where(self._found_inf > 0, torch.full_like(norm, -1.0), norm)

    def clip_master_grads_by_value(self, clip_value: float) -> None:
        """Clamp every fp32 master grad to ``[-clip_value, clip_value]``."""
        self.unscale_grads()
        grads = self._unscale_targets()
        if grads:
            torch._foreach_clamp_min_(grads, -clip_value)
            torch._foreach_clamp_max_(grads, clip_value)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Unscale, then update the masters unless the step overflowed, copy them into the model, rescale."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._fused:
            grad_scale = None if self._step_state.grads_read else self._copy_scaled_grads_and_check()
            self._inner.found_inf = self._found_inf if self._loss_scaler is not None else None
            self._inner.grad_scale = grad_scale
            self._inner.step()
        else:
            self.unscale_grads()
            if self._loss_scaler is None or not self._found_inf.item():  # sync: non-fused optimizers cannot gate
                self._inner.step()
        if self._half_params:
            torch._foreach_copy_(self._half_params, self._masters)
        if self._step_state.grads_detached:
            for master, view in zip(self._masters, self._master_grads, strict=True):
                master.grad = view
            self._step_state.grads_detached = False
        self._skipped_steps.add_(self._found_inf)
        self._last_skip.capture(self._found_inf)
        if self._loss_scaler is not None:
            self._loss_scaler.update(self._found_inf)
        self._step_state.grads_read = True  # until the next backward, `overflow` reports this step
        return loss

    def _copy_scaled_grads_and_check(self) -> Tensor | None:
        """The fused fast path: copy the still-scaled half grads into the master grads and decide overflow with
        one read-only pass over the half grads (half the bytes of the fp32 copies); the fused optimizer divides by
        the scale inside its own kernel, saving the read-modify-write pass of a separate unscale. Returns the scale
        to hand it, or ``None`` (nothing to unscale: bf16, or some grads missing, which take the ordinary path)."""
        half_grads = [p.grad for p in self._half_params]
        if self._loss_scaler is None or any(g is None for g in half_grads):
            self.unscale_grads()
            return None
        self._read_half_grads()
        own_grads = [p.grad for p in self._own_master_params if p.grad is not None]
        # fp32 norms, finite unless some element is inf/NaN (|g| <= 65504, so no false overflow); one list per
        # dtype, as a foreach kernel takes one
        norms = [n for g in (half_grads, own_grads) if g for n in torch._foreach_norm(g, dtype=torch.float32)]
        if norms:
            self._found_inf.copy_(torch.logical_not(torch.isfinite(torch.stack(norms).sum())))
        else:
            self._found_inf.zero_()
        self._vote_overflow()
        return self._loss_scaler.scale

    def last_step_skipped_ready(self) -> bool:
        """Whether `last_step_skipped` can answer without waiting for the device."""
        return self._last_skip.ready()

    def last_step_skipped(self) -> bool:
        """Whether the most recent ``step`` was skipped for overflow (waits only for that step, if at all)."""
        return bool(self._last_skip.read())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's grads (the masters' grads are rewritten at every unscale)."""
        for param in self._half_params + self._own_master_params:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.detach_().zero_()
        self._step_state.grads_read = False

    def forget_process_groups(self) -> None:
        """Drop the overflow and norm groups (destroyed at interpreter exit); later steps count this rank alone."""
        self._overflow_group = self._norm_group = None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            "Adding a param group to an fp16/bf16 master-weight optimizer is not supported: its masters live in "
            "one flat buffer built at setup. Create every param group in `configure_optimizers` (set "
            "`requires_grad=False` on the ones you want frozen at first)."
        )

    # -- checkpoints --------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state plus the fp32 masters and the loss scaler (smp's fp16 checkpoint content)."""
        return {
            "optimizer": self._inner.state_dict(),
            "fp32_from_fp16": [master.detach().clone() for master in self._masters],
            "loss_scaler": self._loss_scaler.state_dict() if self._loss_scaler is not None else None,
            "skipped_steps": int(self._skipped_steps.item()),  # sync: checkpoints only
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a `state_dict`; every check runs before anything is overwritten."""
        missing = {"optimizer", "fp32_from_fp16", "loss_scaler"} - state_dict.keys()
        if missing:
            raise ValueError(
                f"This optimizer state has no {sorted(missing)}: it was not saved by an fp16/bf16 SMP run. "
                "Resume with the precision the checkpoint was written with, or load weights only."
            )
        masters = state_dict["fp32_from_fp16"]
        if len(masters) != len(self._masters) or any(
            saved.shape != master.shape for saved, master in zip(masters, self._masters, strict=False)
        ):
            raise ValueError(
                f"The checkpoint holds {len(masters)} master weights with shapes "
                f"{[tuple(m.shape) for m in masters][:4]}..., this optimizer has {len(self._masters)}: the "
                "checkpoint comes from a different model or parameter order."
            )
        saved_scaler = state_dict["loss_scaler"]
        if (saved_scaler is None) != (self._loss_scaler is None):
            raise ValueError(
                "The checkpoint's loss-scaler state does not match this run: one is fp16 (scaled), the other is "
                "not. Resume with the same precision (`fp16=True` or `bf16=True`) the checkpoint was written with."
            )
        self._inner.load_state_dict(state_dict["optimizer"])
        with torch.no_grad():
            if self._masters:
                torch._foreach_copy_(self._masters, [m.to(self._flat_master.device) for m in masters])
                torch._foreach_copy_(self._half_params, self._masters)
        if self._loss_scaler is not None:
            self._loss_scaler.load_state_dict(saved_scaler)
        self._skipped_steps.fill_(state_dict.get("skipped_steps", 0))

    # -- internals ----------------------------------------------------------------------------------------------

    def _unscale_targets(self) -> list[Tensor]:
        """Every fp32 grad the update reads: the flat master grad (one kernel) and the fp32 params' own grads."""
        own = [p.grad for p in self._own_master_params if p.grad is not None]
        return ([self._flat_master_grad] if self._half_params else []) + own

    def _norm_targets(self) -> list[Tensor]:
        """The grads that count in the global norm: all of them (one flat kernel) unless some are duplicates."""
        if all(self._norm_counts):
            return self._unscale_targets()
        grads = [master.grad for master in self._masters] + [p.grad for p in self._own_master_params]
        return [g for g, counts in zip(grads, self._norm_counts, strict=True) if counts and g is not None]

    def _global_norm(self, grads: list[Tensor], norm_type: float) -> Tensor:
        return global_grad_norm(grads, norm_type, group=self._norm_group, device=self._found_inf.device)


def global_grad_norm(
    grads: list[Tensor], norm_type: float, *, group: dist.ProcessGroup | None, device: torch.device
) -> Tensor:
    """The ``norm_type`` norm of ``grads`` over every rank of ``group`` (each rank passing the grads it counts),
    as a 0-dim device tensor: no host sync."""
    if not grads:
        local = torch.zeros((), device=device)
    elif math.isinf(norm_type):
        local = torch.stack([g.abs().max() for g in grads]).max()
    else:
        local = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, norm_type)), norm_type)
    if group is None or _group_size(group) <= 1:  # None: local (`_group_size` would read it as the world)
        return local
    if math.isinf(norm_type):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return local
    powered = local.pow(norm_type)
    dist.all_reduce(powered, op=dist.ReduceOp.SUM, group=group)
    return powered.pow(1.0 / norm_type)


def clip_grad_norm_counted(params: list[Tensor], max_norm: float, *, group: dist.ProcessGroup | None) -> Tensor:
    """Clip the grads of plain (fp32) ``params`` by their global norm over ``group``, counting each value once (a
    parameter whose placement is a norm duplicate does not count), as `MasterWeightOptimizer.clip_master_grads`
    does for masters."""
    with_grads = [p for p in params if p.grad is not None]
    grads = [p.grad for p in with_grads]
    device = grads[0].device if grads else torch.device("cpu")
    norm = global_grad_norm(
        [p.grad for p in with_grads if placement_of(p).counts_in_norm], 2.0, group=group, device=device
    )
    if grads:
        torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


def _split_params(optimizer: Optimizer) -> tuple[list[Tensor], list[Tensor | None], list[Tensor]]:
    """The inner optimizer's half params (to get masters) and its fp32 params (their own masters)."""
    half: list[Tensor] = []
    own: list[Tensor] = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            (half if param.dtype in HALF_DTYPES else own).append(param)
    if any(optimizer.state.get(p) for p in half):
        raise ValueError(
            "The optimizer already has state for its half-precision parameters (it has stepped or was loaded). "
            "Wrap it before the first step; load checkpoints into the wrapped optimizer."
        )
    return half, [None] * len(half), own


def _single_device(params: Iterable[Tensor]) -> torch.device:
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(
            f"The optimizer's parameters live on several devices {sorted(map(str, devices))}; one rank trains on "
            "one device. Move the model to one device before building the optimizer."
        )
    return devices.pop() if devices else torch.device("cpu")


def _views(flat: Tensor, params: list[Tensor]) -> list[Tensor]:
    views, offset = [], 0
    for param in params:
        views.append(flat[offset : offset + param.numel()].view_as(param))
        offset += param.numel()
    return views


def _repoint_param_groups(optimizer: Optimizer, masters_by_id: dict[int, Tensor]) -> None:
    for group in optimizer.param_groups:
        group["params"] = [masters_by_id.get(id(p), p) for p in group["params"]]


def _group_size(group: dist.ProcessGroup | None) -> int:
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def build_loss_scaler(
    *, dynamic: bool, static_scale: float, dynamic_args: dict[str, Any] | None
) -> DynamicLossScaler | StaticLossScaler:
    """The loss scaler for an fp16 run, from the strategy's or ``smp.DistributedOptimizer``'s settings."""
    if dynamic:
        return DynamicLossScaler.from_args(dynamic_args)
    return StaticLossScaler(static_scale)
