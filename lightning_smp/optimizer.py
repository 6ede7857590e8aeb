"""The master-weight optimizer: the order of one update over fp32 masters, and its state by parameter.

It owns the order of one update (take grads → unscale → check → clip → step → write back → rescale), which of
the optimizer's parameters are trained (those that require grad, decided here once for every layout) and the
public view of its state by model parameter that checkpoints read and write. Where the masters live and how grads
reach them is a `Masters` (`master_shard.py`: whole, ZeRO-1 shares; `sharded_data_parallel.py`: FSDP2's shards);
the job-wide overflow vote and norm are `grad_vote.py`'s, the loss-scale rule `loss_scaler.py`'s, when Lightning
calls it `precision.py`'s. `found_inf` stays on the device: fused optimizers (`fused=True`) take it and skip the
update themselves, so a CUDA step never waits for the host; other optimizers read it once per step, as
`torch.amp.GradScaler` does.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_smp._compat import (
    foreach_clamp_max_,
    foreach_clamp_min_,
    foreach_mul_,
    foreach_norm,
    non_finite_check_and_unscale_,
)
from lightning_smp.grad_vote import global_grad_norm, vote_overflow
from lightning_smp.host_mirror import HostMirror
from lightning_smp.loss_scaler import DynamicLossScaler, LossScaler, StaticLossScaler
from lightning_smp.master_shard import HALF_DTYPES, FlatPiece, Masters, Run, WholeMasters, single_device

if TYPE_CHECKING:
    from lightning_smp.topology import Topology

__all__ = ["MasterWeightOptimizer", "build_loss_scaler", "load_state_by_tensor"]


@dataclass
class _StepState:
    """Per-step flags. Kept in one mutable object because Lightning's `LightningOptimizer` subclasses this
    optimizer's class dynamically and forwards attribute reads (not writes) to it: methods must never assign
    attributes on `self`."""

    grads_read: bool = False  # the grads of the latest backward are in the masters' grads and checked


class MasterWeightOptimizer(Optimizer):
    """Wraps a torch optimizer built over a model's parameters so that it updates their fp32 masters.

    The inner optimizer's param groups are re-pointed at the masters, and this wrapper's ``param_groups`` and
    ``state`` ARE the inner optimizer's, so ``StepLR(wrapper)`` and ``StepLR(wrapper.optimizer)`` both work.
    A parameter that does not require grad when the optimizer is wrapped (frozen) is left out of the groups: no
    master, no master grad, no state, never changed, as a torch optimizer skips a parameter without a grad; a
    group of frozen parameters only stays, empty. Where the masters live is ``masters``:
    `WholeMasters` (fp32 copies of half-precision parameters; fp32 ones are their own), `ShardedMasters` (this
    data-parallel replica's share, ZeRO-1) or `FSDPMasters` (FSDP2's sharded fp32 parameters).

    Args:
        optimizer: the inner optimizer, constructed over the model's parameters.
        loss_scaler: fp16: a static or dynamic scaler; bf16 and fp32: ``None`` (no scaling, no overflow check).
        topology: the run's layout, whose groups the overflow vote, the norm and sharded masters use while it
            runs, looked up through it at each step (held weakly; the groups go when the topology releases them
            at the run's end, `Topology.release`); ``None``: this rank alone.
        masters: the `Masters` class to build over the trained parameters.
        clip_norm: clip the master grads to this global norm at every step (smp's ``sdp_gradient_clipping``);
            ``None``: only when asked (``clip_master_grads``, Lightning's ``gradient_clip_val``).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        loss_scaler: LossScaler | None,
        topology: Topology | None = None,
        masters: Callable[[list[Tensor], Run], Masters] = WholeMasters,
        clip_norm: float | None = None,
    ) -> None:
        if isinstance(optimizer, MasterWeightOptimizer):
            raise ValueError("The optimizer is already a MasterWeightOptimizer; wrap the plain optimizer once.")
        params = _params_of(optimizer)
        device = single_device(params)
        self._frozen = [p for p in params if not p.requires_grad]
        self._inner = optimizer
        self._step_state = _StepState()
        self._loss_scaler = loss_scaler.to(device) if loss_scaler is not None else None
        self._found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self._skipped_steps = torch.zeros((), dtype=torch.float32, device=device)
        self._last_skip = HostMirror(device)
        self._run: Run = weakref.ref(topology) if topology is not None else _no_run
        self._clip_norm = clip_norm
        self._masters = masters([p for p in params if p.requires_grad], self._run)
        optimized = self._masters.optimized()
        for group in optimizer.param_groups:
            group["params"] = [optimized[id(p)] for p in group["params"] if id(p) in optimized]
        self._fused = any(group.get("fused") for group in optimizer.param_groups)

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
        masters = f"{len(self._masters.master_params())} {type(self._masters).__name__}"
        return f"{type(self).__name__}({type(self._inner).__name__}, {masters}, {scaler})"

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
        if any(p.grad is not None for p in self._masters.params):
            self.unscale_grads()
        return bool(self._found_inf.item())  # sync

    def master_params(self) -> list[Tensor]:
        """The fp32 tensors the inner optimizer updates: the masters, then the params that are fp32 already."""
        return self._masters.master_params()

    # -- one update ---------------------------------------------------------------------------------------------

    def note_backward(self) -> None:
        """The half-precision grads changed (a backward ran): the next unscale must read them again."""
        self._step_state.grads_read = False

    def reduce_during_backward(self) -> AbstractContextManager[None]:
        """A context for the last backward before ``step``: where the masters reduce the grads over the replicas
        themselves (ZeRO-1), each bucket's reduction starts as soon as that backward makes its grads final, and
        ``step`` waits for it; elsewhere nothing. Every replica must run the same backwards armed (the strategy arms
        the one before each step of automatic optimization)."""
        return self._masters.reduce_during_backward()

    def unscale_grads(self) -> None:
        """Take the model's grads into the fp32 master grads, unscale them and decide overflow for the whole job.

        Runs at most once per backward; clipping, ``overflow`` and ``step`` call it as needed.
        """
        if self._step_state.grads_read:
            return
        self._step_state.grads_read = True
        self._take_grads()
        self._found_inf.zero_()
        if self._loss_scaler is None:
            return
        grads = self._masters.grads()
        if grads:
            non_finite_check_and_unscale_(grads, self._found_inf, self._loss_scaler.inv_scale)
        vote_overflow(self._found_inf, self._run())

    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the fp32 master grads by their global norm; returns that norm, or -1 on overflow (as smp).

        The result is a 0-dim device tensor, so clipping costs no host sync.
        """
        self.unscale_grads()
        grads = self._masters.grads()
        norm = global_grad_norm(
            self._masters.counted_grads(),
            float(norm_type),
            topology=self._run(),
            device=self._found_inf.device,
            replicated=self._masters.replicated,
        )
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        if grads:
            foreach_mul_(grads, coefficient)
        return torch.where(self._found_inf > 0, torch.full_like(norm, -1.0), norm)

    def clip_master_grads_by_value(self, clip_value: float) -> None:
        """Clamp every fp32 master grad to ``[-clip_value, clip_value]``."""
        self.unscale_grads()
        grads = self._masters.grads()
        if grads:
            foreach_clamp_min_(grads, -clip_value)
            foreach_clamp_max_(grads, clip_value)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Unscale (and clip to ``clip_norm``), then update the masters unless the step overflowed, copy them into
        the model, rescale."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._clip_norm is not None:
            self.clip_master_grads(self._clip_norm)
        if self._fused:
            grad_scale = None if self._step_state.grads_read else self._copy_scaled_grads_and_check()
            self._inner.found_inf = self._found_inf if self._loss_scaler is not None else None
            self._inner.grad_scale = grad_scale
            self._inner.step()
        else:
            self.unscale_grads()
            if self._loss_scaler is None or not self._found_inf.item():  # sync: non-fused optimizers cannot gate
                self._inner.step()
        self._masters.write_params()
        self._masters.after_step()
        self._count_step()
        self._step_state.grads_read = True  # until the next backward, `overflow` reports this step
        return loss

    def _take_grads(self) -> None:
        """The masters' gradient intake, refusing a parameter unfrozen since the optimizer was wrapped."""
        unfrozen = [tuple(p.shape) for p in self._frozen if p.requires_grad and p.grad is not None]
        if unfrozen:
            raise ValueError(
                f"{len(unfrozen)} parameter(s) (shapes {unfrozen[:3]}) have gradients but did not require grad when "
                "the optimizer was wrapped, so they have no master weights and would never change. Unfreeze "
                "parameters before `trainer.fit` (the optimizer is built again at the start of every fit), or keep "
                "them trainable and set their learning rate to 0 in a param group until they should train."
            )
        self._masters.take_grads()

    def _count_step(self) -> None:
        """After a step: count it if it was skipped, remember that for `last_step_skipped`, update the scale."""
        self._skipped_steps.add_(self._found_inf)
        self._last_skip.capture(self._found_inf)
        if self._loss_scaler is not None:
            self._loss_scaler.update(self._found_inf)

    def _copy_scaled_grads_and_check(self) -> Tensor | None:
        """The fused fast path: copy the still-scaled half grads into the master grads and decide overflow with
        one read-only pass over the half grads (half the bytes of the fp32 copies); the fused optimizer divides by
        the scale inside its own kernel, saving the read-modify-write pass of a separate unscale. Returns the scale
        to hand it, or ``None`` (nothing to unscale: bf16, or a layout or grads without the fast path)."""
        checked = self._masters.finite_check_grads()
        if self._loss_scaler is None or checked is None:
            self.unscale_grads()
            return None
        self._step_state.grads_read = True
        self._take_grads()
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for grad in checked:  # one list per dtype, as a foreach kernel takes one
            by_dtype.setdefault(grad.dtype, []).append(grad)
        # fp32 norms, finite unless some element is inf/NaN (|g| <= 65504, so no false overflow)
        norms = [n for same in by_dtype.values() for n in foreach_norm(same, dtype=torch.float32)]
        if norms:
            self._found_inf.copy_(torch.logical_not(torch.isfinite(torch.stack(norms).sum())))
        else:
            self._found_inf.zero_()
        vote_overflow(self._found_inf, self._run())
        return self._loss_scaler.scale

    def last_step_skipped_ready(self) -> bool:
        """Whether `last_step_skipped` can answer without waiting for the device."""
        return self._last_skip.ready()

    def last_step_skipped(self) -> bool:
        """Whether the most recent ``step`` was skipped for overflow (waits only for that step, if at all)."""
        return bool(self._last_skip.read())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's grads (the masters' grads are rewritten at every unscale)."""
        for param in [*self._masters.params, *self._frozen]:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.detach_().zero_()
        self._step_state.grads_read = False

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            "Adding a param group to an fp16/bf16 master-weight optimizer is not supported: its masters live in "
            "one flat buffer built at setup. Create every param group in `configure_optimizers`; parameters frozen "
            "then (`requires_grad=False`) stay frozen for that fit, and train in a later fit once unfrozen."
        )

    # -- checkpoints: by model parameter ---------------------------------------------------------------------------

    def model_params(self) -> list[Tensor]:
        """The model parameters this optimizer updates (through their masters), in its param groups' order."""
        return list(self._masters.params)

    def master_parts(self) -> dict[int, Tensor | FlatPiece]:
        """id(model parameter) → its fp32 master as this rank holds it (whole, a DTensor shard, or a ZeRO-1
        replica's `FlatPiece`): checkpoints save it under the parameter's name and load into it in place."""
        return self._masters.master_parts()

    @torch.no_grad()
    def load_masters(self, values: dict[int, Tensor | FlatPiece]) -> None:
        """Set the masters from values by id(model parameter) (whole fp32 tensors, or the parts `master_parts`
        handed out, loaded in place), then the model's parameters from them. Collective under ZeRO-1."""
        self._masters.load_masters(values)

    def state_by_param(self) -> list[tuple[Tensor, dict[str, Any]]]:
        """Each model parameter with optimizer state on this rank, with that state (element-wise values shaped like
        the parameter, or this replica's `FlatPiece` of them under ZeRO-1)."""
        return self._masters.state_by_param(self._inner.state)

    def state_part(self, param: Tensor, dtype: torch.dtype) -> Tensor | FlatPiece | None:
        """An empty tensor for what this rank holds of an element-wise optimizer state of ``param``, for a
        checkpoint to load into; None when it holds none."""
        return self._masters.state_part(param, dtype)

    def load_state_by_param(self, states: dict[int, dict[str, Any]], param_groups: Sequence[dict[str, Any]]) -> None:
        """Set the optimizer state from per-parameter states by id(model parameter) (whole, or the parts `state_part`
        made) and the param groups' hyper-parameters (``param_groups`` without their ``params``); parameters
        without a state start fresh."""
        load_state_by_tensor(self._inner, self._masters.state_of_optimized(states), param_groups)

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state plus the fp32 masters and the loss scaler (smp's fp16 checkpoint content)."""
        return {
            "optimizer": self._inner.state_dict(),
            "fp32_from_fp16": [master.detach().clone() for _, master in self._masters.positional_masters()],
            "loss_scaler": self._loss_scaler.state_dict() if self._loss_scaler is not None else None,
            "skipped_steps": int(self._skipped_steps.item()),  # sync: checkpoints only
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a `state_dict`; every check runs before anything is overwritten."""
        pairs = self._masters.positional_masters()
        missing = {"optimizer", "loss_scaler", *(["fp32_from_fp16"] if pairs else [])} - state_dict.keys()
        if missing:
            raise ValueError(
                f"This optimizer state has no {sorted(missing)}: it was not saved by an fp16/bf16 SMP run. "
                "Resume with the precision the checkpoint was written with, or load weights only."
            )
        masters = state_dict.get("fp32_from_fp16", [])
        own = [master for _, master in pairs]
        if len(masters) != len(own) or any(saved.shape != m.shape for saved, m in zip(masters, own, strict=False)):
            raise ValueError(
                f"The checkpoint holds {len(masters)} master weights with shapes "
                f"{[tuple(m.shape) for m in masters][:4]}..., this optimizer has {len(own)}: the "
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
            self._masters.load_masters(
                {id(p): m.to(self._found_inf.device) for (p, _), m in zip(pairs, masters, strict=True)}
            )
        if self._loss_scaler is not None:
            self._loss_scaler.load_state_dict(saved_scaler)
        self._skipped_steps.fill_(state_dict.get("skipped_steps", 0))


def load_state_by_tensor(
    optimizer: Optimizer, states: dict[int, dict[str, Any]], param_groups: Sequence[dict[str, Any]]
) -> None:
    """Load a torch ``optimizer``'s state from states by id(the tensor it updates) and its groups' hyper-parameters
    (torch keys both by position; these keys hold in any layout)."""
    if len(param_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"The checkpoint's optimizer has {len(param_groups)} param groups, this one has "
            f"{len(optimizer.param_groups)}: build the optimizer with the same groups as when it was saved."
        )
    groups, state, start = [], {}, 0
    for saved, group in zip(param_groups, optimizer.param_groups, strict=True):
        groups.append(
            {
                **{k: v for k, v in saved.items() if k != "params"},
                "params": list(range(start, start + len(group["params"]))),
            }
        )
        for position, tensor in enumerate(group["params"], start):
            if id(tensor) in states:
                state[position] = states[id(tensor)]
        start += len(group["params"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _params_of(optimizer: Optimizer) -> list[Tensor]:
    """The inner optimizer's parameters, refusing one that has stepped (its state would be keyed by the params)."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    if any(optimizer.state.get(p) for p in params if p.dtype in HALF_DTYPES):
        raise ValueError(
            "The optimizer already has state for its half-precision parameters (it has stepped or was loaded). "
            "Wrap it before the first step; load checkpoints into the wrapped optimizer."
        )
    return params


def _no_run() -> None:
    """The topology of a one-process optimizer: none."""


def build_loss_scaler(
    *, dynamic: bool, static_scale: float, dynamic_args: dict[str, Any] | None
) -> DynamicLossScaler | StaticLossScaler:
    """The loss scaler for an fp16 run, from the strategy's or ``smp.DistributedOptimizer``'s settings."""
    if dynamic:
        return DynamicLossScaler.from_args(dynamic_args)
    return StaticLossScaler(static_scale)
